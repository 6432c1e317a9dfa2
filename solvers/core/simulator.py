"""Check: simulate any schedule on the execution model of DESIGN.md.

Execution model:
- One compute stream runs the schedule's node steps in order, each for its ``runtime_ms``.
- Each process group has one FIFO communication stream (a group the schedule splits has a
  second one for its all-gathers, :attr:`Schedule.split_groups`). An issue step first spends
  the bucket's copy-in time on the compute stream (prologue casts, plus the copy into the
  bucket buffer when merged); the collective then starts at ``max(compute time, stream
  free)`` and lasts ``Problem.bucket_comm_ms``, or longer where another stream of the same
  ranks moves data at the same time: streams of one link share its bandwidth
  (:mod:`solvers.core.streams`). A wait step blocks the compute stream until the bucket
  completes, then (merged all-gathers) spends the copy-out time.
- Memory: a node's output is allocated when it runs and freed after its last reader (views
  share their base's storage); a collective's output is allocated at issue; a collective's
  input stays alive until its wait (until the copy-in when merged: the bucket buffer then
  holds the data until the wait); epilogue casts of a collective's result run at its wait;
  graph inputs named ``primals*`` and graph outputs are never
  freed. Merged buckets follow torch's ``merge_all_gather_bucket`` /
  ``merge_reduce_scatter_bucket``: an all-gather allocates its bucket buffer (the members'
  outputs), copies a ``cat`` of the members' inputs into it (a single-use dtype cast feeding
  a member is folded into that copy and never runs: the cat reads the cast's input) and holds
  the buffer until the wait, where members are copied out one by one; a reduce-scatter's
  ``cat`` of its inputs is its buffer, held until the wait, and the inputs are freed before
  the output is allocated: one storage whose views the members' results are, freed after the
  last reader of any of them.
- A multi-output node's results are storages of their own (``output_bytes``): one that only
  the node's getitems read is freed after them while its siblings live on; a result the op
  writes into an argument is that argument's storage. A storage nothing reads is freed right
  after the node that made it (FX's generated code drops it).
- Step time is when the compute stream finishes (every collective is waited on).

torch's count (``tracker_peak_bytes``): the same run is also counted by the rules of torch's
``memory_estimator.MemoryTracker`` on the graph the schedule writes back
(:func:`scheduler.check.judge.torch_tracker_peak`), reported beside the execution model's:

- a collective's input is freed at the collective (issue), not at its wait;
- a collective's result and its wait's result are two storages (the wait's fake tensor is
  fresh): the result lives from the issue to the wait, the wait's from the wait to its last
  reader, both during the wait. A merged reduce-scatter's members are views of one wait
  result, freed after the last reader of any of them;
- a merged all-gather's ``out=`` result is a storage of its own beside the bucket buffer
  (torch's meta kernel returns a fresh tensor): both are counted at the collective, then the
  buffer is freed. A collective the graph already writes into a buffer (an
  ``all_gather_into_tensor_out`` of a re-exported graph, which the export gives no bytes of
  its own) counts its result at the buffer's size;
- a storage nothing reads is never freed.

Both counts equal the reference liveness count and torch's tracker on the written graph, to
the byte, on every graph checked (``tests/test_judge.py``).

What each step does to memory is data built once per problem (:func:`_static`): a node's
storages (``_Static.steps``) and a bucket's issue and wait as micro-operations
(:meth:`_Static.bucket_ops`), which the simulator runs and the fast evaluator
(:mod:`solvers.core.evaluate`) reads, so that the rules live in one place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from solvers.core.problem import Collective, Problem, merge_cat_bytes
from solvers.core.schedule import Schedule, Step
from solvers.core.streams import Streams, stream_of

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SimResult:
    """Outcome of one simulated run.

    Attributes:
        step_ms: when the compute stream finishes.
        compute_ms: busy time of the compute stream (nodes, prologues, copies).
        exposed_comm_ms: time the compute stream spends blocked in waits.
        comm_ms: busy time of each process group's stream.
        peak_bytes: maximum live bytes over the run.
        peak_step: index into the schedule's steps where the peak occurs.
        tracker_peak_bytes: maximum live bytes of the same run by torch's ``MemoryTracker``
            rules on the written graph (module docstring).
        tracker_peak_step: index into the steps where that peak occurs (-1: the inputs).
        node_times: node name -> (start_ms, end_ms) on the compute stream.
        bucket_times: bucket index -> (issue_ms, start_ms, end_ms, wait_done_ms).
        memory: (time_ms, live_bytes) after every step.
        step_live_bytes: live bytes during every step (after its allocations, before its frees).
        bucket_exposed_ms: bucket index -> time the compute stream waited for it (ms).
        n_collectives: number of collectives issued (buckets).
    """

    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    comm_ms: dict[str, float]
    peak_bytes: int
    peak_step: int
    node_times: dict[str, tuple[float, float]]
    bucket_times: dict[int, tuple[float, float, float, float]]
    memory: list[tuple[float, int]]
    n_collectives: int
    tracker_peak_bytes: int = 0
    tracker_peak_step: int = -1
    step_live_bytes: list[int] = dataclasses.field(repr=False, default_factory=list)
    bucket_exposed_ms: dict[int, float] = dataclasses.field(repr=False, default_factory=dict)
    schedule: Schedule = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def max_peak_bytes(self) -> int:
        """The larger of the two counts (torch's tracker rules are reported, not held: the
        budget bounds :attr:`peak_bytes`)."""
        return max(self.peak_bytes, self.tracker_peak_bytes)

    def summary(self) -> dict[str, Any]:
        return {
            "step_ms": round(self.step_ms, 4),
            "compute_ms": round(self.compute_ms, 4),
            "exposed_comm_ms": round(self.exposed_comm_ms, 4),
            "comm_ms": {k: round(v, 4) for k, v in self.comm_ms.items()},
            "peak_bytes": self.peak_bytes,
            "tracker_peak_bytes": self.tracker_peak_bytes,
            "n_collectives": self.n_collectives,
        }

    def write_chrome_trace(self, path: str | Path, problem: Problem | None = None) -> Path:
        """Write the timeline as a Chrome trace (open in https://ui.perfetto.dev)."""
        events: list[dict[str, Any]] = []
        for name, (s, e) in self.node_times.items():
            events.append({"name": name, "ph": "X", "ts": s * 1e3, "dur": (e - s) * 1e3, "pid": 0, "tid": "compute"})
        for b, (issue, s, e, _done) in self.bucket_times.items():
            members = self.schedule.buckets[b].members if self.schedule else ()
            group, label = "comm", f"bucket {b}"
            if problem is not None and members:
                c0 = problem.colls[members[0]]
                group = f"comm {c0.group_name}"
                label = f"{c0.coll_type} x{len(members)}"
            events.append(
                {
                    "name": label,
                    "ph": "X",
                    "ts": s * 1e3,
                    "dur": (e - s) * 1e3,
                    "pid": 0,
                    "tid": group,
                    "args": {"members": list(members), "issued_ms": issue},
                }
            )
        for t, live in self.memory:
            events.append({"name": "memory", "ph": "C", "ts": t * 1e3, "pid": 0, "args": {"GiB": live / 2**30}})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path


def simulate(dag: nx.DiGraph, schedule: Schedule | None = None, *, problem: Problem | None = None) -> SimResult:
    """Simulate ``schedule`` (default: the traced order) of a cost-annotated DAG.

    Args:
        dag: a DAG from :func:`scheduler.export_dag` (an FX graph is exported first there).
        schedule: any schedule over the DAG; default: as traced.
        problem: a prebuilt :class:`Problem` of the DAG, to skip rebuilding it.

    Raises:
        TypeError: ``dag`` is not a networkx DAG (export an FX graph with
            :func:`scheduler.export_dag` first).
        ScheduleInvalidError: the schedule does not fit the DAG (see :func:`validate_schedule`
            for the full check).
    """
    if not isinstance(dag, nx.DiGraph):
        raise TypeError(
            f"simulate() takes a cost-annotated DAG, got {type(dag).__name__}: export an FX graph with "
            "scheduler.export_dag(gm) first"
        )
    problem = problem or Problem.from_dag(dag)
    schedule = schedule or problem.traced_schedule()
    _check_shape(problem, schedule)
    return _Simulator(problem, schedule).run()


def simulate_ranks(problems: "Sequence[Problem]", schedule: Schedule | None = None) -> list[SimResult]:
    """Simulate ``schedule`` (default: the traced order) on every rank of a group at once, each
    rank with its own costs: ``problems[r]`` is the same graph priced for rank ``r`` (by that
    rank's profile, say). The ranks run in lockstep at the collectives: a collective starts
    once every rank has issued it and the collective before it on its stream has ended on every
    rank, so a rank that reaches it early waits for the last one, as a real group does. A
    single-rank simulation of any one rank (:func:`simulate`) sees none of that waiting. Each
    rank's collective time is its own problem's. Returns each rank's result; the group's step
    is the largest ``step_ms``.

    Raises:
        ValueError: no problem, problems of different graphs, or streams that share a network
            link (two groups of the same ranks, or a split schedule: their processor sharing is
            not synchronised across ranks).
        ScheduleInvalidError: as :func:`simulate`.
    """
    if not problems:
        raise ValueError("simulate_ranks needs the problem of at least one rank")
    first = problems[0]
    schedule = schedule or first.traced_schedule()
    for r, p in enumerate(problems):
        if p.seq != first.seq or list(p.colls) != list(first.colls):
            raise ValueError(f"the problem of rank {r} is not the graph of rank 0: every rank must run the same graph")
        _check_shape(p, schedule)
    sims = [_Simulator(p, schedule) for p in problems]
    if any(sim.streams.shared for sim in sims):
        raise ValueError("simulate_ranks does not synchronise streams that share a network link (two groups of "
                         "the same ranks, or a split schedule): simulate each rank alone")
    for k, step in enumerate(schedule.steps):
        for sim in sims:
            sim.step(k, step)
        if step.kind == "issue":
            start = max(sim.streams.start(step.ref) for sim in sims)
            for sim in sims:
                sim.streams.hold(step.ref, start)
    return [sim.result() for sim in sims]


def _check_shape(problem: Problem, schedule: Schedule) -> None:
    """The schedule names this graph's buckets: every step a bucket it has, every collective in
    one bucket (the rest of validity is :func:`~solvers.core.validator.validate_schedule`'s)."""
    nb = len(schedule.buckets)
    for s in schedule.steps:
        if s.kind != "node" and not (isinstance(s.ref, int) and 0 <= s.ref < nb):
            raise ScheduleInvalidError(f"step {s.kind} names bucket {s.ref!r}; the schedule has {nb} buckets")
    members = [m for b in schedule.buckets for m in b.members]
    if len(members) != len(problem.colls) or set(members) != problem.colls.keys():
        raise ScheduleInvalidError("the schedule's buckets do not hold each collective of the graph once")
    wrong = sorted(set(schedule.split_groups) - set(problem.splittable_groups()))
    if wrong:
        raise ScheduleInvalidError(f"the schedule splits groups {wrong} whose all-gathers share no group with "
                                   f"another collective; splittable: {list(problem.splittable_groups())}")
    _check_windows(problem, schedule)


def _check_windows(problem: Problem, schedule: Schedule) -> None:
    """Every bucket issued and waited inside the windows of all its members (a bucket whose
    members' windows do not meet has none): a schedule outside them runs a node before its
    input, so no clock of it means anything. The rest of the data dependencies (node order,
    chains of collectives) is :func:`~solvers.core.validator.validate_schedule`'s."""
    issue, wait = schedule.positions()
    colls = problem.colls
    for b, bucket in enumerate(schedule.buckets):
        i, w = issue[b], wait[b]
        if i < 0 or w < 0:
            continue  # never issued or waited: the run says so
        for m in bucket.members:
            c = colls[m]
            if not c.ready <= i <= w <= c.needed:
                raise ScheduleInvalidError(
                    f"bucket {b} is issued at gap {i} and waited at gap {w}, outside the window "
                    f"[{c.ready}, {c.needed}] of its member {m!r}")


class ScheduleInvalidError(ValueError):
    """A schedule violates the execution model or does not match its graph."""


#: the storage a node's output is counted as: a name, or the names of a multi-output node's
#: results (a node that holds them all, such as the node itself, which its getitems read)
Owner = str | tuple[str, ...]


class _Memory:
    """Live storages of one run: allocation at first write, release after the last of the
    counted uses, and the peak. ``owner`` maps a node to the storage its output is counted as
    (default: its own; several for a node holding every result of a multi-output node);
    ``uses`` (storage -> release events, this run's own copy) and ``never_free`` name
    storages."""

    def __init__(self, uses: dict[str, int], never_free: "set[str] | frozenset[str]", owner: dict[str, Owner]):
        self.owner = owner
        self.uses = uses
        self.never_free = never_free
        self.live: dict[str, int] = {}
        self.total = 0
        self.peak = 0

    def record(self) -> None:
        """The live bytes now count towards the peak."""
        self.peak = max(self.peak, self.total)

    def alloc(self, owner: str, nbytes: int) -> None:
        if nbytes and owner not in self.live:
            self.live[owner] = nbytes
            self.total += nbytes

    def free(self, owner: str) -> None:
        if owner in self.live and owner not in self.never_free:
            self.total -= self.live.pop(owner)

    def release(self, name: str) -> None:
        """One use of ``name``'s storage is done; free it after the last one."""
        owner = self.owner.get(name, name)
        if owner.__class__ is tuple:
            for o in owner:
                self.drop(o)
        else:
            self.drop(owner)  # type: ignore[arg-type]

    def drop(self, owner: str) -> None:
        """One use of storage ``owner`` is done; free it after the last one."""
        left = self.uses.get(owner, 0) - 1
        self.uses[owner] = left
        if left <= 0:
            self.free(owner)

    def alloc_node(self, name: str, nbytes: int) -> None:
        """``name``'s storage, allocated once whatever the node (several may share it); a
        single-output node only (a multi-output node allocates each of its results,
        :attr:`_Static.steps`)."""
        self.alloc(self.owner.get(name, name), nbytes)  # type: ignore[arg-type]


#: codes of a micro-operation of a bucket's step (:meth:`_Static.bucket_ops`)
ALLOC, REC, REL, DROP, FREE = range(5)
#: the bucket's own storages, named per run after the bucket's index (``bucket:<b>``: the
#: buffer of a merged bucket's copy-in; ``result:<b>``: torch's tracker's ``out=`` result of a
#: merged collective; ``wait:<b>``: a merged bucket's result)
BUCKET, RESULT, WAIT = "bucket", "result", "wait"
#: one micro-operation: ``(sub, code, key, amount, member)``. ``sub`` numbers its point in the
#: step (operations of one point are simultaneous for what a record sees; a record at ``sub``
#: sees every change at a smaller one); ``code`` one of ALLOC (storage ``key`` of ``amount``
#: bytes, none when it is live), REC (the live bytes plus ``amount`` transient bytes count
#: towards the peak), REL (one use of node ``key``'s storage is done), DROP (one use of storage
#: ``key`` is done), FREE (storage ``key`` is freed); ``member`` the collective whose operation
#: it is, None for the bucket's own (``key`` then BUCKET, RESULT or WAIT)
Op = tuple[int, int, Any, int, "str | None"]
#: a bucket's steps: ``ops[count][anchor]``, count 0 the execution model's and 1 torch's
#: tracker's, anchor 0 the issue and 1 the wait
BucketOps = tuple[tuple[tuple[Op, ...], tuple[Op, ...]], tuple[tuple[Op, ...], tuple[Op, ...]]]


@dataclasses.dataclass(frozen=True)
class _Static:
    """What every run over one problem shares (built once per problem, :func:`_static`): each
    node's inputs, and for each count the owner of every node's storage, the release events
    per owner and the owners never freed; what each step does to memory (node steps:
    ``steps``; a bucket's issue and wait: :meth:`bucket_ops`)."""

    preds: dict[str, tuple[str, ...]]
    inputs: tuple[tuple[str, int], ...]
    mem_owner: dict[str, Owner]
    mem_uses: dict[str, int]
    mem_never_free: frozenset[str]
    trk_owner: dict[str, Owner]
    trk_uses: dict[str, int]
    trk_never_free: frozenset[str]
    #: per count, owner -> the nodes it owns (a merged reduce-scatter's members move under
    #: their bucket's result)
    mem_nodes: dict[Owner, tuple[str, ...]]
    trk_nodes: dict[Owner, tuple[str, ...]]
    #: node step -> (runtime_ms, the storages it allocates with their bytes by the execution
    #: model's count (several results of a multi-output node are several storages) and by
    #: torch's tracker (where a wait on no collective of the graph gets a fresh one), the
    #: storages the execution model's count frees right after it: those nothing reads)
    steps: dict[str, tuple[float, tuple[tuple[str, int], ...], tuple[tuple[str, int], ...], tuple[str, ...]]]
    #: the problem's collectives and the DAG's node attributes (what :meth:`bucket_ops` reads)
    colls: dict[str, Collective] = dataclasses.field(repr=False, default_factory=dict)
    nodes: Any = dataclasses.field(repr=False, default=None)
    #: (members, merged) -> :meth:`bucket_ops`, filled as buckets are met
    ops: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)

    def bucket_ops(self, members: tuple[str, ...], merged: bool | None = None) -> BucketOps:
        """What the issue and the wait of a bucket of ``members`` do to memory, by each count,
        as micro-operations (:data:`Op`) in the order the simulator runs them. ``merged``
        (default: more than one member): as a merged bucket; the operations a collective makes
        as a member (``member`` set) are the same in every merged bucket it joins.

        The issue: the prologue casts run (allocated, a record, their inputs released; a merged
        all-gather skips the casts it folds into its copy-in). Alone: the output, a record;
        torch's tracker counts the result ``result:<collective>`` and frees the input here.
        A merged all-gather: its bucket buffer (the members' storage where they are views of
        it, :func:`_copied_out`), a record with the ``cat`` of the inputs as transient bytes
        (:func:`~solvers.core.problem.merge_cat_bytes`), the inputs and folded casts
        released; torch's tracker counts the ``out=`` result beside the buffer, then frees the
        buffer. A merged reduce-scatter: its ``cat`` (the bucket buffer), a record, the inputs
        released, then the result whose views the members are; torch's tracker frees the
        buffer after the result.

        The wait: a merged all-gather's members copied out of its buffer (when they are not
        views), the epilogue casts, a record; the buffer freed (merged) or the input released
        (alone). torch's tracker: the wait's fresh result beside the collective's, whose use
        is then done (merged: the ``out=`` result freed, and the members copied out of the
        wait's result, which is freed after them), the epilogue casts, a record. Then the
        epilogues' inputs released.
        """
        merged = len(members) > 1 if merged is None else merged
        key = (members, merged)
        ops = self.ops.get(key)
        if ops is None:
            ops = self.ops[key] = _bucket_ops(self, members, merged)
        return ops

_STATIC: "weakref.WeakKeyDictionary[Problem, _Static]" = weakref.WeakKeyDictionary()


def _static(problem: Problem) -> _Static:
    """The :class:`_Static` of ``problem`` (cached: problems are not changed once built)."""
    st = _STATIC.get(problem)
    if st is None:
        st = _STATIC[problem] = _build_static(problem)
    return st


def _build_static(p: Problem) -> _Static:
    dag = p.dag
    preds = {n: tuple(dag.predecessors(n)) for n in dag.nodes}
    # release events of each node's output: one per reading node step, one per prologue read
    # at issue, one per collective input (released at its wait, or at the issue when merged)
    uses: dict[str, int] = defaultdict(int)
    for name in p.seq:
        for u in preds[name]:
            uses[u] += 1
    for cname, c in p.colls.items():
        for reader in (*c.prologue, cname, *c.epilogue):
            for u in preds[reader]:
                uses[u] += 1
    # graph inputs the graph cannot free, and whatever the graph returns
    never_free: set[str] = set()
    for n, a in dag.nodes(data=True):
        if a["kind"] == "input" and not a.get("releasable", True):
            never_free.add(n)
        if a["kind"] == "output":
            never_free.update(preds[n])
    root, results = _storages(dag)
    trk_owner = _tracker_owners(p, root, preds)

    def by_owner(owner: dict[str, Owner]) -> tuple[dict[str, int], frozenset[str]]:
        counts: dict[str, int] = defaultdict(int)
        for name, n in uses.items():
            for o in _each(owner.get(name, name)):
                counts[o] += n
        return dict(counts), frozenset(o for name in never_free for o in _each(owner.get(name, name)))

    mem_uses, mem_never_free = by_owner(root)
    trk_uses, trk_never_free = by_owner(trk_owner)
    for m in p.colls:  # the wait reads the collective's result (its DROP in _bucket_ops)
        trk_uses[f"result:{m}"] = trk_uses.get(f"result:{m}", 0) + 1

    def by_storage(owner: dict[str, Owner]) -> dict[Owner, tuple[str, ...]]:
        out: dict[Owner, list[str]] = defaultdict(list)
        for name, o in owner.items():
            out[o].append(name)
        return {o: tuple(ns) for o, ns in out.items()}

    inputs = tuple((n, int(a["size_bytes"])) for n, a in dag.nodes(data=True) if a["kind"] == "input")
    steps = {}
    for name in p.seq:
        a = dag.nodes[name]
        allocs = results.get(name) or (((name, int(a["size_bytes"])),) if a["alias_of"] is None else ())
        # the execution model's count drops what nothing reads at once (FX's code does)
        unread = tuple(o for o, nbytes in allocs if nbytes and not mem_uses.get(o) and o not in mem_never_free)
        trk_allocs = ((name, int(a["size_bytes"])),) if trk_owner[name] == name and a["alias_of"] is not None else allocs
        steps[name] = (float(a["runtime_ms"]), allocs, trk_allocs, unread)
    return _Static(preds=preds, inputs=inputs, mem_owner=root, mem_uses=mem_uses, mem_never_free=mem_never_free,
                   trk_owner=trk_owner, trk_uses=trk_uses, trk_never_free=trk_never_free,
                   mem_nodes=by_storage(root), trk_nodes=by_storage(trk_owner), steps=steps, colls=p.colls,
                   nodes=dag.nodes)


def _bucket_ops(st: _Static, members: tuple[str, ...], merged: bool) -> BucketOps:
    """:meth:`_Static.bucket_ops`, built."""
    colls, nodes, preds, trk_owner = st.colls, st.nodes, st.preds, st.trk_owner
    gather = colls[members[0]].coll_type == "all_gather"
    copied = merged and _copied_out(colls, members)
    mem_i: list[Op] = []
    trk_i: list[Op] = []
    mem_w: list[Op] = []
    trk_w: list[Op] = []

    def alloc(ops: list[Op], sub: int, key: str, nbytes: int, member: str | None) -> None:
        if nbytes:
            ops.append((sub, ALLOC, key, nbytes, member))

    def release(ops: list[Op], sub: int, name: str, member: str) -> None:
        ops.extend((sub, REL, u, 0, member) for u in preds[name])

    def own_bytes(name: str) -> int:
        return int(nodes[name]["size_bytes"]) if nodes[name]["alias_of"] is None else 0

    def tracker_out_bytes(m: str) -> int:
        # a collective writing into a buffer of the graph (the export gives it no bytes of its
        # own) counts its result at the buffer's size
        alias = nodes[m]["alias_of"]
        return colls[m].out_bytes if alias is None else int(nodes[alias]["size_bytes"])

    # the issue: prologue casts (a merged all-gather folds its single-use casts into the copy)
    folded = {colls[m].folded_cast: m for m in members if colls[m].folded_cast} if merged and gather else {}
    prologue = [(pn, m) for m in members for pn in colls[m].prologue if pn not in folded]
    for pn, m in prologue:
        alloc(mem_i, 0, pn, own_bytes(pn), m)
        alloc(trk_i, 0, trk_owner.get(pn, pn), own_bytes(pn), m)  # type: ignore[arg-type]
    for ops in (mem_i, trk_i):
        ops.append((1, REC, None, 0, None))
    for pn, m in prologue:
        release(mem_i, 2, pn, m)
        release(trk_i, 2, pn, m)
    size = sum(colls[m].out_bytes for m in members)
    if not merged:
        (m,) = members
        alloc(mem_i, 3, m, colls[m].out_bytes, m)
        mem_i.append((4, REC, None, 0, None))
        alloc(trk_i, 3, f"result:{m}", tracker_out_bytes(m), m)
        trk_i.append((4, REC, None, 0, None))
        release(trk_i, 5, m, m)  # torch's tracker frees the input at the collective
    elif gather:
        read = merge_cat_bytes([colls[m] for m in members])
        alloc(mem_i, 3, BUCKET if copied else WAIT, size, None)
        alloc(trk_i, 3, BUCKET, size, None)
        for ops in (mem_i, trk_i):
            ops.append((4, REC, None, read, None))
        for name, m in (*((m, m) for m in members), *folded.items()):
            release(mem_i, 5, name, m)
            release(trk_i, 5, name, m)
        alloc(trk_i, 5, RESULT, size, None)
        trk_i.append((6, REC, None, 0, None))
        trk_i.append((7, FREE, BUCKET, 0, None))
    else:
        payload = sum(colls[m].payload_bytes for m in members)
        alloc(mem_i, 3, BUCKET, payload, None)
        alloc(trk_i, 3, BUCKET, payload, None)
        for ops in (mem_i, trk_i):
            ops.append((4, REC, None, 0, None))
        for m in members:
            release(mem_i, 5, m, m)
            release(trk_i, 5, m, m)
        alloc(mem_i, 5, WAIT, size, None)
        mem_i.append((6, REC, None, 0, None))
        alloc(trk_i, 5, RESULT, size, None)
        trk_i.append((6, REC, None, 0, None))
        trk_i.append((7, FREE, BUCKET, 0, None))
    # the wait, the execution model's count
    if copied:
        for m in members:
            alloc(mem_w, 0, m, colls[m].out_bytes, m)
    epilogue = [(e, m) for m in members for e in colls[m].epilogue]
    for e, m in epilogue:
        alloc(mem_w, 0, e, own_bytes(e), m)
    mem_w.append((1, REC, None, 0, None))
    if merged:
        mem_w.append((2, FREE, BUCKET, 0, None))
    else:
        release(mem_w, 2, members[0], members[0])  # the input lives until the wait
    # the wait, torch's tracker
    if not merged:
        (m,) = members
        alloc(trk_w, 0, m, tracker_out_bytes(m), m)
        trk_w.append((1, REC, None, 0, None))
        trk_w.append((2, DROP, f"result:{m}", 0, m))
    else:
        alloc(trk_w, 0, WAIT, size, None)
        trk_w.append((1, REC, None, 0, None))
        trk_w.append((2, FREE, RESULT, 0, None))
        if copied:
            for m in members:
                alloc(trk_w, 2, m, colls[m].out_bytes, m)
            trk_w.append((3, REC, None, 0, None))
            trk_w.append((4, FREE, WAIT, 0, None))
    for e, m in epilogue:
        alloc(trk_w, 4, trk_owner.get(e, e), own_bytes(e), m)  # type: ignore[arg-type]
    trk_w.append((5, REC, None, 0, None))
    for e, m in epilogue:
        release(mem_w, 6, e, m)
        release(trk_w, 6, e, m)
    return (tuple(mem_i), tuple(mem_w)), (tuple(trk_i), tuple(trk_w))


def _each(owner: Owner) -> tuple[str, ...]:
    return owner if isinstance(owner, tuple) else (owner,)


def _storages(dag: nx.DiGraph) -> tuple[dict[str, Owner], dict[str, tuple[tuple[str, int], ...]]]:
    """The storage each node's output is (the node owning it, ``alias_of``; the result
    ``<node>#<index>`` of a multi-output node that a getitem holds, ``output_index``; every
    result for a node that holds them all), and per multi-output node the storages it
    allocates with their bytes. A result written into an argument is that argument's."""
    nodes = dag.nodes
    key: dict[str, Owner] = {}
    results: dict[str, tuple[tuple[str, int], ...]] = {}
    for n in dag.graph["order"]:
        a = nodes[n]
        alias = a["alias_of"]
        if alias is not None:
            index = a.get("output_index")
            key[n] = f"{alias}#{index}" if index is not None else key.get(alias, alias)
            continue
        sizes = a.get("output_bytes")
        if sizes is None:
            key[n] = n
            continue
        written = a.get("output_alias") or [None] * len(sizes)
        fresh = tuple((f"{n}#{j}", int(b)) for j, (b, w) in enumerate(zip(sizes, written)) if w is None and b)
        held = [o for o, _ in fresh] + [o for w in written if w is not None for o in _each(key.get(w, w))]
        held = list(dict.fromkeys(held))
        key[n] = held[0] if len(held) == 1 else tuple(held)
        results[n] = fresh
    for n in dag.nodes:  # nodes outside the order (none expected) own their storage
        key.setdefault(n, nodes[n]["alias_of"] or n)
    return key, results


def _tracker_owners(p: Problem, root: dict[str, Owner], preds: dict[str, tuple[str, ...]]) -> dict[str, Owner]:
    """Node -> its storage by torch's tracker: a collective's result is ``result:<name>``,
    freed after its last reader (its wait, a further wait, a read of its size before the
    wait); a wait's result is a storage of its own, owned by the collective's name (also when the collective
    writes into a buffer, ``all_gather_into_tensor_out`` already in the graph, whose views the
    export roots at the buffer), and so is a wait on anything else (a further wait, a wait on a
    graph input), owned by its own name; views follow the node they view; a multi-output node's
    results are storages of their own, as in the execution model's count (``root``)."""
    dag = p.dag
    waits = {c.wait: name for name, c in p.colls.items()}
    owner: dict[str, Owner] = {}
    for n in dag.graph["order"]:
        if n in p.colls:
            owner[n] = f"result:{n}"
        elif n in waits:
            owner[n] = waits[n]
        elif dag.nodes[n].get("external_wait"):
            owner[n] = n  # every wait_tensor's fake result is fresh, a further wait's too
        elif dag.nodes[n]["alias_of"] is None:
            owner[n] = root[n]
        else:
            viewed = [owner[u] for u in preds[n] if root.get(u) == root[n] and u in owner]
            owner[n] = viewed[0] if viewed else root[n]
    for n in dag.nodes:  # nodes outside the order (none expected): as the export roots them
        owner.setdefault(n, root[n])
    return owner


def _copied_out(colls: dict[str, Collective], members: tuple[str, ...]) -> bool:
    """Whether a merged bucket's members are copied out of its result at the wait: torch's merge
    reshapes an all-gather's ``(group_size, -1)`` slices to each member's shape, which copies
    unless the group has one rank. Otherwise (a reduce-scatter, or an all-gather on one rank)
    the members are views of the bucket's result."""
    c0 = colls[members[0]]
    return c0.coll_type == "all_gather" and c0.group_size > 1


def _merged_memory(owner: dict[str, Owner], uses: dict[str, int], never_free: frozenset[str],
                   nodes: dict[Owner, tuple[str, ...]], merged: list[tuple[int, tuple[str, ...]]]) -> _Memory:
    """One count's memory for a run (``owner``, ``uses``, ``never_free`` and ``nodes`` of
    :class:`_Static`) where the members of each merged bucket ``(bucket, members)`` that are not
    copied out (:func:`_copied_out`) are views of one result, ``wait:<bucket>`` (torch's merge
    splits the bucket's output into views), freed after the last reader of any of them."""
    if not merged:
        return _Memory(dict(uses), never_free, owner)
    owner, uses, never_free = dict(owner), dict(uses), set(never_free)
    for b, members in merged:
        result = f"wait:{b}"
        for m in members:
            for name in nodes.get(m, ()):
                owner[name] = result
            uses[result] = uses.get(result, 0) + uses.pop(m, 0)
            if m in never_free:
                never_free.discard(m)
                never_free.add(result)
    return _Memory(uses, never_free, owner)


class _Simulator:
    """One run of a schedule: the compute-stream clock ``t``, the streams, and the memory by
    both counts (``mem``: the execution model's; ``trk``: torch's tracker rules)."""

    def __init__(self, problem: Problem, schedule: Schedule):
        self.p = problem
        self.s = schedule
        st = _static(problem)
        self.st = st
        self.preds = st.preds
        self.steps = st.steps
        merged = [(b, bucket.members) for b, bucket in enumerate(schedule.buckets)
                  if len(bucket.members) > 1 and not _copied_out(problem.colls, bucket.members)]
        self.mem = _merged_memory(st.mem_owner, st.mem_uses, st.mem_never_free, st.mem_nodes, merged)
        self.trk = _merged_memory(st.trk_owner, st.trk_uses, st.trk_never_free, st.trk_nodes, merged)
        for n, size in st.inputs:
            # inputs nobody reads (and not pinned) are dead on arrival; keep them: they were
            # passed in
            for mem in (self.mem, self.trk):
                mem.alloc_node(n, size)
        self.trk.record()
        self.t = 0.0
        self.busy = 0.0
        self.exposed = 0.0
        split = frozenset(schedule.split_groups)
        self.split = split
        self.streams = Streams(problem.stream_links(schedule.split_groups) if split or problem.shares_links else None)
        self.comm_busy: dict[str, float] = defaultdict(float)
        self.node_times: dict[str, tuple[float, float]] = {}
        self.bucket_times: dict[int, tuple[float, float, float, float]] = {}
        self.bucket_exposed: dict[int, float] = {}
        self.memory: list[tuple[float, int]] = [(0.0, self.mem.total)]
        self.peak, self.peak_step = self.mem.total, -1
        self.tracker_peak_step = -1
        self.step_live: list[int] = []
        self.issued: set[int] = set()
        self.waited: set[int] = set()
        self.waited_members: set[str] = set()

    def _release_inputs(self, name: str, *mems: _Memory) -> None:
        """One use of each input of ``name`` is done, in ``mems`` (default: both counts)."""
        for u in self.preds[name]:
            for mem in mems or (self.mem, self.trk):
                mem.release(u)

    def _record(self, k: int, live: int) -> None:
        if live > self.peak:
            self.peak, self.peak_step = live, k
        self.step_live.append(live)

    def run(self) -> SimResult:
        for k, step in enumerate(self.s.steps):
            self.step(k, step)
        return self.result()

    def step(self, k: int, step: Step) -> None:
        """Run step ``k`` of the schedule."""
        before = self.trk.peak
        if step.kind == "node":
            self._run_node(k, step.ref)
        elif step.kind == "issue":
            self._issue(k, step.ref)
        else:
            self._wait(k, step.ref)
        if self.trk.peak > before:
            self.tracker_peak_step = k
        self.memory.append((self.t, self.mem.total))

    def result(self) -> SimResult:
        """The run's result, after its last step."""
        missing = set(range(len(self.s.buckets))) - self.waited
        if missing:
            raise ScheduleInvalidError(f"buckets {sorted(missing)[:5]} are never waited on")
        return SimResult(
            step_ms=self.t,
            compute_ms=self.busy,
            exposed_comm_ms=self.exposed,
            comm_ms=dict(self.comm_busy),
            peak_bytes=self.peak,
            peak_step=self.peak_step,
            node_times=self.node_times,
            bucket_times=self.bucket_times,
            memory=self.memory,
            n_collectives=len(self.s.buckets),
            tracker_peak_bytes=self.trk.peak,
            tracker_peak_step=self.tracker_peak_step,
            step_live_bytes=self.step_live,
            bucket_exposed_ms=self.bucket_exposed,
            schedule=self.s,
        )

    def _run_node(self, k: int, name: str) -> None:
        """A compute or view node: runs for its runtime; its output is allocated, then its
        inputs' uses are released."""
        rt, allocs, trk_allocs, unread = self.steps[name]
        self.node_times[name] = (self.t, self.t + rt)
        self.t += rt
        self.busy += rt
        for owner, nbytes in allocs:
            self.mem.alloc(owner, nbytes)
        for owner, nbytes in trk_allocs:
            self.trk.alloc(owner, nbytes)
        self._record(k, self.mem.total)
        self.trk.record()
        for owner in unread:
            self.mem.free(owner)
        self._release_inputs(name)

    def _issue(self, k: int, b: int) -> None:
        """Issue bucket ``b``: copy-in (and prologue casts) on the compute stream, outputs and
        the bucket buffer allocated (:meth:`_Static.bucket_ops`), then the collective queued on
        its group's stream."""
        p = self.p
        members = self.s.buckets[b].members
        for m in members:
            if not p.issue_after[m] <= self.waited_members:
                raise ScheduleInvalidError(f"bucket {b} issues {m!r} before the wait of "
                                           f"{sorted(p.issue_after[m] - self.waited_members)[:3]}, whose result it reads")
        cin = p.copy_in_ms(members)
        t_issue = self.t
        self.t += cin
        self.busy += cin
        (mem_issue, _), (trk_issue, _) = self.st.bucket_ops(members)
        self._record(k, self._apply(b, mem_issue, trk_issue))
        c0 = p.colls[members[0]]
        dur = p.bucket_comm_ms(members)
        stream = stream_of(c0.coll_type, c0.group_name, self.split)
        self.streams.issue(b, stream, self.t, dur)
        self.comm_busy[stream] += dur
        self.bucket_times[b] = (t_issue, float("nan"), float("nan"), float("nan"))
        self.issued.add(b)

    def _apply(self, b: int, mem_ops: tuple[Op, ...], trk_ops: tuple[Op, ...]) -> int:
        """Run one step's micro-operations of bucket ``b`` on both counts; returns the highest
        live bytes the execution model's count records in the step."""
        live = 0
        for mem, ops, own in ((self.mem, mem_ops, True), (self.trk, trk_ops, False)):
            for _, code, key, amount, member in ops:
                if member is None and key is not None:
                    key = f"{key}:{b}"
                if code == ALLOC:
                    mem.alloc(key, amount)
                elif code == REC:
                    if own:
                        live = max(live, mem.total + amount)
                    else:
                        mem.peak = max(mem.peak, mem.total + amount)
                elif code == REL:
                    mem.release(key)
                elif code == DROP:
                    mem.drop(key)
                else:
                    mem.free(key)
        return live

    def _wait(self, k: int, b: int) -> None:
        """Wait on bucket ``b``: the compute stream blocks until it completes, then copies out
        (merged all-gathers) and runs the epilogues; memory as :meth:`_Static.bucket_ops` says."""
        p = self.p
        if b not in self.issued:
            raise ScheduleInvalidError(f"bucket {b} is waited before it is issued")
        members = self.s.buckets[b].members
        end = self.streams.end(b)
        if end > self.t:
            self.exposed += end - self.t
            self.bucket_exposed[b] = end - self.t
            self.t = end
        cout = p.copy_out_ms(members)
        self.t += cout
        self.busy += cout
        (_, mem_wait), (_, trk_wait) = self.st.bucket_ops(members)
        self._record(k, self._apply(b, mem_wait, trk_wait))
        self.bucket_times[b] = (self.bucket_times[b][0], self.streams.start(b), end, self.t)
        self.waited.add(b)
        self.waited_members.update(members)
