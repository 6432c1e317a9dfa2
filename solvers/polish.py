"""Polish: a local search on the evaluator, the search's last stage (:mod:`solvers.search`).

Formulation. One graph priced by each cost model ``m`` of a set ``M`` (a
:class:`~solvers.core.problem.Problem` ``P_m`` each: same nodes, collectives and bytes, other
times), a reference step time ``R_m > 0`` per model, a budget ``B``:

    minimise    max_{m in S} max(0, t_m(s) / B_m - 1)   slower than a baseline under a strict model
    then        max_m  r_m(s)                    the worst-case regret (one model: the step time)
    then        sum_m  r_m(s)                    ties: the total
    where       r_m(s) = t_m(s) / R_m - 1 + w * max(0, t_m(s) / B_m - 1)
    subject to  (1) ``s`` is a valid schedule of the graph: members of a bucket share a
                    chain and are consecutive in it, every chain issues in order, issue and
                    wait within each bucket's issue range (:func:`_neighbours`, :func:`chain_ordered`)
                (2) peak(s) <= B by the execution model's count (the memory the written graph
                    holds; it is the same under every model)
                (3) no bucket of several collectives over ``max_bucket_bytes`` of payload

where ``B_m`` is the step time of the best baseline under model ``m``, ``S`` the strict models
(the nominal ones a user judges by: no regret elsewhere may buy a loss to a baseline under
them; none unless given) and ``w`` a weight (:func:`regret`: being slower than a baseline
under some model costs far more than regret against the fastest known schedule), ``t_m(s)``
the step time of ``s`` under ``P_m``, evaluated exactly
(:class:`solvers.core.evaluate.ModelEvaluator`: the simulator's numbers, memory once, a
timeline per model). A start over the budget is first moved under it: the score is (bytes
over ``B``, strict slowdown, worst-case regret, total), compared in that order, and the result
is refused when the excess stays. The score and its comparison are the search's one order
(:class:`solvers.objective.Ordering`; the search sorts and chooses by the same).

Search: first-improvement local search. Moves (:func:`_neighbours`): merge two consecutive
buckets of a chain (all-gathers keep the earlier issue and wait, reduce-scatters the later);
move the boundary between two consecutive buckets of a chain by one unit (a run of one
block's collectives) or one collective (:func:`_transfers`); or move one bucket's issue or
wait by ``k`` gaps for ``k`` in :attr:`PolishConfig.steps`. Moves are scanned cyclically from
the one after the last accepted; a neighbour is evaluated under the model of largest regret
first and rejected as soon as one model's regret exceeds the current worst, so most rejected
moves cost one evaluation. The search stops after a full scan without gain or when
:attr:`PolishConfig.max_evaluations` are spent: work is counted in evaluations, not seconds,
so every rank gets the same schedule from the same graph. Then one pass tries splitting each
bucket into its members, issued and waited where it was, kept where it lowers the score and
slows no model (:attr:`PolishConfig.splits`): no move above ends a bucket, and a local search
whose limit binds on a large graph would seldom reach such a move were it one of them.

:func:`link_pass` and :func:`ahead_pass`, the search's stages after the polish, work on the
same score with the same rule (kept where the score drops and no model slows): issues of
buckets on a link that streams share moved past the exposed transfers of the other streams on
it; issues of buckets the compute stream waits on moved earlier, also ahead of buckets of
their chain needed before them.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from solvers.config import renamed_fields
from solvers.core.evaluate import Evaluation, ModelEvaluator, ReadSchedule
from solvers.core.plan import PlannedBucket, build_schedule, chain_ordered, chain_units
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule, Step
from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.streams import stream_of
from solvers.core.units import fmt_bytes
from solvers.heuristics import issue_range
from solvers.objective import SAME_STEP, Ordering, regret

__all__ = ["PolishConfig", "PolishResult", "ahead_pass", "link_pass", "polish", "regret"]

logger = logging.getLogger(__name__)


@renamed_fields(max_simulations="max_evaluations")
@dataclasses.dataclass(frozen=True, kw_only=True)
class PolishConfig:
    """Limits and moves of :func:`polish`."""

    #: deterministic work limit of the moves, in evaluations: one per model and neighbour
    #: evaluated (fewer when a neighbour is rejected early), and one more per neighbour built
    #: (the pass of splits after them is bounded by the number of buckets instead). Was
    #: ``max_simulations``, which still works for one release (deprecated)
    max_evaluations: int = 4000
    #: gap distances a bucket's issue or wait is moved by, largest first
    steps: tuple[int, ...] = (8, 2, 1)
    #: move the boundary between consecutive buckets by one unit or collective (:func:`_transfers`)
    transfers: bool = True
    #: once the moves above end, try splitting each bucket into its members, issued and waited
    #: where it was, bucket by bucket, kept where no model's step grows (:func:`_split_pass`):
    #: where its transfer stays hidden, a bucket's copies into and out of its buffer cost
    #: compute that its members alone do not, and no move above ends a bucket
    splits: bool = True
    #: largest payload of a merged bucket in bytes (None: no cap)
    max_bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1, got {self.max_evaluations}")
        if not self.steps or any(k < 1 for k in self.steps):
            raise ValueError(f"steps must be positive gap distances, got {self.steps}")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes < 1:
            raise ValueError(f"max_bucket_bytes must be >= 1 or None, got {self.max_bucket_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolishResult:
    """What :func:`polish` found (the start itself when no move gained)."""

    schedule: Schedule
    #: model label -> simulated step time of ``schedule`` (ms)
    step_ms: dict[str, float]
    #: model label -> ``step_ms / reference - 1``
    regret: dict[str, float]
    peak_bytes: int
    #: moves accepted
    moves: int
    #: evaluations spent (as :attr:`PolishConfig.max_evaluations` counts them), the pass of
    #: splits included
    evaluations: int
    #: of those, the pass of splits' (outside the moves' limit)
    split_evaluations: int = 0
    solve_time_s: float
    #: why the search stopped
    stopped: str

    @property
    def worst_regret(self) -> float:
        return max(self.regret.values())


def polish(problems: Mapping[str, Problem], start: Schedule, reference_ms: Mapping[str, float],
           mem_budget_bytes: int | None = None, config: PolishConfig = PolishConfig(), *,
           baseline_ms: Mapping[str, float] | None = None, baseline_weight: float = 0.0,
           strict_models: Sequence[str] = (), evaluator: ModelEvaluator | None = None) -> PolishResult:
    """Lower the worst-case regret of ``start`` across the models of ``problems`` (module
    docstring).

    Args:
        problems: model label -> the graph priced by that model (same collectives, same
            nodes in the same order; the first problem's chains and issue ranges define the moves).
        start: a schedule of that graph; one over ``mem_budget_bytes`` is first moved under it
            (moves that lower the excess are taken before any other).
        reference_ms: model label -> the best step time known under that model (ms, > 0), e.g.
            the best candidate's; the regret under ``m`` is ``t_m / reference_ms[m] - 1``.
        mem_budget_bytes: peak-memory budget (bytes) by the execution model's count (the
            memory the written graph holds); None: no limit.
        baseline_ms, baseline_weight: the best baseline's step per model and the weight of a
            slowdown against it (:func:`regret`); None or 0: the regret alone.
        strict_models: labels under which a slowdown against ``baseline_ms`` comes first
            (module docstring); none: the regret alone decides.
        evaluator: the evaluator of ``problems`` to use (the search's own, shared); None: one
            is built.

    Raises:
        ValueError: no problem, problems of different graphs, a reference missing or not > 0,
            or a start that is not a valid schedule of them.
        InfeasibleBudgetError: the moves could not bring the start under the budget (states
            the smallest peak reached).
    """
    t0 = time.perf_counter()
    search, current = _begun(problems, start, reference_ms, mem_budget_bytes, baseline_ms, baseline_weight,
                             strict_models, evaluator, "the start schedule")
    schedule, score, sims = current
    moves, k, unchanged = 0, 0, 0
    stopped = "converged: no move lowers the worst-case regret"
    memo: tuple[dict, dict] = ({}, {})
    neighbours = _neighbours(search.p0, _plan_of(schedule), config, memo)
    while neighbours and unchanged < len(neighbours):
        if search.evaluations >= config.max_evaluations:
            stopped = f"work limit: {config.max_evaluations} evaluations"
            break
        k %= len(neighbours)
        found = search.scored_plan(neighbours[k], score)
        if found is not None:
            schedule, score, sims = found
            moves += 1
            unchanged = 0
            neighbours = _neighbours(search.p0, _plan_of(schedule), config, memo)
            logger.debug("polish move %d: excess %d B, strict slowdown %.4f, worst regret %.4f (%d evaluations)",
                         moves, score[0], score[1], score[2], search.evaluations)
        else:
            unchanged += 1
        k += 1  # the scan goes on from the next move, not from the first
    moved = search.evaluations
    if config.splits and score[0] == 0:
        found = _split_pass(search, schedule, score, sims)
        if found is not None:
            (schedule, score, sims), split = found
            moves += split
    peak = max(s.peak_bytes for s in sims.values())
    if score[0] > 0:
        raise InfeasibleBudgetError(
            f"the polish could not bring its start under the budget of {fmt_bytes(mem_budget_bytes or 0)}: "
            f"the smallest peak it reached is {fmt_bytes(peak)} ({peak} B); start from a schedule that fits",
            mem_budget_bytes=mem_budget_bytes or 0, min_peak_bytes=peak)
    regrets = {label: search.regret(label, sims[label].step_ms) for label in search.labels}
    result = PolishResult(schedule=search.schedule_of(schedule),
                           step_ms={label: sims[label].step_ms for label in search.labels}, regret=regrets,
                           peak_bytes=peak, moves=moves, evaluations=search.evaluations,
                           split_evaluations=search.evaluations - moved,
                           solve_time_s=time.perf_counter() - t0, stopped=stopped)
    logger.info("polish: worst-case regret %.2f %% after %d moves, %d evaluations, %.1f s (%s)",
                100 * result.worst_regret, moves, search.evaluations, result.solve_time_s, stopped)
    return result


def _split_pass(search: "_Search", schedule: Schedule | ReadSchedule, score: tuple[int, float, float, float],
                sims: Mapping[str, Evaluation]):
    """Each bucket of several collectives of ``schedule`` split into its members (issued and
    waited where it was), one after another in the plan's order, each split kept where it lowers
    the score and no model's step time grows: ((schedule, score, evaluations by label), splits
    kept), or None when none is kept. The pass is for copies that cost compute while the
    transfers stay hidden, which every model gains from; a split that trades one model for
    another is the moves' business. It runs outside the moves' limit, whatever they spent: one
    evaluation per bucket and one per model at most, a pass bounded by the number of buckets."""
    plan = _plan_of(schedule)
    best, kept = None, 0
    colls = search.p0.colls  # fixed collectives stay
    for entry in [e for e in plan if len(e.members) > 1 and colls[e.members[0]].movable]:
        alone = [PlannedBucket(Bucket((m,)), entry.issue_at, entry.wait_at) for m in entry.members]
        found = search.scored_plan([x for x in plan if x != entry] + alone, score)
        if found is None or _slows(found[2], sims):
            continue
        best, kept = found, kept + 1
        score, sims = found[1], found[2]
        plan = _plan_of(found[0])
    return None if best is None else (best, kept)


def _slows(new: Mapping[str, Evaluation], old: Mapping[str, Evaluation]) -> bool:
    """Some model's step time grows from ``old`` to ``new`` by more than float rounding (a
    transfer moved to another time sums the same times in another order)."""
    return any(new[label].step_ms > old[label].step_ms * (1 + SAME_STEP) for label in old)


def link_pass(problems: Mapping[str, Problem], schedule: Schedule, reference_ms: Mapping[str, float],
              mem_budget_bytes: int | None = None, *, baseline_ms: Mapping[str, float] | None = None,
              baseline_weight: float = 0.0, strict_models: Sequence[str] = (),
              evaluator: ModelEvaluator | None = None, rounds: int = 2, trials: int = 6) -> PolishResult | None:
    """Issues of buckets on a link that streams share moved after the exposed transfers of the
    other streams on it, each move kept where it lowers :func:`polish`'s score and no model's
    step time grows; None where the graph's streams share no link or no move is kept (arguments
    as :func:`polish`'s; ``schedule`` fits the budget).

    On a shared link a transfer in flight beside another slows both (processor sharing,
    :mod:`solvers.core.streams`); where the other is waited on by the compute stream (an
    expert-parallel all-to-all between its dispatch and its combine), the step loses the time it
    lost. The polish's moves shift one bucket by a few gaps, and a bucket queued among others on
    its stream gains nothing until every one queued with it is out of the way: the local search
    does not get there. Here each model's run in turn names the flights to avoid
    (:func:`_clear_issues`); the whole placement is tried first, then halves of it (the last in
    issue order first: a later bucket moved drags no other of its stream), at most ``trials``
    per model and round, ``rounds`` rounds over the models (a move kept changes the runs that
    name the flights): work bounded by the number of models, not by the graph, counted in
    evaluations like the polish's."""
    t0 = time.perf_counter()
    links = next(iter(problems.values())).stream_links(schedule.split_groups)
    if len(set(links.values())) == len(links):
        return None
    search, current = _begun(problems, schedule, reference_ms, mem_budget_bytes, baseline_ms, baseline_weight,
                             strict_models, evaluator, "the schedule")
    kept = 0
    for _ in range(rounds):
        found = _link_round(search, current, trials)
        if found is None:
            break
        current, k = found
        kept += k
    if not kept:
        return None
    schedule_, score, sims = current
    return _moves_kept(search, schedule_, sims, kept, t0)


def _link_round(search: "_Search", current, trials: int):
    """One round of :func:`link_pass`, each model's run in turn (one that names the moves of an
    earlier one in the round is skipped): (the schedule, its score and evaluations, moves kept),
    or None when none is kept."""
    schedule, score, sims = current
    # every model's run of the round's start: once a move is kept they name flights that have
    # moved a little, and each placement is evaluated exactly anyway
    runs = {lb: _Run(search.problems[lb], search.schedule_of(schedule)) for lb in search.labels}
    kept, seen = 0, []
    for label in search.labels:
        targets = _clear_issues(runs, label)
        if not targets or targets in seen:
            continue
        seen.append(targets)
        pending = [list(reversed(list(targets.items())))]
        for _ in range(trials):
            if not pending:
                break
            part = dict(pending.pop(0))
            trial = [PlannedBucket(e.bucket, part.get(e.members, e.issue_at), e.wait_at) for e in _plan_of(schedule)]
            found = search.scored_plan(trial, score)
            if found is not None and not _slows(found[2], sims):
                kept += 1
                schedule, score, sims = found
            elif len(part) > 1:  # its halves, each tried on what is kept by then
                items = list(part.items())
                pending[:0] = [items[:len(items) // 2], items[len(items) // 2:]]
    return None if not kept else ((schedule, score, sims), kept)


def ahead_pass(problems: Mapping[str, Problem], schedule: Schedule, reference_ms: Mapping[str, float],
               mem_budget_bytes: int | None = None, *, baseline_ms: Mapping[str, float] | None = None,
               baseline_weight: float = 0.0, strict_models: Sequence[str] = (),
               evaluator: ModelEvaluator | None = None, trials: int = 4) -> PolishResult | None:
    """Buckets the compute stream waits on, issued earlier, also ahead of buckets of their
    chain needed before them; each move kept where it lowers :func:`polish`'s score and no
    model's step time grows; None where no move is kept (arguments as :func:`polish`'s;
    ``schedule`` fits the budget).

    Every other stage issues a chain's buckets in the order they are needed
    (:func:`solvers.core.plan.chain_ordered`): a bucket ready long before a bucket needed
    earlier than it, but ready only just before that need (a tensor-parallel all-gather of a
    saved activation behind the output gradient's), is then issued with that one and queues
    behind its transfer on their FIFO stream. And the polish moves an issue by a few gaps at a
    time, each move kept only where it gains by itself: out of a queue, moving one bucket a
    few gaps seldom does. Here each bucket that some model's compute stream waits on, issued
    after its readiness, is tried at earlier gaps down to its readiness: right after the issue
    of another bucket some model's compute stream waits on (the bucket's copy into its buffer
    then costs no time: the compute stream would have waited), latest first, then at its
    readiness; at most ``trials`` per bucket, each evaluated exactly."""
    t0 = time.perf_counter()
    search, current = _begun(problems, schedule, reference_ms, mem_budget_bytes, baseline_ms, baseline_weight,
                             strict_models, evaluator, "the schedule")
    p0 = search.p0
    issue, _ = schedule.positions()
    buckets = schedule.buckets
    sims = {lb: simulate(search.problems[lb].dag, schedule, problem=search.problems[lb]) for lb in search.labels}
    # the buckets some model's compute stream waits on
    waited = {k for sim in sims.values() for k, ms in sim.bucket_exposed_ms.items() if ms > 0}
    kept = 0
    sched, score, evals = current
    steps = list(schedule.steps)
    at = _issue_steps(steps)
    for k in sorted(waited, key=lambda k: (issue[k], k)):
        ready = max(p0.colls[m].ready for m in buckets[k].members)
        if ready >= issue[k] or not p0.colls[buckets[k].members[0]].movable:
            continue
        mine = at[k]
        # after the issue of a bucket the compute stream later waits on: the copy into this
        # bucket's buffer is spent while that transfer runs
        spots = sorted(((issue[x], at[x] + 1) for x in waited if x != k and ready <= issue[x] < issue[k]),
                       reverse=True)[:trials - 1]
        first = _gap_start(steps, ready)
        for g, j in [*spots, (ready, first)]:
            trial = steps[:mine] + steps[mine + 1:]
            trial.insert(j if j < mine else j - 1, Step("issue", k))
            search.evaluations += 1
            try:
                found = search.scored(Schedule(buckets, tuple(trial), schedule.split_groups), score)
            except (ScheduleInvalidError, ValueError):  # it reads a result not waited for by then
                found = None
            if found is not None and not _slows(found[2], evals):
                sched, score, evals = found
                steps, issue[k] = trial, g
                at = _issue_steps(steps)
                kept += 1
                break
    if not kept:
        return None
    return _moves_kept(search, sched, evals, kept, t0)


def _moves_kept(search: "_Search", schedule: Schedule | ReadSchedule, sims: Mapping[str, Evaluation], kept: int,
                t0: float) -> PolishResult:
    """The :class:`PolishResult` of a pass after the polish (:func:`link_pass`, :func:`ahead_pass`)
    that kept ``kept`` moves, ending at ``schedule`` evaluated as ``sims``."""
    return PolishResult(schedule=search.schedule_of(schedule), step_ms={lb: sims[lb].step_ms for lb in search.labels},
                        regret={lb: search.regret(lb, sims[lb].step_ms) for lb in search.labels},
                        peak_bytes=max(s.peak_bytes for s in sims.values()), moves=kept,
                        evaluations=search.evaluations, solve_time_s=time.perf_counter() - t0,
                        stopped=f"{kept} move(s) kept")


def _issue_steps(steps: Sequence[Step]) -> dict[int, int]:
    """Bucket -> the index of its issue in ``steps``."""
    return {st.ref: j for j, st in enumerate(steps) if st.kind == "issue"}  # type: ignore[misc]


def _gap_start(steps: Sequence[Step], gap: int) -> int:
    """The index in ``steps`` of the first step of gap ``gap`` (after ``gap`` node steps)."""
    seen = 0
    for j, st in enumerate(steps):
        if seen == gap:
            return j
        seen += st.kind == "node"
    return len(steps)


class _Run:
    """One model's run of a schedule, as :func:`_clear_issues` reads it."""

    def __init__(self, p: Problem, schedule: Schedule):
        self.p, self.schedule = p, schedule
        self.sim = simulate(p.dag, schedule, problem=p)
        self.reached = [0.0]  # when the compute stream reaches each gap
        for n in p.seq:
            self.reached.append(self.sim.node_times[n][1] if n in self.sim.node_times else self.reached[-1])

    def alone(self, members: tuple[str, ...]) -> float:
        """The bucket's transfer time alone, counted as its members' times summed: above the
        simulator's price of a merged bucket (:meth:`Problem.bucket_comm_ms`), so that a move
        leaves it more room before its wait."""
        return sum(self.p.colls[m].runtime_ms for m in members)


def _clear_issues(runs: Mapping[str, _Run], label: str) -> dict[tuple[str, ...], int]:
    """Bucket members -> a later issue gap, for the buckets that model ``label``'s run has in
    flight beside an exposed transfer of another stream on their link.

    Each stream that shares a link, its movable buckets in issue order: the earliest time, no
    earlier than its issue and than the end of the stream's previous bucket so placed, at which
    its transfer (at its time alone) crosses no flight of another stream on the link that the
    compute stream waited for; its issue moves to the first gap the compute stream reaches then,
    where in every model's run the transfer alone still ends by the time the compute stream
    reaches the bucket's wait (a move that exposes it under another model would be refused)."""
    run = runs[label]
    p, schedule, sim = run.p, run.schedule, run.sim
    split = tuple(schedule.split_groups)
    links = p.stream_links(split)
    issue, wait = schedule.positions()
    stream = [stream_of(p.colls[b.members[0]].coll_type, p.colls[b.members[0]].group_name, split)
              for b in schedule.buckets]
    out: dict[tuple[str, ...], int] = {}
    for s in sorted(set(stream)):
        exposed = sorted(sim.bucket_times[k][1:3] for k, other in enumerate(stream)
                         if other != s and links[other] == links[s] and sim.bucket_exposed_ms.get(k, 0.0) > 0)
        if not exposed:
            continue
        free = 0.0
        for k in sorted((k for k, other in enumerate(stream) if other == s and p.colls[schedule.buckets[k].members[0]].movable),
                        key=lambda k: (issue[k], k)):
            members = schedule.buckets[k].members
            alone = run.alone(members)
            t, crossing = max(run.reached[issue[k]], free), True
            while crossing:
                crossing = False
                for a, e in exposed:
                    if a < t + alone and e > t:
                        t, crossing = e, True
            g = bisect.bisect_left(run.reached, t, lo=issue[k], hi=wait[k] + 1)
            if issue[k] < g <= wait[k] and all(r.reached[g] + r.alone(members) <= r.reached[wait[k]]
                                                for r in runs.values()):
                out[members] = g
            else:
                g = issue[k]
            free = max(run.reached[g], free) + alone
    return out


def _begun(problems: Mapping[str, Problem], schedule: Schedule, reference_ms: Mapping[str, float],
           mem_budget_bytes: int | None, baseline_ms: Mapping[str, float] | None, baseline_weight: float,
           strict_models: Sequence[str], evaluator: ModelEvaluator | None, what: str):
    """The :class:`_Search` of a pass from ``schedule`` and ``schedule`` scored (arguments as
    :func:`polish`'s; ``what`` names ``schedule`` in the error).

    Raises:
        ValueError: ``schedule`` is not a valid schedule of the problems' graph.
    """
    search = _Search(problems, reference_ms, mem_budget_bytes, baseline_ms, baseline_weight, schedule.split_groups,
                     strict_models, evaluator)
    current = search.scored(schedule, None)
    if current is None:
        raise ValueError(f"{what} is not a valid schedule of the problems' graph")
    return search, current


class _Search:
    """The models, the references and the evaluation count of one :func:`polish`."""

    def __init__(self, problems: Mapping[str, Problem], reference_ms: Mapping[str, float],
                 mem_budget_bytes: int | None, baseline_ms: Mapping[str, float] | None = None,
                 baseline_weight: float = 0.0, split_groups: tuple[str, ...] = (), strict_models: Sequence[str] = (),
                 evaluator: ModelEvaluator | None = None):
        # the evaluator refuses no problem, and problems of different graphs
        self.evaluator = evaluator if evaluator is not None else ModelEvaluator(problems)
        self.labels = list(problems)
        self.problems = dict(problems)
        self.p0 = self.problems[self.labels[0]]
        missing = [label for label in self.labels if not reference_ms.get(label, 0) > 0]
        if missing:
            raise ValueError(f"reference step times must be > 0 for every model; missing or not > 0: {missing}")
        #: the search's one order (:class:`solvers.objective.Ordering`), its regret also with one model
        self.ordering = Ordering(self.labels, mem_budget_bytes, {label: float(reference_ms[label]) for label in
                                                                 self.labels}, baseline_ms, baseline_weight,
                                 strict_models)
        self.strict = self.ordering.strict
        self.evaluations = 0
        #: the start's :attr:`Schedule.split_groups`, which every move keeps
        self.split_groups = split_groups
        #: model labels: a strict one the schedule loses to the baseline under, then the one of
        #: largest regret first (rejects most neighbours at once)
        self.order = list(self.labels)

    def scored_plan(self, plan: list[PlannedBucket], bar: tuple[int, float, float, float]):
        """:meth:`scored` of the schedule of ``plan`` (:func:`solvers.core.plan.build_schedule`)
        without building it: an accepted one is returned as its
        :class:`~solvers.core.evaluate.ReadSchedule` (:func:`_plan_of` reads it, :meth:`schedule_of`
        builds the schedule)."""
        ordered = chain_ordered(self.p0, plan)
        if ordered is None:
            return None
        # counted as one evaluation, the cost of building the schedule before the evaluator read
        # plans directly, so that work limits keep their meaning
        self.evaluations += 1
        try:
            read = self.evaluator.read_plan(ordered, self.split_groups)
        except ValueError:
            return None
        return self.scored(read, bar)

    def schedule_of(self, schedule: Schedule | ReadSchedule) -> Schedule:
        """The schedule of an accepted plan (:meth:`scored_plan`), as ``build_schedule`` builds it."""
        if isinstance(schedule, ReadSchedule):
            return schedule.schedule or build_schedule(self.p0, list(schedule.plan)).with_split(self.split_groups)
        return schedule

    def scored(self, schedule: Schedule | ReadSchedule, bar: tuple[int, float, float, float] | None):
        """(schedule, (excess bytes over the budget, strict slowdown, worst regret, total),
        evaluations by label)
        when ``schedule`` is valid and its score is below ``bar`` (None: any valid one), else
        None. Evaluates the models in :attr:`order` (:class:`~solvers.core.evaluate.ModelEvaluator`:
        the simulator's numbers, memory counted once) and stops at the first that rules it out;
        each model evaluated counts as one evaluation. With no budget a schedule is ruled out
        on its step times alone, and its memory is counted only once it improves on the bar."""
        read = schedule if isinstance(schedule, ReadSchedule) else self.evaluator.read(schedule)
        evaluation = self.evaluator.lazy(read)
        # with no budget memory rules nothing out: it is counted for the schedule kept alone
        by_time = bar is not None and self.ordering.mem_budget_bytes is None
        # excess, loss and worst only grow as models are added: a partial score already worse
        # than the bar in its first unequal term rules the schedule out
        excess, loss, worst, total = 0, 0.0, -float("inf"), 0.0
        for label in self.order:
            try:
                if by_time:
                    step = evaluation.step_ms(label)
                else:
                    sim = evaluation(label)
                    step, excess = sim.step_ms, max(excess, self.ordering.excess(sim.peak_bytes))
            except ScheduleInvalidError:
                return None
            finally:
                self.evaluations += 1
            loss = max(loss, self.ordering.loss(label, step))
            r = self.regret(label, step)
            if bar is not None and Ordering.rules_out(excess, loss, r, bar):
                return None
            worst, total = max(worst, r), total + r
        if bar is not None and excess == bar[0] and not Ordering.improves((excess, loss, worst, total), bar):
            return None
        sims = {label: evaluation(label) for label in self.order}
        ratio = {label: self.regret(label, sims[label].step_ms) for label in self.labels}
        losing = {label for label in self.strict if self.ordering.loss(label, sims[label].step_ms) > 0}
        self.order = sorted(self.labels, key=lambda label: (label not in losing, -ratio[label]))
        return schedule, (excess, loss, worst, total), sims

    def regret(self, label: str, step_ms: float) -> float:
        return self.ordering.regret(label, step_ms)


def _plan_of(schedule: Schedule | ReadSchedule) -> list[PlannedBucket]:
    if isinstance(schedule, ReadSchedule) and schedule.plan is not None:
        return list(schedule.plan)  # the buckets and gaps of the schedule it builds, in its order
    issue, wait = schedule.positions()
    return [PlannedBucket(b, issue[k], wait[k]) for k, b in enumerate(schedule.buckets)]


def _neighbours(p: Problem, plan: list[PlannedBucket], config: PolishConfig,
                memo: tuple[dict, dict] | None = None) -> "_Moves":
    """Every schedule one move from ``plan`` (module docstring), merges first, then
    transfers, then shifts, as plans (:func:`solvers.core.plan.chain_ordered` keeps each
    chain's issue order), each built when read (:class:`_Moves`). ``memo``: the moves of each
    pair of consecutive buckets and of each bucket, kept between calls of one search (a move
    changes one or two buckets, the moves of the others stay)."""
    pairs, singles = ({}, {}) if memo is None else memo
    index = {m: (key, i) for key, names in p.chains.items() for i, m in enumerate(names)}
    by_chain: dict[tuple, list[int]] = {}
    for e, (bk, _, _) in enumerate(plan):
        if bk.members[0] in index:
            by_chain.setdefault(index[bk.members[0]][0], []).append(e)
    merges: list[tuple[int, int, tuple[PlannedBucket, ...]]] = []
    transfers: list[tuple[int, int, tuple[PlannedBucket, ...]]] = []
    for key, es in by_chain.items():
        es.sort(key=lambda e: index[plan[e][0].members[0]][1])
        gather = p.colls[plan[es[0]][0].members[0]].coll_type == "all_gather"
        for a, b in zip(es, es[1:]):
            pair = (plan[a], plan[b])
            if pair not in pairs:
                pairs[pair] = _pair_moves(p, index, plan[a], plan[b], gather, config)
            merged, moved = pairs[pair]
            if merged is not None:
                merges.append((a, b, (merged,)))
            transfers.extend((a, b, new) for new in moved)
    shifts: list[tuple[int, PlannedBucket]] = []
    for e, entry in enumerate(plan):
        if entry.members[0] not in index:
            continue  # fixed collectives stay where they are
        if entry not in singles:
            singles[entry] = _shifts(p, entry, config)
        shifts.extend((e, moved) for moved in singles[entry])
    return _Moves(plan, merges + transfers, shifts)


def _pair_moves(p: Problem, index: dict[str, tuple], first: PlannedBucket, second: PlannedBucket, gather: bool,
                config: PolishConfig) -> tuple[PlannedBucket | None, list[tuple[PlannedBucket, ...]]]:
    """The merge of two consecutive buckets of a chain (None when it exceeds the cap or has no
    issue range) and the moves of the boundary between them (:func:`_transfers`)."""
    (b1, i1, w1), (b2, i2, w2) = first, second
    merged = None
    members = tuple(sorted(b1.members + b2.members, key=lambda m: index[m][1]))
    if _fits_cap(p, members, config):
        # all-gathers: ready by the earlier need; reduce-scatters: every gradient in first
        issue, wait = (min(i1, i2), min(w1, w2)) if gather else (max(i1, i2), max(w1, w2))
        merged = _placed(p, members, issue, wait)
    moved = [tuple(pair) for pair in _transfers(p, first, second, gather, config)] if config.transfers else []
    return merged, moved


def _shifts(p: Problem, entry: PlannedBucket, config: PolishConfig) -> tuple[PlannedBucket, ...]:
    """``entry`` with its issue or its wait moved by each distance of :attr:`PolishConfig.steps`,
    both ways, within its members' readiness and need."""
    bk, i, w = entry
    lo = max(p.colls[m].ready for m in bk.members)
    hi = min(p.colls[m].needed for m in bk.members)
    out = []
    for k in config.steps:
        for d in (-k, k):
            if lo <= i + d <= w:
                out.append(PlannedBucket(bk, i + d, w))
            if i <= w + d <= hi:
                out.append(PlannedBucket(bk, i, w + d))
    return tuple(out)


class _Moves(Sequence[list[PlannedBucket]]):
    """The neighbours of a plan (:func:`_neighbours`), in their order, each plan built when it
    is read: the search reads few of a large graph's neighbours before it moves, and building
    every one costs more than evaluating those few.

    A pair move replaces two buckets of a chain by new ones, put after the rest of the plan; a
    shift replaces one bucket where it stands."""

    def __init__(self, plan: list[PlannedBucket], pairs: list[tuple[int, int, tuple[PlannedBucket, ...]]],
                 shifts: list[tuple[int, PlannedBucket]]):
        self.plan, self.pairs, self.shifts = plan, pairs, shifts

    def __len__(self) -> int:
        return len(self.pairs) + len(self.shifts)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k < len(self.pairs):
            a, b, new = self.pairs[k]
            return [x for e, x in enumerate(self.plan) if e != a and e != b] + list(new)
        e, moved = self.shifts[k - len(self.pairs)]
        return [*self.plan[:e], moved, *self.plan[e + 1:]]


def _placed(p: Problem, members: tuple[str, ...], issue: int, wait: int) -> PlannedBucket | None:
    """A bucket of ``members`` at these gaps, moved into its issue range (issued once every
    member is ready, waited before any is needed: a merged reduce-scatter whose result compute
    reads is waited by that read); None when the range is empty."""
    lo, hi = issue_range(p, members)
    issue = max(issue, lo)
    if issue > hi:
        return None
    return PlannedBucket(Bucket(members), issue, min(max(wait, issue), hi))


def _fits_cap(p: Problem, members: Sequence[str], config: PolishConfig) -> bool:
    """A bucket of ``members`` is within :attr:`PolishConfig.max_bucket_bytes` (one alone
    always is: it is no merge)."""
    return config.max_bucket_bytes is None or len(members) < 2 or \
        sum(p.colls[m].payload_bytes for m in members) <= config.max_bucket_bytes


def _transfers(p: Problem, first: PlannedBucket, second: PlannedBucket, gather: bool,
               config: PolishConfig) -> list[list[PlannedBucket]]:
    """The moves of the boundary between consecutive buckets of one chain: the first bucket's
    last unit (:func:`chain_units`) or last collective to the second, the second's first unit
    or first collective to the first (a unit of one collective is one move). The bucket that
    gives keeps its issue and wait (still valid for fewer members). The one that takes keeps
    them where the piece allows: an all-gather is waited no later than the piece's need (and
    issued no later than that), a reduce-scatter issued no earlier than the piece's gradients
    are ready (and waited no earlier)."""
    (b1, i1, w1), (b2, i2, w2) = first, second

    def taking(members: tuple[str, ...], piece: tuple[str, ...], issue: int, wait: int) -> PlannedBucket | None:
        if gather:
            wait = min(wait, min(p.colls[m].needed for m in piece))
            return _placed(p, members, min(issue, wait), wait)
        issue = max(issue, max(p.colls[m].ready for m in piece))
        return _placed(p, members, issue, max(wait, issue))

    out: list[list[PlannedBucket | None]] = []
    if len(b1.members) > 1:  # the first bucket's tail joins the second
        for k in sorted({len(chain_units(p, b1.members)[-1]), 1}):
            if k < len(b1.members):
                piece = b1.members[-k:]
                out.append([PlannedBucket(Bucket(b1.members[:-k]), i1, w1), taking(piece + b2.members, piece, i2, w2)])
    if len(b2.members) > 1:  # the second bucket's head joins the first
        for k in sorted({len(chain_units(p, b2.members)[0]), 1}):
            if k < len(b2.members):
                piece = b2.members[:k]
                out.append([taking(b1.members + piece, piece, i1, w1), PlannedBucket(Bucket(b2.members[k:]), i2, w2)])
    return [pair for pair in out  # type: ignore[misc]
            if all(e is not None and _fits_cap(p, e[0].members, config) for e in pair)]
