"""Warm starts: the one place that turns heuristics (and a user's hint) into starting points.

The solve loop (:mod:`solvers.driver`) starts every model from :func:`best_warm_start`; the
per-layer template (:mod:`solvers.decompose`) copies the steady state of
:func:`unconstrained_schedules`; the API falls back to :func:`fitting_heuristics` when a solve
fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from solvers.core.problem import Problem
from solvers.core.schedule import InfeasibleBudgetError, Schedule, SolveResult, SolveStatus
from solvers.core.simulator import simulate
from solvers.heuristics import HEURISTICS

logger = logging.getLogger(__name__)


def fitting_heuristics(problem: Problem, mem_budget_bytes: int | None, *, seed: int = 0) -> list[SolveResult]:
    """Every heuristic's result that fits ``mem_budget_bytes`` (in :data:`HEURISTICS` order).
    A heuristic whose ladder cannot reach the budget is left out."""
    out = []
    for name, fn in HEURISTICS.items():
        try:
            r = fn(problem, mem_budget_bytes=mem_budget_bytes, seed=seed)
        except InfeasibleBudgetError:
            continue
        if mem_budget_bytes is None or r.peak_bytes <= mem_budget_bytes:
            out.append(r)
    return out


def unconstrained_schedules(problem: Problem, *, seed: int = 0) -> list[tuple[str, Schedule]]:
    """Every heuristic's schedule without a budget, by name."""
    return [(name, fn(problem, mem_budget_bytes=None, seed=seed).schedule) for name, fn in HEURISTICS.items()]


def exceeds_cap(problem: Problem, schedule: Schedule, max_bucket_bytes: int | None) -> bool:
    """A bucket of more than one collective holds more than ``max_bucket_bytes`` of payload."""
    return max_bucket_bytes is not None and any(
        len(b.members) > 1 and sum(problem.colls[m].payload_bytes for m in b.members) > max_bucket_bytes
        for b in schedule.buckets
    )


def best_warm_start(problem: Problem, hint: Schedule | None, mem_budget_bytes: int | None, *, seed: int = 0,
                    max_bucket_bytes: int | None = None, extra_starts: Sequence[Schedule] = ()) -> SolveResult | None:
    """The fastest (simulated) schedule among ``hint``, ``extra_starts`` (e.g. the best schedule
    found at a smaller budget, see :func:`solvers.registry.solve_budgets`) and the heuristics
    that fit the budget and the bucket cap; None when none fits. Ties keep the earlier one (hint
    first, then the extra starts, then the heuristics: FSDP2-like, the per-block plan, is always
    among them)."""
    best = None
    given = [("hint", hint)] if hint is not None else []
    given += [(f"start {i}", s) for i, s in enumerate(extra_starts)]
    for name, schedule in given:
        sim = simulate(problem.dag, schedule, problem=problem)
        fits = mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes
        if fits and not exceeds_cap(problem, schedule, max_bucket_bytes) and (
                best is None or sim.step_ms < best.objective_ms):
            best = SolveResult(schedule, SolveStatus.HEURISTIC, name, sim.step_ms, 0.0, 0.0, sim.peak_bytes)
    for r in fitting_heuristics(problem, mem_budget_bytes, seed=seed):
        if exceeds_cap(problem, r.schedule, max_bucket_bytes):
            continue
        if best is None or r.objective_ms < best.objective_ms:
            best = r
    if best is not None:
        logger.info("warm start: %s, %.3f ms", best.solver, best.objective_ms)
    return best
