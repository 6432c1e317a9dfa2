"""The solve loop, one for every model backend (CP-SAT, MILP).

:func:`solve` runs a :class:`Backend` on a problem:

1. warm start: the fastest of the hint, the extra starts (e.g. the best schedule found at a
   smaller budget) and the heuristics that fit (:mod:`solvers.warmstart`);
2. solve: graphs with at most ``full_model_max_members`` movable collectives and no repeating
   layers as one model (:meth:`Backend.solve_full`), the others by the decomposition of
   :mod:`solvers.decompose`
   (per-layer template, then rolling windows, each window by :meth:`Backend.solve_window`);
   when the whole-graph model fails (infeasible, nothing found, repair not converging) the
   decomposition runs from the warm start with the work left, rather than stopping there;
   when the decomposition converges with at least ``restart_share`` of the work left, it runs
   again from the fastest start of the other bucket granularity
   (:func:`solvers.warmstart.other_family`) and the faster result is kept;
3. check: every schedule is simulated; when its peak exceeds the budget (the model prices merge
   transients approximately) the model's budget is tightened by the excess and the model
   re-solved, at most ``memory_repair_rounds`` times;
4. polish: a local search on the simulator from the schedule that fits (:mod:`solvers.minimax`
   with the one cost model: bucket merges, transfers across bucket boundaries and small issue /
   wait moves; the budget held by both counts of the simulator, or, for a start over it by
   torch's tracker rules that the moves cannot bring under, that count held where the start
   has it, a second polish) with the work the search left (at most ``polish_share`` of
   the limit; the search keeps its whole limit, which short limits need, and a solve's work
   stays within its limit);
5. answer, never worse than the warm start: a model that is infeasible or finds nothing, or a
   repair that does not converge, returns the warm start (flagged) when one fits, and raises
   :class:`InfeasibleBudgetError` naming the smallest peak found when none does; a schedule
   that simulates slower than the warm start is replaced by it.

Determinism: ``time_limit_s`` is a budget of *deterministic* work (:class:`WorkBudget`): every
model and window gets a fixed share of it, whatever the wall clock says, so every rank runs the
same solves and gets the same schedule. The wall clock is only a safety cap
(``wall_clock_factor`` x the limit + ``wall_clock_slack_s``); when it stops a solve the result
says so in a note and is no longer rank-deterministic (the API's rank agreement,
:mod:`scheduler.consensus`, settles it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from collections.abc import Sequence

from solvers import decompose
from solvers.config import DEFAULT_TIME_LIMIT_S, SolverConfig
from solvers.core.problem import Problem
from solvers.core.schedule import (
    InfeasibleBudgetError,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    StageRecord,
)
from solvers.core.simulator import SimResult, simulate
from solvers.core.units import fmt_bytes
from solvers.decompose import CAP_NOTE, WorkBudget, better
from solvers.minimax import MinimaxConfig, polish
from solvers.periodic import detect_periodicity
from solvers.repair import repair_by_excess
from solvers.warmstart import other_family, warm_starts

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelOutcome:
    """One solve of a whole-graph model.

    Attributes:
        status: "optimal", "feasible", "infeasible" or "unknown" (nothing found in the limit).
        schedule: the solution (None unless optimal or feasible).
        model_step_ms, bound_ms: the model's objective and best bound (None if unknown).
        notes: remarks for the result.
        alternatives: other schedules of the same model objective (e.g. a second phase with
            less memory); the driver keeps one when it simulates at least as fast.
    """

    status: str
    schedule: Schedule | None
    model_step_ms: float | None
    bound_ms: float | None
    notes: tuple[str, ...] = ()
    alternatives: tuple[Schedule, ...] = ()


class _NoSchedule(Exception):
    """A whole-graph model found no schedule (its status: "infeasible" or "unknown")."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


class Backend(Protocol):
    """A model backend (:class:`solvers.cpsat.CpSatBackend`, :class:`solvers.milp.MilpBackend`)."""

    name: str
    config: SolverConfig
    #: solves stopped by their wall-clock safety cap rather than their deterministic limit
    wall_cap_hits: int

    def solve_full(self, problem: Problem, mem_budget_bytes: int | None, start: Schedule, limit_s: float,
                   seed: int, num_workers: int) -> ModelOutcome:
        """The whole graph as one model within the deterministic limit ``limit_s``."""
        ...

    #: a :data:`solvers.decompose.WindowSolver`
    solve_window: Callable[..., Schedule | None]

    def min_peak(self, problem: Problem, limit_s: float, seed: int, num_workers: int) -> Schedule | None: ...


def solve(problem: Problem, backend: Backend, *, mem_budget_bytes: int | None = None,
          time_limit_s: float = DEFAULT_TIME_LIMIT_S, seed: int = 0, hint: Schedule | None = None, num_workers: int = 1,
          extra_starts: Sequence[Schedule] = ()) -> SolveResult:
    """Solve ``problem`` with ``backend`` (see the module docstring). ``time_limit_s`` is
    deterministic work (see the module docstring); ``extra_starts`` are more candidate warm
    starts (the result is never slower than the fastest of them that fits).

    Raises:
        InfeasibleBudgetError: no schedule fits the budget; ``min_peak_bytes`` is the smallest
            simulated peak found.
        ScheduleError: the model failed without a schedule and no heuristic fits.
    """
    run = _Run(problem, backend, mem_budget_bytes, time_limit_s, seed, num_workers)
    if not problem.chains:
        sim = simulate(problem.dag, problem.traced_schedule(), problem=problem)
        if mem_budget_bytes is not None and sim.max_peak_bytes > mem_budget_bytes:  # the only schedule
            raise run._infeasible("no collective can move", sim)
        return run.result(sim, SolveStatus.OPTIMAL, sim.step_ms, ["no movable collectives: traced order kept"])
    t0 = time.perf_counter()
    starts = warm_starts(problem, hint, mem_budget_bytes, seed=seed,
                         max_bucket_bytes=backend.config.max_bucket_bytes, extra_starts=extra_starts)
    run.warm = starts[0] if starts else None
    run.second = other_family(starts)
    run.record("starts", t0, simulations=len(starts), step_ms=run.warm.objective_ms if run.warm else None)
    if run.warm is not None:
        logger.info("warm start: %s, %.3f ms", run.warm.solver, run.warm.objective_ms)
    return run.loop()


def scaled_search(cfg: SolverConfig, time_limit_s: float) -> SolverConfig:
    """``cfg`` with window limits that grow with the time limit (``lns_window_s`` at least
    1/100 of it, ``template_window_s`` at least 1/30): a longer limit buys larger searches per
    window, not only more windows. A function of the arguments only (deterministic)."""
    return dataclasses.replace(cfg, lns_window_s=max(cfg.lns_window_s, time_limit_s / 100),
                               template_window_s=max(cfg.template_window_s, time_limit_s / 30))


class _Run:
    """State of one :func:`solve`: the warm start, the notes, the history of improvements."""

    def __init__(self, problem: Problem, backend: Backend, mem_budget_bytes: int | None, time_limit_s: float,
                 seed: int, num_workers: int):
        self.p = problem
        self.backend = backend
        self.cfg = scaled_search(backend.config, time_limit_s)
        self.mem_budget_bytes = mem_budget_bytes
        self.time_limit_s = time_limit_s
        self.seed = seed
        self.num_workers = num_workers
        self.t0 = time.perf_counter()
        self.budget = WorkBudget(time_limit_s, time_limit_s * self.cfg.wall_clock_factor + self.cfg.wall_clock_slack_s)
        self.cap_hits0 = getattr(backend, "wall_cap_hits", 0)
        self.warm: SolveResult | None = None
        #: the fastest start of the other bucket granularity (:func:`solvers.warmstart.other_family`)
        self.second: SolveResult | None = None
        self.notes: list[str] = []
        self.history: list[tuple[float, float]] = []  # (perf_counter, step ms) of improvements
        #: the result's alternatives (:attr:`SolveResult.alternatives`)
        self.alternatives: tuple[Schedule, ...] = ()
        #: the stages that ran (:attr:`SolveResult.stages`)
        self.stages: list[StageRecord] = []

    def record(self, name: str, t0: float, *, work_s: float = 0.0, simulations: int = 0,
               step_ms: float | None = None, before_ms: float | None = None) -> None:
        """Add a :class:`StageRecord` for a stage that started at ``t0`` (perf_counter)."""
        gained = max(0.0, before_ms - step_ms) if before_ms is not None and step_ms is not None else 0.0
        self.stages.append(StageRecord(name=name, wall_s=time.perf_counter() - t0, work_s=work_s,
                                       simulations=simulations, step_ms=step_ms, gained_ms=gained))

    @functools.cached_property
    def decomposed(self) -> bool:
        """Large graphs, and graphs whose layers repeat (templates first), go to the
        decomposition: on a 16-layer graph with only 51 collectives the whole-graph model found
        nothing that fits (27.4 ms at 60 s) where the template and windows found 25.7 ms in 19 s."""
        cfg = self.cfg
        if sum(len(c) for c in self.p.chains.values()) > cfg.full_model_max_members:
            return True
        return cfg.decompose_repeating and cfg.template_rounds > 0 and detect_periodicity(
            self.p, min_blocks=cfg.template_min_blocks, max_stride=cfg.template_max_period_blocks) is not None

    def loop(self) -> SolveResult:
        """Solve, check the simulated peak, tighten the model's budget by the excess and solve
        again (3, :func:`solvers.repair.repair_by_excess`); then polish (4)."""
        start = [self.warm.schedule if self.warm is not None else self.p.traced_schedule()]
        rounds = self.cfg.memory_repair_rounds

        def solve_round(model_budget: int | None) -> tuple[SimResult, bool, float] | None:
            round_ = len(made_at)
            if round_ and self.budget.exhausted(0.5):
                return None
            made_at.append(round_)
            t0, left0 = time.perf_counter(), self.budget.left_s
            before = self.warm.objective_ms if self.warm is not None and round_ == 0 else None
            if self.decomposed:
                schedule, sim = self._decomposed(model_budget, start[0], templates=round_ == 0)
                if round_ == 0:
                    schedule, sim = self._restart(model_budget, schedule, sim)
                proven, bound = False, self.p.lower_bound_ms()
            else:
                limit = self.budget.take(self.budget.left_s * (1.0 if round_ == rounds else 0.5))
                out = self.backend.solve_full(self.p, model_budget, start[0], limit, self.seed, self.num_workers)
                self.notes += out.notes
                if out.schedule is None:
                    raise _NoSchedule(out.status)
                schedule, sim = self._fastest(out.schedule, out.alternatives)
                proven = out.status == "optimal"
                bound = max(out.bound_ms if out.bound_ms is not None else -math.inf, self.p.lower_bound_ms())
            self.record("search" if round_ == 0 else "repair", t0, work_s=left0 - self.budget.left_s,
                        step_ms=sim.step_ms, before_ms=before)
            start[0] = schedule
            return sim, proven, bound

        def excess(made: tuple[SimResult, bool, float]) -> int:
            return 0 if self.mem_budget_bytes is None else made[0].peak_bytes - self.mem_budget_bytes

        made_at: list[int] = []
        try:
            repair = repair_by_excess(solve_round, excess, self.mem_budget_bytes, rounds=rounds)
        except _NoSchedule as e:
            return self._no_schedule(e.status)
        for made in repair.made:
            if excess(made) > 0:
                self.notes.append(f"simulated peak exceeded the budget by {excess(made)} B; tightened the model budget")
        if repair.fitting is not None:
            if len(repair.made) > 1:
                self.notes.append(f"memory repaired in {len(repair.made) - 1} round(s)")
            return self._final(*repair.fitting)
        if self.warm is not None:
            # the model's memory terms could not be repaired to the simulator's in time (merge
            # transients): search windows from the best heuristic that fits, and say so
            return self._rescue("memory repair did not converge")
        raise self._infeasible(f"the model's schedules exceeded it in simulation after {rounds} repair rounds",
                               repair.made[-1][0] if repair.made else None)

    def _decomposed(self, model_budget: int | None, start: Schedule, *, templates: bool):
        schedule, sim, notes = decompose.search(
            self.p, self.cfg, self.backend.solve_window, model_budget, start, self.budget, self.seed,
            self.num_workers, self.mem_budget_bytes, templates=templates, history=self.history,
        )
        self.notes += notes
        return schedule, sim

    def _restart(self, model_budget: int | None, schedule: Schedule, sim: SimResult) -> tuple[Schedule, SimResult]:
        """(2) The search converged with work left: search again from :attr:`second`, the
        faster of the two results kept."""
        if self.second is None or self.budget.exhausted(self.cfg.restart_share * self.time_limit_s):
            return schedule, sim
        self.notes.append(f"searched again from {self.second.solver} with the work left "
                          f"({self.budget.left_s:.1f} s)")
        logger.info("restart from %s (%.3f ms) with %.1f s of work left", self.second.solver,
                    self.second.objective_ms, self.budget.left_s)
        t0, left0 = time.perf_counter(), self.budget.left_s
        other, osim = self._decomposed(model_budget, self.second.schedule, templates=True)
        won = better(osim, sim, self.mem_budget_bytes)
        self.record("restart", t0, work_s=left0 - self.budget.left_s, step_ms=osim.step_ms if won else sim.step_ms,
                    before_ms=sim.step_ms)
        return (other, osim) if won else (schedule, sim)

    def _rescue(self, why: str) -> SolveResult:
        """The whole-graph model gave nothing usable: the decomposition from the warm start
        with the work left (its windows keep only fitting improvements), or the warm start."""
        assert self.warm is not None
        if self.budget.exhausted(0.1):
            self.notes.append(f"{why}; returned the best warm start ({self.warm.solver})")
            return self._warm_result()
        self.notes.append(f"{why}; searched windows from the best warm start ({self.warm.solver})")
        t0, left0 = time.perf_counter(), self.budget.left_s
        _, sim = self._decomposed(self.mem_budget_bytes, self.warm.schedule, templates=True)
        self.record("rescue", t0, work_s=left0 - self.budget.left_s, step_ms=sim.step_ms,
                    before_ms=self.warm.objective_ms)
        return self._final(sim, False, self.p.lower_bound_ms())

    def _fastest(self, schedule: Schedule, alternatives: tuple[Schedule, ...]) -> tuple[Schedule, SimResult]:
        sim = simulate(self.p.dag, schedule, problem=self.p)
        for alt in alternatives:
            asim = simulate(self.p.dag, alt, problem=self.p)
            if asim.step_ms <= sim.step_ms + 1e-9:
                schedule, sim = alt, asim
        return schedule, sim

    def _no_schedule(self, status: str) -> SolveResult:
        """(5) The whole-graph model found nothing: the warm start, or a clear error."""
        if self.warm is not None:
            # the model restricts positions to anchors and prices memory conservatively, so its
            # infeasibility proves nothing while a heuristic schedule fits: return that
            why = "under the budget" if self.mem_budget_bytes is not None else "within the time limit"
            return self._rescue(f"model {status.upper()} {why}")
        if self.mem_budget_bytes is None:
            raise ScheduleError(f"{self.backend.name} found no schedule ({status}) within {self.time_limit_s:g} s; "
                                "raise time_limit_s")
        why = "proven infeasible" if status == "infeasible" else "none found in the time limit"
        raise self._infeasible(why, None)

    def _infeasible(self, why: str, sim: SimResult | None) -> InfeasibleBudgetError:
        min_peak = self._min_peak(sim)
        return InfeasibleBudgetError(
            f"no schedule keeps peak memory under {fmt_bytes(self.mem_budget_bytes or 0)} ({why}); the smallest "
            f"peak found is {fmt_bytes(min_peak)} ({min_peak} B): raise mem_budget to at least that",
            budget_bytes=self.mem_budget_bytes or 0,
            min_peak_bytes=min_peak,
        )

    def _min_peak(self, sim: SimResult | None) -> int:
        """Smallest simulated peak of the traced order, the last schedule tried and the
        backend's least-peak model (whole-graph models only)."""
        peaks = [simulate(self.p.dag, self.p.traced_schedule(), problem=self.p).max_peak_bytes]
        if sim is not None:
            peaks.append(sim.max_peak_bytes)
        if not self.decomposed:
            limit = max(1.0, self.time_limit_s / 4)
            least = self.backend.min_peak(self.p, limit, self.seed, self.num_workers)
            if least is not None:
                peaks.append(simulate(self.p.dag, least, problem=self.p).max_peak_bytes)
        return min(peaks)

    def _warm_result(self) -> SolveResult:
        """The warm start returned as this solver's (flagged) answer, with the analytic bound."""
        assert self.warm is not None
        sim = simulate(self.p.dag, self.warm.schedule, problem=self.p)
        return self.result(sim, SolveStatus.FEASIBLE, min(self.p.lower_bound_ms(), sim.step_ms), self.notes)

    def _polish(self, sim: SimResult) -> tuple[SimResult, bool]:
        """(4) ``sim``'s schedule polished on the simulator with the work the search left, at most
        ``polish_share`` of the limit: (the simulation of the result, whether it gained)."""
        work_s = self.budget.take(self.cfg.polish_share * self.time_limit_s)
        if not self.cfg.polish_share or work_s <= 0 or self.budget.exhausted(0.0):
            return sim, False
        t0 = time.perf_counter()
        config = MinimaxConfig.for_work(work_s, self.p, nodes_per_s=self.cfg.polish_nodes_per_s,
                                        max_bucket_bytes=self.cfg.max_bucket_bytes)
        try:
            result = polish({"model": self.p}, sim.schedule, {"model": sim.step_ms}, self.mem_budget_bytes, config)
        except InfeasibleBudgetError:
            # the model guarantees the budget by the execution model's count only: a start over
            # it by torch's tracker rules, which the moves cannot bring under, is polished with
            # that count held where the start has it (the written graph is judged and repaired
            # later, scheduler.verify)
            result = polish({"model": self.p}, sim.schedule, {"model": sim.step_ms}, self.mem_budget_bytes, config,
                            tracker_budget_bytes=max(self.mem_budget_bytes or 0, sim.tracker_peak_bytes))
        gained = result.step_ms["model"] < sim.step_ms - 1e-9
        self.record("polish", t0, work_s=work_s, simulations=result.simulations,
                    step_ms=min(result.step_ms["model"], sim.step_ms), before_ms=sim.step_ms)
        if not gained:
            return sim, False
        self.notes.append(f"polished on the simulator: {sim.step_ms:.3f} -> {result.step_ms['model']:.3f} ms "
                          f"({result.moves} moves, {result.simulations} simulations)")
        polished = simulate(self.p.dag, result.schedule, problem=self.p)
        self.history.append((time.perf_counter(), polished.step_ms))
        return polished, True

    def _final(self, sim: SimResult, proven: bool, bound_ms: float) -> SolveResult:
        """(4) The polish, then (5) never a schedule that simulates slower than the warm start."""
        unpolished = sim.schedule
        sim, gained = self._polish(sim)
        if gained:
            # a merge the polish adds can cost more in counts the model does not make (torch's
            # tracker): the written-graph check judges both
            self.alternatives = (unpolished,)
        proven = proven and not gained  # the simulator beat the model's optimum: its prices were approximate
        if self.warm is not None and self.warm.objective_ms < sim.step_ms - 1e-9:
            # the model prices copies and transients approximately
            sim = simulate(self.p.dag, self.warm.schedule, problem=self.p)
            proven = False
            self.notes.append(f"kept the warm start ({self.warm.solver}): the model's schedule simulated slower")
        status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
        return self.result(sim, status, min(bound_ms, sim.step_ms), self.notes)

    def result(self, sim: SimResult, status: SolveStatus, bound_ms: float, notes: list[str]) -> SolveResult:
        if self.budget.cap_hit or getattr(self.backend, "wall_cap_hits", 0) > self.cap_hits0:
            notes = [*notes, CAP_NOTE]
        history = tuple((round(t - self.t0, 3), ms) for t, ms in self.history)
        return SolveResult(
            schedule=sim.schedule,
            status=status,
            solver=self.backend.name,
            objective_ms=sim.step_ms,
            best_bound_ms=bound_ms,
            solve_time_s=time.perf_counter() - self.t0,
            peak_bytes=sim.peak_bytes,
            notes=tuple(notes),
            history=history,
            alternatives=tuple(a for a in self.alternatives if a.digest() != sim.schedule.digest()),
            stages=tuple(self.stages),
        )
