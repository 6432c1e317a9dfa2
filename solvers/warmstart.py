"""Warm starts: the one place that turns heuristics (and a user's hint) into starting points.

The solve loop (:mod:`solvers.driver`) starts every model from :func:`best_warm_start`: the
fastest of the hint, the extra starts, the heuristics and :func:`grouped_fsdp2` (FSDP2-like
with several blocks per bucket, a part of the decision space the window search cannot reach
from one bucket per block: merging two blocks' buckets pays only when every pair is merged,
so no single local move gains); the
per-layer template (:mod:`solvers.decompose`) copies the steady state of
:func:`unconstrained_schedules`; the API falls back to :func:`fitting_heuristics` when a solve
fails.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from solvers.core.problem import Problem
from solvers.core.schedule import InfeasibleBudgetError, Schedule, SolveResult, SolveStatus
from solvers.core.simulator import simulate
from solvers.heuristics import HEURISTICS, BlockGroups, FSDP2Config, evaluate, fsdp2_blocks, fsdp2_schedule

logger = logging.getLogger(__name__)

#: blocks per bucket that :func:`grouped_fsdp2` tries
GROUP_SIZES = (2, 3, 4)
#: name of :func:`grouped_fsdp2`'s result
GROUPED = "fsdp2-grouped"


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


def warm_starts(problem: Problem, hint: Schedule | None, mem_budget_bytes: int | None, *, seed: int = 0,
                max_bucket_bytes: int | None = None, extra_starts: Sequence[Schedule] = ()) -> list[SolveResult]:
    """Every start that fits the budget and the bucket cap, fastest (simulated) first: ``hint``,
    ``extra_starts`` (e.g. the best schedule found at a smaller budget, see
    :func:`solvers.registry.solve_budgets`), the heuristics and :func:`grouped_fsdp2`. Ties keep
    the earlier one (hint first, then the extra starts, then the heuristics: FSDP2-like, the
    per-block plan, is always among them)."""
    found: list[SolveResult] = []
    given = [("hint", hint)] if hint is not None else []
    given += [(f"start {i}", s) for i, s in enumerate(extra_starts)]
    for name, schedule in given:
        sim = simulate(problem.dag, schedule, problem=problem)
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            found.append(SolveResult(schedule, SolveStatus.HEURISTIC, name, sim.step_ms, 0.0, 0.0, sim.peak_bytes))
    found += fitting_heuristics(problem, mem_budget_bytes, seed=seed)
    grouped = grouped_fsdp2(problem, mem_budget_bytes, max_bucket_bytes=max_bucket_bytes)
    if grouped is not None:
        found.append(grouped)
    found = [r for r in found if not exceeds_cap(problem, r.schedule, max_bucket_bytes)]
    return sorted(found, key=lambda r: r.objective_ms)  # stable: ties keep the order above


def best_warm_start(problem: Problem, hint: Schedule | None, mem_budget_bytes: int | None, *, seed: int = 0,
                    max_bucket_bytes: int | None = None, extra_starts: Sequence[Schedule] = ()) -> SolveResult | None:
    """The first of :func:`warm_starts` (the fastest start that fits); None when none fits."""
    starts = warm_starts(problem, hint, mem_budget_bytes, seed=seed, max_bucket_bytes=max_bucket_bytes,
                         extra_starts=extra_starts)
    if starts:
        logger.info("warm start: %s, %.3f ms", starts[0].solver, starts[0].objective_ms)
    return starts[0] if starts else None


def other_family(starts: Sequence[SolveResult]) -> SolveResult | None:
    """The fastest of ``starts`` (fastest first, as :func:`warm_starts` gives them) from the other
    family than the first: one bucket per block or so (the heuristics, a hint) when the first is
    :func:`grouped_fsdp2`'s, and that one otherwise; None when there is none. The solve loop
    searches from it too when the first search converges with work left
    (:mod:`solvers.driver`): from different bucket granularities the window search reaches
    different schedules, and the faster start does not always lead to the faster end."""
    if not starts:
        return None
    grouped = starts[0].solver == GROUPED
    return next((r for r in starts[1:] if (r.solver == GROUPED) != grouped), None)


def grouped_fsdp2(problem: Problem, mem_budget_bytes: int | None, *,
                  max_bucket_bytes: int | None = None) -> SolveResult | None:
    """The fastest FSDP2-like schedule with several blocks per bucket that fits the budget and
    the bucket cap (:class:`solvers.heuristics.BlockGroups`); None when there are fewer than
    three blocks or no grouping is faster than one bucket per block.

    Searched by coordinates, each step simulated: the all-gathers' grouping (sizes
    :data:`GROUP_SIZES`, grouping from the first block or from a quarter, half or three
    quarters of the way: memory is tight at one end of a pass, where the activations peak), then
    the reduce-scatters' given it, then, if that grouped them, the all-gathers' again. At most
    46 simulations (0.3 s on llama3-8b's 8-layer backward, 1.4 s at 32 layers); deterministic.
    """
    n_blocks = len({b for b in fsdp2_blocks(problem).values() if b.startswith(("block:", "layers."))})
    if n_blocks < 3:
        return None
    t0 = time.perf_counter()
    starts = sorted({s for s in (0, 1, n_blocks // 4, n_blocks // 2, 3 * n_blocks // 4) if s < n_blocks - 1})
    base = FSDP2Config()
    best: tuple[float, FSDP2Config] | None = None
    tried: set[FSDP2Config] = set()

    def consider(cfg: FSDP2Config) -> None:
        nonlocal best
        if cfg in tried:
            return
        tried.add(cfg)
        schedule = fsdp2_schedule(problem, cfg)
        sim = simulate(problem.dag, schedule, problem=problem)
        fits = mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes
        if fits and not exceeds_cap(problem, schedule, max_bucket_bytes) and (best is None or sim.step_ms < best[0]):
            best = (sim.step_ms, cfg)

    consider(base)
    for i, field in enumerate(("gather_groups", "reduce_groups", "gather_groups")):
        current = best[1] if best is not None else base
        if i == 2 and current.reduce_groups == base.reduce_groups:
            break  # the reduce-scatters kept one block per bucket: the first pass stands
        for size in GROUP_SIZES:
            for start in starts:
                consider(dataclasses.replace(current, **{field: BlockGroups(size, start)}))
    if best is None or best[1] == base:
        return None
    cfg = best[1]
    logger.info("grouped FSDP2-like start: %s, %.3f ms (%d tried)", cfg, best[0], len(tried))
    return evaluate(problem, fsdp2_schedule(problem, cfg), GROUPED, SolveStatus.HEURISTIC, t0,
                    notes=(f"all-gathers {cfg.gather_groups}, reduce-scatters {cfg.reduce_groups}",))
