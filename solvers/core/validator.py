"""Check: a solver-independent validator for any schedule, from any source.

Checks, in order (the first failure raises :class:`ScheduleInvalidError` naming it):
1. coverage: every collective of the DAG is in exactly one bucket; fixed (unmovable)
   collectives stay alone; payload bytes are those of the input graph.
2. homogeneity: a bucket's members share type, process group, dtype and reduce op.
3. order: every schedulable node appears once; data dependencies hold (a node runs after its
   producers, a bucket is issued after its members' inputs exist and waited before any reader
   of its results, further waits on a member included); every bucket is issued once and
   waited once after its issue.
4. memory: simulated peak memory <= budget (when a budget is given).
Returns the simulation, so callers get the predicted numbers for free.
"""

from __future__ import annotations

from collections import Counter

from solvers.core.simulator import ScheduleInvalidError, SimResult, simulate
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule


def validate_schedule(
    problem: Problem,
    schedule: Schedule,
    *,
    mem_budget_bytes: int | None = None,
) -> SimResult:
    """Validate ``schedule`` against ``problem`` and return its simulation.

    Raises:
        ScheduleInvalidError: the first violated check (see module docstring).
    """
    _check_coverage(problem, schedule)
    _check_homogeneous(problem, schedule)
    _check_order(problem, schedule)
    sim = simulate(problem.dag, schedule, problem=problem)
    if mem_budget_bytes is not None and sim.peak_bytes > mem_budget_bytes:
        raise ScheduleInvalidError(
            f"simulated peak memory {sim.peak_bytes} B exceeds the budget {mem_budget_bytes} B"
        )
    return sim


def _check_coverage(problem: Problem, schedule: Schedule) -> None:
    seen = Counter(m for b in schedule.buckets for m in b.members)
    dup = [m for m, k in seen.items() if k > 1]
    if dup:
        raise ScheduleInvalidError(f"collectives in more than one bucket: {dup[:5]}")
    unknown = [m for m in seen if m not in problem.colls]
    if unknown:
        raise ScheduleInvalidError(f"buckets name collectives the graph does not have: {unknown[:5]}")
    missing = [c for c in problem.colls if c not in seen]
    if missing:
        raise ScheduleInvalidError(f"collectives of the graph missing from the schedule: {missing[:5]}")
    for b in schedule.buckets:
        if len(b.members) > 1 and any(not problem.colls[m].movable for m in b.members):
            raise ScheduleInvalidError(f"bucket {b.members} merges a fixed (unmodelled) collective")
    total_in = sum(c.payload_bytes for c in problem.colls.values())
    dag_total = sum(a["payload_bytes"] for _, a in problem.dag.nodes(data=True) if a["kind"] == "collective")
    if total_in != dag_total:
        raise ScheduleInvalidError(f"payload bytes changed: {total_in} != {dag_total}")


def _check_homogeneous(problem: Problem, schedule: Schedule) -> None:
    for b in schedule.buckets:
        keys = {problem.colls[m].key for m in b.members}
        if len(keys) > 1:
            raise ScheduleInvalidError(
                f"bucket {b.members[:3]}... mixes collective types / process groups / dtypes: "
                f"{sorted(map(str, keys))}"
            )


def _check_order(problem: Problem, schedule: Schedule) -> None:
    dag = problem.dag
    nodes_in_order = schedule.node_order()
    if Counter(nodes_in_order) != Counter(problem.seq):
        extra = set(nodes_in_order) - set(problem.seq)
        lost = set(problem.seq) - set(nodes_in_order)
        raise ScheduleInvalidError(
            f"schedule's compute nodes differ from the graph's: unknown {sorted(extra)[:3]}, "
            f"missing {sorted(lost)[:3]}, or listed twice"
        )
    issue, wait = schedule.positions()
    for b, (i, w) in enumerate(zip(issue, wait)):
        if i < 0 or w < 0:
            raise ScheduleInvalidError(f"bucket {b} is {'never issued' if i < 0 else 'never waited'}")
    step_pos: dict[tuple[str, object], int] = {}
    for k, s in enumerate(schedule.steps):
        key = (s.kind, s.ref)
        if key in step_pos:
            raise ScheduleInvalidError(f"step {s.kind} {s.ref!r} appears twice")
        step_pos[key] = k
    # where does each DAG node run?
    bucket_of = schedule.bucket_of()
    run_at: dict[str, int] = {}
    for name in problem.seq:
        run_at[name] = step_pos[("node", name)]
    for cname, c in problem.colls.items():
        b = bucket_of[cname]
        run_at[cname] = step_pos[("issue", b)]
        for pn in c.prologue:
            run_at[pn] = step_pos[("issue", b)]
        run_at[c.wait] = step_pos[("wait", b)]
        for e in c.epilogue:
            run_at[e] = step_pos[("wait", b)]
        if run_at[c.wait] < run_at[cname]:
            raise ScheduleInvalidError(f"bucket {b} is waited before it is issued")
    for v, at_v in run_at.items():
        for u in dag.predecessors(v):
            if u in run_at and run_at[u] > at_v:
                raise ScheduleInvalidError(
                    f"dependency violated: {v!r} runs before its input {u!r}"
                )
            # a further wait on a collective returns its result: it reads it after the wait
            if u in problem.colls and v in problem.colls[u].result_readers and run_at[problem.colls[u].wait] >= at_v:
                raise ScheduleInvalidError(
                    f"dependency violated: {v!r} reads the result of {u!r} before its wait {problem.colls[u].wait!r}"
                )
            if u in run_at and run_at[u] == at_v and dag.nodes[v]["kind"] == "wait" and u != dag.nodes[v]["collective"]:
                raise ScheduleInvalidError(f"dependency violated: {v!r} in the same step as {u!r}")
    for cname, c in problem.colls.items():
        if not c.movable:
            b = bucket_of[cname]
            if (issue[b], wait[b]) != (c.traced_issue, c.traced_wait):
                raise ScheduleInvalidError(
                    f"fixed collective {cname!r} moved from gaps ({c.traced_issue}, {c.traced_wait}) "
                    f"to ({issue[b]}, {wait[b]})"
                )
