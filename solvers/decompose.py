"""Decomposition of large graphs: per-layer templates, then rolling windows.

Both run over a *window solver*: a callable that solves a small model of
:mod:`solvers.model` in which some collectives (``free``, whole buckets of the incumbent) are
decided and every other bucket of the incumbent is a fixed interval (CP-SAT's or the MILP's
``solve_window``). Only simulated improvements that fit the budget replace the incumbent, so
the result fits whenever the start does.

0. Starts: the per-block plan (FSDP2-like, one bucket per block, shrunk to the budget) replaces
   the start when it simulates faster, so no start leaves the search above it; buckets spanning
   more than ``split_blocks_over`` blocks are split at block boundaries (the *split move*: a
   window frees whole buckets, and one bucket of everything would free the whole graph). The
   split incumbent is searched even when it simulates slower; the best schedule seen is kept.
1. Template (:func:`template_search`), for graphs whose layers repeat (:mod:`solvers.periodic`,
   one block per period or ``k`` for alternating layers): a window over about three periods
   around the middle, each block's decisions tied to those one period earlier (a steady
   state), is solved from the fastest copy of one of the incumbent's periods onto it (under a
   budget the middle period is often one that gave up its prefetch); the window's result is a
   candidate as it is, and its middle period is copied onto every layer, or onto the layers
   with the most memory headroom. Rounds repeat from the new incumbent until one gains nothing
   or would start where an earlier one did.
2. Windows (:func:`window_search`): each window frees the incumbent's buckets that hold a run
   of ``lns_window_members`` consecutive collectives (in order of need), each of them free to
   move only within ``lns_radius_anchors`` of its incumbent position or as far as the chain
   neighbour it could merge with (a trust region: the small model searches far better in the
   same deterministic time; sweeps compound the moves); windows are visited
   most-exposed first (those exposing no communication are skipped: ``lns_min_exposed_ms``),
   sweep after sweep, until a sweep brings no gain. A window whose
   neighbourhood has not changed since it last failed is skipped (the solve would repeat).
   When a window is accepted on repeating layers, each whole period it decided is copied onto
   the other blocks as the template's is (kept only when faster): one window's find reaches
   every layer without a window per layer.

Determinism: every limit is a fixed deterministic budget (``lns_window_s``,
``template_window_s``) charged against the solve's :class:`WorkBudget`; the wall clock is only
a safety cap (:attr:`WorkBudget.cap_hit`), reported when hit.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable

from solvers.config import SearchConfig
from solvers.core.problem import Problem
from solvers.core.schedule import InfeasibleBudgetError, Schedule
from solvers.core.simulator import SimResult, simulate
from solvers.heuristics import solve_fsdp2
from solvers.model import Anchors
from solvers.periodic import Periodicity, at_traced, detect_periodicity, isolate, replicate, split_at_blocks
from solvers.warmstart import exceeds_cap, unconstrained_schedules

logger = logging.getLogger(__name__)

#: ``(problem, mem_budget_bytes, schedule, free, limit_s, seed, num_workers, anchors, ties=None)
#: -> Schedule | None``: the window's best schedule (not yet simulated), or None. ``limit_s`` is
#: a deterministic limit (the backend converts it to its solver's deterministic clock)
WindowSolver = Callable[..., "Schedule | None"]


class WorkBudget:
    """The deterministic work left to one solve, and its wall-clock safety cap.

    Every solve asks for a fixed limit and is charged that limit, whatever wall time it takes,
    so the sequence of solves (hence the schedule) is the same on every rank. The wall clock
    only stops a starved or stuck process: ``cap_hit`` then says the result is no longer
    rank-deterministic.
    """

    def __init__(self, work_s: float, wall_cap_s: float):
        self.left_s = float(work_s)
        self.wall_deadline = time.perf_counter() + wall_cap_s
        self.cap_hit = False

    def take(self, want_s: float) -> float:
        """Grant (and charge) ``want_s`` or what is left, whichever is less."""
        grant = max(0.0, min(want_s, self.left_s))
        self.left_s -= grant
        return grant

    def exhausted(self, least_s: float = 1e-3) -> bool:
        """Less than ``least_s`` left, or the wall-clock cap passed (recorded in ``cap_hit``)."""
        if time.perf_counter() > self.wall_deadline:
            if not self.cap_hit:
                logger.warning("wall-clock safety cap reached: the search stops early; the schedule may differ "
                               "between ranks (rank agreement in scheduler.consensus catches that)")
            self.cap_hit = True
            return True
        return self.left_s < least_s


CAP_NOTE = ("the wall-clock safety cap stopped the search before its deterministic limits: the schedule is not "
            "rank-deterministic (the API's rank agreement settles it)")


def search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver, model_budget_bytes: int | None,
           start: Schedule, budget: WorkBudget, seed: int, num_workers: int, mem_budget_bytes: int | None, *,
           templates: bool = True, history: list | None = None) -> tuple[Schedule, SimResult, list[str]]:
    """Starts (0), template (1, when ``templates``), then windows (2), from ``start``.
    ``model_budget_bytes`` is the budget the models see (tightened by the driver's repair),
    ``mem_budget_bytes`` the one simulated schedules must fit. Returns the best schedule, its
    simulation and notes."""
    notes: list[str] = []
    search_ = _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, budget, seed,
                      num_workers, Anchors(problem), history)
    sim = search_.start(start, notes)
    schedule = sim.schedule
    if templates and cfg.template_rounds:
        schedule, sim, n_templates = search_.templates(schedule, sim)
        if n_templates:
            notes.append(f"per-layer template: {n_templates} round(s) copied a solved block onto the others")
    schedule, sim = search_.split(schedule, sim, notes)
    schedule, sim, sweeps = search_.windows(schedule, sim)
    best, best_sim = search_.best
    notes.append(f"rolling-window search: {sweeps} sweep(s) of {cfg.lns_window_members}-collective windows")
    return best, best_sim, notes


def template_search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                    model_budget_bytes: int | None, schedule: Schedule, sim: SimResult, work_s: float, seed: int,
                    num_workers: int, mem_budget_bytes: int | None,
                    anchors: Anchors | None = None) -> tuple[Schedule, SimResult, int]:
    """Step 1 alone (see :meth:`_Search.templates`), with ``work_s`` of deterministic work:
    (schedule, simulation, templates accepted)."""
    budget = WorkBudget(work_s, work_s * 100)
    return _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, budget, seed, num_workers,
                   anchors or Anchors(problem), None).templates(schedule, sim)


def window_search(problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                  model_budget_bytes: int | None, schedule: Schedule, sim: SimResult, work_s: float, seed: int,
                  num_workers: int, mem_budget_bytes: int | None,
                  anchors: Anchors | None = None) -> tuple[Schedule, SimResult, int]:
    """Step 2 alone (see :meth:`_Search.windows`), with ``work_s`` of deterministic work:
    (schedule, simulation, sweeps)."""
    budget = WorkBudget(work_s, work_s * 100)
    return _Search(problem, cfg, window_solver, model_budget_bytes, mem_budget_bytes, budget, seed, num_workers,
                   anchors or Anchors(problem), None).windows(schedule, sim)


def better(csim: SimResult, sim: SimResult, mem_budget_bytes: int | None) -> bool:
    """``csim`` fits the budget and is faster than ``sim`` (or as fast with a lower peak), or
    ``sim`` does not fit the budget."""
    if mem_budget_bytes is not None and csim.peak_bytes > mem_budget_bytes:
        return False
    if mem_budget_bytes is not None and sim.peak_bytes > mem_budget_bytes:
        return True
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


def neighbourhood(schedule: Schedule, names: Iterable[str]) -> tuple:
    """The buckets of ``schedule`` holding ``names``, with their issue and wait gaps: a window
    over ``names`` whose neighbourhood is unchanged solves (almost) the same model again."""
    issue, wait = schedule.positions()
    bucket_of = schedule.bucket_of()
    return tuple(sorted((schedule.buckets[b].members, issue[b], wait[b]) for b in {bucket_of[n] for n in names}))


class _Search:
    """The fixed arguments of one decomposition (problem, budgets, window solver) and the best
    schedule seen (the incumbent may be worse after the split move)."""

    def __init__(self, problem: Problem, cfg: SearchConfig, window_solver: WindowSolver,
                 model_budget_bytes: int | None, mem_budget_bytes: int | None, budget: WorkBudget, seed: int,
                 num_workers: int, anchors: Anchors, history: list | None):
        self.p = problem
        self.cfg = cfg
        self.solve_window = window_solver
        self.model_budget_bytes = model_budget_bytes
        self.mem_budget_bytes = mem_budget_bytes
        self.budget = budget
        self.seed = seed
        self.num_workers = num_workers
        self.anchors = anchors
        self.history = history
        self.best: tuple[Schedule, SimResult] | None = None

    @functools.cached_property
    def periodicity(self) -> Periodicity | None:
        """The repeating layers (None: none found); the template and the window copies use it."""
        cfg = self.cfg
        return detect_periodicity(self.p, min_blocks=cfg.template_min_blocks, max_stride=cfg.template_max_period_blocks)

    def _record(self, schedule: Schedule, sim: SimResult) -> None:
        if self.best is None or better(sim, self.best[1], self.mem_budget_bytes):
            self.best = (schedule, sim)
            if self.history is not None:
                self.history.append((time.perf_counter(), sim.step_ms))

    def _accept(self, schedule: Schedule, sim: SimResult, cand: Schedule, csim: SimResult):
        if better(csim, sim, self.mem_budget_bytes):
            self._record(cand, csim)
            return cand, csim, True
        return schedule, sim, False

    # -- starts ------------------------------------------------------------------------------
    def start(self, start: Schedule, notes: list[str]) -> SimResult:
        """(0) ``start``, or the per-block plan when it simulates faster."""
        sim = simulate(self.p.dag, start, problem=self.p)
        self._record(start, sim)
        plan = self._per_block_plan()
        if plan is not None:
            psim = simulate(self.p.dag, plan, problem=self.p)
            if better(psim, sim, self.mem_budget_bytes):
                notes.append("started from the per-block plan (FSDP2-like): it simulates faster than the start")
                self._record(plan, psim)
                return psim
        return sim

    def _per_block_plan(self) -> Schedule | None:
        """FSDP2-like (one bucket per block) shrunk to the budget; None when it cannot fit."""
        try:
            plan = solve_fsdp2(self.p, mem_budget_bytes=self.mem_budget_bytes, seed=self.seed).schedule
        except InfeasibleBudgetError:
            return None
        return None if exceeds_cap(self.p, plan, getattr(self.cfg, "max_bucket_bytes", None)) else plan

    def split(self, schedule: Schedule, sim: SimResult, notes: list[str]) -> tuple[Schedule, SimResult]:
        """(0) The split move: buckets spanning more than ``split_blocks_over`` blocks split at
        block boundaries, at their positions. The split incumbent is kept when it fits, even if
        slower (the windows can then move its pieces); the best schedule seen is kept apart."""
        cand, n_split = split_at_blocks(self.p, schedule, self.cfg.split_blocks_over)
        if not n_split:
            return schedule, sim
        csim = simulate(self.p.dag, cand, problem=self.p)
        if self.mem_budget_bytes is not None and csim.peak_bytes > self.mem_budget_bytes:
            return schedule, sim
        notes.append(f"split {n_split} bucket(s) spanning more than {self.cfg.split_blocks_over} blocks at block "
                     "boundaries before the windows")
        logger.info("split move: %d bucket(s); step %.3f -> %.3f ms", n_split, sim.step_ms, csim.step_ms)
        self._record(cand, csim)
        return cand, csim

    # -- per-layer template ------------------------------------------------------------------
    def templates(self, schedule: Schedule, sim: SimResult) -> tuple[Schedule, SimResult, int]:
        """Rounds of the per-layer template (see the module docstring). Under a budget, the
        unconstrained heuristics' middle blocks are tried first the same way (a budget often
        binds on a few layers only: the others can take the unconstrained pattern). Rounds stop
        when one does not improve the simulated step time. Returns (schedule, simulation,
        number of templates accepted)."""
        p, cfg = self.p, self.cfg
        self._record(schedule, sim)
        per = self.periodicity
        if per is None:
            return schedule, sim, 0
        accepted = 0
        if self.mem_budget_bytes is not None:
            for name, free_run in unconstrained_schedules(p, seed=self.seed):
                schedule, sim, improved = self._copy_best(per, schedule, sim, free_run, name)
                accepted += improved
        window_blocks = _template_blocks(per, cfg.template_window_blocks)
        free = {n for b in window_blocks for n in per.members[b].values()}
        seen: set[tuple] = set()  # the window's decisions in the starts of earlier rounds
        for round_ in range(cfg.template_rounds):
            if self.budget.exhausted():
                break
            base = self._template_start(per, schedule, window_blocks, free)
            if neighbourhood(base, free) in seen:
                break  # the same start again: the solve would repeat
            seen.add(neighbourhood(base, free))
            cand = self._template_window(per, base, window_blocks, free, self.budget.take(cfg.template_window_s))
            if cand is None:
                break
            schedule, sim, improved = self._accept(schedule, sim, cand, simulate(p.dag, cand, problem=p))
            schedule, sim, copied = self._copy_best(per, schedule, sim, cand, "window")
            improved |= copied
            logger.info("template round %d (blocks %d..%d, %d per period of %d): step %.3f ms, peak %.3f GiB%s",
                        round_ + 1, per.blocks[0], per.blocks[-1], per.stride, per.period, sim.step_ms,
                        sim.peak_bytes / 2**30, "" if improved else " (no gain)")
            if not improved:
                break
            accepted += 1
        return schedule, sim, accepted

    def _template_start(self, per: Periodicity, schedule: Schedule, window_blocks: list[int],
                        free: set[str]) -> Schedule:
        """The start of the tied window over ``window_blocks`` (whose collectives are ``free``):
        the fastest periodic copy of one period of ``schedule`` onto every window block
        (:meth:`_template_base`), or else the traced positions there (they repeat exactly, so
        the tied model can complete them)."""
        return (self._template_base(per, schedule, window_blocks, free)
                or at_traced(self.p, schedule, free) or isolate(self.p, schedule, free))

    def _template_window(self, per: Periodicity, base: Schedule, window_blocks: list[int], free: set[str],
                         limit_s: float) -> Schedule | None:
        """Solve the tied window over ``window_blocks`` from ``base``: it decides exactly their
        collectives ``free`` (buckets reaching outside are split), each block tied to the one a
        period earlier."""
        p, k = self.p, per.stride
        pairs = [(per.members[b][r], per.members[b + k][r]) for b in window_blocks if b + k in window_blocks
                 for r in per.members[b]]
        return self.solve_window(p, self.model_budget_bytes, base, free, limit_s, self.seed, self.num_workers,
                                 self.anchors, ties=(pairs, per.period))

    def _template_base(self, per: Periodicity, schedule: Schedule, window_blocks: list[int],
                       free: set[str]) -> Schedule | None:
        """The fastest periodic start of the template window: the decisions of one period of
        the incumbent copied onto every window block, from whichever period simulates fastest
        within the budget (where a budget binds, the middle period is often the one that gave up
        its prefetch); None when no copy is periodic."""
        p = self.p
        iso = isolate(p, schedule, free)
        best = None
        seen: set[tuple] = set()
        for source in per.blocks:
            if source + per.stride - 1 not in per.members:
                continue
            pattern = _period_pattern(per, iso, source)
            if pattern in seen:
                continue  # the same decisions as a period tried already: the same copy
            seen.add(pattern)
            base = replicate(p, per, iso, source, window_blocks)
            if base is None or not _ties_hold(base, per, window_blocks):
                continue
            bsim = simulate(p.dag, base, problem=p)
            if self.mem_budget_bytes is not None and bsim.peak_bytes > self.mem_budget_bytes:
                continue
            if best is None or bsim.step_ms < best[1] - 1e-9:
                best = (base, bsim.step_ms)
        return None if best is None else best[0]

    def _copy_best(self, per: Periodicity, schedule: Schedule, sim: SimResult, source: Schedule,
                   label: str, block: int | None = None) -> tuple[Schedule, SimResult, bool]:
        """Copy ``source``'s period starting at ``block`` (default: the middle one) onto the
        incumbent's blocks, all of them or those with the most memory headroom (3/4, 1/2, 1/4);
        keep the fastest copy that fits."""
        p = self.p
        order = sorted(per.blocks, key=lambda b: (_block_peak(p, per, b, schedule, sim), b))
        improved = False
        for frac in (1.0, 0.75, 0.5, 0.25):
            targets = order[: max(1, int(len(order) * frac))]
            tmpl = replicate(p, per, source, per.middle() if block is None else block, targets, onto=schedule)
            if tmpl is None:
                break
            tsim = simulate(p.dag, tmpl, problem=p)
            logger.debug("%s template on %d blocks: step %.3f ms, peak %.3f GiB", label, len(targets), tsim.step_ms,
                         tsim.peak_bytes / 2**30)
            schedule, sim, ok = self._accept(schedule, sim, tmpl, tsim)
            improved |= ok
        return schedule, sim, improved

    def _propagate(self, schedule: Schedule, sim: SimResult, freed: set[str]) -> tuple[Schedule, SimResult]:
        """After an accepted window: copy each whole period the window decided onto the other
        blocks of the repeating layers, as the template copies its middle period (all blocks or
        those with the most headroom; a copy is kept only when it simulates faster and fits).
        One simulation per copy; on the 16-layer graphs of ``benchmarks/solve_time.py`` it
        reached 202.6 against 203.4 ms on the llama forward and 22.3 against 22.5 ms on the
        alternating backward, both at the traced peak, and changed no other row."""
        per = self.periodicity
        if per is None:
            return schedule, sim
        for s in per.blocks:
            period = range(s, s + per.stride)
            if all(b in per.members and set(per.members[b].values()) <= freed for b in period):
                schedule, sim, _ = self._copy_best(per, schedule, sim, schedule, f"block {s} of a window", block=s)
        return schedule, sim

    # -- rolling windows ---------------------------------------------------------------------
    def windows(self, schedule: Schedule, sim: SimResult) -> tuple[Schedule, SimResult, int]:
        """Sweeps of windows, most exposed first, until one brings no gain or the work budget
        is spent. Returns the best schedule, its simulation and the number of sweeps."""
        p, cfg = self.p, self.cfg
        self._record(schedule, sim)
        order = window_order(p)
        k = cfg.lns_window_members
        stride = max(1, k // 2)
        starts = list(range(0, max(1, len(order) - k + stride), stride))
        failed: dict[int, tuple] = {}  # window start -> its neighbourhood when it last failed
        sweeps = 0
        for sweep in range(cfg.lns_max_sweeps):
            improved, solved = False, 0
            sweeps += 1
            # most exposed communication first (ties: graph order), from the incumbent's run
            bucket_of = schedule.bucket_of()
            exposed = {n: sim.bucket_exposed_ms.get(b, 0.0) for n, b in bucket_of.items()}
            window_exposed = {s0: sum(exposed.get(n, 0.0) for n in order[s0: s0 + k]) for s0 in starts}
            visit = sorted((s0 for s0 in starts if window_exposed[s0] > cfg.lns_min_exposed_ms),
                           key=lambda s0: (-window_exposed[s0], s0))
            for s0 in visit:
                if self.budget.exhausted():
                    return schedule, sim, sweeps
                around = order[max(0, s0 - stride): s0 + k + stride]
                if failed.get(s0) == neighbourhood(schedule, around):
                    continue
                solved += 1
                free = bucket_free(schedule, order[s0: s0 + k])
                cand = self.solve_window(p, self.model_budget_bytes, schedule, free, self.budget.take(cfg.lns_window_s),
                                         self.seed, self.num_workers, self.anchors)
                ok = False
                if cand is not None:
                    schedule, sim, ok = self._accept(schedule, sim, cand, simulate(p.dag, cand, problem=p))
                logger.debug("window at %d (exposing %.3f ms): %s, step %.3f ms", s0, window_exposed[s0],
                             "accepted" if ok else "no gain", sim.step_ms)
                if ok:
                    schedule, sim = self._propagate(schedule, sim, bucket_free(schedule, order[s0: s0 + k]))
                    failed.pop(s0, None)
                else:
                    failed[s0] = neighbourhood(schedule, around)
                improved |= ok
            logger.info("window sweep %d: %d window(s) solved, step %.3f ms, peak %.3f GiB", sweep + 1, solved,
                        sim.step_ms, sim.peak_bytes / 2**30)
            if not improved:
                break
        return schedule, sim, sweeps


def _period_pattern(per: Periodicity, schedule: Schedule, source: int) -> tuple:
    """The decisions of the period starting at block ``source``, relative to it: its buckets
    (by role) with their issue and wait gaps shifted to the period's origin. Periods with equal
    patterns copy alike (up to the clamps at the graph's ends)."""
    issue, wait = schedule.positions()
    block_of, role_of = per.block_of(), per.role_of()
    shift = (source - per.blocks[0]) // per.stride * per.period
    phase = (source - per.blocks[0]) % per.stride
    out = []
    for b, bk in enumerate(schedule.buckets):
        first = block_of.get(bk.members[0])
        if first is None or not source <= first < source + per.stride:
            continue
        out.append((tuple((block_of.get(m, -1) - source, role_of.get(m)) for m in bk.members),
                    issue[b] - shift, wait[b] - shift))
    return (phase, tuple(sorted(out)))


def _template_blocks(per: Periodicity, window_blocks: int) -> list[int]:
    """The template window: ``window_blocks // 2`` periods on each side of the middle period
    (none for periods of more than 2 blocks: one period is already a large window)."""
    k, mid = per.stride, per.middle()
    h = window_blocks // 2 if k <= 2 else 0
    return [b for b in range(mid - h * k, mid + k + h * k) if b in per.members]


def _ties_hold(schedule: Schedule, per: Periodicity, blocks: list[int]) -> bool:
    """Every role of ``blocks`` is issued (and waited) one period after the block one period
    before, in a bucket of the same size: the start satisfies the template window's ties."""
    issue, wait = schedule.positions()
    bucket_of = schedule.bucket_of()
    for b in blocks:
        if b + per.stride not in blocks:
            continue
        for role, n in per.members[b].items():
            x, y = bucket_of[n], bucket_of[per.members[b + per.stride][role]]
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
