"""Decomposition of large graphs: per-layer templates, then rolling windows.

Both run over a *window solver*: a callable that solves a small model of
:mod:`solvers.model` in which some collectives (``free``, whole buckets of the incumbent) are
decided and every other bucket of the incumbent is a fixed interval (CP-SAT's or the MILP's
``solve_window``). Only simulated improvements that fit the budget replace the incumbent, so
the result fits whenever the start does.

1. Template (:func:`template_search`), for graphs whose layers repeat (:mod:`solvers.periodic`):
   a window over ``template_window_blocks`` blocks around the middle, each block's decisions
   tied to the previous block's shifted by one period (a steady state), is solved and its
   middle block copied onto every layer, or onto the layers with the most memory headroom.
2. Windows (:func:`window_search`): each window frees the incumbent's buckets that hold a run
   of ``lns_window_members`` consecutive collectives (in order of need); windows are visited
   most-exposed first, sweep after sweep, until a sweep brings no gain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from solvers.config import SearchConfig
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule
from solvers.core.simulator import SimResult, simulate
from solvers.model import Anchors
from solvers.periodic import Periodicity, at_traced, detect_periodicity, isolate, replicate
from solvers.warmstart import unconstrained_schedules

logger = logging.getLogger(__name__)

#: ``(problem, mem_budget_bytes, schedule, free, limit_s, seed, num_workers, anchors, ties=None)
#: -> Schedule | None``: the window's best schedule (not yet simulated), or None
WindowSolver = Callable[..., "Schedule | None"]


def search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver, model_budget_bytes: int | None,
           start: Schedule, deadline: float, seed: int, num_workers: int, mem_budget_bytes: int | None, *,
           templates: bool = True, history: list | None = None) -> tuple[Schedule, SimResult, list[str]]:
    """Template (when ``templates``), then windows, from ``start``. ``model_budget_bytes`` is
    the budget the models see (tightened by the driver's repair), ``mem_budget_bytes`` the one
    simulated schedules must fit. Returns the best schedule, its simulation and notes."""
    anchors = Anchors(problem)
    notes = []
    schedule = start
    sim = simulate(problem.dag, schedule, problem=problem)
    if history is not None:
        history.append((time.perf_counter(), sim.step_ms))
    search_ = _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, deadline, seed,
                      num_workers, anchors, history)
    if templates and cfg.template_rounds:
        schedule, sim, n_templates = search_.templates(schedule, sim)
        if n_templates:
            notes.append(f"per-layer template: {n_templates} round(s) copied a solved block onto the others")
    schedule, sim, sweeps = search_.windows(schedule, sim)
    notes.append(f"rolling-window search: {sweeps} sweep(s) of {cfg.lns_window_members}-collective windows")
    return schedule, sim, notes


def template_search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                    model_budget_bytes: int | None, schedule: Schedule, sim: SimResult, deadline: float, seed: int,
                    num_workers: int, mem_budget_bytes: int | None,
                    anchors: Anchors | None = None) -> tuple[Schedule, SimResult, int]:
    """Step 1 alone (see :meth:`_Search.templates`): (schedule, simulation, templates accepted)."""
    return _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, deadline, seed, num_workers,
                   anchors or Anchors(problem), None).templates(schedule, sim)


def window_search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                  model_budget_bytes: int | None, schedule: Schedule, sim: SimResult, deadline: float, seed: int,
                  num_workers: int, mem_budget_bytes: int | None,
                  anchors: Anchors | None = None) -> tuple[Schedule, SimResult, int]:
    """Step 2 alone (see :meth:`_Search.windows`): (schedule, simulation, sweeps)."""
    return _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, deadline, seed, num_workers,
                   anchors or Anchors(problem), None).windows(schedule, sim)


def better(csim: SimResult, sim: SimResult, mem_budget_bytes: int | None) -> bool:
    """``csim`` fits the budget and is faster than ``sim`` (or as fast with a lower peak)."""
    if mem_budget_bytes is not None and csim.peak_bytes > mem_budget_bytes:
        return False
    return csim.step_ms < sim.step_ms - 1e-6 or (
        abs(csim.step_ms - sim.step_ms) <= 1e-6 and csim.peak_bytes < sim.peak_bytes
    )


def window_order(problem: Problem) -> list[str]:
    """Movable collectives in the order the graph needs them (need for all-gathers, gradient
    ready for reduce-scatters)."""
    names = [c.name for c in problem.colls.values() if c.movable]
    return sorted(
        names,
        key=lambda n: (
            problem.colls[n].needed if problem.colls[n].coll_type == "all_gather" else problem.colls[n].ready,
            problem.colls[n].traced_issue,
        ),
    )


def bucket_free(schedule: Schedule, names: Iterable[str]) -> set[str]:
    """``names`` and every collective sharing a bucket with one of them in ``schedule``."""
    bucket_of = schedule.bucket_of()
    return {m for b in {bucket_of[n] for n in names} for m in schedule.buckets[b].members}


class _Search:
    """The fixed arguments of one decomposition: problem, budgets, deadline, window solver."""

    def __init__(self, problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                 model_budget_bytes: int | None, mem_budget_bytes: int | None, deadline: float, seed: int,
                 num_workers: int, anchors: Anchors, history: list | None):
        self.p = problem
        self.cfg = cfg
        self.solve_window = window_solver
        self.model_budget_bytes = model_budget_bytes
        self.mem_budget_bytes = mem_budget_bytes
        self.deadline = deadline
        self.seed = seed
        self.num_workers = num_workers
        self.anchors = anchors
        self.history = history

    def _accept(self, schedule: Schedule, sim: SimResult, cand: Schedule, csim: SimResult):
        if better(csim, sim, self.mem_budget_bytes):
            if self.history is not None:
                self.history.append((time.perf_counter(), csim.step_ms))
            return cand, csim, True
        return schedule, sim, False

    # -- per-layer template ------------------------------------------------------------------
    def templates(self, schedule: Schedule, sim: SimResult) -> tuple[Schedule, SimResult, int]:
        """Rounds of the per-layer template (see the module docstring). Under a budget, the
        unconstrained heuristics' middle blocks are tried first the same way (a budget often
        binds on a few layers only: the others can take the unconstrained pattern). Rounds stop
        when one does not improve the simulated step time. Returns (schedule, simulation,
        number of templates accepted)."""
        p, cfg = self.p, self.cfg
        per = detect_periodicity(p, min_blocks=cfg.template_min_blocks)
        if per is None:
            return schedule, sim, 0
        accepted = 0
        if self.mem_budget_bytes is not None:
            for name, free_run in unconstrained_schedules(p, seed=self.seed):
                if self.deadline - time.perf_counter() <= 1.0:
                    break
                schedule, sim, improved = self._copy_best(per, schedule, sim, free_run, name)
                accepted += improved
        mid = per.middle()
        half = cfg.template_window_blocks // 2
        window_blocks = [b for b in range(mid - half, mid + half + 1) if b in per.members]
        for round_ in range(cfg.template_rounds):
            left = self.deadline - time.perf_counter()
            if left <= 1.0:
                break
            cand = self._template_window(per, schedule, window_blocks, min(left * 0.5, cfg.template_window_s))
            if cand is None:
                break
            schedule, sim, improved = self._copy_best(per, schedule, sim, cand, "window")
            logger.info("template round %d (blocks %d..%d, period %d): step %.3f ms, peak %.3f GiB%s",
                        round_ + 1, per.blocks[0], per.blocks[-1], per.period, sim.step_ms, sim.peak_bytes / 2**30,
                        "" if improved else " (no gain)")
            if not improved:
                break
            accepted += 1
        return schedule, sim, accepted

    def _template_window(self, per: Periodicity, schedule: Schedule, window_blocks: list[int],
                         limit_s: float) -> Schedule | None:
        """Solve the tied window over ``window_blocks``: it decides exactly their collectives
        (buckets reaching outside are split), starting from the middle block's decisions on
        every window block, or else from the traced positions there (both repeat exactly, so
        the tied model can complete them)."""
        p = self.p
        free = {n for b in window_blocks for n in per.members[b].values()}
        base = replicate(p, per, isolate(p, schedule, free), per.middle(), window_blocks)
        if base is None or not _ties_hold(base, per, window_blocks):
            base = at_traced(p, schedule, free) or isolate(p, schedule, free)
        pairs = [(per.members[b][r], per.members[b + 1][r]) for b in window_blocks[:-1] for r in per.members[b]]
        return self.solve_window(p, self.model_budget_bytes, base, free, limit_s, self.seed, self.num_workers,
                                 self.anchors, ties=(pairs, per.period))

    def _copy_best(self, per: Periodicity, schedule: Schedule, sim: SimResult, source: Schedule,
                   label: str) -> tuple[Schedule, SimResult, bool]:
        """Copy ``source``'s middle block onto the incumbent's blocks, all of them or those with
        the most memory headroom (3/4, 1/2, 1/4); keep the fastest copy that fits."""
        p = self.p
        order = sorted(per.blocks, key=lambda b: (_block_peak(p, per, b, schedule, sim), b))
        improved = False
        for frac in (1.0, 0.75, 0.5, 0.25):
            targets = order[: max(1, int(len(order) * frac))]
            tmpl = replicate(p, per, source, per.middle(), targets, onto=schedule)
            if tmpl is None:
                break
            tsim = simulate(p.dag, tmpl, problem=p)
            logger.debug("%s template on %d blocks: step %.3f ms, peak %.3f GiB", label, len(targets), tsim.step_ms,
                         tsim.peak_bytes / 2**30)
            schedule, sim, ok = self._accept(schedule, sim, tmpl, tsim)
            improved |= ok
        return schedule, sim, improved

    # -- rolling windows ---------------------------------------------------------------------
    def windows(self, schedule: Schedule, sim: SimResult) -> tuple[Schedule, SimResult, int]:
        """Sweeps of windows, most exposed first, until one brings no gain or time is up.
        Returns the best schedule, its simulation and the number of sweeps."""
        p, cfg = self.p, self.cfg
        order = window_order(p)
        k = cfg.lns_window_members
        stride = max(1, k // 2)
        starts = list(range(0, max(1, len(order) - k + stride), stride))
        sweeps = 0
        for sweep in range(cfg.lns_max_sweeps):
            improved = False
            sweeps += 1
            # most exposed communication first (ties: graph order), from the incumbent's run
            bucket_of = schedule.bucket_of()
            exposed = {n: sim.bucket_exposed_ms.get(b, 0.0) for n, b in bucket_of.items()}
            visit = sorted(starts, key=lambda s0: (-sum(exposed.get(n, 0.0) for n in order[s0: s0 + k]), s0))
            for i, s0 in enumerate(visit):
                left = self.deadline - time.perf_counter()
                if left <= 0.2:
                    return schedule, sim, sweeps
                limit = min(left, max(cfg.lns_min_window_s, left / (len(visit) - i) * 0.8))
                free = bucket_free(schedule, order[s0: s0 + k])
                cand = self.solve_window(p, self.model_budget_bytes, schedule, free, limit, self.seed,
                                         self.num_workers, self.anchors)
                if cand is None:
                    continue
                schedule, sim, ok = self._accept(schedule, sim, cand, simulate(p.dag, cand, problem=p))
                improved |= ok
            logger.info("window sweep %d: step %.3f ms, peak %.3f GiB", sweep + 1, sim.step_ms, sim.peak_bytes / 2**30)
            if not improved:
                break
        return schedule, sim, sweeps


def _ties_hold(schedule: Schedule, per: Periodicity, blocks: list[int]) -> bool:
    """Every role of ``blocks`` is issued (and waited) one period after the previous block's,
    in a bucket of the same size: the start satisfies the template window's ties."""
    issue, wait = schedule.positions()
    bucket_of = schedule.bucket_of()
    for b in blocks[:-1]:
        for role, n in per.members[b].items():
            x, y = bucket_of[n], bucket_of[per.members[b + 1][role]]
            if (issue[y] - issue[x] != per.period or wait[y] - wait[x] != per.period
                    or len(schedule.buckets[x].members) != len(schedule.buckets[y].members)):
                return False
    return True


def _block_peak(problem: Problem, per: Periodicity, block: int, schedule: Schedule, sim: SimResult) -> int:
    """Highest simulated live bytes of ``schedule`` between the first and the last need of
    ``block``'s collectives (the graph's end excluded)."""
    needs = [problem.colls[n].needed for n in per.members[block].values() if problem.colls[n].needed < problem.n]
    if not needs or not sim.step_live_bytes:
        return 0
    lo, hi = min(needs), max(needs)
    gap, peak = 0, 0
    for s, live in zip(schedule.steps, sim.step_live_bytes):
        if lo <= gap <= hi:
            peak = max(peak, live)
        if s.kind == "node":
            gap += 1
    return peak
