"""The user-facing entry points: export -> solve -> validate -> write back, with a report.

- :func:`optimize_schedule`: rewrite a partitioned forward or backward FX graph in place.
- :func:`solve_dag`: the same solve on a saved DAG, without torch (notebooks, CLI).
- :func:`backend`: a ``torch.compile`` backend (aot_autograd) that runs it on every graph.
- :func:`inductor_post_grad_pass`: the same as an inductor post-grad custom pass.
- :func:`parse_bytes`: ``"40GiB"`` -> bytes, for every ``mem_budget`` argument.

Failure policy: a memory budget that no schedule reaches raises
:class:`solvers.schedule.InfeasibleBudgetError` with the smallest peak found; a solver that
fails or times out is replaced (``fallback=True``) by the best valid schedule among its
incumbent and the heuristics, which is never worse than the graph as traced; the report says
so (``fell_back``, ``notes``) and a warning is logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.simulator import ScheduleInvalidError, SimResult, simulate
from scheduler.validator import validate_schedule
from solvers.problem import Problem, fmt_bytes, fmt_ms
from solvers.schedule import InfeasibleBudgetError, Schedule, ScheduleError, SolveResult, SolveStatus

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: heuristics tried (in this order) as the solver's hint and as fallbacks
_HEURISTICS = ("fsdp2", "traced")
#: key of the report in ``gm.meta``
REPORT_KEY = "fsdp_sched_report"

# --------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(x: int | float | str | None) -> int | None:
    """A memory size in bytes.

    Accepts None (no limit, returned as None), a number of bytes, or a string: a number and a
    unit, case-insensitive: ``B``, decimal ``KB`` / ``MB`` / ``GB`` / ``TB`` (powers of 1000)
    or binary ``KiB`` / ``MiB`` / ``GiB`` / ``TiB`` (powers of 1024), e.g. ``"40GiB"``,
    ``"512MB"``, ``"1.5 GB"``, ``"300 KiB"``. Fractions of a byte are rounded down.

    Raises:
        ValueError: an unknown unit or a malformed string (the message lists the units), or a
            size that is zero or negative.
        TypeError: neither None, a number nor a string.
    """
    if x is None:
        return None
    if isinstance(x, bool):
        raise TypeError(f"a memory size must be bytes (int) or a string like '40GiB', got {x!r}")
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"memory size must be finite, got {x!r}")
        value = int(x)
    elif isinstance(x, str):
        m = _BYTES_RE.match(x)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse memory size {x!r}: write a number and a unit, one of B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '40GiB' or '1.5 GB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"a memory size must be bytes (int) or a string like '40GiB', got {type(x).__name__}")
    if value <= 0:
        raise ValueError(f"memory size must be > 0 bytes, got {x!r}")
    return value


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class ScheduleReport:
    """What one optimisation predicts and did. Times in ms, memory in bytes, distances in
    compute nodes; "before" is the graph as traced, "after" the chosen schedule, both
    simulated on the same cost model (:mod:`scheduler.simulator`)."""

    #: name of the graph ("forward", "backward", ...)
    graph_name: str
    #: solver or heuristic that produced the schedule (after any fallback)
    solver: str
    #: the solver asked for
    requested_solver: str
    #: a :class:`solvers.schedule.SolveStatus` value, or "unchanged" for a graph without collectives
    status: str
    #: wall time of the whole solve, heuristics and validation included (s)
    solve_time_s: float
    #: the memory budget (bytes), None for none
    mem_budget_bytes: int | None
    step_ms_before: float
    step_ms_after: float
    peak_bytes_before: int
    peak_bytes_after: int
    exposed_comm_ms_before: float
    exposed_comm_ms_after: float
    n_collectives_before: int
    n_collectives_after: int
    #: analytic lower bound on step time (DESIGN.md), valid for every schedule
    lower_bound_ms: float
    #: the best proven bound on step time (solver bound, else the analytic one)
    best_bound_ms: float
    #: (step_ms_after - best_bound_ms) / step_ms_after, 0 when proven optimal
    gap: float
    #: per bucket, the parameter FQNs of its members (collective names where FQNs are unknown)
    buckets: list[list[str]] = dataclasses.field(default_factory=list)
    #: per bucket, its collective type ("all_gather", "reduce_scatter", ...)
    bucket_types: list[str] = dataclasses.field(default_factory=list)
    #: per all-gather bucket, compute nodes between its issue and the first use of its result
    ag_prefetch: list[int] = dataclasses.field(default_factory=list)
    #: per reduce-scatter bucket, compute nodes between its last gradient and its issue
    rs_issue_delay: list[int] = dataclasses.field(default_factory=list)
    #: per reduce-scatter bucket, compute nodes between its issue and its wait
    rs_wait_distance: list[int] = dataclasses.field(default_factory=list)
    #: :meth:`solvers.schedule.Schedule.digest` of the schedule (equal on every rank)
    digest: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    #: the schedule is not the requested solver's (it failed, timed out, or a heuristic was better)
    fell_back: bool = False
    #: ``"forward"``, ``"backward"``, ``"inference"`` or ``"unknown"`` (a graph given by hand)
    graph_kind: str = "unknown"
    #: torch's compile id of the graph (``"0/0"``: frame 0, first compile; the forward and the
    #: backward of one compile share it), None outside ``torch.compile``
    compile_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "ScheduleReport":
        return ScheduleReport(**data)

    def summary_line(self) -> str:
        """One line for logs."""
        return (
            f"fsdp-sched {self._title()}: step {fmt_ms(self.step_ms_before)} -> {fmt_ms(self.step_ms_after)}, "
            f"peak {fmt_bytes(self.peak_bytes_before)} -> {fmt_bytes(self.peak_bytes_after)}, "
            f"collectives {self.n_collectives_before} -> {self.n_collectives_after} "
            f"({self.solver}, {self.status}, gap {self.gap:.1%}{', fell back' if self.fell_back else ''})"
        )

    def _title(self) -> str:
        title = self.graph_name
        if self.graph_kind not in ("unknown", self.graph_name):
            title += f" ({self.graph_kind})"
        return title + (f" [compile {self.compile_id}]" if self.compile_id else "")

    def __str__(self) -> str:
        budget = fmt_bytes(self.mem_budget_bytes) if self.mem_budget_bytes else "none"
        rows = [
            ("step time", fmt_ms(self.step_ms_before), fmt_ms(self.step_ms_after)),
            ("peak memory", fmt_bytes(self.peak_bytes_before), fmt_bytes(self.peak_bytes_after)),
            ("exposed comm", fmt_ms(self.exposed_comm_ms_before), fmt_ms(self.exposed_comm_ms_after)),
            ("collectives", str(self.n_collectives_before), str(self.n_collectives_after)),
        ]
        lines = [
            f"fsdp-sched report: {self._title()} (solver {self.solver}, status {self.status}, "
            f"{self.solve_time_s:.2f} s, budget {budget})",
            f"  {'':<14}{'traced':>14}{'scheduled':>14}",
        ]
        lines += [f"  {name:<14}{a:>14}{b:>14}" for name, a, b in rows]
        lines.append(
            f"  lower bound {fmt_ms(self.lower_bound_ms)}, best bound {fmt_ms(self.best_bound_ms)}, "
            f"gap {self.gap:.1%}"
        )
        n_ag = self.bucket_types.count("all_gather")
        n_rs = self.bucket_types.count("reduce_scatter")
        lines.append(f"  buckets: {len(self.buckets)} (all-gather {n_ag}, reduce-scatter {n_rs})")
        if self.ag_prefetch:
            lines.append(f"  all-gather prefetch (compute nodes): {_spread(self.ag_prefetch)}")
        if self.rs_wait_distance:
            lines.append(
                f"  reduce-scatter issue delay: {_spread(self.rs_issue_delay)}; "
                f"issue-to-wait: {_spread(self.rs_wait_distance)}"
            )
        if self.fell_back:
            lines.append(f"  fell back from {self.requested_solver} to {self.solver}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.digest:
            lines.append(f"  schedule digest {self.digest[:16]}")
        return "\n".join(lines)


def _spread(xs: list[int]) -> str:
    s = sorted(xs)
    return f"min {s[0]}, median {s[len(s) // 2]}, max {s[-1]}"


# --------------------------------------------------------------------------------------------
# solve (torch-free)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Candidate:
    name: str
    schedule: Schedule
    sim: SimResult
    result: SolveResult | None = None


def solve_dag(
    dag: nx.DiGraph,
    mem_budget: int | str | None = None,
    *,
    solver: str = "cpsat",
    time_limit_s: float = 30.0,
    seed: int = 0,
    fallback: bool = True,
    num_workers: int = 1,
) -> tuple[Schedule, ScheduleReport]:
    """Find and validate a schedule of a cost-annotated DAG (no torch graph needed).

    Args:
        dag: from :func:`scheduler.export_dag` or :func:`scheduler.load_dag`.
        mem_budget: peak-memory budget: bytes or a string such as ``"40GiB"`` (see
            :func:`parse_bytes`); None (default) for no limit.
        solver: ``"cpsat"`` (default), ``"milp"`` or a heuristic name
            (:func:`solvers.available_solvers`).
        time_limit_s: solver time limit in seconds (default 30; deterministic for CP-SAT).
        seed: solver random seed (default 0).
        fallback: on a solver failure or timeout, return the best valid schedule among the
            solver's incumbent and the heuristics (default True); False re-raises.
        num_workers: solver threads (default 1: deterministic).

    Returns:
        The validated schedule and its :class:`ScheduleReport`.

    Raises:
        ValueError: a malformed or non-positive budget, an unknown solver.
        InfeasibleBudgetError: no schedule found keeps peak memory under the budget;
            ``min_peak_bytes`` is the smallest peak found.
        ScheduleError: the solver failed and ``fallback`` is False.
    """
    budget = parse_bytes(mem_budget)
    problem = Problem.from_dag(dag)
    return _solve_problem(
        problem,
        budget,
        solver=solver,
        time_limit_s=time_limit_s,
        seed=seed,
        fallback=fallback,
        num_workers=num_workers,
    )


def _solve_problem(
    problem: Problem,
    budget: int | None,
    *,
    solver: str,
    time_limit_s: float,
    seed: int,
    fallback: bool,
    num_workers: int,
) -> tuple[Schedule, ScheduleReport]:
    from solvers.dispatch import available_solvers, solve

    t0 = time.perf_counter()
    traced = problem.traced_schedule()
    before = simulate(problem.dag, traced, problem=problem)
    graph_name = str(problem.dag.graph.get("name", "graph"))
    if not problem.colls:
        report = _report(problem, traced, before, before, graph_name=graph_name, budget=budget, t0=t0,
                         solver="none", requested=solver, status="unchanged", best_bound=None,
                         notes=["the graph has no collectives: left unchanged"], fell_back=False)
        return traced, report
    if solver not in available_solvers():
        raise ValueError(f"unknown solver {solver!r}; choose one of {available_solvers()}")

    candidates = _heuristic_candidates(problem, budget, seed=seed, exclude=solver)
    fitting = [c for c in candidates if budget is None or c.sim.peak_bytes <= budget]
    hint = fitting[0].schedule if fitting else None
    notes: list[str] = _fixed_collective_notes(problem)
    chosen: _Candidate | None = None
    try:
        result = solve(
            problem,
            solver=solver,
            mem_budget_bytes=budget,
            time_limit_s=time_limit_s,
            seed=seed,
            hint=hint,
            num_workers=num_workers,
        )
        sim = validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
        chosen = _Candidate(solver, result.schedule, sim, result)
        notes += list(result.notes)
        if result.status == SolveStatus.FEASIBLE:
            notes.append(f"{solver} stopped at its limit ({time_limit_s:g} s) without proving optimality")
    except InfeasibleBudgetError as e:
        if not fitting:
            raise _infeasible(e, budget, candidates) from e
        if not fallback:
            raise
        notes.append(f"{solver} found no schedule under the budget ({e}); a heuristic schedule fits")
        logger.warning("fsdp-sched: %s found no schedule under the budget; using a heuristic that fits", solver)
    except Exception as e:  # a failed solve must not fail training when a valid schedule exists
        if not fallback:
            raise
        reason = f"{type(e).__name__}: {e}"
        notes.append(f"{solver} failed ({reason}); fell back to the best valid heuristic schedule")
        logger.warning("fsdp-sched: solver %s failed (%s); falling back to heuristics", solver, reason)
        if not fitting:
            raise _infeasible(None, budget, candidates) from e

    pick = chosen
    if fallback:
        # never worse than the traced order (or any heuristic): the solver's model approximates
        pool = ([chosen] if chosen is not None else []) + fitting
        pick = min(pool, key=lambda c: (round(c.sim.step_ms, 9), c.sim.peak_bytes, len(c.schedule.buckets)))
        if chosen is not None and pick is not chosen:
            notes.append(
                f"heuristic {pick.name!r} simulates better than {solver}'s schedule "
                f"({fmt_ms(pick.sim.step_ms)} vs {fmt_ms(chosen.sim.step_ms)}): using it"
            )
    assert pick is not None
    fell_back = pick is not chosen
    if pick.result is not None:
        status = SolveStatus.FALLBACK.value if fell_back else pick.result.status.value
        best_bound = pick.result.best_bound_ms
    else:
        status, best_bound = SolveStatus.FALLBACK.value, None
    if chosen is not None and chosen.result is not None:
        # a proven bound holds whatever schedule is returned
        best_bound = chosen.result.best_bound_ms
    report = _report(problem, pick.schedule, before, pick.sim, graph_name=graph_name, budget=budget, t0=t0,
                     solver=pick.name, requested=solver, status=status, best_bound=best_bound, notes=notes,
                     fell_back=fell_back)
    return pick.schedule, report


def _fixed_collective_notes(problem: Problem) -> list[str]:
    """A note naming the collectives left where traced (unmodelled types such as all_to_all,
    non-FSDP all-reduces, or ones pinned by a dependency on another collective)."""
    fixed = [c for c in problem.colls.values() if not c.movable]
    if not fixed:
        return []
    names = ", ".join(f"{c.name} ({c.coll_type})" for c in fixed[:5]) + (", ..." if len(fixed) > 5 else "")
    logger.info("fsdp-sched: %d collective(s) left in place, not scheduled: %s", len(fixed), names)
    return [f"{len(fixed)} collective(s) left in place, not scheduled (unmodelled or pinned): {names}"]


def _heuristic_candidates(problem: Problem, budget: int | None, *, seed: int, exclude: str) -> list[_Candidate]:
    """Valid heuristic schedules ("fsdp2", then "traced"), plus the traced order itself."""
    from solvers.dispatch import available_solvers, solve

    out: list[_Candidate] = []
    names = [h for h in _HEURISTICS if h in available_solvers() and h != exclude]
    for h in names:
        try:
            r = solve(problem, solver=h, mem_budget_bytes=budget, time_limit_s=10.0, seed=seed)
            out.append(_Candidate(h, r.schedule, validate_schedule(problem, r.schedule), r))
        except (ScheduleError, ScheduleInvalidError, ValueError) as e:
            logger.debug("heuristic %s gave no valid schedule: %s", h, e)
    if not any(c.name == "traced" for c in out):
        traced = problem.traced_schedule()
        out.append(_Candidate("traced", traced, validate_schedule(problem, traced)))
    return out


def _infeasible(err: InfeasibleBudgetError | None, budget: int | None, candidates: list[_Candidate]) -> Exception:
    peaks = [c.sim.peak_bytes for c in candidates]
    if err is not None and err.min_peak_bytes is not None:
        peaks.append(err.min_peak_bytes)
    min_peak = min(peaks) if peaks else None
    if budget is None:  # no budget: nothing to relax; the solver failed outright
        return ScheduleError("no valid schedule found")
    return InfeasibleBudgetError(
        f"no schedule keeps peak memory under {fmt_bytes(budget)} ({budget} B); the smallest peak "
        f"reached is {fmt_bytes(min_peak or 0)} ({min_peak} B): raise mem_budget to at least that",
        budget_bytes=budget,
        min_peak_bytes=min_peak,
    )


def _report(
    problem: Problem,
    schedule: Schedule,
    before: SimResult,
    after: SimResult,
    *,
    graph_name: str,
    budget: int | None,
    t0: float,
    solver: str,
    requested: str,
    status: str,
    best_bound: float | None,
    notes: list[str],
    fell_back: bool,
) -> ScheduleReport:
    lower = problem.lower_bound_ms()
    bound = max(lower, best_bound) if best_bound is not None else lower
    bound = min(bound, after.step_ms)
    gap = max(0.0, (after.step_ms - bound) / after.step_ms) if after.step_ms > 0 else 0.0
    buckets, types, prefetch, rs_delay, rs_wait = _bucket_stats(problem, schedule)
    return ScheduleReport(
        graph_name=graph_name,
        solver=solver,
        requested_solver=requested,
        status=status,
        solve_time_s=time.perf_counter() - t0,
        mem_budget_bytes=budget,
        step_ms_before=before.step_ms,
        step_ms_after=after.step_ms,
        peak_bytes_before=before.peak_bytes,
        peak_bytes_after=after.peak_bytes,
        exposed_comm_ms_before=before.exposed_comm_ms,
        exposed_comm_ms_after=after.exposed_comm_ms,
        n_collectives_before=before.n_collectives,
        n_collectives_after=after.n_collectives,
        lower_bound_ms=lower,
        best_bound_ms=bound,
        gap=gap,
        buckets=buckets,
        bucket_types=types,
        ag_prefetch=prefetch,
        rs_issue_delay=rs_delay,
        rs_wait_distance=rs_wait,
        digest=schedule.digest(),
        notes=list(notes),
        fell_back=fell_back,
        graph_kind=str(problem.dag.graph.get("graph_kind", "unknown")),
    )


def _bucket_stats(problem: Problem, schedule: Schedule):
    # computes[p] = number of compute nodes in seq[:p]
    computes = [0]
    for name in problem.seq:
        computes.append(computes[-1] + (problem.dag.nodes[name]["kind"] == "compute"))
    issue, wait = schedule.positions()
    buckets, types, prefetch, rs_delay, rs_wait = [], [], [], [], []
    for b, bucket in enumerate(schedule.buckets):
        colls = [problem.colls[m] for m in bucket.members]
        buckets.append([f for c in colls for f in (c.fqns or (c.name,))])
        ctype = colls[0].coll_type
        types.append(ctype)
        if ctype == "all_gather":
            needed = min(c.needed for c in colls)
            prefetch.append(computes[needed] - computes[issue[b]])
        elif ctype == "reduce_scatter":
            ready = max(c.ready for c in colls)
            rs_delay.append(computes[issue[b]] - computes[min(ready, issue[b])])
            rs_wait.append(computes[wait[b]] - computes[issue[b]])
    return buckets, types, prefetch, rs_delay, rs_wait


# --------------------------------------------------------------------------------------------
# FX graphs
# --------------------------------------------------------------------------------------------
def optimize_schedule(
    gm: "torch.fx.GraphModule",
    mem_budget: int | str | None = None,
    *,
    solver: str = "cpsat",
    time_limit_s: float = 30.0,
    cost_model: Any = None,
    cluster: Any = None,
    payload_order: str = "registration",
    control_deps: bool = False,
    seed: int = 0,
    fallback: bool = True,
    broadcast_from: int | None = None,
    num_workers: int = 1,
    agree: bool = True,
    consensus_group: Any = None,
    schedule_hook: Any = None,
) -> "torch.fx.GraphModule":
    """Schedule the collectives of a partitioned FSDP graph and rewrite it in place.

    Exports ``gm`` (:func:`scheduler.export_dag`), solves, validates the schedule against the
    execution model and the budget, then writes it back (:func:`scheduler.apply_schedule`).
    The :class:`ScheduleReport` is stored at ``gm.meta["fsdp_sched_report"]`` and summarised in
    one log line.

    Args:
        gm: a forward or backward graph whose nodes carry FakeTensor ``meta['val']`` (as
            aot_autograd produces); merging buckets needs an initialised process group in
            which its groups resolve (a fake one is enough).
        mem_budget: peak-memory budget, bytes or a string like ``"40GiB"``; None (default):
            no limit.
        solver, time_limit_s, seed, fallback, num_workers: see :func:`solve_dag`.
        cost_model, cluster: passed to :func:`scheduler.export_dag` (default: the analytic
            model on a 64-H100 cluster).
        payload_order: ``"registration"`` (default) or ``"execution"``, see
            :func:`scheduler.apply_schedule`.
        control_deps: pin the order with control dependencies for inductor (default False).
        broadcast_from: with an initialised process group of more than one rank, only this
            rank solves and broadcasts the schedule to the others (identical graphs get the
            identical schedule even if solves were not deterministic). None (default): every
            rank solves by itself.
        agree: with an initialised process group of more than one rank (default True), the
            ranks agree before writing back (:mod:`scheduler.consensus`): one all-gather of
            schedule digests; on a mismatch every rank takes the schedule of rank 0 (or of
            ``broadcast_from``) and the report says so; if the pass fails on any rank, every
            rank leaves its graph unchanged and logs why (if it fails on every rank, each
            raises). False: no collective at all (each rank on its own, as with one rank).
        consensus_group: the process group whose ranks must agree (default None: the world).
            With pipeline parallelism, pass the group of the ranks that compile this graph.
        schedule_hook: ``hook(problem, schedule) -> Schedule | None``, called on the solved
            schedule before the ranks agree; a returned schedule replaces it (validated, and
            the report updated); it may also raise. For custom edits of a schedule, and to
            inject faults in tests (a different schedule or an error on one rank).

    Returns:
        ``gm``, rewritten (or unchanged when it has no collectives).

    Raises:
        ValueError: a malformed budget or unknown solver.
        InfeasibleBudgetError: no schedule fits ``mem_budget`` (states the smallest peak).
        ScheduleError: the solve failed and ``fallback`` is False, or the schedule cannot be
            written back (the message says why). With ``agree``, these are raised only when
            the pass failed on every rank of the group; otherwise the graph stays unchanged.
    """
    from scheduler import consensus
    from scheduler.dag import export_dag

    budget = parse_bytes(mem_budget)
    group = consensus.agreement_group(consensus_group) if agree else None

    def export() -> Problem:
        dag = export_dag(gm, cost_model=cost_model, cluster=cluster)
        return Problem.from_dag(dag)

    def solve_here(problem: Problem) -> tuple[Schedule, ScheduleReport]:
        schedule, report = _solve_problem(
            problem,
            budget,
            solver=solver,
            time_limit_s=time_limit_s,
            seed=seed,
            fallback=fallback,
            num_workers=num_workers,
        )
        return _run_schedule_hook(schedule_hook, problem, schedule, report, budget)

    def write_back(problem: Problem, schedule: Schedule) -> None:
        from scheduler.writeback import apply_schedule

        if problem.colls:
            apply_schedule(gm, problem, schedule, payload_order=payload_order, control_deps=control_deps)

    if group is None:
        problem = export()
        if broadcast_from is not None and _world_size() > 1:
            schedule, report = _solve_and_broadcast(lambda: solve_here(problem), problem, budget, broadcast_from)
        else:
            schedule, report = solve_here(problem)
        write_back(problem, schedule)
    else:
        report = _optimize_agreed(gm, group, export, solve_here, write_back, budget=budget, solver=solver,
                                  broadcast_from=broadcast_from)
    report.compile_id = _compile_id()
    gm.meta[REPORT_KEY] = report
    logger.info("%s", report.summary_line())
    return gm


def _optimize_agreed(gm, group, export, solve_here, write_back, *, budget, solver, broadcast_from) -> ScheduleReport:
    """:func:`optimize_schedule` on a group of ranks that must agree (see
    :mod:`scheduler.consensus`): solve, agree on one schedule, write back, agree that every
    rank wrote it back (else every rank restores its graph). Returns this rank's report."""
    import torch.distributed as dist

    from scheduler import consensus

    src = 0 if broadcast_from is None else dist.get_group_rank(group, broadcast_from)
    problem: Problem | None = None
    schedule: Schedule | None = None
    report: ScheduleReport | None = None
    error: BaseException | None = None
    try:
        problem = export()
        if broadcast_from is None or dist.get_rank(group) == src:
            schedule, report = solve_here(problem)
    except Exception as e:  # the other ranks must learn of it, or they hang in a collective
        error = e
        logger.warning("fsdp-sched: the pass failed on this rank (%s: %s)", type(e).__name__, e)
    agreed = consensus.agree_on_schedule(schedule, report.to_json() if report else None, error, group=group, src=src)
    if agreed.action == "raise":
        if error is not None:
            raise error
        raise ScheduleError(f"rank {src} failed to solve the schedule: {agreed.failures.get(src)}")
    if agreed.action == "skip":
        return _unchanged_report(problem, budget=budget, requested=solver, notes=agreed.notes)
    assert problem is not None and agreed.schedule is not None
    if agreed.report_json is not None:
        report = ScheduleReport.from_json(agreed.report_json)
    assert report is not None
    report.notes += agreed.notes

    backup = _copy_graph(gm.graph) if problem.colls else None
    write_error: BaseException | None = None
    try:
        if agreed.adopted_from is not None:  # it must fit this rank's graph
            try:
                validate_schedule(problem, agreed.schedule, mem_budget_bytes=budget)
            except ScheduleInvalidError as e:
                raise ScheduleError(
                    f"the schedule of rank {agreed.adopted_from} does not fit this rank's graph ({e}); "
                    "every rank must trace the identical graph"
                ) from e
        write_back(problem, agreed.schedule)
    except Exception as e:
        write_error = e
        logger.warning("fsdp-sched: writing the schedule back failed on this rank (%s: %s)", type(e).__name__, e)
    failures = consensus.agree_on_outcome(write_error, group=group)
    if not failures:
        return report
    if backup is not None:
        gm.graph = backup  # the graph as it was, on every rank (names and meta kept)
    rank = min(failures)
    note = (
        f"the schedule was not written back on any rank: writing it back failed on rank(s) {sorted(failures)} "
        f"(rank {rank}: {failures[rank]}); every rank keeps the graph as traced"
    )
    logger.warning("fsdp-sched: %s", note)
    return _unchanged_report(problem, budget=budget, requested=solver, notes=[note])


def _run_schedule_hook(hook, problem: Problem, schedule: Schedule, report: ScheduleReport, budget: int | None):
    """Apply ``optimize_schedule(schedule_hook=...)``; a changed schedule is validated and the
    report updated."""
    if hook is None:
        return schedule, report
    new = hook(problem, schedule)
    if new is None or new.digest() == schedule.digest():
        return schedule, report
    sim = validate_schedule(problem, new, mem_budget_bytes=budget)
    buckets, types, prefetch, rs_delay, rs_wait = _bucket_stats(problem, new)
    report = dataclasses.replace(
        report,
        step_ms_after=sim.step_ms,
        peak_bytes_after=sim.peak_bytes,
        exposed_comm_ms_after=sim.exposed_comm_ms,
        n_collectives_after=sim.n_collectives,
        gap=max(0.0, (sim.step_ms - report.best_bound_ms) / sim.step_ms) if sim.step_ms > 0 else 0.0,
        buckets=buckets,
        bucket_types=types,
        ag_prefetch=prefetch,
        rs_issue_delay=rs_delay,
        rs_wait_distance=rs_wait,
        digest=new.digest(),
        notes=report.notes + ["schedule replaced by schedule_hook"],
    )
    return new, report


def _unchanged_report(problem: Problem | None, *, budget: int | None, requested: str, notes: list[str]) -> ScheduleReport:
    """The report of a graph left as traced because the ranks could not agree on a schedule."""
    if problem is not None:
        traced = problem.traced_schedule()
        before = simulate(problem.dag, traced, problem=problem)
        return _report(problem, traced, before, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                       budget=budget, t0=time.perf_counter(), solver="none", requested=requested,
                       status="unchanged", best_bound=None, notes=notes, fell_back=True)
    nan = float("nan")  # this rank could not even export its graph
    return ScheduleReport(graph_name="graph", solver="none", requested_solver=requested, status="unchanged",
                          solve_time_s=0.0, mem_budget_bytes=budget, step_ms_before=nan, step_ms_after=nan,
                          peak_bytes_before=0, peak_bytes_after=0, exposed_comm_ms_before=nan,
                          exposed_comm_ms_after=nan, n_collectives_before=0, n_collectives_after=0,
                          lower_bound_ms=nan, best_bound_ms=nan, gap=0.0, notes=list(notes), fell_back=True)


def _copy_graph(graph: "torch.fx.Graph") -> "torch.fx.Graph":
    """A copy of ``graph`` with the same node names and meta (to restore it)."""
    import copy

    import torch.fx

    out = torch.fx.Graph()
    out._codegen = copy.deepcopy(graph._codegen)
    value, output_node = out.graph_copy(graph, {}, return_output_node=True)
    new_output = out.output(value, type_expr=output_node.type)
    new_output.meta = dict(output_node.meta)
    return out


def _compile_id() -> str | None:
    """torch's id of the compile in progress ("0/0"), None outside ``torch.compile``."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _solve_and_broadcast(solve_here, problem: Problem, budget: int | None, src: int):
    """Solve on rank ``src`` only and broadcast the schedule (or the error) to every rank."""
    import torch.distributed as dist

    payload: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            schedule, report = solve_here()
            payload[0] = {"schedule": schedule.to_json(), "report": report.to_json()}
        except InfeasibleBudgetError as e:
            payload[0] = {"infeasible": str(e), "budget": e.budget_bytes, "min_peak": e.min_peak_bytes}
        except Exception as e:  # every rank must learn that the solve failed, or they hang
            payload[0] = {"error": f"{type(e).__name__}: {e}"}
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compilers run under aot_autograd's fake mode: use real tensors
        dist.broadcast_object_list(payload, src=src)
    data = payload[0]
    if "infeasible" in data:
        raise InfeasibleBudgetError(data["infeasible"], budget_bytes=data["budget"], min_peak_bytes=data["min_peak"])
    if "error" in data:
        raise ScheduleError(f"rank {src} failed to solve the schedule: {data['error']}")
    schedule = Schedule.from_json(data["schedule"])
    report = ScheduleReport.from_json(data["report"])
    if dist.get_rank() != src:
        try:  # the schedule must fit this rank's graph (identical graphs on every rank)
            validate_schedule(problem, schedule, mem_budget_bytes=budget)
        except ScheduleInvalidError as e:
            raise ScheduleError(
                f"the schedule broadcast from rank {src} does not fit this rank's graph ({e}); "
                "every rank must trace the identical graph"
            ) from e
        report.notes.append(f"schedule received from rank {src}")
    return schedule, report


# --------------------------------------------------------------------------------------------
# compiler integration
# --------------------------------------------------------------------------------------------
def backend(**options: Any):
    """A ``torch.compile`` backend that schedules the partitioned forward and backward graphs.

    Uses aot_autograd; its forward and backward compilers run :func:`optimize_schedule` with
    ``options`` on each graph and return it for eager execution. ``options`` are
    :func:`optimize_schedule`'s keyword arguments, plus ``fw_mem_budget`` / ``bw_mem_budget``
    (budgets for one graph only, overriding ``mem_budget``) and ``partition_fn`` (default
    ``min_cut_rematerialization_partition``, as SimpleFSDP uses). The returned backend has a
    ``reports`` list collecting every graph's :class:`ScheduleReport`.

    Example::

        compiled = torch.compile(model, backend=scheduler.backend(mem_budget="40GiB"))
    """
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler

    options = dict(options)
    partition_fn = options.pop("partition_fn", min_cut_rematerialization_partition)
    fw_budget = options.pop("fw_mem_budget", options.get("mem_budget"))
    bw_budget = options.pop("bw_mem_budget", options.get("mem_budget"))
    options.pop("mem_budget", None)
    # fail on a bad budget now, not at the first compile
    parse_bytes(fw_budget), parse_bytes(bw_budget)
    reports: list[ScheduleReport] = []

    def compiler(kind: str, budget: Any):
        def compile_graph(gm: "torch.fx.GraphModule", example_inputs: Any) -> "torch.fx.GraphModule":
            gm.meta.setdefault("fsdp_graph_kind", kind)
            optimize_schedule(gm, budget, **options)
            reports.append(gm.meta[REPORT_KEY])
            return gm

        return make_boxed_compiler(compile_graph)

    fn = aot_autograd(
        fw_compiler=compiler("forward", fw_budget),
        bw_compiler=compiler("backward", bw_budget),
        partition_fn=partition_fn,
    )
    fn.reports = reports  # type: ignore[attr-defined]
    return fn


def inductor_post_grad_pass(**options: Any):
    """An inductor post-grad custom pass that schedules each graph inductor compiles.

    Usage::

        import torch._inductor.config as inductor_config
        inductor_config.post_grad_custom_post_pass = scheduler.api.inductor_post_grad_pass(
            mem_budget="40GiB")
        compiled = torch.compile(model)   # the default inductor backend

    ``options`` are :func:`optimize_schedule`'s keyword arguments; ``control_deps`` defaults to
    True here, so that inductor's own reordering keeps the chosen overlap. The pass wraps the
    ``fx.Graph`` it receives in its owning GraphModule (or a fresh one) and rewrites it in
    place; reports are collected in the pass's ``reports`` list, each naming its graph
    (``graph_name`` / ``graph_kind``: "forward", "backward" or "inference"; ``compile_id``:
    torch's compile id, shared by the forward and backward of one compile). On a process
    group the ranks agree on the schedule before it is written back (see
    :func:`optimize_schedule`'s ``agree``). Its ``uuid()`` is built from
    the options, so inductor's FX graph cache tells differently configured passes apart
    (objects such as a cost model enter by ``repr``; give them a stable one to get cache hits
    across processes).
    """
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

    options = {"control_deps": True, **options}
    parse_bytes(options.get("mem_budget"))

    class _FsdpSchedPass(CustomInferenceAwareGraphPass):
        def __init__(self) -> None:
            self.reports: list[ScheduleReport] = []

        def __call__(self, graph: "torch.fx.Graph", is_inference: bool = False) -> None:
            import torch.fx

            gm = graph.owning_module
            if not isinstance(gm, torch.fx.GraphModule):
                gm = torch.fx.GraphModule(torch.nn.Module(), graph)
            gm.meta["fsdp_graph_kind"] = _post_grad_graph_kind(graph, is_inference)
            optimize_schedule(gm, **options)
            self.reports.append(gm.meta[REPORT_KEY])

        def uuid(self) -> str:
            return "fsdp-sched:" + json.dumps(options, sort_keys=True, default=repr)

    return _FsdpSchedPass()


def _post_grad_graph_kind(graph: "torch.fx.Graph", is_inference: bool) -> str:
    """Which graph an inductor post-grad pass sees. Inductor tells a custom pass only whether
    the graph is an inference graph; aot_autograd names the backward graph's gradient inputs
    ``tangents_<i>`` (the forward graph has only ``primals_<i>``)."""
    if is_inference:
        return "inference"
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    return "forward"
