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
- Memory: what each step allocates and frees, by the execution model's count and by torch's
  ``MemoryTracker`` rules, is :mod:`solvers.core.memory`'s rule set; the simulator runs its
  micro-operations step by step (the fast evaluator, :mod:`solvers.core.evaluate`, analyses the
  same operations once per graph).
- Step time is when the compute stream finishes (every collective is waited on).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from solvers.core.memory import (ALLOC, DROP, REC, REL, LiveMemory, Op, copied_out, merged_memory,
                                 static_memory)
from solvers.core.problem import Problem
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


class Simulator:
    """One run of a schedule: the compute-stream clock ``t``, the streams, and the memory by
    both counts (``mem``: the execution model's; ``trk``: torch's tracker rules)."""

    def __init__(self, problem: Problem, schedule: Schedule):
        self.p = problem
        self.s = schedule
        st = static_memory(problem)
        self.st = st
        self.steps = st.steps
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
        """A compute or view node: runs for its runtime; memory as
        :meth:`~solvers.core.memory.StaticMemory.node_ops` says."""
        rt = self.steps[name][0]
        self.node_times[name] = (self.t, self.t + rt)
        self.t += rt
        self.busy += rt
        mem_ops, trk_ops = self.st.node_ops(name)
        self._record(k, self._apply(-1, mem_ops, trk_ops))

    def _issue(self, k: int, b: int) -> None:
        """Issue bucket ``b``: copy-in (and prologue casts) on the compute stream, outputs and
        the bucket buffer allocated (:meth:`~solvers.core.memory.StaticMemory.bucket_ops`), then the collective queued on
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
        """Run one step's micro-operations (:data:`~solvers.core.memory.Op`; of bucket ``b``,
        whose own storages are named after it) on both counts; returns the highest live bytes
        the execution model's count records in the step."""
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
        (merged all-gathers) and runs the epilogues; memory as :meth:`~solvers.core.memory.StaticMemory.bucket_ops` says."""
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
