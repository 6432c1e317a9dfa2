"""The scheduling problem as plain data, extracted once from a cost-annotated DAG.

Everything downstream (heuristics, CP-SAT and ILP models, the simulator, the validator)
reads a :class:`Problem`; nothing here imports torch.

Vocabulary:
- ``seq``: the schedulable nodes (DAG kinds "compute" and "view" that are not a collective's
  prologue), in execution order. Gap ``p`` is the point just before ``seq[p]``.
- a collective is *ready* at the first gap after all of its inputs exist, and *needed* at the
  gap of the first node that reads its result (``n = len(seq)`` when only the graph output
  does). It can be issued in ``[ready, needed]`` and waited in ``[issue, needed]``.
- a collective's *result* is read by the readers of its wait and by further waits on it (a
  collective with several ``wait_tensor`` users): all of them only after its wait. Any other
  user of the collective node reads no result (the size of an all-to-all's output, a view that
  autograd keeps of a gathered parameter) and may run before the wait; it pins the collective
  where traced.
- a bucket key ``(coll_type, group_name, dtype, reduce_op, alone)``: only collectives with
  equal keys may be merged (``alone`` names a collective torch cannot merge, else None).
  Mergeable collectives of one key form a *chain* ordered by ``needed`` (then by ``ready``):
  buckets are runs of consecutive chain members.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from functools import cached_property

import networkx as nx

from solvers.core.schedule import Bucket, Schedule, ScheduleError
from solvers.core.units import fit_line

#: casts that torch's ``merge_all_gather_bucket`` folds into a bucket's copy-in when they feed
#: an all-gather and have no other user (``bucketing.has_mergeable_all_gather_convert_dtype``)
FOLDED_CAST_OPS = frozenset({"convert_element_type", "_to_copy"})


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the graph, with the positions that bound its schedule."""

    name: str
    wait: str
    coll_type: str
    group_name: str
    group_size: int
    dtype: str | None
    reduce_op: str | None
    payload_bytes: int  #: per-rank input bytes
    out_bytes: int  #: per-rank output bytes
    fqns: tuple[str, ...]
    param_index: int | None
    runtime_ms: float  #: time of this collective alone
    prologue: tuple[str, ...]
    prologue_ms: float  #: compute-stream time of the prologue (casts) at issue
    movable: bool
    epilogue: tuple[str, ...]  #: casts / views run right after the wait (feed only the output)
    epilogue_ms: float
    ready: int  #: earliest issue gap
    needed: int  #: latest wait gap
    traced_issue: int
    traced_wait: int
    #: the repeated block (layer) the parameter belongs to, numbered in forward execution order,
    #: as the export inferred it (:mod:`scheduler.structure`); None outside any repeated block
    #: or when the DAG carries no inferred structure
    block: int | None = None
    #: the direction the collective runs in, ``"forward"`` or ``"backward"`` (the export's
    #: ``phase``: in a joint graph it tells a forward gather from a backward re-gather of the
    #: same block); None when the DAG does not say
    phase: str | None = None
    #: bytes a merged all-gather's copy-in reads for this member: the input of its dtype cast
    #: when torch's merge folds that cast into the copy (see :meth:`Problem.copy_in_ms`), else
    #: the payload
    merge_read_bytes: int = 0
    #: the prologue cast that a merge folds into the copy-in (None: none), and its time
    folded_cast: str | None = None
    folded_cast_ms: float = 0.0
    #: whether torch's merge functions can take it into a bucket: they need the wait to be the
    #: collective's only user, so one waited by several ``wait_tensor`` nodes stays alone
    #: (it may still move)
    mergeable: bool = True
    #: the further ``wait_tensor`` nodes on the collective: they return its result, so they
    #: run only after its wait. Other users of the collective node (a ``sym_size`` of its
    #: output, a view of it) read no result; they keep the collective where traced
    result_readers: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, str | None, str | None, str | None]:
        """Collectives may share a bucket only when their keys are equal: same type, process
        group, dtype and reduce op, and both mergeable (the last field names a collective
        that is not, so that it has no partner)."""
        return (self.coll_type, self.group_name, self.dtype, self.reduce_op, None if self.mergeable else self.name)

    @property
    def input_bytes(self) -> int:
        return self.payload_bytes


class Problem:
    """Scheduling view of one DAG. Build with :meth:`from_dag`."""

    def __init__(self, dag: nx.DiGraph, seq: tuple[str, ...], colls: dict[str, Collective]):
        self.dag = dag
        self.seq = seq
        self.n = len(seq)
        self.pos = {name: i for i, name in enumerate(seq)}
        #: collectives in traced issue order
        self.colls = colls
        g = dag.graph
        self.comm_model: dict[str, dict[str, float]] = g.get("comm_model", {})
        self.copy_ms_per_byte: float = float(g.get("copy_ms_per_byte", 0.0))
        self.copy_ms_fixed: float = float(g.get("copy_ms_fixed", 0.0))

    # ------------------------------------------------------------------------------------
    @staticmethod
    def from_dag(dag: nx.DiGraph) -> "Problem":
        order: list[str] = dag.graph["order"]
        nodes = dag.nodes
        seq = tuple(
            n for n in order if nodes[n]["kind"] in ("compute", "view") and not nodes[n].get("moves_with")
        )
        pos = {name: i for i, name in enumerate(seq)}
        n = len(seq)
        # traced gap of every node = number of seq nodes before it in graph order
        traced_gap: dict[str, int] = {}
        seen = 0
        for name in order:
            traced_gap[name] = seen
            if name in pos:
                seen += 1
        colls: dict[str, Collective] = {}
        for name in order:
            a = nodes[name]
            if a["kind"] != "collective":
                continue
            prologue = tuple(a.get("prologue") or ())
            movable = bool(a.get("movable"))
            # ready: after the producers of the prologue's (or the collective's) inputs
            heads = [prologue[0]] if prologue else [name]
            ready = 0
            for h in heads:
                for u in dag.predecessors(h):
                    ua = nodes[u]
                    if u in pos:
                        ready = max(ready, pos[u] + 1)
                    elif ua["kind"] in ("wait", "collective") or ua.get("moves_with"):
                        movable = False  # depends on another collective: keep it where traced
            wait = a["wait"]
            epilogue = tuple(a.get("epilogue") or ())
            # readers of the result: those of the wait (or the epilogue's end), and the further
            # waits on the collective itself, which return the result too and so read it only
            # once the collective is waited. Any other user reads the output before the wait
            # (its size, a view of it that autograd keeps): it needs no result, but it needs
            # the collective issued, so the collective keeps its traced place
            users = tuple(v for v in dag.successors(name) if v != wait)
            readers = tuple(v for v in users if nodes[v].get("external_wait"))
            if len(readers) < len(users):
                movable = False
            needed = n
            for v in (*dag.successors(epilogue[-1] if epilogue else wait), *readers):
                if v in pos:
                    needed = min(needed, pos[v])
                elif nodes[v]["kind"] != "output":
                    movable = False
            t_issue, t_wait = traced_gap[name], traced_gap[wait]
            if not movable:
                ready, needed = t_issue, t_wait
            prologue_ms = sum(float(nodes[p]["runtime_ms"]) for p in prologue)
            folded_cast = _folded_cast(dag, a, prologue)
            folded_cast_ms = float(nodes[folded_cast]["runtime_ms"]) if folded_cast else 0.0
            merge_read_bytes = _merge_read_bytes(dag, a, folded_cast)
            colls[name] = Collective(
                name=name,
                wait=wait,
                coll_type=a["coll_type"],
                group_name=a["group_name"],
                group_size=int(a["group_size"]),
                dtype=a.get("dtype"),
                reduce_op=a.get("reduce_op"),
                payload_bytes=int(a["payload_bytes"]),
                out_bytes=int(a["size_bytes"]),
                fqns=tuple(a.get("fqns") or ()),
                param_index=a.get("param_index"),
                runtime_ms=float(a["runtime_ms"]),
                prologue=prologue,
                prologue_ms=prologue_ms,
                epilogue=epilogue,
                epilogue_ms=sum(float(nodes[e]["runtime_ms"]) for e in epilogue),
                movable=movable and a["coll_type"] in ("all_gather", "reduce_scatter", "all_reduce"),
                ready=ready,
                needed=needed,
                traced_issue=t_issue,
                traced_wait=t_wait,
                block=a.get("block"),
                phase=a.get("phase"),
                merge_read_bytes=merge_read_bytes,
                folded_cast=folded_cast,
                folded_cast_ms=folded_cast_ms,
                mergeable=not users,
                result_readers=readers,
            )
            if not (ready <= t_issue <= t_wait <= needed) and movable:
                raise ScheduleError(f"collective {name!r}: traced positions outside its window")
        return Problem(dag, seq, colls)

    # ------------------------------------------------------------------------------------
    @cached_property
    def chains(self) -> dict[tuple, list[str]]:
        """Mergeable collectives per bucket key, in chain order (needed, ready, traced)."""
        chains: dict[tuple, list[str]] = {}
        for c in self.colls.values():
            if c.movable:
                chains.setdefault(c.key, []).append(c.name)
        for key, members in chains.items():
            members.sort(key=lambda m: (self.colls[m].needed, self.colls[m].ready, self.colls[m].traced_issue))
        return chains

    @cached_property
    def result_of(self) -> dict[str, str]:
        """Node -> the collective whose result it is: the collective's wait and epilogue, and
        the collective itself where further waits read it. What reads one of these runs after
        that collective's wait."""
        out: dict[str, str] = {}
        for name, c in self.colls.items():
            for node in (name, c.wait, *c.epilogue):
                out[node] = name
        return out

    @cached_property
    def issue_after(self) -> dict[str, frozenset[str]]:
        """Collective -> the collectives whose result its issue reads, directly or through its
        prologue (a chain: an all-reduce of a gathered parameter); it is issued only after
        they are waited."""
        out: dict[str, frozenset[str]] = {}
        for name, c in self.colls.items():
            read = {self.result_of.get(u) for r in (*c.prologue, name) for u in self.dag.predecessors(r)}
            out[name] = frozenset(read - {None, name})  # type: ignore[arg-type]
        return out

    def schedule_at(self, buckets: Sequence[Bucket], issue_at: Sequence[int], wait_at: Sequence[int]) -> Schedule:
        """The schedule of ``buckets`` issued and waited at these gaps
        (:meth:`Schedule.from_positions`), where every issue that reads another bucket's result
        follows that bucket's wait in a gap they share."""
        bucket_of = {m: b for b, bk in enumerate(buckets) for m in bk.members}
        after = {b: {bucket_of[d] for m in bk.members for d in self.issue_after.get(m, ()) if d in bucket_of}
                 for b, bk in enumerate(buckets)}
        return Schedule.from_positions(self.seq, buckets, issue_at, wait_at, after=after)

    @cached_property
    def compute_ms(self) -> list[float]:
        return [float(self.dag.nodes[s]["runtime_ms"]) for s in self.seq]

    @property
    def total_compute_ms(self) -> float:
        return sum(self.compute_ms) + sum(c.prologue_ms + c.epilogue_ms for c in self.colls.values())

    def bucket_comm_ms(self, members: Sequence[str]) -> float:
        """Communication time of a bucket (ms): the collective's own cost when alone, else the
        cost model's time at the total payload, interpolated in the export's table of its
        (type, group) (``comm_model[key]["table"]``), or the fitted ``alpha + beta * total
        payload`` when there is no table (older DAGs, synthetic overrides)."""
        if len(members) == 1:
            return self.colls[members[0]].runtime_ms
        c0 = self.colls[members[0]]
        m = self.comm_model.get(f"{c0.coll_type}|{c0.group_name}")
        total = sum(self.colls[x].payload_bytes for x in members)
        if m is None:
            return sum(self.colls[x].runtime_ms for x in members)
        table = m.get("table")
        if table and table[0][0] <= total <= table[-1][0]:
            return _interpolate(table, total)
        return m["alpha_ms"] + m["beta_ms_per_byte"] * total

    def merged_line(self, coll_type: str, group_name: str) -> tuple[float, float]:
        """``(alpha_ms, beta_ms_per_byte)`` of the line the linear solver models price a merged
        collective of this key with: fitted, minimising the squared relative error, to the
        export's table over the payloads a merged bucket takes (twice the median member's
        payload up to all of them); the export's line where there is no table."""
        m = self.comm_model.get(f"{coll_type}|{group_name}")
        if m is None:
            return 0.0, 0.0
        pays = sorted(c.payload_bytes for c in self.colls.values()
                      if c.coll_type == coll_type and c.group_name == group_name)
        lo = 2 * pays[len(pays) // 2] if pays else 0
        points = [(x, y) for x, y in m.get("table") or () if x >= lo and y > 0]
        if len(points) < 2:
            return float(m["alpha_ms"]), float(m["beta_ms_per_byte"])
        return fit_line(points)

    def copy_ms(self, nbytes: int) -> float:
        return self.copy_ms_fixed + self.copy_ms_per_byte * nbytes

    def copy_in_ms(self, members: Sequence[str]) -> float:
        """Compute-stream time at a bucket's issue (ms): the members' prologues, plus, when
        merged, the copy into the bucket buffer as torch's merge functions emit it.

        Reduce-scatter: one copy (the ``cat`` into the bucket), ``f + c * P``. All-gather: a
        ``cat`` of the members' inputs, ``f + c * Q``, then its ``copy_`` into the bucket
        buffer, which reads ``Q`` and writes ``P`` bytes, ``f + c * (Q + P) / 2``; the dtype
        casts the merge folds into that copy no longer run (their time is taken back). ``P``
        is the payload, ``Q`` the bytes read (:attr:`Collective.merge_read_bytes`), ``f`` /
        ``c`` the fixed and per-byte cost of a copy that reads and writes ``n`` bytes
        (``copy_ms(n) = f + c * n``). :meth:`merge_copy_ms` gives each member's share and
        :meth:`merge_copy_fixed_ms` the bucket's fixed part."""
        t = sum(self.colls[m].prologue_ms for m in members)
        if len(members) > 1:
            fixed_in, _ = self.merge_copy_fixed_ms(self.colls[members[0]].coll_type)
            t += fixed_in + sum(self.merge_copy_ms(self.colls[m])[0] for m in members)
        return t

    def copy_out_ms(self, members: Sequence[str]) -> float:
        """Compute-stream time at a bucket's wait (ms): the members' epilogues (casts), plus,
        for a merged all-gather, one copy per member out of the bucket buffer
        (``sum_m f + c * out_m``: torch's merge splits along a strided dim, which copies).
        Reduce-scatter outputs are contiguous views: free."""
        t = sum(self.colls[m].epilogue_ms for m in members)
        if len(members) > 1:
            _, fixed_out = self.merge_copy_fixed_ms(self.colls[members[0]].coll_type)
            t += fixed_out + sum(self.merge_copy_ms(self.colls[m])[1] for m in members)
        return t

    def merge_copy_ms(self, c: Collective) -> tuple[float, float]:
        """(copy-in, copy-out) time member ``c`` adds to a merged bucket (ms), beyond the
        bucket's fixed part (:meth:`merge_copy_fixed_ms`); the copy-in share may be below the
        per-byte cost where a folded cast is taken back."""
        f, per_byte = self.copy_ms_fixed, self.copy_ms_per_byte
        if c.coll_type != "all_gather":
            return per_byte * c.payload_bytes, 0.0
        q, p = c.merge_read_bytes, c.payload_bytes
        copy_in = per_byte * q + per_byte * (q + p) / 2 - c.folded_cast_ms
        return copy_in, f + per_byte * c.out_bytes

    def merge_cat_bytes(self, members: Sequence[str]) -> int:
        """Bytes of the ``cat`` that a merged all-gather copies into its bucket buffer: every
        member's input (its folded cast's input, :attr:`Collective.merge_read_bytes`) in the
        widest dtype among them, to which ``torch.cat`` promotes (members share one payload
        dtype, so the widest is the largest ratio of bytes read to payload)."""
        return merge_cat_bytes([self.colls[m] for m in members])

    def merge_copy_fixed_ms(self, coll_type: str) -> tuple[float, float]:
        """(copy-in, copy-out) time of a merged bucket that does not grow with its members (ms):
        all-gathers two fixed copy costs at issue (the read and the write into the buffer),
        reduce-scatters one."""
        f = self.copy_ms_fixed
        return (2 * f, 0.0) if coll_type == "all_gather" else (f, 0.0)

    # ------------------------------------------------------------------------------------
    def traced_schedule(self) -> Schedule:
        """The graph as traced: every collective alone, issued and waited where it was."""
        names = list(self.colls)
        return self._schedule_in_traced_gaps(names)

    def _schedule_in_traced_gaps(self, names: list[str]) -> Schedule:
        # Keep the traced interleaving of issues and waits inside each gap.
        order = self.dag.graph["order"]
        bucket_idx = {c: i for i, c in enumerate(names)}
        wait_of = {self.colls[c].wait: c for c in names}
        steps_nodes: list = []
        from solvers.core.schedule import Step

        for name in order:
            if name in self.pos:
                steps_nodes.append(Step("node", name))
            elif name in bucket_idx:
                steps_nodes.append(Step("issue", bucket_idx[name]))
            elif name in wait_of:
                steps_nodes.append(Step("wait", bucket_idx[wait_of[name]]))
        return Schedule(tuple(Bucket((c,)) for c in names), tuple(steps_nodes))

    def lower_bound_ms(self) -> float:
        """Analytic lower bound on the simulated step time of *any* schedule (ms).

        The largest of:
        - compute: all compute-stream work (nodes and prologues; merge copies only add);
        - per stream: its communication at the cheapest (each movable collective costs at least
          ``beta * payload``, plus one ``alpha`` per stream), started no earlier than the first
          collective is ready, plus the compute after the last all-gather of the stream is needed;
        - per all-gather chain: the first-needed all-gather, alone at best, must finish before
          the compute from its first use onward can start (the exposed first all-gather).
        """
        prefix = [0.0]
        for v in self.compute_ms:
            prefix.append(prefix[-1] + v)
        total = self.total_compute_ms
        bounds = [total]
        per_stream: dict[str, list[Collective]] = {}
        for c in self.colls.values():
            per_stream.setdefault(c.group_name, []).append(c)
        for group, cs in per_stream.items():
            busy = 0.0
            alpha_min = None
            for c in cs:
                m = self.comm_model.get(f"{c.coll_type}|{c.group_name}")
                if m and c.movable:
                    busy += min(c.runtime_ms, m["beta_ms_per_byte"] * c.payload_bytes)
                    alpha_min = m["alpha_ms"] if alpha_min is None else min(alpha_min, m["alpha_ms"])
                else:
                    busy += c.runtime_ms
            busy += alpha_min or 0.0
            start = prefix[min(c.ready for c in cs)]
            # after the stream's last transfer, at least the compute after the latest need of
            # any all-gather on it remains (reduce-scatters are needed only at the end)
            tail = min(prefix[self.n] - prefix[c.needed] for c in cs)
            bounds.append(start + busy + tail)
        # exposed first all-gather: nothing from its first use on can start before it is done;
        # that delay D also postpones every later gradient, so each reduce-scatter ends at least
        # at (its gradient's time + D + its own transfer)
        delay, first_need = 0.0, self.n
        ags = [c for c in self.colls.values() if c.coll_type == "all_gather"]
        if ags:
            c = min(ags, key=lambda c: (c.needed, c.ready))
            first_need = c.needed
            delay = max(0.0, prefix[c.ready] + self._alone_ms(c) - prefix[c.needed])
            bounds.append(total + delay)
        for c in self.colls.values():
            if c.coll_type != "reduce_scatter":
                continue
            shift = delay if c.ready >= first_need else 0.0
            bounds.append(prefix[c.ready] + shift + self._alone_ms(c) + c.epilogue_ms + (prefix[self.n] - prefix[c.needed]))
        return max(bounds)

    def _alone_ms(self, c: Collective) -> float:
        """Least time collective ``c`` can take: alone, or its share ``beta * payload`` plus one
        ``alpha`` of a bucket (a bucket finishes no earlier than that)."""
        m = self.comm_model.get(f"{c.coll_type}|{c.group_name}")
        if m is None or not c.movable:
            return c.runtime_ms
        return min(c.runtime_ms, m["alpha_ms"] + m["beta_ms_per_byte"] * c.payload_bytes)


def merge_cat_bytes(cs: Sequence[Collective]) -> int:
    """:meth:`Problem.merge_cat_bytes` of the members ``cs`` (for a caller holding the collectives
    without their problem: the simulator's static data)."""
    total = sum(c.payload_bytes for c in cs)
    read, payload = max(((c.merge_read_bytes, c.payload_bytes) for c in cs if c.payload_bytes),
                        key=lambda qp: qp[0] / qp[1], default=(1, 1))
    return total * read // payload


def _interpolate(table: Sequence[Sequence[float]], x: float) -> float:
    """Piecewise-linear value at ``x`` of increasing ``[[x, y], ...]`` points (x in range)."""
    i = bisect.bisect_left([p[0] for p in table], x)
    if table[i][0] == x:
        return float(table[i][1])
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _folded_cast(dag: nx.DiGraph, a: dict, prologue: tuple[str, ...]) -> str | None:
    """The prologue cast that torch's merge folds into a merged all-gather's copy-in (the
    collective of DAG attributes ``a``): a single-use dtype cast feeding it directly (the
    prologue holds single-use nodes only). None for anything else."""
    if a["coll_type"] != "all_gather" or not prologue:
        return None
    last = dag.nodes[prologue[-1]]
    parts = str(last["target"]).split(".")
    if last["kind"] != "compute" or len(parts) < 3 or parts[1] not in FOLDED_CAST_OPS:
        return None
    return prologue[-1] if dag.in_degree(prologue[-1]) == 1 else None


def _merge_read_bytes(dag: nx.DiGraph, a: dict, folded_cast: str | None) -> int:
    """Bytes a merged copy-in reads for one member: its folded cast's input, else its payload."""
    if folded_cast is None:
        return int(a["payload_bytes"])
    (source,) = dag.predecessors(folded_cast)
    return int(dag.nodes[source]["size_bytes"])
