"""The search's stages: starts, windows, polish, strict, links, ahead.

:func:`search` finds a schedule of one graph priced by one cost model or by several (a
*family*: the same nodes, collectives and bytes, other times), under a peak-memory budget.
Every schedule it compares is evaluated exactly on the execution model
(:mod:`solvers.core.evaluate`: the simulator's step time and peak memory, the memory the
written graph holds).

=========  ====================================================  =====================  ========================================
stage      what it does                                          work                   why it exists
=========  ====================================================  =====================  ========================================
starts     each chain of mergeable collectives bucketed          a fixed set: about     bucket granularity decides most of a
           regularly (``size`` blocks per bucket, issued         one evaluation per     step and no local move changes it (the
           ``ahead`` buckets early), chain after chain; the      start, plus the moves  models disagree on it: one wants two
           heuristics (traced, FSDP2-like, per-block plan,       that bring the best    blocks per bucket, another four); a
           SimpleFSDP-like, AutoParallel-like), as they are and  few under the budget   valid answer before any solver
           shrunk to the budget; the caller's starts; the best
           few over the budget moved under it at their peak
           (:func:`solvers.starts.fit_by_delays`); the best that fits is the
           incumbent
windows    with one cost model: CP-SAT (or the MILP) re-decides  ``window_share`` of    where memory binds, issues, waits and
           rolling windows of the incumbent's collectives        ``work_limit``, in     merges around the peak move together,
           (bucketing, issue and wait gaps,                      the backend's          which one local move cannot do
           :mod:`solvers.model`), most exposed first; a          deterministic time
           window's schedule is kept only when it evaluates
           better and fits
polish     first-improvement local search                        the rest of the        the evaluator prices merges and both
           (:func:`solvers.polish.polish`): merge two           limit, in              memory counts exactly where a model
           neighbouring buckets of a chain, move a boundary      evaluations, shared    approximates them; a local search ends
           between them, move one issue or wait; then one        by its starts, and a   where its start leads; no move ends a
           pass that splits each bucket into its members;        pass over the          bucket, and where transfers hide a
           from the incumbent and, with several models,          buckets                bucket's copies cost compute
           from the fastest start under each
strict     with several models, when every polished schedule     what the polish left,  the minimax leaves every model but the
           is slower than the best baseline under a strict       at least               worst free to degrade; a user judges
           model: the polish again, that slowdown first, from    ``strict_share`` of    by the nominal models
           the polished or start schedule that loses least       its work
links      where streams share a link: issues moved past the     rounds x trials per    a transfer beside a waited one on its
           exposed transfers of the other streams on it, whole   model, outside the     link slows it; a queue of transfers
           then in halves, kept where no model slows             limit                  moves only all at once
           (:func:`solvers.polish.link_pass`)
ahead      buckets waited on, issued earlier, also ahead of      ``ahead_trials`` per   the stages above issue a chain in the
           buckets of their chain needed before them: right      bucket waited on,      order of need, so a ready bucket waits
           after the issue of another waited-on bucket (its      outside the limit      on a FIFO stream for a late one; out
           copy-in hidden), or at its readiness; kept where no                          of a queue, one issue moved a few gaps
           model slows (:func:`solvers.polish.ahead_pass`)                              seldom gains by itself
=========  ====================================================  =====================  ========================================

Streams (``all_gather_stream``, :mod:`solvers.core.streams`): with ``"choose"`` the starts are
evaluated again with the all-gathers of each group that also reduces on a second stream
(:attr:`Schedule.split_groups`), and the polish runs from the best of those too, in its share of
the work; the better schedule is kept. ``"separate"`` splits every start. The windows model one
stream per group and keep the incumbent's split.

The objective (:class:`Objective`, its one order :class:`solvers.objective.Ordering`, which every
stage compares by): with one cost model, the step time; with several, the
worst-case regret ``max_m r_m`` (then the sum), where ``r_m = t_m / R_m - 1`` against the
fastest start's step ``R_m`` under model ``m``, plus :attr:`SearchConfig.baseline_weight` times
the slowdown against the best baseline's step under ``m`` (:func:`solvers.objective.regret`). It
orders the starts and the polish's moves. Between finished schedules, the slowdown against the
best baseline under the strict models (:attr:`SearchConfig.strict_models`, the nominal analytic
and torch models) decides first (:meth:`Objective.key`), because the minimax leaves every model
but the worst free to degrade. When every polished schedule loses that way, the ``strict``
stage polishes once more with that slowdown first in the polish's own order, from whichever
polished schedule or start loses least (a baseline that is the fastest under every strict
model loses nothing). The polish does not take the slowdown first from the outset: its early
moves would then trade regret for it and end in a worse place on graphs where no start lost.
A schedule over the budget never replaces one that fits. Windows run with one model only: a
window is solved under one model, and with several its schedule trades that model against the
others: none was kept under the family where the benchmarks tried (BENCHMARKS.md, the stages).

The last two stages (links, ahead) refine one polished answer (where the polish did not run,
neither do they): a caller that runs the search in several orders of compute and keeps one
answer (:mod:`scheduler.solving`) runs them on that answer alone (``search(finish=False)``,
then :func:`finish`).

Determinism: ``work_limit`` is deterministic work, shared by the windows (the backend's
deterministic clock) and the polish (evaluations, converted at
:attr:`SearchConfig.evaluated_nodes_per_s`); the starts are a fixed set. The wall clock never
decides what runs, so every rank runs the same stages and gets the same schedule from the
same graph.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from solvers.core.peaks import memory_model
from solvers.core.problem import Problem
from solvers.core.schedule import (
    InfeasibleBudgetError,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    StageRecord,
)
from solvers.core.simulator import simulate
from solvers.core.units import fmt_bytes
from solvers import polish as polishing
from solvers.objective import Evaluated, Objective, SearchConfig
from solvers.starts import starts

logger = logging.getLogger(__name__)

#: default work limit of a solve (work units: deterministic work, about one second of one core;
#: ``SolverOptions.work_limit``)
DEFAULT_WORK_LIMIT = 1.0
#: where a search may put all-gathers (:func:`search`'s ``all_gather_stream``)
ALL_GATHER_STREAMS = ("shared", "choose", "separate")
#: work a sum of window limits may exceed its share by: the sum is a float, and a
#: share that holds n windows exactly must run all n
WORK_TOLERANCE = 1e-9
#: the least polish worth running, in evaluations per cost model: its start's evaluation and
#: one neighbour's (with less, the polish could not try a single move)
POLISH_MIN_EVALUATIONS_PER_MODEL = 2


class WindowBackend(Protocol):
    """A model backend that re-decides one window of a schedule
    (:class:`solvers.cpsat.CpSatBackend`, :class:`solvers.milp.MilpBackend`)."""

    name: str

    def solve_window(self, problem: Problem, mem_budget_bytes: int | None, schedule: Schedule, free: set[str],
                     work_limit: float, seed: int, num_workers: int, anchors) -> Schedule | None: ...


# --------------------------------------------------------------------------------------------
# stage 2: windows
# --------------------------------------------------------------------------------------------
def windows(objective: Objective, incumbent: Evaluated, backend: WindowBackend, config: SearchConfig,
            work_limit: float, seed: int, num_workers: int) -> tuple[Evaluated, float]:
    """Rolling windows of CP-SAT (or MILP) solves over the incumbent (module docstring).
    Returns the best schedule and the deterministic work spent (work units)."""
    from solvers.model import Anchors  # the formulation's anchors, built once per solve

    p = objective.primary
    anchors = Anchors(p)
    order = window_order(p)
    k = config.window_members
    stride = config.window_stride if config.window_stride is not None else max(1, k // 2)
    offsets = list(range(0, max(1, len(order) - k + stride), stride))
    spent = 0.0
    for _sweep in range(config.window_sweeps):
        improved = False
        exposed = _exposed_by_collective(p, incumbent.schedule)
        load = {s0: sum(exposed.get(n, 0.0) for n in order[s0:s0 + k]) for s0 in offsets}
        for s0 in sorted((s0 for s0 in offsets if load[s0] > 0), key=lambda s0: (-load[s0], s0)):
            if spent + config.window_work > work_limit + WORK_TOLERANCE:
                return incumbent, spent
            spent += config.window_work
            free = bucket_free(incumbent.schedule, order[s0:s0 + k])
            try:
                cand = backend.solve_window(p, objective.mem_budget_bytes, incumbent.schedule, free,
                                            config.window_work, seed, num_workers, anchors)
            except ScheduleError as e:
                logger.debug("window at %d failed: %s", s0, e)
                continue
            # the window's model runs one stream per group; the incumbent's streams stay
            e = objective.evaluate(cand.with_split(incumbent.schedule.split_groups)) if cand is not None else None
            if e is not None and objective.fits(e) and objective.regret_key(e) < objective.regret_key(incumbent):
                e.name, e.origin = incumbent.name, incumbent.start
                incumbent, improved = e, True
        if not improved:
            break
    return incumbent, spent


def window_order(p: Problem) -> list[str]:
    """Movable collectives in the order the graph needs them (need for all-gathers, gradient
    ready for the others)."""
    names = [c.name for c in p.colls.values() if c.movable]
    return sorted(names, key=lambda n: (p.colls[n].needed if p.colls[n].coll_type == "all_gather"
                                        else p.colls[n].ready, p.colls[n].traced_issue))


def bucket_free(schedule: Schedule, names: Sequence[str]) -> set[str]:
    """``names`` and every collective sharing a bucket with one of them."""
    bucket_of = schedule.bucket_of()
    return {m for b in {bucket_of[n] for n in names} for m in schedule.buckets[b].members}


def _exposed_by_collective(p: Problem, schedule: Schedule) -> dict[str, float]:
    """Collective -> the time the compute stream waits for its bucket (ms, one simulation)."""
    sim = simulate(p.dag, schedule, problem=p)
    return {m: sim.bucket_exposed_ms.get(b, 0.0) for b, bk in enumerate(schedule.buckets) for m in bk.members}


# --------------------------------------------------------------------------------------------
# the stages
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Started:
    """The search after its first stage (:func:`begin`): the starts evaluated, from which
    :func:`search` continues. Lets a caller compare the starts of several problems of one graph
    (the orders of compute of :mod:`scheduler.orders`) and run the later stages on one."""

    objective: Objective
    #: the starts that fit, best first by the objective's regret
    found: list[Evaluated]
    #: the best start with the all-gathers on their own stream, where the streams are chosen
    split_best: Evaluated | None
    #: the incumbent: the better of ``found[0]`` and ``split_best``
    best: Evaluated
    stages: list[StageRecord]
    #: when the search began (``time.perf_counter``)
    t0: float

    def result(self) -> SolveResult:
        """The search ended here: the best start that fits, or none better by the objective's
        key (:func:`search` with ``starts_only``)."""
        return _result(self, self.best)


def begin(
    problems: Mapping[str, Problem],
    mem_budget_bytes: int | None,
    *,
    config: SearchConfig = SearchConfig(),
    extra_starts: Sequence[Schedule] = (),
    all_gather_stream: str = "shared",
    baselines: Sequence[tuple[str, Schedule]] = (),
) -> Started:
    """The search's first stage (the starts); arguments as :func:`search`'s.

    Raises:
        InfeasibleBudgetError: as :func:`search`.
    """
    if all_gather_stream not in ALL_GATHER_STREAMS:
        raise ValueError(f"all_gather_stream={all_gather_stream!r} must be one of {ALL_GATHER_STREAMS}")
    t0 = time.perf_counter()
    objective = Objective(problems, mem_budget_bytes, config.baseline_weight, config.strict_models)
    # a start keeps its streams only where the caller lets the search choose them
    given = [s.with_split(()) if all_gather_stream == "shared" else s for s in extra_starts]
    named = [(name, s.with_split(()) if all_gather_stream == "shared" else s) for name, s in baselines]
    found, smallest = starts(objective, config, [(f"start {i}", s) for i, s in enumerate(given)], named)
    if not found:
        peak = smallest if smallest is not None else 0
        model = memory_model(objective.primary)
        # how far the advice may be from the least budget that could hold: no schedule goes below it
        least = model.least_peak()[0] if model.reason is None else None
        bound = "" if least is None else f"; no schedule in this order of compute peaks below {fmt_bytes(least)}"
        refusal = InfeasibleBudgetError(
            f"no schedule keeps peak memory under {fmt_bytes(mem_budget_bytes or 0)} ({mem_budget_bytes} B); the "
            f"smallest peak reached is {fmt_bytes(peak)} ({peak} B): raise mem_budget to at least that{bound}",
            mem_budget_bytes=mem_budget_bytes or 0, min_peak_bytes=peak, least_peak_bytes=least)
        # the work spent all the same, for a caller that goes on in another order of compute
        refusal.stages = [StageRecord(name="starts", wall_s=time.perf_counter() - t0,
                                      evaluations=objective.evaluations)]
        raise refusal
    groups = objective.primary.splittable_groups() if all_gather_stream != "shared" else ()
    split_best = None
    if groups:
        # the starts again with the all-gathers on their own stream (memory is the same)
        split = [e for f in found if (e := objective.evaluate(f.schedule.with_split(groups), f.name)) is not None]
        split.sort(key=objective.regret_key)
        if all_gather_stream == "separate":
            found = split
        elif split:
            split_best = split[0]
    best = found[0] if split_best is None or objective.regret_key(found[0]) <= objective.regret_key(split_best) \
        else split_best
    stages = [_stage("starts", t0, 0.0, objective.evaluations, best, objective.labels[0], best)]
    return Started(objective, found, split_best, best, stages, t0)


def search(
    problems: Mapping[str, Problem],
    mem_budget_bytes: int | None,
    *,
    backend: WindowBackend | None = None,
    work_limit: float = DEFAULT_WORK_LIMIT,
    seed: int = 0,
    num_workers: int = 1,
    config: SearchConfig = SearchConfig(),
    extra_starts: Sequence[Schedule] = (),
    all_gather_stream: str = "shared",
    baselines: Sequence[tuple[str, Schedule]] = (),
    starts_only: bool = False,
    started: Started | None = None,
    finish: bool = True,
) -> SolveResult:
    """Run the search's stages (module docstring) and return its best schedule.

    Args:
        problems: model label -> the graph priced by that model; the first is the primary one.
        mem_budget_bytes: peak-memory budget by the execution model's count; None: no limit.
        backend: the window solver (None: no windows).
        work_limit: deterministic work (work units; module docstring).
        seed, num_workers: the backend's.
        config: the search's tuning values.
        extra_starts: schedules of the graph to start from too (e.g. the best at a smaller
            budget): the result is never slower than the fastest that fits.
        all_gather_stream: ``"shared"``: every collective on its own group's stream;
            ``"separate"``: the all-gathers of each group that also reduces on a second stream
            (:attr:`Schedule.split_groups`, :mod:`solvers.core.streams`); ``"choose"``: both,
            the polish's work shared between them, and the better schedule kept.
        baselines: named schedules of the graph (torch's overlap scheduler read back, as
            :func:`scheduler.optimize_schedule` gives them) that are starts and, where they fit,
            baselines: under each strict model the result is no slower than the best baseline
            wherever one start is (:meth:`Objective.key`), and the result is never worse by that
            key than any start that fits.
        starts_only: run the first stage alone: the best start that fits, no windows, no
            polish (``work_limit`` then unused).
        started: the first stage as :func:`begin` ran it on these arguments: the search goes on
            from there (``problems``, ``extra_starts`` and ``baselines`` then unused).
        finish: run the last stages (links, ahead); False: the caller runs them with
            :func:`finish` on the one answer it keeps of several searches.

    Returns:
        A :class:`SolveResult` whose ``alternatives`` are the next best starts (fallbacks for a
        written graph that does not hold the budget) and ``stages`` what each stage did.

    Raises:
        InfeasibleBudgetError: no start fits the budget; ``min_peak_bytes`` is the smallest
            peak of any start, a schedule that fits a budget that large.
    """
    if started is None:
        started = begin(problems, mem_budget_bytes, config=config, extra_starts=extra_starts,
                        all_gather_stream=all_gather_stream, baselines=baselines)
    objective, found, split_best, best = started.objective, started.found, started.split_best, started.best
    primary = objective.labels[0]
    stages = list(started.stages)

    work_left = 0.0 if starts_only else work_limit
    # windows with one cost model only: under several, a window solved under one of them
    # traded that model against the others and no window was ever taken (module docstring)
    if backend is not None and len(objective.labels) == 1 and work_left * config.window_share >= config.window_work:
        t, n0, before = time.perf_counter(), objective.evaluations, best
        best, spent = windows(objective, best, backend, config, work_left * config.window_share, seed, num_workers)
        work_left = max(0.0, work_left - spent)
        stages.append(_stage("windows", t, spent, objective.evaluations - n0, best, primary, before))

    def polish(start: Evaluated, evaluations: int, strict_models: tuple[str, ...] = ()) -> polishing.PolishResult:
        return polishing.polish(objective.problems, start.schedule, _polish_reference(objective), mem_budget_bytes,
                                polishing.PolishConfig(max_evaluations=evaluations, steps=config.polish_steps),
                                baseline_ms=objective.baseline_ms, baseline_weight=objective.baseline_weight,
                                strict_models=strict_models, evaluator=objective.evaluator)

    n_polish = objective.evaluations_for(work_left, config)
    if n_polish >= POLISH_MIN_EVALUATIONS_PER_MODEL * len(objective.labels):
        t, before = time.perf_counter(), best
        polished, used, spent = best, 0, 0
        # a local search ends where its start leads: with several models, also from the best
        # start under each model alone (where the models disagree, the worst case lies between)
        froms = _polish_starts(objective, found, best, config.polish_starts)
        if split_best is not None:  # each choice of streams polished, the better kept
            other = split_best if not best.schedule.split_groups else found[0]
            froms = [f for f in froms if not f.same_schedule(other)][:config.polish_starts - 1]
            froms.append(other)
        for k, start in enumerate(froms):
            share = (n_polish - used) // (len(froms) - k)
            if share < POLISH_MIN_EVALUATIONS_PER_MODEL * len(objective.labels):
                continue
            result = polish(start, share)
            # the pass of splits is bounded by the buckets, not the share: it takes none from
            # the polishes after this one
            used += result.evaluations - result.split_evaluations
            spent += result.evaluations
            polished = _kept(objective, result.schedule, start, polished)
        best = polished
        stages.append(_stage("polish", t, work_left * spent / n_polish, spent, best, primary, before))
        if objective.strict_loss(best) > 0:
            # every polished schedule loses to a baseline under a strict model: the polish again,
            # the loss first, from the start that loses least (a baseline that is the best under
            # every strict model loses nothing), the best polished one on a tie (module docstring)
            t, before = time.perf_counter(), best
            share = max(n_polish - used, int(n_polish * config.strict_share))
            start = min([best, *found], key=objective.key)
            result = polish(start, share, objective.strict)
            best = _kept(objective, result.schedule, start, best)
            stages.append(_stage("strict", t, work_left * result.evaluations / n_polish, result.evaluations, best,
                                 primary, before))
    if finish and _polished(stages):
        best = _last_stages(objective, best, stages, mem_budget_bytes, config)
    return _result(dataclasses.replace(started, stages=stages), best)


def finish(started: Started, result: SolveResult, mem_budget_bytes: int | None,
           config: SearchConfig = SearchConfig()) -> SolveResult:
    """The search's last stages (links, ahead) on ``result``, the answer :func:`search` with
    ``finish=False`` gave from ``started``: a caller that runs several searches of one graph (the
    orders of compute of :mod:`scheduler.orders`) and keeps one answer runs them on that one
    alone. ``result`` itself where no stage improves it, or where the polish did not run."""
    if not _polished(result.stages):
        return result
    objective = started.objective
    best = objective.evaluate(result.schedule, result.start)
    if best is None:
        raise ValueError("result is not a schedule of the search's graph")
    best.origin = next((e for e in started.found if e.name == result.start and not e.same_schedule(best)), None)
    stages = list(result.stages)
    kept = _last_stages(objective, best, stages, mem_budget_bytes, config)
    if kept is best:
        return dataclasses.replace(result, stages=tuple(stages))
    return dataclasses.replace(_result(dataclasses.replace(started, stages=stages), kept), notes=result.notes)


def _polished(stages: Sequence[StageRecord]) -> bool:
    """Whether the polish ran: the last stages refine a polished answer, and with work for the
    starts alone (``work_limit`` too small for the polish) they do not run either."""
    return any(st.name == "polish" for st in stages)


def _last_stages(objective: Objective, best: Evaluated, stages: list[StageRecord], mem_budget_bytes: int | None,
                 config: SearchConfig) -> Evaluated:
    """The links and ahead stages from ``best`` (module docstring), each recorded in ``stages``
    where it kept a move: the best schedule found."""
    primary, reference = objective.labels[0], _polish_reference(objective)
    passes = (("links", config.link_rounds,
               functools.partial(polishing.link_pass, rounds=config.link_rounds, trials=config.link_trials)),
              ("ahead", config.ahead_trials, functools.partial(polishing.ahead_pass, trials=config.ahead_trials)))
    for name, on, run in passes:
        if not on:
            continue
        t, before = time.perf_counter(), best
        found = run(objective.problems, best.schedule, reference, mem_budget_bytes, baseline_ms=objective.baseline_ms,
                    baseline_weight=objective.baseline_weight, strict_models=objective.strict,
                    evaluator=objective.evaluator)
        if found is not None:
            best = _kept(objective, found.schedule, best, best)
            stages.append(_stage(name, t, 0.0, found.evaluations, best, primary, before))
    return best


def _kept(objective: Objective, schedule: Schedule, start: Evaluated, incumbent: Evaluated) -> Evaluated:
    """``schedule``, a stage's answer from ``start``, evaluated (found from ``start``'s start)
    where it fits and its key is lower than ``incumbent``'s; else ``incumbent``."""
    e = objective.evaluate(schedule, start.name)
    if e is None:
        return incumbent
    e.origin = start.start
    return e if objective.fits(e) and objective.key(e) < objective.key(incumbent) else incumbent


def _result(started: Started, best: Evaluated) -> SolveResult:
    """The search's answer: ``best``, or the start best by the objective's key where that is
    better (no stage may end worse than a start it could have kept: with too little work for
    the polish, the start best by the regret may lose to a baseline that another start does
    not)."""
    objective, found = started.objective, started.found
    primary = objective.labels[0]
    floor = min(found, key=objective.key)
    if objective.key(floor) < objective.key(best):
        best = floor
    origin = best.start
    alternatives = tuple(e.schedule for e in found if not e.same_schedule(best))
    status = SolveStatus.FEASIBLE if best is not found[0] or any(s.name != "starts" for s in started.stages) else \
        SolveStatus.HEURISTIC
    notes = (f"best start: {found[0].name}",)
    problems = objective.problems
    return SolveResult(best.schedule, status, "search", best.step_ms(primary), problems[primary].lower_bound_ms(),
                       time.perf_counter() - started.t0, best.peak_bytes, notes, alternatives=alternatives,
                       stages=tuple(started.stages), start=origin.name,
                       start_step_ms={label: origin.step_ms(label) for label in objective.labels},
                       step_ms_by_model={label: best.step_ms(label) for label in objective.labels})


def _polish_starts(objective: Objective, found: Sequence[Evaluated], best: Evaluated, most: int) -> list[Evaluated]:
    """The polish's starts: ``best``, then with several models the fastest start under each
    (distinct ones, at most ``most`` in all)."""
    out = [best]
    if len(objective.labels) > 1:
        for label in objective.labels:
            fastest = min(found, key=lambda e: (e.step_ms(label), objective.regret_key(e)))
            if all(not fastest.same_schedule(o) for o in out):
                out.append(fastest)
    return out[:most]


def _polish_reference(objective: Objective) -> dict[str, float]:
    """The polish's reference per model: the objective's (one model: any positive number, the
    regret then orders by step time alone)."""
    return dict(objective.reference_ms)


def _stage(name: str, t0: float, work: float, evaluations: int, e: Evaluated, label: str,
           before: Evaluated) -> StageRecord:
    return StageRecord(name=name, wall_s=time.perf_counter() - t0, work=work, evaluations=evaluations,
                       step_ms=e.step_ms(label), gained_ms=max(0.0, before.step_ms(label) - e.step_ms(label)))
