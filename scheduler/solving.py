"""Step 3 of :func:`scheduler.optimize_schedule`, the solve, and :func:`solve_dag`, the same
solve on a saved DAG (no torch graph: notebooks, the CLI).

:func:`search_in_orders` runs the search (:mod:`solvers.search`) in the orders of compute
``SolverOptions.compute_order`` names (:mod:`scheduler.orders`): with two, the starts in both and
the later stages in both (``"choose"``; with no budget not in an order whose starts trail by
more than ``SolverOptions.order_margin``) or in the order whose best start is better
(``"starts"``; in both where the first answer ends slower than torch's own schedule), and the
search's last stages (:func:`solvers.search.finish`) on the answer kept alone.
:func:`solve_graph` is one solve: the search or the solver asked for, the best start that fits
where a solver fails (``SolverOptions.fallback``), the schedule hook applied.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from scheduler.costs.family import fixed_parts
from scheduler.options import SolverOptions
from scheduler.orders import (
    Outcome,
    begin_orders,
    better_order,
    search_orders,
    slower_than_torch,
    starts_in_order,
    torch_steps,
    trailing_order,
)
from scheduler.report import ScheduleReport, fixed_collective_notes, make_report, unchanged_report
from solvers.core import (
    InfeasibleBudgetError,
    Problem,
    Schedule,
    SolveResult,
    SolveStatus,
    StageRecord,
    simulate,
    validate_schedule,
)
from solvers.core.units import fmt_bytes, parse_bytes
from solvers.registry import BACKENDS, solve_problems
from solvers.search import Started, search
from solvers.search import finish as finish_search

logger = logging.getLogger(__name__)


def search_in_orders(problems: Mapping[str, Problem], mem_budget_bytes: int | None, solver: SolverOptions,
                      torch_runs: Sequence[Any]) -> tuple[Outcome, list[str], list[StageRecord]]:
    """The search in the orders of compute ``solver.compute_order`` names (:mod:`scheduler.orders`).
    With two, the starts run in both; with ``"choose"`` the rest of the search too, and
    :func:`better_order` takes one answer; with ``"starts"`` the rest runs in the order whose best
    start has the smaller worst-case regret, and in the other too only where that answer is
    slower than torch's own schedule under a strict model. ``"choose"`` does the same with no
    budget where one order's starts trail by more than ``solver.order_margin``
    (:func:`trailing_order`). Returns the order's outcome, the report's notes and the stages of
    the other order.

    Raises:
        InfeasibleBudgetError: no order has a start within ``mem_budget_bytes``.
    """
    problem = next(iter(problems.values()))
    orders = search_orders(problems, solver, torch_runs)
    # torch's own schedule judges the first answer only where the search may end in one order
    one_order = False
    refusal: InfeasibleBudgetError | None = None
    begun: list[tuple[Any, Started | None]] = [(orders[0], None)]
    starts_notes: list[str] = []
    left_out: list[tuple[InfeasibleBudgetError, str]] = []
    if len(orders) > 1:
        begun, refusal, left_out = begin_orders(orders, mem_budget_bytes, solver, problem)
        if not begun:
            assert refusal is not None
            raise refusal
        best_starts = [(*order, started.result()) for order, started in begun]
        trailing = trailing_order(best_starts, mem_budget_bytes, solver)
        one_order = len(begun) > 1 and (solver.compute_order == "starts" or trailing is not None)
        if one_order:
            k, starts_notes = better_order(best_starts, solver, on_starts=True)
            begun = [begun[k], *begun[:k], *begun[k + 1:]]
        if trailing is not None:
            starts_notes.append(trailing[1])
    torchs = torch_steps([(*order, None) for order, _ in begun], solver) if one_order else {}
    outcomes: list[Outcome] = []
    all_notes: list[list[str]] = []
    starteds: list[Started | None] = []
    # the search's last stages run on the answer kept alone, not in every order
    later = len(begun) > 1
    for order, started in begun:
        if outcomes and one_order and not slower_than_torch(outcomes[0][3], torchs):
            break
        name, base, named = order
        try:
            result, notes = solve_graph(base, mem_budget_bytes,
                                        starts_in_order(solver, problem, next(iter(base.values()))),
                                        baselines=named, started=started, finish=not later)
        except InfeasibleBudgetError as e:  # the other order may fit
            refusal = refusal or e
            continue
        except Exception as e:  # torch's order is a second chance, never the call's failure
            if name != "torch" or len(orders) == 1:
                raise
            logger.warning("fsdp-sched: the search in torch's order of compute failed (%s: %s)",
                           type(e).__name__, e)
            continue
        outcomes.append((name, base, named, result))
        all_notes.append(notes)
        starteds.append(started)
    if not outcomes:
        assert refusal is not None
        raise refusal
    # the choice on the starts says why, where its order alone was finished
    only_first = len(outcomes) == 1 and outcomes[0][1] is begun[0][0][1]
    k, order_notes = (0, starts_notes) if starts_notes and only_first else better_order(outcomes, solver)
    if later:
        name, base, named, result = outcomes[k]
        outcomes[k] = (name, base, named, finish_graph(base, result, starteds[k], mem_budget_bytes, solver,
                                                      all_notes[k]))
    finished = {id(o[1]) for o in outcomes}
    others = [st for j, (*_, other) in enumerate(outcomes) if j != k for st in other.stages]
    others += [st for order, started in begun if started is not None and id(order[1]) not in finished
               for st in started.stages]
    # an order with no start within the budget still spent its starts' time
    others += [st for e, _ in left_out for st in e.stages]
    return outcomes[k], all_notes[k] + order_notes + [note for _, note in left_out], others


def solve_graph(problems: Mapping[str, Problem], mem_budget_bytes: int | None, solver: SolverOptions,
           baselines: Sequence[tuple[str, Schedule]] = (), started: Started | None = None, finish: bool = True
           ) -> tuple[SolveResult, list[str]]:
    """The search (or the solver asked for), its hook applied, and the report's notes. A solver
    that fails falls back to the best start that fits (``solver.fallback``). ``baselines``:
    named starts that are baselines too (torch's pass read back); ``started``: the search's
    first stage run already on these (:func:`scheduler.orders.begin_orders`); ``finish``:
    False leaves the search's last stages and the hook to :func:`finish_graph` (with
    ``started``), for the one answer kept of several orders of compute."""
    problem = next(iter(problems.values()))
    notes = fixed_collective_notes(problem)
    try:
        result = solve_problems(problems, solver=solver.solver, mem_budget_bytes=mem_budget_bytes,
                                work_limit=solver.work_limit, seed=solver.seed, num_workers=solver.num_workers,
                                extra_starts=solver.extra_starts, config=solver.search,
                                all_gather_stream=solver.all_gather_stream, baselines=baselines, started=started,
                                finish=finish)
        validate_schedule(problem, result.schedule, mem_budget_bytes=mem_budget_bytes)
    except Exception as e:  # a failed solve must not fail training when a valid schedule exists
        # the search's own refusal names the smallest peak of every start: nothing to fall back to.
        # A heuristic that cannot reach the budget is not a failure to hide but a question the
        # search's starts answer (the traced order among them), whatever ``fallback`` says: a
        # budget the graph itself holds is never refused
        infeasible = isinstance(e, InfeasibleBudgetError)
        if (infeasible and solver.solver in BACKENDS) or (not solver.fallback and not infeasible):
            raise
        logger.warning("fsdp-sched: %s failed (%s: %s); falling back to the best start", solver.solver_name,
                       type(e).__name__, e)
        notes.append(f"{solver.solver_name} failed ({type(e).__name__}: {e}); fell back to the best start that fits")
        starts = started.result() if started is not None else search(
            problems, mem_budget_bytes, backend=None, starts_only=True, extra_starts=solver.extra_starts, config=solver.search,
            all_gather_stream=solver.all_gather_stream, baselines=baselines)
        result = dataclasses.replace(starts, status=SolveStatus.FALLBACK, solver="fallback")
    notes += list(result.notes)
    return (_hooked(problem, result, mem_budget_bytes, solver, notes) if finish else result), notes


def finish_graph(problems: Mapping[str, Problem], result: SolveResult, started: Started | None,
                 mem_budget_bytes: int | None, solver: SolverOptions, notes: list[str]) -> SolveResult:
    """What :func:`solve_graph` with ``finish=False`` left: the search's last stages
    (:func:`solvers.search.finish`) on ``result`` where the search found it, then the hook;
    ``notes`` gets the report's notes. A last stage that fails leaves ``result`` as it was."""
    problem = next(iter(problems.values()))
    if started is not None and result.status is not SolveStatus.FALLBACK:
        try:
            finished = finish_search(started, result, mem_budget_bytes, solver.search)
            validate_schedule(problem, finished.schedule, mem_budget_bytes=mem_budget_bytes)
            result = finished
        except Exception as e:  # the search's answer stands: a last stage only improves on it
            logger.warning("fsdp-sched: the search's last stages failed (%s: %s); its answer before them kept",
                           type(e).__name__, e)
            notes.append(f"the search's last stages failed ({type(e).__name__}: {e}); its answer before them kept")
    return _hooked(problem, result, mem_budget_bytes, solver, notes)


def _hooked(problem: Problem, result: SolveResult, mem_budget_bytes: int | None, solver: SolverOptions,
            notes: list[str]) -> SolveResult:
    """``result`` with ``solver.schedule_hook`` applied (validated), the note in ``notes``."""
    if solver.schedule_hook is not None:
        new = solver.schedule_hook(problem, result.schedule)
        if new is not None and new.digest() != result.schedule.digest():
            sim = validate_schedule(problem, new, mem_budget_bytes=mem_budget_bytes)
            result = dataclasses.replace(result, schedule=new, objective_ms=sim.step_ms, alternatives=())
            notes.append("schedule replaced by schedule_hook")
    return result


def criterion_of(problems: Mapping[str, Problem], solver: SolverOptions, cost_model: Any = None) -> str:
    labels = list(problems)
    if len(labels) == 1:
        return f"fastest under {labels[0]}"
    strict = [label for label in labels if label in solver.search.strict_models]
    first = f"no slower than the best baseline under {' and '.join(strict)}, then " if strict else ""
    fixed = fixed_parts(cost_model)
    shared = f", each with {fixed} and the rest priced by its own model" if fixed else ""
    return f"{first}least worst-case regret over {len(labels)} cost models ({', '.join(labels)}){shared}"


def check_traced_fits(problem: Problem, mem_budget_bytes: int | None) -> None:
    """A graph without collectives has one schedule: it must fit the budget too."""
    peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
    if mem_budget_bytes is not None and peak > mem_budget_bytes:
        raise InfeasibleBudgetError(f"the graph has no collectives to schedule and peaks at {fmt_bytes(peak)} "
                                    f"({peak} B), over mem_budget {fmt_bytes(mem_budget_bytes)} "
                                    f"({mem_budget_bytes} B): raise mem_budget to at least {peak} B",
                                    mem_budget_bytes=mem_budget_bytes, min_peak_bytes=peak)


def solve_dag(dag: nx.DiGraph, mem_budget: int | str | None = None, *, solver: SolverOptions = SolverOptions()
              ) -> tuple[Schedule, ScheduleReport]:
    """Find and validate a schedule of a cost-annotated DAG (no torch graph needed: notebooks,
    the CLI). The DAG's own cost model decides.

    Returns:
        The validated schedule and its :class:`ScheduleReport`.

    Raises:
        TypeError, ValueError: a bad argument.
        InfeasibleBudgetError: no schedule found keeps peak memory under the budget.
        ScheduleError: the solver failed and ``solver.fallback`` is False.
    """
    if not isinstance(dag, nx.DiGraph):
        raise TypeError(f"dag={type(dag).__name__} must be a networkx DiGraph (scheduler.export_dag / load_dag)")
    if not isinstance(solver, SolverOptions):
        raise TypeError(f"solver={solver!r} must be a scheduler.SolverOptions")
    mem_budget_bytes = parse_bytes(mem_budget)
    t0 = time.perf_counter()
    problem = Problem.from_dag(dag)
    before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
    if not problem.colls:
        check_traced_fits(problem, mem_budget_bytes)
        return before.schedule, unchanged_report(problem, mem_budget_bytes=mem_budget_bytes, requested=solver.solver_name,
                                                  notes=["the graph has no collectives: left unchanged"])
    label = str(dag.graph.get("cost_model", "model"))
    result, notes = solve_graph({label: problem}, mem_budget_bytes, solver)
    sim = validate_schedule(problem, result.schedule, mem_budget_bytes=mem_budget_bytes)
    report = make_report(problem, before, sim, graph_name=str(dag.graph.get("name", "graph")), mem_budget_bytes=mem_budget_bytes,
                         t0=t0, solver=result.solver, requested=solver.solver_name, status=result.status.value,
                         best_bound=result.best_bound_ms, notes=notes,
                         fell_back=result.status == SolveStatus.FALLBACK, stages=result.stages)
    report.criterion = f"fastest under {label}"
    return result.schedule, report
