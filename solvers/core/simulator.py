"""Check: simulate any schedule on the execution model of DESIGN.md.

Execution model:
- One compute stream runs the schedule's node steps in order, each for its ``runtime_ms``.
- Each process group has one FIFO communication stream. An issue step first spends the
  bucket's copy-in time on the compute stream (prologue casts, plus the copy into the bucket
  buffer when merged); the collective then starts at ``max(compute time, stream free)`` and
  lasts ``Problem.bucket_comm_ms``. A wait step blocks the compute stream until the bucket
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
  the outputs are allocated.
- Step time is when the compute stream finishes (every collective is waited on).

Differences from ``torch._inductor.fx_passes.memory_estimator`` on unmodified graphs: torch
frees a collective's input after the collective node itself, not after its wait. For FSDP
graphs as traced (wait right after issue) the peaks agree; see docs in README.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import networkx as nx

from solvers.core.problem import Problem
from solvers.core.schedule import Schedule

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
    step_live_bytes: list[int] = dataclasses.field(repr=False, default_factory=list)
    bucket_exposed_ms: dict[int, float] = dataclasses.field(repr=False, default_factory=dict)
    schedule: Schedule = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]

    def summary(self) -> dict[str, Any]:
        return {
            "step_ms": round(self.step_ms, 4),
            "compute_ms": round(self.compute_ms, 4),
            "exposed_comm_ms": round(self.exposed_comm_ms, 4),
            "comm_ms": {k: round(v, 4) for k, v in self.comm_ms.items()},
            "peak_bytes": self.peak_bytes,
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
    return _Simulator(problem, schedule).run()


class ScheduleInvalidError(ValueError):
    """A schedule violates the execution model or does not match its graph."""


class _Memory:
    """Live storages of one run: allocation at first write, release after the last of the
    counted uses, and the peak."""

    def __init__(self, uses: dict[str, int], never_free: set[str]):
        self.uses = uses
        self.never_free = never_free
        self.live: dict[str, int] = {}
        self.total = 0

    def alloc(self, owner: str, nbytes: int) -> None:
        if nbytes and owner not in self.live:
            self.live[owner] = nbytes
            self.total += nbytes

    def free(self, owner: str) -> None:
        if owner in self.live and owner not in self.never_free:
            self.total -= self.live.pop(owner)

    def release(self, owner: str) -> None:
        """One use of ``owner`` is done; free it after the last one."""
        self.uses[owner] -= 1
        if self.uses[owner] <= 0:
            self.free(owner)


class _Simulator:
    """One run of a schedule: the compute-stream clock ``t``, the streams, and the memory."""

    def __init__(self, problem: Problem, schedule: Schedule):
        self.p = problem
        self.s = schedule
        dag = problem.dag
        self.dag = dag
        self.nodes = dag.nodes
        self.root = {n: (a["alias_of"] or n) for n, a in dag.nodes(data=True)}
        self.mem = _Memory(self._uses(), self._never_free())
        for n, a in self.nodes(data=True):
            if a["kind"] == "input":
                # inputs nobody reads (and not pinned) are dead on arrival; keep them: they
                # were passed in
                self.mem.alloc(n, int(a["size_bytes"]))
        self.t = 0.0
        self.busy = 0.0
        self.exposed = 0.0
        self.stream_free: dict[str, float] = defaultdict(float)
        self.comm_busy: dict[str, float] = defaultdict(float)
        self.node_times: dict[str, tuple[float, float]] = {}
        self.bucket_times: dict[int, tuple[float, float, float, float]] = {}
        self.bucket_end: dict[int, float] = {}
        self.bucket_exposed: dict[int, float] = {}
        self.memory: list[tuple[float, int]] = [(0.0, self.mem.total)]
        self.peak, self.peak_step = self.mem.total, -1
        self.step_live: list[int] = []
        self.issued: set[int] = set()
        self.waited: set[int] = set()

    def _uses(self) -> dict[str, int]:
        """Number of release events of each storage: one per reading node step, one per
        prologue read at issue, one per collective input (released at its wait, or at the
        issue when merged)."""
        p, dag = self.p, self.p.dag
        uses: dict[str, int] = defaultdict(int)
        for name in p.seq:
            for u in dag.predecessors(name):
                uses[self.root[u]] += 1
        for cname, c in p.colls.items():
            for reader in (*c.prologue, cname, *c.epilogue):
                for u in dag.predecessors(reader):
                    uses[self.root[u]] += 1
        return uses

    def _never_free(self) -> set[str]:
        """Graph inputs the graph cannot free, and whatever the graph returns."""
        out: set[str] = set()
        for n, a in self.nodes(data=True):
            if a["kind"] == "input" and not a.get("releasable", True):
                out.add(n)
            if a["kind"] == "output":
                out.update(self.root[u] for u in self.dag.predecessors(n))
        return out

    def _release_inputs(self, name: str) -> None:
        for u in self.dag.predecessors(name):
            self.mem.release(self.root[u])

    def _record(self, k: int, live: int) -> None:
        if live > self.peak:
            self.peak, self.peak_step = live, k
        self.step_live.append(live)

    def run(self) -> SimResult:
        for k, step in enumerate(self.s.steps):
            if step.kind == "node":
                self._run_node(k, step.ref)
            elif step.kind == "issue":
                self._issue(k, step.ref)
            else:
                self._wait(k, step.ref)
            self.memory.append((self.t, self.mem.total))
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
            step_live_bytes=self.step_live,
            bucket_exposed_ms=self.bucket_exposed,
            schedule=self.s,
        )

    def _run_node(self, k: int, name: str) -> None:
        """A compute or view node: runs for its runtime; its output is allocated, then its
        inputs' uses are released."""
        a = self.nodes[name]
        rt = float(a["runtime_ms"])
        self.node_times[name] = (self.t, self.t + rt)
        self.t += rt
        self.busy += rt
        if a["alias_of"] is None:
            self.mem.alloc(name, int(a["size_bytes"]))
        self._record(k, self.mem.total)
        self._release_inputs(name)

    def _issue(self, k: int, b: int) -> None:
        """Issue bucket ``b``: copy-in (and prologue casts) on the compute stream, outputs and
        the bucket buffer allocated, then the collective queued on its group's stream."""
        p = self.p
        members = self.s.buckets[b].members
        cin = p.copy_in_ms(members)
        t_issue = self.t
        self.t += cin
        self.busy += cin
        live = self._merge_inputs(b) if len(members) > 1 else self._alloc_alone(members[0])
        self._record(k, live)
        c0 = p.colls[members[0]]
        dur = p.bucket_comm_ms(members)
        start = max(self.t, self.stream_free[c0.group_name])
        end = start + dur
        self.stream_free[c0.group_name] = end
        self.comm_busy[c0.group_name] += dur
        self.bucket_end[b] = end
        self.bucket_times[b] = (t_issue, start, end, float("nan"))
        self.issued.add(b)

    def _run_prologue(self, members: tuple[str, ...], *, skip: frozenset[str] = frozenset()) -> int:
        """Prologue casts run before the collective: allocated, then their inputs released
        (as torch's memory_estimator counts it). Returns the live bytes in between."""
        nodes, mem = self.nodes, self.mem
        prologue = [pn for m in members for pn in self.p.colls[m].prologue if pn not in skip]
        for pn in prologue:
            mem.alloc(pn, int(nodes[pn]["size_bytes"]) if nodes[pn]["alias_of"] is None else 0)
        live = mem.total
        for pn in prologue:
            self._release_inputs(pn)
        return live

    def _alloc_alone(self, m: str) -> int:
        """A collective alone: prologue, then its output. Returns the step's peak live bytes;
        its input stays alive until the wait."""
        live = self._run_prologue((m,))
        self.mem.alloc(m, self.p.colls[m].out_bytes)
        return max(live, self.mem.total)

    def _merge_inputs(self, b: int) -> int:
        """A merged bucket's copy-in, as torch's merge functions emit it; the bucket buffer
        lives until the wait. Returns the step's peak live bytes."""
        members = self.s.buckets[b].members
        if self.p.colls[members[0]].coll_type == "all_gather":
            return self._merge_all_gather(b, members)
        return self._merge_reduce_scatter(b, members)

    def _merge_all_gather(self, b: int, members: tuple[str, ...]) -> int:
        """The bucket buffer (the members' outputs) is allocated, then a ``cat`` of the
        members' inputs is copied into it and dropped: folded dtype casts never run, the cat
        reads their inputs (``merge_read_bytes``)."""
        p, mem = self.p, self.mem
        folded = frozenset(p.colls[m].folded_cast for m in members) - {None}
        live = self._run_prologue(members, skip=folded)
        mem.alloc(f"bucket:{b}", sum(p.colls[m].out_bytes for m in members))
        live = max(live, mem.total + sum(p.colls[m].merge_read_bytes for m in members))
        for name in (*members, *folded):
            self._release_inputs(name)
        return live

    def _merge_reduce_scatter(self, b: int, members: tuple[str, ...]) -> int:
        """The ``cat`` of the members' inputs is the bucket buffer; the inputs are released
        after it, then the outputs allocated."""
        p, mem = self.p, self.mem
        live = self._run_prologue(members)
        mem.alloc(f"bucket:{b}", sum(p.colls[m].payload_bytes for m in members))
        live = max(live, mem.total)
        for m in members:
            self._release_inputs(m)
            mem.alloc(m, p.colls[m].out_bytes)
        return max(live, mem.total)

    def _wait(self, k: int, b: int) -> None:
        """Wait on bucket ``b``: the compute stream blocks until it completes, then copies out
        (merged all-gathers) and runs the epilogues; inputs are released."""
        p, nodes, mem = self.p, self.nodes, self.mem
        if b not in self.issued:
            raise ScheduleInvalidError(f"bucket {b} is waited before it is issued")
        members = self.s.buckets[b].members
        merged = len(members) > 1
        c0 = p.colls[members[0]]
        if self.bucket_end[b] > self.t:
            self.exposed += self.bucket_end[b] - self.t
            self.bucket_exposed[b] = self.bucket_end[b] - self.t
            self.t = self.bucket_end[b]
        cout = p.copy_out_ms(members)
        self.t += cout
        self.busy += cout
        if merged and c0.coll_type == "all_gather":
            for m in members:
                mem.alloc(m, p.colls[m].out_bytes)
        for m in members:
            for e in p.colls[m].epilogue:
                if nodes[e]["alias_of"] is None:
                    mem.alloc(e, int(nodes[e]["size_bytes"]))
        self._record(k, mem.total)
        if merged:
            mem.free(f"bucket:{b}")
        else:
            self._release_inputs(members[0])
        for m in members:
            for e in p.colls[m].epilogue:
                self._release_inputs(e)
        i0, s0, e0, _ = self.bucket_times[b]
        self.bucket_times[b] = (i0, s0, e0, self.t)
        self.waited.add(b)
