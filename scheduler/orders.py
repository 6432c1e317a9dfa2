"""The orders of compute the search runs in, and torch's pass as its starts.

torch's overlap scheduler (:mod:`scheduler.torch_overlap`) is run on a copy of the graph and read
back as starts (:mod:`scheduler.readback`). It also moves compute nodes: it runs a collective's
input early so that the collective issues early. Over the traced order its schedule is read
back with repairs, over its own order exactly; ``SolverOptions.compute_order`` says in which
orders the search runs (:func:`search_orders`) and :func:`better_order` which answer is taken.
Any order that runs every node after its inputs is the same graph
(:mod:`solvers.core.order`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs.hardware import Cluster
from scheduler.options import SolverOptions
from scheduler.torch_overlap import TorchStart, torch_starts
from solvers.core import InfeasibleBudgetError, Problem, Schedule, SolveResult, StageRecord, simulate
from solvers.core.evaluate import ModelEvaluator
from solvers.core.order import in_order, node_order
from solvers.core.peaks import memory_model
from solvers.core.units import fmt_bytes
from solvers.objective import SAME_STEP
from solvers.registry import BACKENDS, check_starts
from solvers.search import Started, begin

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)


def torch_starts_for(gm: "torch.fx.GraphModule", problem: Problem, cluster: Cluster | None, solver: SolverOptions
                  ) -> list[TorchStart]:
    """torch's pass in each variant of ``solver.torch_starts``, read back over ``problem``; none
    for a solver that takes no starts (a heuristic, a callable)."""
    if not solver.torch_starts or not (isinstance(solver.solver, str) and solver.solver in BACKENDS):
        return []
    return torch_starts(gm, problem, solver.torch_starts, cluster=cluster)


def search_orders(problems: Mapping[str, Problem], solver: SolverOptions, runs: Sequence[TorchStart]
            ) -> list[tuple[str, Mapping[str, Problem], list[tuple[str, Schedule]]]]:
    """The orders of compute the search runs in (``solver.compute_order``): each as its name
    (``"traced"``, ``"torch"``), the problems of the graph in that order and torch's starts read
    back over them.

    torch's pass moves compute nodes (it runs a collective's input early to issue it early); over
    the traced order its schedule is read back with repairs that can cost much of its gain, over
    its own order (:func:`scheduler.readback.torch_order`) exactly."""
    traced = ("traced", problems, [(r.name, r.schedule) for r in runs if r.schedule is not None])
    ordered = next((r for r in runs if r.schedule_in_order is not None), None)
    if solver.compute_order == "traced" or ordered is None:
        return [traced]
    rebased = {label: in_order(p, ordered.order) for label, p in problems.items()}  # type: ignore[arg-type]
    torch = ("torch", rebased, [(r.name, r.schedule_in_order) for r in runs
                                if r.order == ordered.order and r.schedule_in_order is not None])
    return [torch] if solver.compute_order == "torch" else [traced, torch]


#: one order's search: its name, its problems, torch's starts read back over them, its result
Outcome = tuple[str, Mapping[str, Problem], list[tuple[str, Schedule]], SolveResult]


def begin_orders(orders: Sequence[tuple[str, Mapping[str, Problem], list[tuple[str, Schedule]]]],
                 budget: int | None, solver: SolverOptions, traced: Problem
                 ) -> tuple[list[tuple[tuple[str, Mapping[str, Problem], list[tuple[str, Schedule]]], Started]],
                            InfeasibleBudgetError | None, list[tuple[InfeasibleBudgetError, str]]]:
    """The search's first stage (its starts, :func:`solvers.search.begin`) in each order of
    :func:`search_orders`, so that its later stages run in the order whose starts are better
    (:func:`better_order`) and not in both. An order in which no start fits is left out (the
    other may fit; the first refusal is returned for when none does, and each order left out
    as its refusal, whose stages the report keeps, and the report's note); a failure in torch's order is a warning,
    never the call's failure.

    An order after the first whose least peak (:func:`least_peak_over`) is over the budget is
    left out without its starts: no schedule of it fits. The first order's starts run whatever
    its bound says, so that a refusal names the smallest peak a schedule reaches."""
    begun, refusal, left_out = [], None, []
    for k, (name, base, named) in enumerate(orders):
        t0 = time.perf_counter()
        least = least_peak_over(next(iter(base.values()))) if k and budget is not None else None
        if least is not None and least[0] > budget:
            e = InfeasibleBudgetError(
                f"no schedule in the {name} order of compute keeps peak memory under {fmt_bytes(budget)}: each "
                f"holds at least {fmt_bytes(least[0])} ({least[0]} B) at {least[1]!r}",
                mem_budget_bytes=budget, min_peak_bytes=None, least_peak_bytes=least[0])
            e.stages = [StageRecord(name="starts", wall_s=time.perf_counter() - t0)]
            refusal = refusal or e
            left_out.append((e, f"the {name} order of compute left out: no schedule of it fits the budget (each "
                                f"holds at least {fmt_bytes(least[0])} at {least[1]!r})"))
            continue
        options = starts_in_order(solver, traced, next(iter(base.values())))
        try:
            check_starts(next(iter(base.values())), options.extra_starts, named)
            started = begin(base, budget, config=options.search, extra_starts=options.extra_starts,
                            all_gather_stream=options.all_gather_stream, baselines=named)
        except InfeasibleBudgetError as e:
            refusal = refusal or e
            left_out.append((e, f"the {name} order of compute left out: no start of it fits the budget (the "
                                f"smallest peak reached is {fmt_bytes(e.min_peak_bytes or 0)})"))
            continue
        except Exception as e:  # torch's order is a second chance, never the call's failure
            if name != "torch":
                raise
            logger.warning("fsdp-sched: the search in torch's order of compute failed (%s: %s)", type(e).__name__, e)
            continue
        begun.append(((name, base, named), started))
    return begun, refusal, left_out


def worst_ratios(outcomes: Sequence[Outcome]) -> list[float]:
    """Each outcome's worst ratio, over the models, of its step time to the least of all the
    outcomes' under that model (1.0: no outcome beats it under any model)."""
    labels = list(outcomes[0][1])
    steps = [dict(result.step_ms_by_model) for *_, result in outcomes]
    best = {label: min(step[label] for step in steps) for label in labels}
    return [max(step[label] / best[label] for label in labels) for step in steps]


def trailing_order(outcomes: Sequence[Outcome], budget: int | None, solver: SolverOptions) -> tuple[int, str] | None:
    """``(index, note)`` of the order of ``outcomes`` (each order's best start) whose worst ratio
    (:func:`worst_ratios`) exceeds the other's by more than ``solver.order_margin``
    (``SolverOptions.order_margin``). Only for ``compute_order="choose"`` with no budget (with
    one, the polish can close such a gap); None where no order trails so."""
    if solver.compute_order != "choose" or budget is not None or solver.order_margin is None or len(outcomes) != 2:
        return None
    worst = worst_ratios(outcomes)
    k = max(range(2), key=lambda i: worst[i])
    if worst[k] <= worst[1 - k] * (1 + solver.order_margin):
        return None
    return k, (f"the {outcomes[k][0]} order of compute searched no further than its starts: its best start's "
               f"worst-case ratio {worst[k] - 1:.2%} against the {outcomes[1 - k][0]} order's {worst[1 - k] - 1:.2%} "
               f"(more than SolverOptions.order_margin={solver.order_margin:g} apart, with no budget)")


def least_peak_over(problem: Problem) -> tuple[int, str] | None:
    """``(bytes, node)``: no schedule of ``problem`` (its order of compute) peaks lower, and
    each holds at least ``bytes`` at compute node ``node``
    (:meth:`solvers.core.peaks.MemoryModel.least_peak`); None where the evaluator cannot count
    the graph's memory itself."""
    model = memory_model(problem)
    if model.reason is not None:
        return None
    least, at = model.least_peak()
    return least, problem.seq[at] if problem.seq else "the graph's inputs"


def better_order(outcomes: Sequence[Outcome], solver: SolverOptions, *, on_starts: bool = False
                 ) -> tuple[int, list[str]]:
    """Which of the searches in the orders of :func:`search_orders` to take (an index of
    ``outcomes``), and the report's note. First the one no slower than torch's own schedule
    under the strict models (the one model where there is one): the search in torch's order
    never is, the traced order's only where reading torch's schedule back over it lost nothing;
    then the smaller worst-case regret under the models judged by; then the traced order.
    ``on_starts``: the results are each order's best start, compared by the regret alone (a
    start a little slower than torch's own schedule under one strict model may be polished
    past it; :func:`scheduler.solving.search_in_orders` finishes the other order too where the
    answer ends slower)."""
    note = "compute in torch's order (SolverOptions.compute_order)"
    if len(outcomes) == 1:
        return 0, [] if outcomes[0][0] == "traced" else [note]
    torchs = {} if on_starts else torch_steps(outcomes, solver)
    keys = [(slower_than_torch(outcome[3], torchs), worst, k)
            for k, (outcome, worst) in enumerate(zip(outcomes, worst_ratios(outcomes)))]
    k = min(keys)[2]
    if outcomes[k][0] == "traced":
        return k, []
    other = keys[1 - k]
    which = "best start" if on_starts else "search"
    why = f"the traced order's {which} is slower than torch's own schedule under a strict model" if other[0] else \
        f"its {which}'s worst-case regret {keys[k][1] - 1:.2%} against the traced order's {other[1] - 1:.2%}"
    return k, [f"{note}: {why}"]


def torch_steps(outcomes: Sequence[Outcome], solver: SolverOptions) -> dict[str, float]:
    """torch's own schedule's step time (its schedule read back over its own order, the torch
    order's of ``outcomes``) under each strict model (the one model where there is one), ms;
    empty where there is no search in torch's order."""
    torch_order = next((o for o in outcomes if o[0] == "torch"), None)
    if torch_order is None or not torch_order[2]:
        return {}
    _, rebased, in_torch, _ = torch_order
    labels = list(rebased)
    strict = [label for label in labels if label in solver.search.strict_models] if len(labels) > 1 else labels
    return {label: simulate(rebased[label].dag, in_torch[0][1], problem=rebased[label]).step_ms for label in strict}


def slower_than_torch(result: SolveResult, torchs: Mapping[str, float]) -> bool:
    """Whether ``result`` is slower than torch's own schedule (:func:`torch_steps`) under a
    strict model, by more than float noise."""
    return any(result.step_ms_by_model[label] > ms * (1 + SAME_STEP) for label, ms in torchs.items())


def starts_in_order(solver: SolverOptions, traced: Problem, base: Problem) -> SolverOptions:
    """``solver`` without the extra starts that belong to a search in the other order of compute
    (:func:`search_orders`): in the traced order, those running the same nodes in another
    order; in torch's, those in the traced order. Any other start is given, to be refused by name
    if it is not one of this graph."""
    if base is traced:
        keep = tuple(s for s in solver.extra_starts
                     if node_order(s) == traced.seq or sorted(node_order(s)) != sorted(traced.seq))
    else:
        keep = tuple(s for s in solver.extra_starts if node_order(s) != traced.seq)
    return solver if keep == solver.extra_starts else dataclasses.replace(solver, extra_starts=keep)


def torch_notes(runs: Sequence[TorchStart]) -> list[str]:
    """The report's notes on torch's starts: each skipped one and each repair, with its reason."""
    notes = []
    for run in runs:
        if run.skipped is not None:
            notes.append(f"{run.name} is no start: {run.skipped}")
        notes += [f"{run.name} read back: {repair}" for repair in run.repairs]
    return notes


def torch_rows(problems: dict[str, Problem], runs: Sequence[TorchStart]) -> list[dict[str, Any]]:
    """The report's rows of torch's starts (:meth:`TorchStart.to_json`), each with its simulated
    step time under every cost model (ms) and its peak (bytes)."""
    rows = []
    evaluator = ModelEvaluator(problems) if any(r.schedule is not None for r in runs) else None
    for run in runs:
        row = run.to_json()
        if run.schedule is not None and evaluator is not None:
            sims = evaluator.evaluate(run.schedule)
            row["step_ms"] = {label: sims[label].step_ms for label in problems}
            row["peak_bytes"] = max(e.peak_bytes for e in sims.values())
        rows.append(row)
    return rows
