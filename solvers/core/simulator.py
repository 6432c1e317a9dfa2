"""Check: simulate any schedule on the execution model of DESIGN.md, with its full trace.

The execution model lives in two modules, each the only statement of its rules:

- time: :mod:`solvers.core.timeline` (the compute stream, FIFO communication streams that share
  a link's bandwidth where they share a link, copy-in at issue, copy-out at wait), walked by its
  :class:`~solvers.core.timeline.Clock`;
- memory: :mod:`solvers.core.memory` (what each step allocates and frees, by the execution
  model's count and by torch's ``MemoryTracker`` rules), as micro-operations run step by step.

The simulator runs both over one schedule and records everything (:class:`SimResult`); the fast
evaluator (:mod:`solvers.core.evaluate`) walks the same clock without records and analyses the
same memory operations once per graph.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from solvers.core.memory import (ALLOC, DROP, REC, REL, Op, copied_out, merged_memory,
                                 static_memory)
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule
from solvers.core.streams import shared_links, stream_of
from solvers.core.timeline import BucketCost, Clock, bucket_steps

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SimResult:
    """The outcome of one run of a schedule on the execution model: the one result type, the
    simulator's (:func:`simulate`: every field) and the fast evaluator's
    (:mod:`solvers.core.evaluate`, which calls it ``Evaluation``: the figures a search reads,
    the trace fields left empty; ``compute_ms`` within float rounding, the nodes' total summed
    first).

    Attributes:
        step_ms: when the compute stream finishes.
        compute_ms: busy time of the compute stream (nodes, prologues, copies).
        exposed_comm_ms: time the compute stream spends blocked in waits.
        comm_ms: busy time of each process group's stream.
        peak_bytes: maximum live bytes over the run.
        n_collectives: number of collectives issued (buckets).
        tracker_peak_bytes: maximum live bytes of the same run by torch's ``MemoryTracker``
            rules on the written graph (:mod:`solvers.core.memory`).
        peak_step: index into the schedule's steps where the peak occurs (trace).
        tracker_peak_step: index into the steps where that peak occurs (-1: the inputs; trace).
        node_times: node name -> (start_ms, end_ms) on the compute stream (trace).
        bucket_times: bucket index -> (issue_ms, start_ms, end_ms, wait_done_ms) (trace).
        memory: (time_ms, live_bytes) after every step (trace).
        step_live_bytes: live bytes during every step (after its allocations, before its
            frees; trace).
        bucket_exposed_ms: bucket index -> time the compute stream waited for it (ms; trace).
        schedule: the schedule run (trace).
    """

    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    comm_ms: dict[str, float]
    peak_bytes: int
    n_collectives: int
    tracker_peak_bytes: int = 0
    peak_step: int = -1
    tracker_peak_step: int = -1
    node_times: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    bucket_times: dict[int, tuple[float, float, float, float]] = dataclasses.field(default_factory=dict)
    memory: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    step_live_bytes: list[int] = dataclasses.field(repr=False, default_factory=list)
    bucket_exposed_ms: dict[int, float] = dataclasses.field(repr=False, default_factory=dict)
    schedule: Schedule = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]

    def figures(self) -> "SimResult":
        """The figures alone, without the trace (what the fast evaluator returns)."""
        return SimResult(step_ms=self.step_ms, compute_ms=self.compute_ms, exposed_comm_ms=self.exposed_comm_ms,
                         comm_ms=dict(self.comm_ms), peak_bytes=self.peak_bytes,
                         tracker_peak_bytes=self.tracker_peak_bytes, n_collectives=self.n_collectives)

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


def peak_step(problem: Problem, schedule: Schedule, peak_bytes: int) -> int:
    """:attr:`SimResult.peak_step` of ``schedule``, whose peak by the memory count is
    ``peak_bytes`` (the fast evaluator's, :mod:`solvers.core.evaluate`): the memory rules run up
    to the first step that reaches it, the clock not at all."""
    _check_shape(problem, schedule)
    sim = Simulator(problem, schedule)
    sim.run_memory(until=peak_bytes)
    return sim.peak_step


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
    return Simulator(problem, schedule).run()


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
    sims = [Simulator(p, schedule) for p in problems]
    if any(sim.clock.links for sim in sims):
        raise ValueError("simulate_ranks does not synchronise streams that share a network link (two groups of "
                         "the same ranks, or a split schedule): simulate each rank alone")
    steps = sims[0].bucket_steps
    done = 0
    for i, (is_issue, b, _) in enumerate(steps):
        if is_issue:
            for sim in sims:
                sim.clock.advance(steps, done, i + 1)
            done = i + 1
            start = max(sim.clock.start[b] for sim in sims)
            for sim in sims:
                sim.clock.hold(b, start)
    for sim in sims:
        sim.run_memory()
        sim.clock.advance(steps, done)
        sim.clock.finish()
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
    _check_ranges(problem, schedule)


def _check_ranges(problem: Problem, schedule: Schedule) -> None:
    """Every bucket issued and waited inside the issue ranges of all its members (a bucket whose
    members' ranges do not meet has none): a schedule outside them runs a node before its
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
                    f"bucket {b} is issued at gap {i} and waited at gap {w}, outside the issue range "
                    f"[{c.ready}, {c.needed}] of its member {m!r}")


class ScheduleInvalidError(ValueError):
    """A schedule violates the execution model or does not match its graph."""


class Simulator:
    """One run of a schedule: the time walk (:class:`~solvers.core.timeline.Clock`, recording)
    and the memory by both counts (``mem``: the execution model's; ``trk``: torch's tracker
    rules), each step's micro-operations of :mod:`solvers.core.memory` run in order."""

    def __init__(self, problem: Problem, schedule: Schedule):
        self.p = problem
        self.s = schedule
        st = static_memory(problem)
        self.st = st
        merged = [(b, bucket.members) for b, bucket in enumerate(schedule.buckets)
                  if len(bucket.members) > 1 and not copied_out(problem.colls, bucket.members)]
        self.mem = merged_memory(st.mem_owner, st.mem_uses, st.mem_never_free, st.mem_nodes, merged)
        self.trk = merged_memory(st.trk_owner, st.trk_uses, st.trk_never_free, st.trk_nodes, merged)
        for n, size in st.inputs:
            # inputs nobody reads (and not pinned) are dead on arrival; keep them: they were
            # passed in
            for mem in (self.mem, self.trk):
                mem.alloc_node(n, size)
        self.trk.record()
        self._initial_total = self.mem.total
        self.peak, self.peak_step = self.mem.total, -1
        self.tracker_peak_step = -1
        self.step_live: list[int] = []
        self.totals: list[int] = []
        #: the schedule's issue and wait steps, each with its gap
        self.bucket_steps = bucket_steps(schedule)
        self.nodes = [s.ref for s in schedule.steps if s.kind == "node"]
        self.clock = Clock([st.steps[n][0] for n in self.nodes], self._costs(),
                           shared_links(problem.stream_links(schedule.split_groups))
                           if schedule.split_groups or problem.shares_links else None, record=True)

    def _costs(self) -> list[BucketCost]:
        """Each bucket's :data:`~solvers.core.timeline.BucketCost`, after the order of the
        steps is checked: a collective issued after the waits of those whose results it reads,
        each bucket waited after its issue and waited at all."""
        p, buckets = self.p, self.s.buckets
        split = frozenset(self.s.split_groups)
        costs: list[BucketCost] = [(0.0, 0.0, 0.0, "")] * len(buckets)
        issued: set[int] = set()
        waited: set[int] = set()
        waited_members: set[str] = set()
        for step in self.s.steps:
            b = step.ref
            if step.kind == "issue":
                members = buckets[b].members
                for m in members:
                    if not p.issue_after[m] <= waited_members:
                        early = sorted(p.issue_after[m] - waited_members)[:3]
                        raise ScheduleInvalidError(f"bucket {b} issues {m!r} before the wait of {early}, whose result "
                                                   "it reads")
                c0 = p.colls[members[0]]
                costs[b] = (p.copy_in_ms(members), p.copy_out_ms(members), p.bucket_comm_ms(members),
                            stream_of(c0.coll_type, c0.group_name, split))
                issued.add(b)
            elif step.kind == "wait":
                if b not in issued:
                    raise ScheduleInvalidError(f"bucket {b} is waited before it is issued")
                waited.add(b)
                waited_members.update(buckets[b].members)
        missing = set(range(len(buckets))) - waited
        if missing:
            raise ScheduleInvalidError(f"buckets {sorted(missing)[:5]} are never waited on")
        return costs

    def _record(self, k: int, live: int) -> None:
        if live > self.peak:
            self.peak, self.peak_step = live, k
        self.step_live.append(live)

    def run(self) -> SimResult:
        self.run_memory()
        self.clock.advance(self.bucket_steps)
        self.clock.finish()
        return self.result()

    def run_memory(self, until: int | None = None) -> None:
        """Every step's memory, in order; with ``until``, only up to the first step where the
        memory count reaches that many bytes."""
        if until is not None and self.peak >= until:
            return
        for k, step in enumerate(self.s.steps):
            before = self.trk.peak
            if step.kind == "node":
                self._run_node(k, step.ref)
            else:
                self._run_bucket(k, step.ref, step.kind == "issue")
            if self.trk.peak > before:
                self.tracker_peak_step = k
            self.totals.append(self.mem.total)
            if until is not None and self.peak >= until:
                return

    def result(self) -> SimResult:
        """The run's result, after its memory and its clock have run."""
        clock = self.clock
        return SimResult(
            step_ms=clock.t,
            compute_ms=clock.busy,
            exposed_comm_ms=clock.exposed,
            comm_ms=dict(clock.comm),
            peak_bytes=self.peak,
            peak_step=self.peak_step,
            node_times=dict(zip(self.nodes, clock.node_times)),
            bucket_times=clock.bucket_times,
            memory=[(0.0, self._initial_total)] + list(zip(clock.times, self.totals)),
            n_collectives=len(self.s.buckets),
            tracker_peak_bytes=self.trk.peak,
            tracker_peak_step=self.tracker_peak_step,
            step_live_bytes=self.step_live,
            bucket_exposed_ms=clock.bucket_exposed,
            schedule=self.s,
        )

    def _run_node(self, k: int, name: str) -> None:
        """A compute or view node: memory as :meth:`~solvers.core.memory.StaticMemory.node_ops`
        says (its time is the clock's)."""
        mem_ops, trk_ops = self.st.node_ops(name)
        self._record(k, self._apply(-1, mem_ops, trk_ops))

    def _run_bucket(self, k: int, b: int, issue: bool) -> None:
        """Bucket ``b``'s issue or wait: memory as
        :meth:`~solvers.core.memory.StaticMemory.bucket_ops` says (its time is the clock's)."""
        (mem_issue, mem_wait), (trk_issue, trk_wait) = self.st.bucket_ops(self.s.buckets[b].members)
        if issue:
            self._record(k, self._apply(b, mem_issue, trk_issue))
        else:
            self._record(k, self._apply(b, mem_wait, trk_wait))

    def _apply(self, b: int, mem_ops: tuple[Op, ...], trk_ops: tuple[Op, ...]) -> int:
        """Run one step's micro-operations (:data:`~solvers.core.memory.Op`; of bucket ``b``,
        whose own storages are named after it) on both counts; returns the highest live bytes
        the execution model's count records in the step."""
        live = 0
        for mem, ops, own in ((self.mem, mem_ops, True), (self.trk, trk_ops, False)):
            release = mem.release
            for _, code, key, amount, member in ops:
                if code == REL:  # the commonest: one use of an input's storage, never the bucket's own
                    release(key)
                    continue
                if member is None and key is not None:
                    key = f"{key}:{b}"
                if code == ALLOC:
                    mem.alloc(key, amount)
                elif code == REC:
                    if own:
                        live = max(live, mem.total + amount)
                    else:
                        mem.peak = max(mem.peak, mem.total + amount)
                elif code == DROP:
                    mem.drop(key)
                else:
                    mem.free(key)
        return live
