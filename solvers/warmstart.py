"""Warm starts: the one place that turns heuristics (and a user's hint) into starting points.

The solve loop (:mod:`solvers.driver`) starts every model from the first of
:func:`warm_starts`, the fastest that fits of the hint, the extra starts, the heuristics and
two plans of our own:

- :func:`grouped_fsdp2`, FSDP2-like with several blocks per bucket: a part of the decision
  space the window search does not reach from one bucket per block (merging one pair of
  blocks' buckets shifts the pipeline and loses; merging every pair wins, so no local move
  leads there);
- :func:`fitted_fsdp2`, FSDP2-like a hair over the budget moved under it at its peak
  (:func:`fit_by_delays`), where the heuristic's own ladder gives up a whole kind of overlap.

When the first search converges early, the loop searches again from :func:`other_family`.
The per-layer template (:mod:`solvers.decompose`) copies the steady state of
:func:`unconstrained_schedules`; the API falls back to :func:`best_warm_start` when a solve
fails.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule, SolveResult, SolveStatus, Step
from solvers.core.simulator import SimResult, simulate
from solvers.heuristics import HEURISTICS, BlockGroups, FSDP2Config, evaluate, fsdp2_blocks, fsdp2_schedule

logger = logging.getLogger(__name__)

#: blocks per bucket that :func:`grouped_fsdp2` tries
GROUP_SIZES = (2, 3, 4)
#: name of :func:`grouped_fsdp2`'s result
GROUPED = "fsdp2-grouped"
#: name of :func:`fitted_fsdp2`'s result
FITTED = "fsdp2-fitted"
#: a plan over the budget by at most this share of it is worth moving under it (:func:`fit_by_delays`)
NEAR_MISS = 0.02
#: how many of the fastest near-miss groupings :func:`grouped_fsdp2` tries to move under the budget
REPAIRED = 3


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
    :func:`solvers.registry.solve_budgets`), the heuristics, :func:`grouped_fsdp2` and
    :func:`fitted_fsdp2`. Ties keep the earlier one (hint first, then the extra starts, then
    the heuristics: FSDP2-like, the per-block plan, is always among them)."""
    found: list[SolveResult] = []
    given = [("hint", hint)] if hint is not None else []
    given += [(f"start {i}", s) for i, s in enumerate(extra_starts)]
    for name, schedule in given:
        sim = simulate(problem.dag, schedule, problem=problem)
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            found.append(SolveResult(schedule, SolveStatus.HEURISTIC, name, sim.step_ms, 0.0, 0.0, sim.peak_bytes))
    found += fitting_heuristics(problem, mem_budget_bytes, seed=seed)
    found += [r for r in (grouped_fsdp2(problem, mem_budget_bytes, max_bucket_bytes=max_bucket_bytes),
                          fitted_fsdp2(problem, mem_budget_bytes)) if r is not None]
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
    The :data:`REPAIRED` fastest groupings that miss the budget by at most
    :data:`NEAR_MISS` of it and would beat the best that fits are moved under it by
    :func:`fit_by_delays` when they can be; one move at the peak of the chosen plan is kept
    when it is faster too (splitting the root's merged norm and output, whose copy-out holds
    the output's buffer twice at the end of a forward).
    """
    n_blocks = len({b for b in fsdp2_blocks(problem).values() if b.startswith(("block:", "layers."))})
    if n_blocks < 3:
        return None
    t0 = time.perf_counter()
    starts = sorted({s for s in (0, 1, n_blocks // 4, n_blocks // 2, 3 * n_blocks // 4) if s < n_blocks - 1})
    base = FSDP2Config()
    best: tuple[float, FSDP2Config, Schedule, SimResult] | None = None
    near: list[tuple[float, int, FSDP2Config, Schedule]] = []  # (step, order, config, plan) over the budget
    tried: set[FSDP2Config] = set()

    def consider(cfg: FSDP2Config) -> None:
        nonlocal best
        if cfg in tried:
            return
        tried.add(cfg)
        schedule = fsdp2_schedule(problem, cfg)
        if exceeds_cap(problem, schedule, max_bucket_bytes):
            return
        sim = simulate(problem.dag, schedule, problem=problem)
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            if best is None or sim.step_ms < best[0]:
                best = (sim.step_ms, cfg, schedule, sim)
        elif cfg != base and sim.peak_bytes <= mem_budget_bytes * (1 + NEAR_MISS):
            near.append((sim.step_ms, len(near), cfg, schedule))

    consider(base)
    for i, field in enumerate(("gather_groups", "reduce_groups", "gather_groups")):
        current = best[1] if best is not None else base
        if i == 2 and current.reduce_groups == base.reduce_groups:
            break  # the reduce-scatters kept one block per bucket: the first pass stands
        for size in GROUP_SIZES:
            for start in starts:
                consider(dataclasses.replace(current, **{field: BlockGroups(size, start)}))
    note = ""
    for step_ms, _, cfg, plan in sorted(near)[:REPAIRED]:
        if best is not None and step_ms >= best[0]:
            break
        fitted = fit_by_delays(problem, plan, mem_budget_bytes)
        if fitted is not None:
            fsim = simulate(problem.dag, fitted, problem=problem)
            if best is None or fsim.step_ms < best[0]:
                best, note = (fsim.step_ms, cfg, fitted, fsim), "; moved under the budget at its peak"
    if best is None or best[1] == base:
        return None
    step_ms, cfg, schedule, sim = best
    lower = fit_by_delays(problem, schedule, sim.peak_bytes - 1, max_moves=1, peel=True)
    if lower is not None and (lower_ms := simulate(problem.dag, lower, problem=problem).step_ms) < step_ms:
        step_ms, schedule, note = lower_ms, lower, note or "; a move at its peak lowered it and gained"
    logger.info("grouped FSDP2-like start: %s%s, %.3f ms (%d tried)", cfg, note, step_ms, len(tried))
    return evaluate(problem, schedule, GROUPED, SolveStatus.HEURISTIC, t0,
                    notes=(f"all-gathers {cfg.gather_groups}, reduce-scatters {cfg.reduce_groups}{note}",))


def fitted_fsdp2(problem: Problem, mem_budget_bytes: int | None) -> SolveResult | None:
    """FSDP2-like (one bucket per block, one ahead) over the budget by at most :data:`NEAR_MISS`
    of it, moved under it by :func:`fit_by_delays`; None when it fits as it is (it is then a
    heuristic's start), misses by more, or cannot be moved under. FSDP2-like's own ladder
    gives up a whole kind of overlap (prefetch, reduce-scatter overlap) for a few bytes."""
    if mem_budget_bytes is None:
        return None
    t0 = time.perf_counter()
    plan = fsdp2_schedule(problem)
    peak = simulate(problem.dag, plan, problem=problem).peak_bytes
    if peak <= mem_budget_bytes or peak > mem_budget_bytes * (1 + NEAR_MISS):
        return None
    fitted = fit_by_delays(problem, plan, mem_budget_bytes)
    if fitted is None:
        return None
    return evaluate(problem, fitted, FITTED, SolveStatus.HEURISTIC, t0, notes=("moved under the budget at its peak",))


def fit_by_delays(problem: Problem, schedule: Schedule, mem_budget_bytes: int, *,
                  max_moves: int = 8, peel: bool = False) -> Schedule | None:
    """``schedule`` moved under ``mem_budget_bytes`` by a few local moves at its peak, or None.

    Each move takes one movable bucket that holds memory at the simulated peak step and
    shortens its life across it: an all-gather issued before the peak is issued after the
    next compute node instead (its buffer no longer overlaps the peak), a reduce-scatter in
    flight is waited before the peak's step (its input freed sooner), and with ``peel`` a merged
    bucket issued or waited across the peak gives up its first or last member to a bucket of its
    own at the same steps (a merged all-gather's copy-out at its wait holds its buffer twice).
    Peeling is off by default: where the copy-out sets our peak, torch's MemoryTracker counts
    the buffer once either way, so on llama3-8b's forward a peeled plan 250 MiB under our peak
    was 8 KiB over the tracker's (the budget is held on all three counts). Of the moves that lower
    the peak, the fastest that fits is taken, else the one with the lowest peak; at most
    ``max_moves`` moves. A schedule a few bytes over the budget (a heuristic's plan against a
    baseline's peak) so keeps all its prefetches but one.
    """
    sim = simulate(problem.dag, schedule, problem=problem)
    for _ in range(max_moves):
        if sim.peak_bytes <= mem_budget_bytes:
            return schedule
        best: tuple[tuple, Schedule, SimResult] | None = None
        for cand in _peak_moves(problem, schedule, sim.peak_step, peel):
            csim = simulate(problem.dag, cand, problem=problem)
            if csim.peak_bytes >= sim.peak_bytes:
                continue
            fits = csim.peak_bytes <= mem_budget_bytes
            key = (not fits, csim.step_ms if fits else csim.peak_bytes, csim.step_ms)
            if best is None or key < best[0]:
                best = (key, cand, csim)
        if best is None:
            return None
        _, schedule, sim = best
    return schedule if sim.peak_bytes <= mem_budget_bytes else None


def _peak_moves(problem: Problem, schedule: Schedule, k: int, peel: bool) -> list[Schedule]:
    """Schedules one move away from ``schedule`` (see :func:`fit_by_delays`) at step ``k``."""
    steps = list(schedule.steps)
    where = {(s.kind, s.ref): i for i, s in enumerate(steps) if s.kind != "node"}
    out = []
    for b, bucket in enumerate(schedule.buckets):
        c = problem.colls[bucket.members[0]]
        i, w = where[("issue", b)], where[("wait", b)]
        if not c.movable or not i <= k <= w:
            continue
        if peel and len(bucket.members) > 1:
            out += [_peeled(schedule, b, i, w, first) for first in (True, False)]
        if k == w:
            continue
        moved = list(steps)
        if c.coll_type == "all_gather":
            nxt = next((j for j in range(max(i, k) + 1, w) if steps[j].kind == "node"), None)
            if nxt is None:
                continue
            step = moved.pop(i)
            moved.insert(nxt, step)  # after the node: ``nxt`` shifted down by the pop
        elif i < k:
            step = moved.pop(w)
            moved.insert(k, step)
        else:
            continue
        out.append(Schedule(schedule.buckets, tuple(moved)))
    return out


def _peeled(schedule: Schedule, b: int, i: int, w: int, first: bool) -> Schedule:
    """``schedule`` with bucket ``b``'s first (or last) member in a bucket of its own, issued
    and waited right after ``b`` (steps ``i`` and ``w``)."""
    members = schedule.buckets[b].members
    alone, rest = ((members[0],), members[1:]) if first else ((members[-1],), members[:-1])
    buckets = list(schedule.buckets)
    buckets[b] = Bucket(rest)
    buckets.append(Bucket(alone))
    steps = list(schedule.steps)
    steps.insert(w + 1, Step("wait", len(buckets) - 1))
    steps.insert(i + 1, Step("issue", len(buckets) - 1))
    return Schedule(tuple(buckets), tuple(steps))
