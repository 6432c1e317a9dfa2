"""The user-facing entry points: export -> solve -> choose -> agree -> install, with a report.

- :func:`optimize_schedule`: rewrite a partitioned forward or backward FX graph in place.
- :func:`solve_dag`: the same solve on a saved DAG, without torch (notebooks, CLI).
- :func:`backend`: a ``torch.compile`` backend (aot_autograd) that runs it on every graph.
- :func:`inductor_post_grad_pass`: the same as an inductor post-grad custom pass.
- :func:`parse_bytes`: ``"40GiB"`` -> bytes, for every ``mem_budget`` argument.

The plan of one :func:`optimize_schedule` call. Work shares are of ``time_limit_s``, which is
deterministic work (CP-SAT's clock, or simulations at a calibrated rate), never the wall clock,
so every rank runs the same stages and gets the same schedule. Each stage that runs adds a
:class:`solvers.core.schedule.StageRecord` (name, wall time, work, step time, gain) to
``ScheduleReport.stages``.

=============  ============================  ===========================  =========================================
stage          what it does                  work                         why it exists
=============  ============================  ===========================  =========================================
cache          the schedule solved before    one file read                a solve takes seconds; every rank and
               for the identical graph,                                   every restart asks again
               budget and options
               (:mod:`scheduler.cache`)
starts         the heuristics and extra      one simulation each          a valid answer before any model, the
               starts simulated; the                                      CP-SAT hint, and the floor of the result
               fastest that fits is the
               incumbent (:mod:`solvers.warmstart`)
search         CP-SAT: one model for small   the limit, less the polish   the joint bucketing / prefetch /
               graphs; per-layer template    the search leaves            interleaving decision, under the budget
               then rolling windows for
               large or repeating ones
               (:mod:`solvers.driver`, :mod:`solvers.decompose`)
restart        the search again from the     what the search left, when   bucket granularity is out of a local
               other bucket granularity      at least ``restart_share``   search's reach
repair         the model's budget lowered    what is left, at most        the model prices merge transients
               by the simulated excess,      ``memory_repair_rounds``     approximately; the simulator decides
               solved again                                               (:func:`solvers.repair.repair_by_excess`)
rescue         windows from the best start   what is left                 a model with no usable answer
polish         merges, transfers and issue   at most ``polish_share``     the simulator prices merges exactly
               / wait moves on the           of the limit, from what      where the model approximates them
               simulator                     the search left              (:mod:`solvers.minimax`)
polish         the best predicted schedule   ``polish_share`` of the      the fastest written graph that fits can
(choice)       that fits polished again      limit                        be another schedule than the solver's
judge-torch    torch's overlap scheduler     one run (a second without    never slower than torch's own scheduler
               written and judged            pre-bucketing when the first on the written graph
                                             fails)
judge          our schedules written back    one write-back and judge     what is written back is what counts
               in predicted order while a    each (usually one)
               prediction can still win
repair         a written graph over by a     at most ``repair_rounds``    the liveness count and torch's tracker
(choice)       count the simulator does not  polishes                     differ from the simulator on some graphs
               make: polished under the
               budget less the excess
=============  ============================  ===========================  =========================================

Then the ranks agree on the chosen schedule's digest (:mod:`scheduler.consensus`) and it is
installed into ``gm``. With ``robust=True`` the choice judges every candidate under the cost
model family and polishes on the worst case (:func:`scheduler.verify.minimax_candidates`).

Failure policy: a memory budget that no schedule reaches raises
:class:`solvers.core.schedule.InfeasibleBudgetError` with the smallest peak found; a solver that
fails or times out is replaced (``fallback=True``) by the best valid schedule among its
incumbent and the heuristics, which is never worse than the graph as traced; the report says
so (``fell_back``, ``notes``) and a warning is logged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.costs import Cluster, resolve_cost_model
from scheduler.dag import DagError, export_dag, graph_has_collectives
from scheduler import cache, consensus
from scheduler.report import ScheduleReport, after_fields, make_report
from scheduler.robust import (
    BASE_COST_MODELS,
    ROBUST,
    blends,
    choice_key,
    cost_model_family,
    minimax_config,
)
from scheduler.verify import (
    TRACED,
    Candidate,
    Criterion,
    cost_model_label,
    install,
    schedule_candidate,
    verify_and_choose,
)
from scheduler.writeback import apply_schedule
from solvers.core import (
    InfeasibleBudgetError,
    Problem,
    Schedule,
    ScheduleError,
    ScheduleInvalidError,
    SolveStatus,
    StageRecord,
    fmt_bytes,
    fmt_ms,
    parse_bytes,
    simulate,
    validate_schedule,
)
from solvers.config import DEFAULT_TIME_LIMIT_S, SearchConfig
from solvers.minimax import MinimaxConfig
from solvers.registry import SOLVERS, SolverFn, available_solvers, solve, solver_name
from solvers.warmstart import best_warm_start, fitting_heuristics

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: key of the report in ``gm.meta``
REPORT_KEY = "fsdp_sched_report"
#: ``gm.meta`` key of the installed schedule over the traced graph's problem (None when torch's
#: scheduler's graph was installed): a start for another solve of the same graph (``extra_starts``)
SCHEDULE_KEY = "fsdp_sched_schedule"
#: ``gm.meta`` key of the schedules the solver itself returned over the traced graph's problem
#: (its result, then the one before its final polish; empty when a hook imposed one): verification
#: may install another candidate, and a local search ends where its start leads, so
#: :func:`scheduler.rewritten.robust_schedule` judges and polishes these too
SOLVED_KEY = "fsdp_sched_solved"

#: :meth:`Candidate.digest` of the choice made for a graph without collectives whose metadata
#: cannot be exported: nothing is written back, and ranks with such a graph agree on it
_UNEXPORTED = hashlib.sha256(b"fsdp-sched: a graph without collectives, not exported").hexdigest()


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------
def check_arguments(*, mem_budget: Any = None, solver: Any = "cpsat", time_limit_s: Any = DEFAULT_TIME_LIMIT_S,
                    seed: Any = 0, fallback: Any = True, num_workers: Any = 1, cost_model: Any = None,
                    cluster: Any = None, payload_order: Any = "registration", control_deps: Any = False,
                    broadcast_from: Any = None, agree: Any = True, schedule_hook: Any = None, verify: Any = True,
                    robust: Any = False, extra_starts: Any = ()) -> int | None:
    """Check every argument of :func:`optimize_schedule` and :func:`solve_dag` before any
    collective or solve, alike on every rank (a function of the arguments alone), and return
    the budget in bytes.

    Raises:
        TypeError: an argument of the wrong type; the message names it, its value and what is
            accepted.
        ValueError: a value out of range (an unknown solver or payload order, a time limit that
            is not finite and positive, ...), named the same way.
    """
    budget = parse_bytes(mem_budget)
    if isinstance(solver, str):
        if solver not in SOLVERS:
            raise ValueError(f"solver={solver!r} is unknown; choose one of {available_solvers()} or pass a callable")
    elif not callable(solver):
        raise TypeError(f"solver={solver!r} must be a solver name ({available_solvers()}) or a callable")
    _check_number("time_limit_s", time_limit_s, positive=True)
    _check_int("seed", seed, low=0, high=2**31 - 1)
    _check_int("num_workers", num_workers, low=1, high=1024)
    if broadcast_from is not None:
        _check_int("broadcast_from", broadcast_from, low=0, high=_world_size() - 1)
    for name, value in (("fallback", fallback), ("control_deps", control_deps), ("agree", agree),
                        ("verify", verify), ("robust", robust)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False")
    if payload_order not in ("registration", "execution"):
        raise ValueError(f"payload_order={payload_order!r} must be 'registration' or 'execution'")
    if schedule_hook is not None and not callable(schedule_hook):
        raise TypeError(f"schedule_hook={schedule_hook!r} must be a callable (problem, schedule) -> Schedule | None")
    if isinstance(extra_starts, (str, bytes)) or not isinstance(extra_starts, Sequence):
        raise TypeError(f"extra_starts={extra_starts!r} must be a sequence of Schedule")
    for start in extra_starts:
        if not isinstance(start, Schedule):
            raise TypeError(f"extra_starts holds {start!r}, which is not a Schedule")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r} must be a scheduler.Cluster or None")
    resolve_cost_model(cost_model, cluster)  # raises ValueError naming a bad cost model
    if robust and not verify:
        raise ValueError("robust=True chooses among candidates judged on their rewritten graphs: it needs verify=True")
    return budget


def _check_number(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number of seconds")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number {'> 0' if positive else ''}".rstrip())


def _check_int(name: str, value: Any, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be in [{low}, {high}]")


# --------------------------------------------------------------------------------------------
# solve (torch-free)
# --------------------------------------------------------------------------------------------
def solve_dag(
    dag: nx.DiGraph,
    mem_budget: int | str | None = None,
    *,
    solver: str | SolverFn = "cpsat",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    seed: int = 0,
    fallback: bool = True,
    num_workers: int = 1,
) -> tuple[Schedule, ScheduleReport]:
    """Find and validate a schedule of a cost-annotated DAG (no torch graph needed).

    Args:
        dag: from :func:`scheduler.export_dag` or :func:`scheduler.load_dag`.
        mem_budget: peak-memory budget: bytes or a string such as ``"40GiB"`` (see
            :func:`parse_bytes`); None (default) for no limit.
        solver: ``"cpsat"`` (default), ``"milp"``, a heuristic name
            (:func:`solvers.available_solvers`), or your own callable with the signature of
            :data:`solvers.registry.SolverFn`.
        time_limit_s: solver time limit in seconds (default ``DEFAULT_TIME_LIMIT_S``, 6.5: a 16-layer
            graph in under 10 s on one core; deterministic work for CP-SAT).
        seed: solver random seed (default 0).
        fallback: on a solver failure or timeout, return the best valid heuristic schedule
            (default True); False re-raises.
        num_workers: solver threads (default 1: deterministic).

    Returns:
        The validated schedule and its :class:`ScheduleReport`.

    Raises:
        ValueError: a malformed or non-positive budget, an unknown solver.
        InfeasibleBudgetError: no schedule found keeps peak memory under the budget;
            ``min_peak_bytes`` is the smallest peak found.
        ScheduleError: the solver failed and ``fallback`` is False.
    """
    budget = check_arguments(mem_budget=mem_budget, solver=solver, time_limit_s=time_limit_s, seed=seed,
                             fallback=fallback, num_workers=num_workers)
    problem = Problem.from_dag(dag)
    return _solve_problem(problem, budget, solver=solver, time_limit_s=time_limit_s, seed=seed,
                          fallback=fallback, num_workers=num_workers)


def _solve_problem(
    problem: Problem,
    mem_budget_bytes: int | None,
    *,
    solver: str | SolverFn,
    time_limit_s: float,
    seed: int,
    fallback: bool,
    num_workers: int,
    extra_starts: Sequence[Schedule] = (),
    alternatives: list[Schedule] | None = None,
) -> tuple[Schedule, ScheduleReport]:
    """Solve, validate and report. The exact solvers are never worse than the best heuristic
    that fits (:mod:`solvers.driver`); a solver given as a callable is held to the same here.
    A failed solve falls back to the best heuristic that fits (``fallback``). The solve's
    :attr:`SolveResult.alternatives` are appended to ``alternatives`` when given."""
    t0 = time.perf_counter()
    name = solver_name(solver)
    before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
    report = functools.partial(make_report, problem, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                               mem_budget_bytes=mem_budget_bytes, t0=t0, requested=name)
    if not problem.colls:
        # nothing to schedule: the graph as traced is the only schedule, and it must fit too
        if mem_budget_bytes is not None and before.max_peak_bytes > mem_budget_bytes:
            peak = before.max_peak_bytes
            raise InfeasibleBudgetError(
                f"the graph has no collectives to schedule and peaks at {fmt_bytes(peak)} ({peak} B), over "
                f"mem_budget {fmt_bytes(mem_budget_bytes)} ({mem_budget_bytes} B): raise mem_budget to at least "
                f"{peak} B", budget_bytes=mem_budget_bytes, min_peak_bytes=peak)
        return before.schedule, report(before, solver="none", status="unchanged", best_bound=None,
                                       notes=["the graph has no collectives: left unchanged"], fell_back=False)
    if isinstance(solver, str) and solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {available_solvers()}")
    notes = _fixed_collective_notes(problem)
    try:
        result = solve(problem, solver=solver, mem_budget_bytes=mem_budget_bytes, time_limit_s=time_limit_s,
                       seed=seed, num_workers=num_workers, extra_starts=extra_starts)
        sim = validate_schedule(problem, result.schedule, mem_budget_bytes=mem_budget_bytes)
    except Exception as e:  # a failed solve must not fail training when a valid schedule exists
        heuristic = best_warm_start(problem, None, mem_budget_bytes, seed=seed)
        if heuristic is None:
            if isinstance(e, InfeasibleBudgetError) or mem_budget_bytes is not None:
                raise _infeasible(e, problem, mem_budget_bytes, fallback) from e
            raise
        if not fallback:
            raise
        if isinstance(e, InfeasibleBudgetError):
            notes.append(f"{name} found no schedule under the budget ({e}); a heuristic schedule fits")
        else:
            notes.append(f"{name} failed ({type(e).__name__}: {e}); fell back to the best valid heuristic schedule")
        logger.warning("fsdp-sched: %s gave no valid schedule (%s); falling back to heuristic %s", name, e, heuristic.solver)
        return heuristic.schedule, report(validate_schedule(problem, heuristic.schedule), solver=heuristic.solver,
                                          status=SolveStatus.FALLBACK.value, best_bound=None, notes=notes,
                                          fell_back=True)
    notes += list(result.notes)
    if alternatives is not None:
        alternatives.extend(result.alternatives)
    if result.status == SolveStatus.FEASIBLE:
        notes.append(f"{name} stopped at its limit ({time_limit_s:g} s) without proving optimality")
    if fallback and not isinstance(solver, str):
        # a solver of the user's: never worse than the heuristics (the exact solvers keep this
        # guarantee themselves, in solvers.driver; a heuristic asked for by name is returned as is)
        heuristic = best_warm_start(problem, None, mem_budget_bytes, seed=seed)
        if heuristic is not None and heuristic.objective_ms < sim.step_ms - 1e-9:
            notes.append(f"heuristic {heuristic.solver!r} simulates better than {name}'s schedule "
                         f"({fmt_ms(heuristic.objective_ms)} vs {fmt_ms(sim.step_ms)}): using it")
            return heuristic.schedule, report(validate_schedule(problem, heuristic.schedule), solver=heuristic.solver,
                                              status=SolveStatus.FALLBACK.value, best_bound=result.best_bound_ms,
                                              notes=notes, fell_back=True)
    return result.schedule, report(sim, solver=name, status=result.status.value, best_bound=result.best_bound_ms,
                                   notes=notes, fell_back=False, stages=result.stages)


def _fixed_collective_notes(problem: Problem) -> list[str]:
    """A note naming the collectives left where traced (unmodelled types such as all_to_all,
    non-FSDP all-reduces, or ones pinned by a dependency on another collective)."""
    fixed = [c for c in problem.colls.values() if not c.movable]
    if not fixed:
        return []
    names = ", ".join(f"{c.name} ({c.coll_type})" for c in fixed[:5]) + (", ..." if len(fixed) > 5 else "")
    logger.info("fsdp-sched: %d collective(s) left in place, not scheduled: %s", len(fixed), names)
    return [f"{len(fixed)} collective(s) left in place, not scheduled (unmodelled or pinned): {names}"]


def _infeasible(err: Exception, problem: Problem, mem_budget_bytes: int | None, fallback: bool) -> Exception:
    """The error when neither the solver nor any heuristic fits: the smallest peak found (by
    every count the budget holds), among the schedules the pass may answer with (without
    ``fallback``, the solver's own)."""
    if mem_budget_bytes is None:  # no budget: nothing to relax; the solver failed outright
        return ScheduleError(f"no valid schedule found ({type(err).__name__}: {err})")
    own = err.min_peak_bytes if isinstance(err, InfeasibleBudgetError) else None
    if not fallback and own is not None:
        return err
    peaks = [simulate(problem.dag, s, problem=problem).max_peak_bytes
             for s in (problem.traced_schedule(), *(r.schedule for r in fitting_heuristics(problem, None)))]
    if own is not None:
        peaks.append(own)
    min_peak = min(peaks)
    return InfeasibleBudgetError(
        f"no schedule keeps peak memory under {fmt_bytes(mem_budget_bytes)} ({mem_budget_bytes} B); the smallest "
        f"peak reached is {fmt_bytes(min_peak)} ({min_peak} B): raise mem_budget to at least that",
        budget_bytes=mem_budget_bytes,
        min_peak_bytes=min_peak,
    )


# --------------------------------------------------------------------------------------------
# FX graphs
# --------------------------------------------------------------------------------------------
def optimize_schedule(
    gm: "torch.fx.GraphModule",
    mem_budget: int | str | None = None,
    *,
    solver: str = "cpsat",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
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
    verify: bool = True,
    robust: bool = False,
    extra_starts: Sequence[Schedule] = (),
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
        verify: close the loop (default True, :mod:`scheduler.verify`): rank the solver's
            schedule, the heuristics that fit and the traced order on the simulator, polish the
            best that fits on it (``SearchConfig.polish_share`` of ``time_limit_s`` of work),
            then write back and judge it and torch's overlap scheduler on copies of ``gm``
            (re-exported step time; peaks by the re-export, the liveness count and torch's
            MemoryTracker), and the next ranked while its prediction could still win; keep the
            fastest written graph that fits ``mem_budget``. A polished graph over the budget by
            a count the simulator does not make (at most 5 % over) is polished again under the
            budget less the excess, at most twice. The report shows the prediction, the
            re-exported figures, why each candidate was dropped, and the stages that ran.
            False: write back the solver's schedule on the model's word alone.
        robust: choose robustly to the cost model (default False; needs ``verify``): every
            candidate is also judged under :func:`scheduler.robust.cost_model_family` of
            ``cluster`` (analytic and torch, bandwidths as given and +-30 %), and the one with
            the least worst-case regret over those models and ``cost_model`` is kept
            (:func:`scheduler.robust.choice_key`) instead of the fastest under ``cost_model``.
            The graph is also solved under three blends of ``cost_model`` and the other base
            model (:func:`scheduler.robust.blends`), each a candidate (compromises where the
            models prefer different schedules), and the best candidates by the criterion
            (``ROBUST.minimax_starts``) are polished on the worst case across the family
            (:mod:`solvers.minimax`, a local search on the simulator under all six models at
            once), each into one more candidate. The report names the criterion and each
            candidate's worst regret. Costs three more solves, the polishes
            (``ROBUST.minimax_work_solves`` times ``time_limit_s`` of work each) and one re-export per
            candidate and model (6 more per candidate).
        extra_starts: schedules of this graph the solver also starts from (exact solvers
            only), e.g. ``gm.meta[SCHEDULE_KEY]`` of another solve of a copy under another cost
            model; the solve is never slower than the fastest of them that fits.

    Returns:
        ``gm``, rewritten (or unchanged when it has no collectives).

    Raises:
        ValueError: a malformed budget or unknown solver, or ``robust`` without ``verify``.
        InfeasibleBudgetError: no schedule fits ``mem_budget`` (states the smallest peak);
            with ``verify``, no rewritten graph fits it.
        ScheduleError: the solve failed and ``fallback`` is False, or the schedule cannot be
            written back (the message says why). With ``agree``, these are raised only when
            the pass failed on every rank of the group; otherwise the graph stays unchanged.
    """
    # a group of ranks agrees on everything that follows, failures included: a check that
    # fails on one rank only (a budget computed from each rank's free memory, a graph that
    # differs) must reach the others, or they wait in the agreement forever
    group = consensus.agreement_group(consensus_group) if agree is True else None
    checked: dict[str, Any] = {}

    def export() -> Problem | None:
        """The arguments checked, then the graph exported; None for a graph without collectives
        whose metadata cannot be exported (nothing to schedule: never fail on it)."""
        checked["budget"] = check_arguments(
            mem_budget=mem_budget, solver=solver, time_limit_s=time_limit_s, cost_model=cost_model, cluster=cluster,
            payload_order=payload_order, control_deps=control_deps, seed=seed, fallback=fallback,
            broadcast_from=broadcast_from, num_workers=num_workers, agree=agree, schedule_hook=schedule_hook,
            verify=verify, robust=robust, extra_starts=extra_starts)
        checked["choice"] = robust_choice(cost_model, cluster) if robust else {}
        try:
            return Problem.from_dag(export_dag(gm, cost_model=cost_model, cluster=cluster))
        except DagError as e:
            if graph_has_collectives(gm):
                raise
            logger.info("graph has no collectives: left unchanged (not exported: %s)", e)
            return None

    writeback = {"payload_order": payload_order, "control_deps": control_deps}

    def solve_here(problem: Problem | None) -> tuple[Candidate, ScheduleReport]:
        budget = checked["budget"]
        if problem is None:  # a graph without collectives that could not be exported
            return Candidate(name=TRACED, graph_digest=_UNEXPORTED), _unchanged_report(
                None, budget=budget, requested=str(solver), notes=["the graph has no collectives: left unchanged"])
        key = _cache_key(problem, budget, solver=solver, time_limit_s=time_limit_s, seed=seed, fallback=fallback,
                         num_workers=num_workers, verify=verify, robust=robust, payload_order=payload_order,
                         control_deps=control_deps, extra_starts=extra_starts, schedule_hook=schedule_hook)
        hit = _cached(problem, key, budget)
        if hit is not None:
            own.extend(hit[2])
            return hit[0], hit[1]
        chosen, report = solve_fresh(problem)
        if key is not None:
            cache.store(key, {"candidate": chosen.to_json(), "report": report.to_json(),
                              "own": [s.to_json() for s in own]})
        return chosen, report

    def solve_fresh(problem: Problem) -> tuple[Candidate, ScheduleReport]:
        budget = checked["budget"]
        unpolished: list[Schedule] = []
        schedule, report = _solve_problem(problem, budget, solver=solver, time_limit_s=time_limit_s, seed=seed,
                                          fallback=fallback, num_workers=num_workers, extra_starts=extra_starts,
                                          alternatives=unpolished)
        solved = schedule.digest()
        schedule, report = _run_schedule_hook(schedule_hook, problem, schedule, report, budget)
        if schedule.digest() == solved:
            own.extend([schedule, *unpolished])
        if not verify or not problem.colls:
            return Candidate(name=report.solver, schedule=schedule), report
        # a schedule the hook imposed is judged alone: it is the user's (or a test's) choice
        alternatives = schedule.digest() == solved
        extra = _blend_candidates(gm, problem, budget, cost_model, cluster, report.solver,
                                  functools.partial(_solve_problem, solver=solver, time_limit_s=time_limit_s,
                                                    seed=seed, fallback=False, num_workers=num_workers,
                                                    extra_starts=(schedule, *extra_starts)),
                                  ) if robust and alternatives else []
        if alternatives:  # the solver's schedule before its final polish, judged on its written graph too
            extra = [schedule_candidate(problem, f"{report.solver}[unpolished]", s) for s in unpolished] + extra
        # the candidates polished on the simulator: on the worst case across the family
        # (robust), else under the one cost model with the solve's polish share
        work_s = (ROBUST.minimax_work_solves if robust else SearchConfig().polish_share) * time_limit_s
        return verify_and_choose(gm, problem, schedule, report, budget, cost_model=cost_model, cluster=cluster,
                                 seed=seed, alternatives=alternatives, extra=extra,
                                 minimax=(minimax_config(work_s, problem) if robust
                                          else MinimaxConfig.for_work(work_s, problem)),
                                 minimax_starts=ROBUST.minimax_starts if robust else 1, **checked["choice"],
                                 **writeback)

    installed: list[Schedule | None] = []
    own: list[Schedule] = []  # the solver's own schedules (SOLVED_KEY)

    def write_back(problem: Problem | None, chosen: Candidate) -> None:
        installed.append(chosen.schedule)
        if problem is None or not problem.colls:
            return
        if verify:
            install(gm, problem, chosen, cluster=cluster, **writeback)  # the graph that was judged
        else:
            apply_schedule(gm, problem, chosen.schedule, **writeback)

    if group is None:
        problem = export()
        if broadcast_from is not None and _world_size() > 1:
            chosen, report = _solve_and_broadcast(lambda: solve_here(problem), problem, checked["budget"],
                                                  broadcast_from)
        else:
            chosen, report = solve_here(problem)
        write_back(problem, chosen)
    else:
        report = _optimize_agreed(gm, group, export, solve_here, write_back, budget=lambda: checked.get("budget"),
                                  solver=solver, broadcast_from=broadcast_from)
    report.compile_id = _compile_id()
    gm.meta[REPORT_KEY] = report
    gm.meta[SCHEDULE_KEY] = installed[0] if installed else None
    gm.meta[SOLVED_KEY] = tuple(own)
    logger.info("%s", report.summary_line())
    return gm


def _cache_key(problem: Problem, budget: int | None, *, schedule_hook: Any, extra_starts: Sequence[Schedule],
               **options: Any) -> str | None:
    """The schedule cache's key of this solve (:mod:`scheduler.cache`), None when caching is
    off or the solve is not a function of data alone (a schedule hook, a solver given as a
    callable)."""
    if cache.cache_dir() is None or schedule_hook is not None or not isinstance(options.get("solver"), str):
        return None
    options["extra_starts"] = [s.digest() for s in extra_starts]
    return cache.cache_key(cache.dag_fingerprint(problem.dag), mem_budget_bytes=budget, options=options)


def _cached(problem: Problem, key: str | None, budget: int | None
            ) -> tuple[Candidate, ScheduleReport, list[Schedule]] | None:
    """The cached answer under ``key``: (chosen candidate, its report marked as a hit, the
    solver's own schedules), None on a miss or on an entry that does not fit ``problem``
    (ignored with a warning)."""
    t0 = time.perf_counter()
    entry = cache.load(key) if key is not None else None
    if entry is None:
        return None
    try:
        chosen = Candidate.from_json(entry["candidate"])
        report = ScheduleReport.from_json(entry["report"])
        own = [Schedule.from_json(s) for s in entry["own"]]
        for schedule in ([chosen.schedule] if chosen.schedule is not None else []) + own:
            validate_schedule(problem, schedule, mem_budget_bytes=budget if schedule is chosen.schedule else None)
    except (KeyError, TypeError, ValueError, ScheduleError) as e:
        logger.warning("fsdp-sched: schedule cache entry %s ignored: it does not fit this graph (%s: %s)", key[:16],
                       type(e).__name__, e)
        return None
    report.cache_hit = True
    report.stages = [StageRecord(name="cache", wall_s=time.perf_counter() - t0).to_json()]
    logger.info("fsdp-sched: schedule of %s taken from the cache (%s)", report.graph_name, key[:16])
    return chosen, report, own


def _blend_candidates(gm: "torch.fx.GraphModule", problem: Problem, budget: int | None, cost_model: Any,
                      cluster: Any, solver_label: str, solve_problem: Callable[..., Any]) -> list[Candidate]:
    """``optimize_schedule(robust=True)``'s extra candidates: the graph solved under blends of
    ``cost_model`` and the other base models (:func:`scheduler.robust.blends`), each schedule
    a candidate over ``problem`` named ``"<solver>[blend 25%]"`` ...; a blend whose solve fails
    is left out (logged)."""
    label = cost_model_label(cost_model)
    family = {label: resolve_cost_model(cost_model, cluster)}
    family.update({b: resolve_cost_model(b, cluster) for b in BASE_COST_MODELS if b != label})
    out = []
    for name, blend in blends(family, list(family)).items():
        try:
            blended = Problem.from_dag(export_dag(gm, cost_model=blend, cluster=cluster))
            schedule, _ = solve_problem(blended, budget)
        except (DagError, ScheduleError, ValueError) as e:
            logger.info("robust: no candidate under %s: %s", name, e)
            continue
        out.append(schedule_candidate(problem, f"{solver_label}[{name}]", schedule))
    return out


def robust_choice(cost_model: Any, cluster: Any) -> dict[str, Any]:
    """Keywords of :func:`scheduler.verify.verify_and_choose` for ``robust=True``: the family
    of ``cluster`` besides ``cost_model`` (which keeps its own label), and the criterion."""
    label = cost_model_label(cost_model)
    others = {k: m for k, m in cost_model_family(cluster).items() if k != label}
    name = f"robust: least worst-case regret over {len(others) + 1} cost models ({', '.join([label, *others])})"
    return {"other_cost_models": others, "criterion": Criterion(name=name, make_key=choice_key)}


def _optimize_agreed(gm, group, export, solve_here, write_back, *, budget, solver, broadcast_from) -> ScheduleReport:
    """:func:`optimize_schedule` on a group of ranks that must agree (see
    :mod:`scheduler.consensus`): check the arguments and export (``export``), solve, agree on
    one schedule (or on the failure of any rank at any of these steps), write back, agree
    that every rank wrote it back (else every rank restores its graph). ``budget()`` is the
    checked budget (None before the check passed). Returns this rank's report."""
    import torch.distributed as dist

    # broadcast_from is checked with the other arguments, inside the agreement: a bad one
    # falls back to rank 0 here, and the check's error reaches every rank
    valid_src = isinstance(broadcast_from, int) and not isinstance(broadcast_from, bool) and (
        0 <= broadcast_from < dist.get_world_size())
    src = dist.get_group_rank(group, broadcast_from) if valid_src else 0
    problem: Problem | None = None
    chosen: Candidate | None = None
    report: ScheduleReport | None = None
    error: BaseException | None = None
    try:
        problem = export()
        if broadcast_from is None or dist.get_rank(group) == src:
            chosen, report = solve_here(problem)
    except Exception as e:  # the other ranks must learn of it, or they hang in a collective
        error = e
        logger.warning("fsdp-sched: the pass failed on this rank (%s: %s)", type(e).__name__, e)
    agreed = consensus.agree_on_schedule(chosen, report.to_json() if report else None, error, group=group, src=src,
                                         decode=Candidate.from_json)
    if agreed.action == "raise":
        if error is not None:
            raise error
        raise ScheduleError(f"rank {src} failed to solve the schedule: {agreed.failures.get(src)}")
    if agreed.action == "skip":
        return _unchanged_report(problem, budget=budget(), requested=str(solver), notes=agreed.notes)
    assert agreed.schedule is not None
    if agreed.report_json is not None:
        report = ScheduleReport.from_json(agreed.report_json)
    assert report is not None
    report.notes += agreed.notes

    backup = _copy_graph(gm.graph) if problem is not None and problem.colls else None
    write_error: BaseException | None = None
    try:
        if agreed.adopted_from is not None and (problem is None) != (agreed.schedule.digest() == _UNEXPORTED):
            raise ScheduleError(f"rank {agreed.adopted_from}'s graph and this rank's differ (one has collectives to "
                                "schedule, the other none); every rank must trace the identical graph")
        if agreed.adopted_from is not None and agreed.schedule.schedule is not None:  # it must fit this rank's graph
            try:
                validate_schedule(problem, agreed.schedule.schedule, mem_budget_bytes=budget())
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
    return _unchanged_report(problem, budget=budget(), requested=str(solver), notes=[note])


def _run_schedule_hook(hook, problem: Problem, schedule: Schedule, report: ScheduleReport, budget: int | None):
    """Apply ``optimize_schedule(schedule_hook=...)``; a changed schedule is validated and the
    report updated."""
    if hook is None:
        return schedule, report
    new = hook(problem, schedule)
    if new is None or new.digest() == schedule.digest():
        return schedule, report
    sim = validate_schedule(problem, new, mem_budget_bytes=budget)
    report = dataclasses.replace(report, **after_fields(problem, sim, report.best_bound_ms), digest=new.digest(),
                                 notes=report.notes + ["schedule replaced by schedule_hook"])
    return new, report


def _unchanged_report(problem: Problem | None, *, budget: int | None, requested: str, notes: list[str]) -> ScheduleReport:
    """The report of a graph left as traced because the ranks could not agree on a schedule."""
    if problem is not None:
        traced = problem.traced_schedule()
        before = simulate(problem.dag, traced, problem=problem)
        return make_report(problem, before, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                           mem_budget_bytes=budget, t0=time.perf_counter(), solver="none", requested=requested,
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


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _solve_and_broadcast(solve_here, problem: Problem, budget: int | None, src: int):
    """Solve on rank ``src`` only and broadcast the schedule (or the error) to every rank."""
    import torch.distributed as dist

    payload: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            chosen, report = solve_here()
            payload[0] = {"schedule": chosen.to_json(), "report": report.to_json()}
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
    chosen = Candidate.from_json(data["schedule"])
    report = ScheduleReport.from_json(data["report"])
    if dist.get_rank() != src and chosen.schedule is not None:
        try:  # the schedule must fit this rank's graph (identical graphs on every rank)
            validate_schedule(problem, chosen.schedule, mem_budget_bytes=budget)
        except ScheduleInvalidError as e:
            raise ScheduleError(
                f"the schedule broadcast from rank {src} does not fit this rank's graph ({e}); "
                "every rank must trace the identical graph"
            ) from e
    if dist.get_rank() != src:
        report.notes.append(f"schedule received from rank {src}")
    return chosen, report


def _compile_id() -> str | None:
    """torch's id of the compile in progress ("0/0"), None outside ``torch.compile``."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)
