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

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from functools import cached_property

import networkx as nx

from solvers.core.bounds import lower_bound_ms
from solvers.core.schedule import Bucket, Schedule, ScheduleError
from solvers.core.streams import stream_of
from solvers.core.units import fit_line, interpolate

#: casts that torch's ``merge_all_gather_bucket`` folds into a bucket's copy-in when they feed
#: an all-gather and have no other user (``bucketing.has_mergeable_all_gather_convert_dtype``)
FOLDED_CAST_OPS = frozenset({"convert_element_type", "_to_copy"})
#: collective types the schedule moves (within their data dependencies)
MOVABLE_TYPES = frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all_single"})
#: collective types torch's merge functions can merge into a bucket
MERGEABLE_TYPES = frozenset({"all_gather", "reduce_scatter", "all_reduce"})


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
    #: as the export inferred it (:mod:`scheduler.export.structure`); None outside any repeated block
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
    #: why the collective keeps its traced place (None: it moves)
    fixed_reason: str | None = None
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
        # a collective's result, as another collective may read it: its wait and its epilogue's
        # last node; and the nodes that run with a collective's issue (itself, its prologue)
        result_node = {(a.get("epilogue") or [a["wait"]])[-1]: n for n, a in nodes(data=True) if a["kind"] == "collective"}
        issued_with = {p: n for n, a in nodes(data=True) if a["kind"] == "collective" for p in (n, *(a.get("prologue") or ()))}
        for name in order:
            a = nodes[name]
            if a["kind"] != "collective":
                continue
            prologue = tuple(a.get("prologue") or ())
            movable = bool(a.get("movable"))
            why: list[str] = [] if movable else [f"{a['target']} is not scheduled (it writes into a buffer it is given)"]
            # ready: after the producers of the prologue's (or the collective's) inputs
            heads = [prologue[0]] if prologue else [name]
            ready = 0
            for h in heads:
                for u in dag.predecessors(h):
                    ua = nodes[u]
                    if u in pos:
                        ready = max(ready, pos[u] + 1)
                    elif u in result_node:
                        pass  # another collective's result: bounded by its issue range (_bound_chains)
                    elif ua["kind"] in ("wait", "collective") or ua.get("moves_with"):
                        movable = False  # depends on another collective: keep it where traced
                        why.append("its input depends on another collective's wait outside a chain")
            wait = a["wait"]
            epilogue = tuple(a.get("epilogue") or ())
            # readers of the result: those of the wait (or the epilogue's end), and the further
            # waits on the collective itself, which return the result too and so read it only
            # once the collective is waited. Any other user reads the output before the wait
            # (its size, a view of it that autograd keeps): it needs no result, but it needs
            # the collective issued, so the collective keeps its traced place
            users = tuple(v for v in dag.successors(name) if v != wait)
            readers = tuple(v for v in users if nodes[v].get("external_wait"))
            # the graph's output reads the collective's tensor only once the step ends, after
            # every wait (a forward returns it for the backward); it constrains nothing
            early = [v for v in users if v not in readers and nodes[v]["kind"] != "output"]
            if early:
                movable = False
                why.append(f"{nodes[early[0]]['target']} reads its output before its wait")
            needed = n
            for v in (*dag.successors(epilogue[-1] if epilogue else wait), *readers):
                if v in pos:
                    needed = min(needed, pos[v])
                elif v in issued_with and v not in readers:
                    pass  # a collective reads it: bounded by that one's issue range below
                elif nodes[v]["kind"] != "output":
                    movable = False
                    why.append("its result is read by a node that runs with another collective's wait")
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
                movable=movable and a["coll_type"] in MOVABLE_TYPES,
                fixed_reason=None if movable and a["coll_type"] in MOVABLE_TYPES else
                ("; ".join(dict.fromkeys(why)) or f"{a['coll_type']} is not a type the schedule moves"),
                ready=ready,
                needed=needed,
                traced_issue=t_issue,
                traced_wait=t_wait,
                block=a.get("block"),
                phase=a.get("phase"),
                merge_read_bytes=merge_read_bytes,
                folded_cast=folded_cast,
                folded_cast_ms=folded_cast_ms,
                mergeable=_mergeable(dag, a, users),
                result_readers=readers,
            )
            if not (ready <= t_issue <= t_wait <= needed) and movable:
                raise ScheduleError(f"collective {name!r}: traced positions outside its range [ready, needed]")
        problem = Problem(dag, seq, colls)
        _bound_chains(problem)
        return problem

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
        after = self.bucket_reads([bk.members for bk in buckets])
        issue_at, wait_at = self.after_waits(buckets, after, issue_at, wait_at)
        return Schedule.from_positions(self.seq, buckets, issue_at, wait_at, after=after)

    def bucket_reads(self, members: Sequence[Sequence[str]]) -> dict[int, set[int]]:
        """Bucket -> the buckets whose results its issue reads (:attr:`issue_after`), for the
        buckets of these ``members``; a set for every bucket, empty for most."""
        bucket_of = {m: b for b, ms in enumerate(members) for m in ms}
        out: dict[int, set[int]] = {b: set() for b in range(len(members))}
        for m in self.readers:  # few collectives read another's result
            if m in bucket_of:
                out[bucket_of[m]].update(bucket_of[d] for d in self.issue_after[m] if d in bucket_of)
        return out

    @cached_property
    def readers(self) -> tuple[str, ...]:
        """The collectives whose issue reads another's result (:attr:`issue_after`)."""
        return tuple(name for name, read in self.issue_after.items() if read)

    def after_waits(self, buckets: Sequence[Bucket], after: Mapping[int, Iterable[int]], issue_at: Sequence[int],
                    wait_at: Sequence[int]) -> tuple[list[int], list[int]]:
        """Gaps of a plan placed by issue ranges alone, made valid for collectives that read
        another's result (``after``: bucket -> the buckets whose results it reads): a reader is
        issued at the wait of what it reads (and waited no earlier) where its issue range allows;
        else a read bucket that moves is waited no later than the reader is issued (issued no
        later too, where its issue range allows; waited no earlier than its issue), and a reader
        still issued before such a wait is issued at it. Within the issue ranges but where a
        bucket merges members of other ranges; what is left invalid the checks refuse."""
        issue_at, wait_at = list(issue_at), list(wait_at)
        if not any(after.values()):  # no bucket reads another's result: nothing to move
            return issue_at, wait_at
        # of the buckets that read or are read only: the others never move here
        involved = {b for b, ds in after.items() if ds} | {d for ds in after.values() for d in ds}
        movable = {b: self.colls[buckets[b].members[0]].movable for b in involved}
        lo = {b: max(self.colls[m].ready for m in buckets[b].members) for b in involved}
        hi = {b: min(self.colls[m].needed for m in buckets[b].members) for b in involved}
        for _ in range(len(issue_at)):
            changed = False
            for b, ds in after.items():
                for d in ds:
                    if d == b or wait_at[d] <= issue_at[b]:
                        continue
                    # the reader later where its issue range allows (the read bucket keeps its
                    # overlap), else the read bucket waited (and issued) sooner
                    if movable[d] and wait_at[d] > hi[b]:
                        if issue_at[d] > issue_at[b] >= lo[d]:
                            issue_at[d] = issue_at[b]
                        wait_at[d] = max(issue_at[d], issue_at[b])
                    if wait_at[d] > issue_at[b]:
                        issue_at[b] = wait_at[d]
                        wait_at[b] = max(wait_at[b], issue_at[b])
                    changed = True
            if not changed:
                break
        return issue_at, wait_at

    @cached_property
    def group_links(self) -> dict[str, Hashable]:
        """Process group -> the network link it runs on: its ranks (sorted) where the export
        recorded them, else its name. Groups of the same ranks share one link
        (:mod:`solvers.core.streams`)."""
        groups = self.dag.graph.get("process_groups") or {}
        out: dict[str, Hashable] = {}
        for c in self.colls.values():
            ranks = (groups.get(c.group_name) or {}).get("ranks")
            out[c.group_name] = tuple(sorted(ranks)) if ranks else c.group_name
        return out

    @cached_property
    def shares_links(self) -> bool:
        """Whether two process groups of the graph run on one link (the same ranks)."""
        links = list(self.group_links.values())
        return len(set(links)) < len(links)

    def splittable_groups(self) -> tuple[str, ...]:
        """Groups whose all-gathers a schedule may move to a second stream
        (:attr:`Schedule.split_groups`): those that run all-gathers and another kind of
        collective, which the all-gathers could otherwise queue behind."""
        kinds: dict[str, set[str]] = {}
        for c in self.colls.values():
            kinds.setdefault(c.group_name, set()).add(c.coll_type)
        return tuple(sorted(g for g, ks in kinds.items() if "all_gather" in ks and len(ks) > 1))

    def stream_links(self, split_groups: Sequence[str] = ()) -> dict[str, Hashable]:
        """Stream -> its link, for the streams a schedule that splits ``split_groups`` uses."""
        split = frozenset(split_groups)
        links = self.group_links
        return {stream_of(c.coll_type, c.group_name, split): links[c.group_name] for c in self.colls.values()}

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
            return interpolate(table, total)
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
        """Analytic lower bound on the simulated step time of *any* valid schedule (ms);
        computed once per problem (:attr:`_lower_bound_ms`)."""
        return self._lower_bound_ms

    @cached_property
    def _lower_bound_ms(self) -> float:
        return lower_bound_ms(self)


def copy_dag(dag: nx.DiGraph) -> nx.DiGraph:
    """A copy of ``dag`` (node and edge attribute dicts copied, the graph's attributes shared, as
    ``nx.DiGraph.copy`` does) that keeps each node's predecessors in their order:
    ``DiGraph.copy`` lists them by the order of the nodes instead, and problems whose DAGs list
    them alike share one memory analysis (:func:`solvers.core.peaks.memory_model`). Edges are
    added target by target, so each node's successors are in the order the export adds them."""
    out = nx.DiGraph()
    out.graph.update(dag.graph)
    out.add_nodes_from((n, dict(a)) for n, a in dag.nodes(data=True))
    out.add_edges_from((u, v, dict(d)) for v in dag for u, d in dag.pred[v].items())
    return out


def _mergeable(dag: nx.DiGraph, a: dict, users: tuple[str, ...]) -> bool:
    """Whether torch's merge functions may take the collective of DAG attributes ``a`` into a
    bucket: an all-gather, a reduce-scatter or (with the DAG's ``merge_all_reduces``: a merged
    all-reduce sums in another order) an all-reduce whose wait is its only user. Tensor-parallel
    ones too: a backward's all-gathers of saved activations are ready at its start, like
    parameters; the issue ranges decide which buckets can be issued."""
    if users or a["coll_type"] not in MERGEABLE_TYPES:
        return False
    return a["coll_type"] != "all_reduce" or bool(dag.graph.get("merge_all_reduces"))


def _bound_chains(p: Problem) -> None:
    """Issue ranges of collectives whose issue reads another's result (:meth:`Problem.issue_after`),
    in place. A chain moves where what is read is a reduce-scatter's result (HSDP: an
    all-reduce of it), which is made at its wait; other collectives that read another's result
    stay where traced, with what they read (an all-gather's or all-reduce's result is made at its
    issue: the evaluator's memory templates do not hold it). Of a chain that moves, the reader
    ``c`` is issued no earlier than the one read, ``d``, can be waited, and ``d`` is waited no
    later than ``c`` is needed (where ``c`` stays where traced: no later than its traced issue). Each schedule
    still issues ``c`` after ``d``'s wait (the evaluator and the validator check it)."""
    colls = p.colls
    # Two chains whose collectives read each other's results (or one chain reading itself) stay
    # where traced too: a bucket could then hold a reader and what it reads, or each of two
    # buckets wait for the other
    reads = {(colls[c].key, colls[d].key) for c, ds in p.issue_after.items() for d in ds}
    for c_name, ds in p.issue_after.items():
        for d_name in ds:
            c, d = colls[c_name], colls[d_name]
            if d.coll_type != "reduce_scatter" or c.key == d.key or (d.key, c.key) in reads:
                why = (f"a {c.coll_type} reads the result of a {d.coll_type} (only a reduce-scatter's result is "
                       "made at its wait)" if d.coll_type != "reduce_scatter" else
                       f"a {c.coll_type} reads the result of a {d.coll_type} and their chains read each other")
                for name, x in ((c_name, c), (d_name, d)):
                    if x.movable:
                        colls[name] = dataclasses.replace(x, movable=False, fixed_reason=why, ready=x.traced_issue,
                                                          needed=x.traced_wait)
    for _ in range(len(colls)):  # chains of chains settle in as many rounds as they are long
        changed = False
        for c_name, ds in p.issue_after.items():
            for d_name in ds:
                c, d = colls[c_name], colls[d_name]
                ready = d.traced_wait if not d.movable else d.ready
                needed = c.traced_issue if not c.movable else c.needed
                new_c = dataclasses.replace(c, ready=max(c.ready, ready)) if c.movable and ready > c.ready else c
                new_d = dataclasses.replace(d, needed=min(d.needed, needed)) if d.movable and needed < d.needed else d
                if new_c is not c or new_d is not d:
                    colls[c_name], colls[d_name] = new_c, new_d
                    changed = True
        if not changed:
            return


def merge_cat_bytes(cs: Sequence[Collective]) -> int:
    """:meth:`Problem.merge_cat_bytes` of the members ``cs`` (for a caller holding the collectives
    without their problem: the simulator's static data)."""
    total = sum(c.payload_bytes for c in cs)
    read, payload = max(((c.merge_read_bytes, c.payload_bytes) for c in cs if c.payload_bytes),
                        key=lambda qp: qp[0] / qp[1], default=(1, 1))
    return total * read // payload


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
