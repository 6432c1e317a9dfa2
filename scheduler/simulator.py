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
  freed. A merged all-gather holds its bucket buffer from issue to wait, where members are
  copied out; a merged reduce-scatter holds its input buffer from issue to wait.
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

from solvers.problem import Problem
from solvers.schedule import Schedule

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


def simulate(
    dag_or_gm: Any,
    schedule: Schedule | None = None,
    *,
    cost_model: Any = None,
    cluster: Any = None,
    problem: Problem | None = None,
) -> SimResult:
    """Simulate ``schedule`` (default: the traced order) of a DAG or FX graph.

    Args:
        dag_or_gm: a DAG from :func:`scheduler.export_dag`, or an FX GraphModule (exported
            first with ``cost_model`` and ``cluster``).
        schedule: any schedule over the DAG; default: as traced.
        cost_model, cluster: used only when exporting an FX graph.
        problem: a prebuilt :class:`Problem` of the DAG, to skip rebuilding it.

    Raises:
        ScheduleInvalidError: the schedule does not fit the DAG (see :func:`validate_schedule`
            for the full check).
    """
    if isinstance(dag_or_gm, nx.DiGraph):
        dag = dag_or_gm
    else:
        from scheduler.dag import export_dag

        dag = export_dag(dag_or_gm, cost_model=cost_model, cluster=cluster)
    problem = problem or Problem.from_dag(dag)
    schedule = schedule or problem.traced_schedule()
    return _Simulator(problem, schedule).run()


class ScheduleInvalidError(ValueError):
    """A schedule violates the execution model or does not match its graph."""


class _Simulator:
    def __init__(self, problem: Problem, schedule: Schedule):
        self.p = problem
        self.s = schedule
        dag = problem.dag
        self.nodes = dag.nodes
        self.root = {n: (a["alias_of"] or n) for n, a in dag.nodes(data=True)}

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

    def run(self) -> SimResult:
        p, s, nodes = self.p, self.s, self.nodes
        dag = p.dag
        uses = self._uses()
        never_free: set[str] = set()
        for n, a in nodes(data=True):
            if a["kind"] == "input" and not a.get("releasable", True):
                never_free.add(n)
            if a["kind"] == "output":
                for u in dag.predecessors(n):
                    never_free.add(self.root[u])
        live: dict[str, int] = {}
        total = 0

        def alloc(owner: str, nbytes: int) -> None:
            nonlocal total
            if nbytes and owner not in live:
                live[owner] = nbytes
                total += nbytes

        def free(owner: str) -> None:
            nonlocal total
            if owner in live and owner not in never_free:
                total -= live.pop(owner)

        def release(owner: str) -> None:
            uses[owner] -= 1
            if uses[owner] <= 0:
                free(owner)

        for n, a in nodes(data=True):
            if a["kind"] == "input":
                alloc(n, int(a["size_bytes"]))
        # inputs nobody reads (and not pinned) are dead on arrival; keep them: they were passed in
        t = 0.0
        busy = 0.0
        exposed = 0.0
        stream_free: dict[str, float] = defaultdict(float)
        comm_busy: dict[str, float] = defaultdict(float)
        node_times: dict[str, tuple[float, float]] = {}
        bucket_times: dict[int, tuple[float, float, float, float]] = {}
        bucket_end: dict[int, float] = {}
        memory: list[tuple[float, int]] = [(0.0, total)]
        peak, peak_step = total, -1
        issued: set[int] = set()
        waited: set[int] = set()
        step_live: list[int] = []
        bucket_exposed: dict[int, float] = {}
        for k, step in enumerate(s.steps):
            if step.kind == "node":
                name = step.ref
                a = nodes[name]
                rt = float(a["runtime_ms"])
                node_times[name] = (t, t + rt)
                t += rt
                busy += rt
                if a["alias_of"] is None:
                    alloc(name, int(a["size_bytes"]))
                if total > peak:
                    peak, peak_step = total, k
                step_live.append(total)
                for u in dag.predecessors(name):
                    release(self.root[u])
            elif step.kind == "issue":
                b = step.ref
                members = s.buckets[b].members
                merged = len(members) > 1
                cin = p.copy_in_ms(members)
                t_issue = t
                t += cin
                busy += cin
                # prologue casts run before the collective: their inputs are freed before the
                # collective's output is allocated (as torch's memory_estimator counts it)
                for m in members:
                    for pn in p.colls[m].prologue:
                        alloc(pn, int(nodes[pn]["size_bytes"]) if nodes[pn]["alias_of"] is None else 0)
                step_peak = total
                for m in members:
                    for pn in p.colls[m].prologue:
                        for u in dag.predecessors(pn):
                            release(self.root[u])
                for m in members:
                    c = p.colls[m]
                    if not merged or c.coll_type != "all_gather":
                        alloc(m, c.out_bytes)
                c0 = p.colls[members[0]]
                if merged:
                    buf = sum(p.colls[m].payload_bytes for m in members)
                    if c0.coll_type == "all_gather":
                        buf = sum(p.colls[m].out_bytes for m in members)
                    alloc(f"bucket:{b}", buf)
                step_peak = max(step_peak, total)
                if step_peak > peak:
                    peak, peak_step = step_peak, k
                step_live.append(step_peak)
                for m in members:
                    c = p.colls[m]
                    if merged:
                        for u in dag.predecessors(m):
                            release(self.root[u])
                dur = p.bucket_comm_ms(members)
                start = max(t, stream_free[c0.group_name])
                end = start + dur
                stream_free[c0.group_name] = end
                comm_busy[c0.group_name] += dur
                bucket_end[b] = end
                bucket_times[b] = (t_issue, start, end, float("nan"))
                issued.add(b)
            else:
                b = step.ref
                if b not in issued:
                    raise ScheduleInvalidError(f"bucket {b} is waited before it is issued")
                members = s.buckets[b].members
                merged = len(members) > 1
                c0 = p.colls[members[0]]
                if bucket_end[b] > t:
                    exposed += bucket_end[b] - t
                    bucket_exposed[b] = bucket_end[b] - t
                    t = bucket_end[b]
                cout = p.copy_out_ms(members)
                t += cout
                busy += cout
                if merged and c0.coll_type == "all_gather":
                    for m in members:
                        alloc(m, p.colls[m].out_bytes)
                for m in members:
                    for e in p.colls[m].epilogue:
                        if nodes[e]["alias_of"] is None:
                            alloc(e, int(nodes[e]["size_bytes"]))
                if total > peak:
                    peak, peak_step = total, k
                step_live.append(total)
                if merged:
                    free(f"bucket:{b}")
                else:
                    for u in dag.predecessors(members[0]):
                        release(self.root[u])
                for m in members:
                    for e in p.colls[m].epilogue:
                        for u in dag.predecessors(e):
                            release(self.root[u])
                i0, s0, e0, _ = bucket_times[b]
                bucket_times[b] = (i0, s0, e0, t)
                waited.add(b)
            memory.append((t, total))
        missing = set(range(len(s.buckets))) - waited
        if missing:
            raise ScheduleInvalidError(f"buckets {sorted(missing)[:5]} are never waited on")
        return SimResult(
            step_ms=t,
            compute_ms=busy,
            exposed_comm_ms=exposed,
            comm_ms=dict(comm_busy),
            peak_bytes=peak,
            peak_step=peak_step,
            node_times=node_times,
            bucket_times=bucket_times,
            memory=memory,
            n_collectives=len(s.buckets),
            step_live_bytes=step_live,
            bucket_exposed_ms=bucket_exposed,
            schedule=s,
        )
