"""The user-facing entry points: export -> solve -> validate -> write back, with a report.

- :func:`optimize_schedule`: rewrite a partitioned forward or backward FX graph in place.
- :func:`solve_dag`: the same solve on a saved DAG, without torch (notebooks, CLI).
- :func:`backend`: a ``torch.compile`` backend (aot_autograd) that runs it on every graph.
- :func:`inductor_post_grad_pass`: the same as an inductor post-grad custom pass.
- :func:`parse_bytes`: ``"40GiB"`` -> bytes, for every ``mem_budget`` argument.

Failure policy: a memory budget that no schedule reaches raises
:class:`solvers.core.schedule.InfeasibleBudgetError` with the smallest peak found; a solver that
fails or times out is replaced (``fallback=True``) by the best valid schedule among its
incumbent and the heuristics, which is never worse than the graph as traced; the report says
so (``fell_back``, ``notes``) and a warning is logged.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.dag import DagError, export_dag, graph_has_collectives
from scheduler.report import ScheduleReport, make_report
from scheduler.writeback import apply_schedule
from solvers.core import (
    InfeasibleBudgetError,
    Problem,
    Schedule,
    ScheduleError,
    ScheduleInvalidError,
    SolveStatus,
    fmt_bytes,
    fmt_ms,
    parse_bytes,
    simulate,
    validate_schedule,
)
from solvers.registry import SOLVERS, SolverFn, available_solvers, solve, solver_name
from solvers.warmstart import best_warm_start, fitting_heuristics

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: key of the report in ``gm.meta``
REPORT_KEY = "fsdp_sched_report"

# --------------------------------------------------------------------------------------------
# solve (torch-free)
# --------------------------------------------------------------------------------------------
def solve_dag(
    dag: nx.DiGraph,
    mem_budget: int | str | None = None,
    *,
    solver: str | SolverFn = "cpsat",
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
        solver: ``"cpsat"`` (default), ``"milp"``, a heuristic name
            (:func:`solvers.available_solvers`), or your own callable with the signature of
            :data:`solvers.registry.SolverFn`.
        time_limit_s: solver time limit in seconds (default 30; deterministic for CP-SAT).
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
    problem = Problem.from_dag(dag)
    return _solve_problem(problem, parse_bytes(mem_budget), solver=solver, time_limit_s=time_limit_s, seed=seed,
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
) -> tuple[Schedule, ScheduleReport]:
    """Solve, validate and report. The exact solvers are never worse than the best heuristic
    that fits (:mod:`solvers.driver`); a solver given as a callable is held to the same here.
    A failed solve falls back to the best heuristic that fits (``fallback``)."""
    t0 = time.perf_counter()
    name = solver_name(solver)
    before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
    report = functools.partial(make_report, problem, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                               mem_budget_bytes=mem_budget_bytes, t0=t0, requested=name)
    if not problem.colls:
        return before.schedule, report(before, solver="none", status="unchanged", best_bound=None,
                                       notes=["the graph has no collectives: left unchanged"], fell_back=False)
    if isinstance(solver, str) and solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {available_solvers()}")
    notes = _fixed_collective_notes(problem)
    try:
        result = solve(problem, solver=solver, mem_budget_bytes=mem_budget_bytes, time_limit_s=time_limit_s,
                       seed=seed, num_workers=num_workers)
        sim = validate_schedule(problem, result.schedule, mem_budget_bytes=mem_budget_bytes)
    except Exception as e:  # a failed solve must not fail training when a valid schedule exists
        heuristic = best_warm_start(problem, None, mem_budget_bytes, seed=seed)
        if heuristic is None:
            if isinstance(e, InfeasibleBudgetError) or mem_budget_bytes is not None:
                raise _infeasible(e, problem, mem_budget_bytes) from e
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
                                   notes=notes, fell_back=False)


def _fixed_collective_notes(problem: Problem) -> list[str]:
    """A note naming the collectives left where traced (unmodelled types such as all_to_all,
    non-FSDP all-reduces, or ones pinned by a dependency on another collective)."""
    fixed = [c for c in problem.colls.values() if not c.movable]
    if not fixed:
        return []
    names = ", ".join(f"{c.name} ({c.coll_type})" for c in fixed[:5]) + (", ..." if len(fixed) > 5 else "")
    logger.info("fsdp-sched: %d collective(s) left in place, not scheduled: %s", len(fixed), names)
    return [f"{len(fixed)} collective(s) left in place, not scheduled (unmodelled or pinned): {names}"]


def _infeasible(err: Exception, problem: Problem, mem_budget_bytes: int | None) -> Exception:
    """The error when neither the solver nor any heuristic fits: the smallest peak found."""
    if mem_budget_bytes is None:  # no budget: nothing to relax; the solver failed outright
        return ScheduleError(f"no valid schedule found ({type(err).__name__}: {err})")
    peaks = [simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes]
    peaks += [r.peak_bytes for r in fitting_heuristics(problem, None)]
    if isinstance(err, InfeasibleBudgetError) and err.min_peak_bytes is not None:
        peaks.append(err.min_peak_bytes)
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
    time_limit_s: float = 30.0,
    cost_model: Any = None,
    cluster: Any = None,
    payload_order: str = "registration",
    control_deps: bool = False,
    seed: int = 0,
    fallback: bool = True,
    broadcast_from: int | None = None,
    num_workers: int = 1,
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

    Returns:
        ``gm``, rewritten (or unchanged when it has no collectives).

    Raises:
        ValueError: a malformed budget or unknown solver.
        InfeasibleBudgetError: no schedule fits ``mem_budget`` (states the smallest peak).
        ScheduleError: the solve failed and ``fallback`` is False, or the schedule cannot be
            written back (the message says why).
    """
    budget = parse_bytes(mem_budget)
    if not graph_has_collectives(gm):
        try:
            dag = export_dag(gm, cost_model=cost_model, cluster=cluster)
        except DagError as e:  # nothing to schedule: never fail on metadata we would not use
            logger.info("graph has no collectives: left unchanged (not exported: %s)", e)
            return gm
    else:
        dag = export_dag(gm, cost_model=cost_model, cluster=cluster)
    problem = Problem.from_dag(dag)

    def solve_here() -> tuple[Schedule, ScheduleReport]:
        return _solve_problem(
            problem,
            budget,
            solver=solver,
            time_limit_s=time_limit_s,
            seed=seed,
            fallback=fallback,
            num_workers=num_workers,
        )

    if broadcast_from is not None and _world_size() > 1:
        schedule, report = _solve_and_broadcast(solve_here, problem, budget, broadcast_from)
    else:
        schedule, report = solve_here()
    if problem.colls:
        apply_schedule(gm, problem, schedule, payload_order=payload_order, control_deps=control_deps)  # type: ignore[arg-type]
    gm.meta[REPORT_KEY] = report
    logger.info("%s", report.summary_line())
    return gm


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
    place; reports are collected in the pass's ``reports`` list. Its ``uuid()`` is built from
    the options, so inductor's FX graph cache tells differently configured passes apart
    (objects such as a cost model enter by ``repr``; give them a stable one to get cache hits
    across processes).
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    options = {"control_deps": True, **options}
    parse_bytes(options.get("mem_budget"))

    class _FsdpSchedPass(CustomGraphPass):
        def __init__(self) -> None:
            self.reports: list[ScheduleReport] = []

        def __call__(self, graph: "torch.fx.Graph") -> None:
            import torch.fx

            gm = graph.owning_module
            if not isinstance(gm, torch.fx.GraphModule):
                gm = torch.fx.GraphModule(torch.nn.Module(), graph)
            optimize_schedule(gm, **options)
            self.reports.append(gm.meta[REPORT_KEY])

        def uuid(self) -> str:
            return "fsdp-sched:" + json.dumps(options, sort_keys=True, default=repr)

    return _FsdpSchedPass()
