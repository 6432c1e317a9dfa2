"""Check, fast: the step time and both peak-memory counts of a schedule, equal to the simulator's.

:func:`solvers.core.simulator.simulate` walks every node of the graph in Python; a search that
judges thousands of neighbours, each under several cost models, spends most of its time there.
An :class:`Evaluator` is built per problem (its analysis is cached per problem) and gives the
same numbers from work that grows with the number of buckets, not of nodes:

- Compute positions are fixed: a schedule only places issue and wait steps into the gaps
  between compute nodes (:mod:`solvers.core.schedule`). Time is the simulator's own walk
  (:class:`solvers.core.timeline.Clock`) without its records, so ``step_ms``,
  ``exposed_comm_ms`` and ``comm_ms`` are the simulator's floats bit for bit.
- Memory is split in two, once per graph (:mod:`solvers.core.memory_analysis`): the storages
  whose allocation and last release happen at compute nodes whatever the schedule make a fixed
  profile; every other storage changes the live bytes only at its bucket's steps (a template
  per bucket, cached by its members) or is freed by whichever of its readers runs last (a
  *floating* free, placed per schedule). The peak is a sweep over the issue and wait steps with a
  range maximum of the profile between them (:mod:`solvers.core.peaks`).

One source of the rules. The storages, their owners, their uses and those never freed are the
execution model's static data (``memory.static_memory``: ``mem_owner`` / ``trk_owner``,
``mem_uses`` / ``trk_uses``, ``*_never_free``, ``preds``, ``inputs``), and so is what each step
does with them: a compute node's storages (``steps``: the results it allocates by each count, those
nothing reads, which the execution model's count drops at once) and a bucket's issue and wait as
the micro-operations the simulator itself runs (``StaticMemory.bucket_ops``: allocations, records,
releases, frees). Where a merged bucket's members are views of one result (a reduce-scatter, an
all-gather on one rank: ``memory.copied_out``), the releases of a member's storage go to
that result, as ``memory.merged_memory`` makes them. A change of those rules reaches
both at once; what keeps it from making the evaluator silently wrong is a guard at build time
(the releases the operations make of every storage are exactly its uses in the static data, and a
collective releases alone what it releases in a bucket) and the tests
(``tests/test_evaluate.py``: the evaluator's numbers against the simulator's on every graph and
schedule kind, the traced and a merged schedule of each among them). Where the guard fails,
where an operation is one the templates do not know, or where a storage cannot be placed
(one made by several collectives, by a node and a collective, made inside the issue range of a
collective that frees it, or the result of a merged bucket whose members are views of it read by
another collective), the evaluator does not guess: :attr:`Evaluator.fast` is False and every
evaluation is :func:`simulate`'s (the reason is logged and kept in :attr:`Evaluator.reason`).

Assumption: the schedule is valid (:func:`~solvers.core.validator.validate_schedule` accepts
it) and its compute nodes run in ``problem.seq`` order, as every schedule builder here makes
them. All of that but the order of the compute nodes is checked on every call, cheaply: each
collective in one bucket, every bucket issued once and waited once after its issue, a merged
bucket of one kind of movable collectives, each bucket issued and waited inside its issue range
``[max ready, min needed]``, a collective that reads another's result issued after that one's
wait (:attr:`Problem.issue_after`). A schedule that fails is simulated instead, so the numbers
stay the simulator's.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from solvers.core.memory_analysis import AT_ISSUE, AT_WAIT
from solvers.core.peaks import Template, memory_model
from solvers.core.plan import PlannedBucket, chain_key
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule, Step, gaps_reading_in_gap, order_gap
from solvers.core.simulator import ScheduleInvalidError, SimResult, simulate
from solvers.core.timeline import Timeline, bucket_steps

logger = logging.getLogger(__name__)

_ISSUE, _WAIT = AT_ISSUE, AT_WAIT


#: what a search reads of one schedule under one cost model: the execution model's one result
#: type, its figures only (:meth:`SimResult.figures`)
Evaluation = SimResult


@dataclasses.dataclass(frozen=True)
class ReadSchedule:
    """A schedule as the evaluator reads it: each bucket's members and the issue and wait
    steps in execution order, ``(is_issue, bucket index, gap)``. ``schedule`` is the schedule
    it was read from (None when read from a plan, :meth:`Evaluator.read_plan`, whose buckets
    ``plan`` then holds in the schedule's order); ``fast`` False when the cheap validity checks
    failed and the simulator must judge it."""

    members: tuple[tuple[str, ...], ...]
    steps: tuple[tuple[bool, int, int], ...]
    fast: bool
    schedule: Schedule | None = None
    plan: tuple[PlannedBucket, ...] | None = None
    #: each bucket's template in the memory model that checked this schedule
    templates: tuple = dataclasses.field(default=(), repr=False, compare=False)
    model: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: :attr:`Schedule.split_groups` of the schedule
    split_groups: tuple[str, ...] = ()

    def to_schedule(self, problem: Problem) -> Schedule:
        """The schedule itself (built from the plan when it was not given)."""
        if self.schedule is not None:
            return self.schedule
        n = problem.n
        order: list[list] = [[] for _ in range(n + 1)]
        for is_issue, b, gap in self.steps:
            order[gap].append(("issue" if is_issue else "wait", b))
        steps: list[Step] = []
        for g in range(n + 1):
            steps.extend(Step(k, b) for k, b in order[g])
            if g < n:
                steps.append(Step("node", problem.seq[g]))
        return Schedule(tuple(Bucket(m) for m in self.members), tuple(steps), self.split_groups)


# -- the evaluators --------------------------------------------------------------------------
class Evaluator:
    """Exact, fast evaluation of schedules of one problem (module docstring). The first one
    built for a problem analyses its memory (cached per problem); later ones are cheap.

    Attributes:
        fast: False when the evaluator cannot place every storage of the graph exactly; then
            every evaluation is the simulator's (``reason`` says why).
        fallbacks: schedules handed to the simulator so far (failed cheap checks or not fast).
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.memory = memory_model(problem)
        self.timeline = Timeline(problem)
        self.fallbacks = 0
        self.after = _collective_dependencies(problem)
        self.involved = {m for c, _, d in self.after for m in (c, d)}
        self.fast = self.memory.reason is None
        self.reason = self.memory.reason
        #: a gap's content -> its steps in order_gap's order (:meth:`_gap_order`)
        self._gap_orders: dict[tuple, tuple[tuple[int, bool], ...]] = {}

    # -- reading ---------------------------------------------------------------------------
    def read(self, schedule: Schedule) -> ReadSchedule:
        """``schedule`` read into a :class:`ReadSchedule` (one pass over its steps)."""
        ops = bucket_steps(schedule)
        members = tuple(b.members for b in schedule.buckets)
        templates = self._check(members, ops) if len(schedule.steps) - len(ops) == self.problem.n else None
        if templates is not None and schedule.split_groups and \
                not set(schedule.split_groups) <= set(self.problem.splittable_groups()):
            templates = None  # the simulator says what is wrong with it
        return ReadSchedule(members, ops, templates is not None, schedule=schedule, templates=templates or (),
                            model=self.memory, split_groups=schedule.split_groups)

    def read_plan(self, plan: Sequence[PlannedBucket], split_groups: tuple[str, ...] = ()) -> ReadSchedule:
        """The :class:`ReadSchedule` of the schedule :func:`solvers.core.plan.build_schedule`
        builds from ``plan``, without building it: buckets sorted by
        (issue gap, need, ready, traced issue, members) of their first member; in a gap, the
        waits of buckets issued earlier, then the issues, then the waits of buckets issued
        there, but an issue that reads the result of a bucket waited in its gap after that
        wait (:meth:`Problem.schedule_at`, :meth:`Schedule.from_positions`).

        Raises:
            ValueError: a bucket's gaps are not ``0 <= issue <= wait <= n``.
        """
        problem = self.problem
        n = problem.n
        ordered = sorted(plan, key=lambda e: chain_key(problem, e))
        # the buckets whose results each reads (only those that read one)
        after = {b: ds for b, ds in problem.bucket_reads([e[0].members for e in ordered]).items() if ds} \
            if self.after else {}
        if after:  # issues after the waits of the results they read, as schedule_at moves them
            ordered = self._clamped(ordered, after)
        keys = []
        for b, (bk, i, w) in enumerate(ordered):
            if not (0 <= i <= w <= n):
                raise ValueError(f"bucket {b}: need 0 <= issue_at ({i}) <= wait_at ({w}) <= {n}")
            keys.append((i, 1, b, True))
            keys.append((w, 0 if i < w else 2, b, False))
        keys.sort()
        if after:
            keys = self._after_waits(keys, after)
        ops = tuple((is_issue, b, gap) for gap, _, b, is_issue in keys)
        members = tuple(e[0].members for e in ordered)
        templates = self._check(members, ops)
        return ReadSchedule(members, ops, templates is not None, plan=tuple(ordered), templates=templates or (),
                            model=self.memory, split_groups=split_groups)

    def _clamped(self, ordered: list, after: Mapping[int, set[int]]) -> list:
        """``ordered`` planned buckets with each issue no earlier than the waits of the buckets whose
        results it reads (``after``; :meth:`Problem.after_waits`, as :meth:`Problem.schedule_at`
        does)."""
        issue, wait = self.problem.after_waits([e[0] for e in ordered], after, [e[1] for e in ordered],
                                               [e[2] for e in ordered])
        return [e if (e[1], e[2]) == (i, w) else PlannedBucket(e[0], i, w) for e, i, w in zip(ordered, issue, wait)]

    def _after_waits(self, keys: list, after: Mapping[int, set[int]]) -> list:
        """``keys`` (sorted ``(gap, phase, bucket, is_issue)``) with each gap that holds an issue
        reading the result of a bucket waited there (``after``: bucket -> the buckets whose
        results it reads) in :func:`order_gap`'s order, as :meth:`Problem.schedule_at` builds it."""
        issued, waited = {}, {}
        for gap, _, b, is_issue in keys:
            (issued if is_issue else waited)[b] = gap
        gaps = sorted(gaps_reading_in_gap(issued, waited, after))
        if not gaps:
            return keys
        out: list = []
        done = 0
        for gap in gaps:
            lo, hi = bisect.bisect_left(keys, (gap,)), bisect.bisect_left(keys, (gap + 1,))
            out.extend(keys[done:lo])
            out.extend((gap, 0, b, is_issue) for b, is_issue in self._gap_order(keys[lo:hi], after))
            done = hi
        out.extend(keys[done:])
        return out

    def _gap_order(self, group: list, after: Mapping[int, set[int]]) -> tuple[tuple[int, bool], ...]:
        """The (bucket, is_issue) steps of one gap's ``group`` of keys in :func:`order_gap`'s
        order; kept by the gap's content (a neighbour of a plan leaves most gaps as they were)."""
        key = (tuple((ph, b, is_issue) for _, ph, b, is_issue in group),
               tuple((b, frozenset(after.get(b, ()))) for _, _, b, is_issue in group if is_issue))
        found = self._gap_orders.get(key)
        if found is None:
            phase = {(is_issue, b): ph for _, ph, b, is_issue in group}
            steps = order_gap([("issue" if is_issue else "wait", b) for _, _, b, is_issue in group],
                              lambda ev: (phase[(ev[0] == "issue", ev[1])], ev[1]), after)
            found = tuple((st.ref, st.kind == "issue") for st in steps)
            if len(self._gap_orders) >= _GAP_ORDERS_KEPT:
                self._gap_orders.clear()
            self._gap_orders[key] = found
        return found

    def _check(self, members: tuple[tuple[str, ...], ...], ops) -> tuple[Template, ...] | None:
        """The cheap part of validity (module docstring): the buckets' templates, or None when
        the simulator must judge the schedule."""
        if not self.fast:
            return None
        colls = self.problem.colls
        names = set().union(*members) if members else set()
        if sum(map(len, members)) != len(colls) or len(names) != len(colls) or not names <= colls.keys():
            return None
        nb = len(members)
        issued = [-1] * nb
        waited = [-1] * nb
        for is_issue, b, gap in ops:
            if b.__class__ is not int or not 0 <= b < nb:
                return None
            if is_issue:
                if issued[b] >= 0:
                    return None
                issued[b] = gap
            else:
                if issued[b] < 0 or waited[b] >= 0:
                    return None
                waited[b] = gap
        if self.after and not self._ordered(members, ops):
            # it reads a result before it exists: no valid schedule, whatever the simulator's
            # clocks would say of it
            raise ScheduleInvalidError("a collective is issued before the wait of a collective whose result it reads")
        cache = self.memory.templates
        template = self.memory.template
        out = []
        for b, ms in enumerate(members):
            t = cache.get(ms) or template(ms)
            if not t.valid or waited[b] < 0 or issued[b] < t.lo or waited[b] > t.hi:
                return None
            out.append(t)
        return tuple(out)

    def _ordered(self, members: tuple[tuple[str, ...], ...], ops) -> bool:
        """A collective that reads another's result is issued (or waited) after that one's
        wait, in another bucket."""
        involved = self.involved
        bucket = {m: b for b, ms in enumerate(members) for m in ms if m in involved}
        step: dict[tuple[int, int], int] = {}
        for k, (is_issue, b, _) in enumerate(ops):
            step[(b, _ISSUE if is_issue else _WAIT)] = k
        for c, anchor, d in self.after:
            bc, bd = bucket.get(c), bucket.get(d)
            if bc is None or bd is None or bc == bd or step[(bc, anchor)] < step[(bd, _WAIT)]:
                return False
        return True

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, schedule: Schedule | ReadSchedule) -> Evaluation:
        """The :class:`Evaluation` of a schedule (or of its :class:`ReadSchedule`); the same numbers
        as :func:`simulate` for a valid schedule (module docstring).

        Raises:
            ScheduleInvalidError: as :func:`simulate` does (a bucket never waited, or waited
                before it is issued).
        """
        read = schedule if isinstance(schedule, ReadSchedule) else self.read(schedule)
        peaks = self.peaks(read)
        if peaks is None:
            return self._simulated(read)
        return self.timed(read, peaks)

    def peaks(self, read: ReadSchedule) -> tuple[int, int] | None:
        """(peak_bytes, tracker_peak_bytes) of a read schedule; None when the simulator must judge it."""
        if not (self.fast and read.fast):
            return None
        if read.model is self.memory:
            return self.memory.peaks(read, read.templates)
        template = self.memory.template
        return self.memory.peaks(read, [template(m) for m in read.members])

    def timed(self, read: ReadSchedule, peaks: tuple[int, int]) -> Evaluation:
        """The evaluation of a read schedule whose peaks are known (they are the same under every cost
        model of one graph)."""
        return self.evaluation(self.times(read), peaks, read)

    def times(self, read: ReadSchedule) -> tuple[float, float, float, dict[str, float]]:
        """The timeline's figures of a read schedule (:meth:`Timeline.run`): its time without
        its memory."""
        return self.timeline.run(read.steps, read.members, read.split_groups)

    @staticmethod
    def evaluation(times: tuple[float, float, float, dict[str, float]], peaks: tuple[int, int],
                   read: ReadSchedule) -> Evaluation:
        """The evaluation of ``read`` from its timeline's figures (:meth:`Timeline.run`) and its peaks."""
        step, compute, exposed, comm = times
        return Evaluation(step_ms=step, compute_ms=compute, exposed_comm_ms=exposed, comm_ms=comm,
                          peak_bytes=peaks[0], tracker_peak_bytes=peaks[1], n_collectives=len(read.members))

    def _simulated(self, read: ReadSchedule) -> Evaluation:
        self.fallbacks += 1
        p = self.problem
        return simulate(p.dag, read.to_schedule(p), problem=p).figures()


#: gap orders an evaluator keeps (:meth:`Evaluator._gap_order`) before it starts again
_GAP_ORDERS_KEPT = 100_000


def _collective_dependencies(p: Problem) -> tuple[tuple[str, int, str], ...]:
    """``(c, _ISSUE, d)``: collective ``c``'s issue (its prologue, itself) reads the result of
    collective ``d`` (:attr:`Problem.issue_after`), so runs after ``d``'s wait. The issue ranges do
    not say it (they count compute nodes only)."""
    return tuple((name, _ISSUE, d) for name in p.colls for d in sorted(p.issue_after[name]))


#: the evaluator of each problem (problems are not changed once built)
_EVALUATORS: "weakref.WeakKeyDictionary[Problem, Evaluator]" = weakref.WeakKeyDictionary()


def evaluator_of(problem: Problem) -> "Evaluator":
    """The :class:`Evaluator` of ``problem``, built once."""
    e = _EVALUATORS.get(problem)
    if e is None:
        e = _EVALUATORS[problem] = Evaluator(problem)
    return e


def evaluate(problem: Problem, schedule: Schedule) -> Evaluation:
    """``simulate(problem.dag, schedule, problem=problem)``'s numbers, fast (the problem's
    :class:`Evaluator`, built once)."""
    return evaluator_of(problem).evaluate(schedule)


class ModelEvaluator:
    """One graph priced by several cost models (same nodes, collectives and bytes, other
    runtimes): a schedule is read once, its memory counted once per distinct memory (once,
    when the problems share their bytes), its timeline run per model.

    Raises:
        ValueError: no problem, or problems of different graphs (other compute nodes or
            collectives, or other issue ranges).
    """

    def __init__(self, problems: Mapping[str, Problem]):
        if not problems:
            raise ValueError("ModelEvaluator needs at least one cost model's problem")
        self.labels = list(problems)
        self.evaluators = {label: evaluator_of(p) for label, p in problems.items()}
        first = self.evaluators[self.labels[0]]
        self.first = first
        shape = _shape(first.problem)
        for label, e in self.evaluators.items():
            if _shape(e.problem) != shape:
                raise ValueError(f"problem {label!r} is not the same graph as {self.labels[0]!r}: every model must "
                                 "price the same export")
        # problems with equal memory share one memory model: its peaks are counted once, for the
        # first of them
        self.memory_of: dict[str, str] = {}
        first_of: dict[int, str] = {}
        for label, e in self.evaluators.items():
            self.memory_of[label] = first_of.setdefault(id(e.memory), label) if e.fast else label

    def read(self, schedule: Schedule) -> ReadSchedule:
        return self.first.read(schedule)

    def read_plan(self, plan: Sequence[PlannedBucket], split_groups: tuple[str, ...] = ()) -> ReadSchedule:
        return self.first.read_plan(plan, split_groups)

    def evaluate(self, schedule: Schedule | ReadSchedule, labels: Sequence[str] | None = None) -> dict[str, Evaluation]:
        """Label -> the :class:`Evaluation` of ``schedule`` under that model (``labels``: only
        those, in that order)."""
        read = schedule if isinstance(schedule, ReadSchedule) else self.read(schedule)
        evals = self.lazy(read)
        return {label: evals(label) for label in (labels or self.labels)}

    def lazy(self, read: ReadSchedule) -> "LazyEvaluation":
        """The evaluations of ``read`` under each model, each made when first asked
        (:class:`LazyEvaluation`), for a search that stops at the first model that rules a
        schedule out."""
        return LazyEvaluation(self, read)


class LazyEvaluation:
    """One read schedule under the models of a :class:`ModelEvaluator`, each figure made when
    first asked and kept: its memory counted at most once per memory model, each model's
    timeline run at most once. Calling it with a model's label gives the :class:`Evaluation`;
    :meth:`step_ms` the step time alone, without counting memory where the evaluator counts
    it apart from time (a search with no budget rules schedules out on their time alone)."""

    def __init__(self, models: ModelEvaluator, read: ReadSchedule):
        self.models = models
        self.read = read
        self._peaks: dict[str, tuple[int, int] | None] = {}
        self._times: dict[str, tuple[float, float, float, dict[str, float]]] = {}
        self._done: dict[str, Evaluation] = {}

    def _peaks_of(self, label: str) -> tuple[int, int] | None:
        source = self.models.memory_of[label]
        if source not in self._peaks:
            self._peaks[source] = self.models.evaluators[source].peaks(self.read)
        return self._peaks[source]

    def step_ms(self, label: str) -> float:
        """The step time under ``label``: its timeline alone where the evaluator counts memory
        itself, else the simulator's evaluation (time and memory come together there).

        Raises:
            ScheduleInvalidError: as :meth:`Evaluator.evaluate`.
        """
        e = self.models.evaluators[label]
        if not (e.fast and self.read.fast):
            return self(label).step_ms
        return self._times_of(label)[0]

    def _times_of(self, label: str) -> tuple[float, float, float, dict[str, float]]:
        times = self._times.get(label)
        if times is None:
            times = self._times[label] = self.models.evaluators[label].times(self.read)
        return times

    def __call__(self, label: str) -> Evaluation:
        """The :class:`Evaluation` under ``label`` (:meth:`Evaluator.evaluate`'s numbers).

        Raises:
            ScheduleInvalidError: as :meth:`Evaluator.evaluate`.
        """
        done = self._done.get(label)
        if done is None:
            e = self.models.evaluators[label]
            found = self._peaks_of(label)
            if found is None:
                done = e._simulated(self.read)
            else:
                done = e.evaluation(self._times_of(label), found, self.read)
            self._done[label] = done
        return done


def _shape(p: Problem) -> tuple:
    """What makes two problems the same graph for one read schedule: the compute sequence and the
    collectives with their issue ranges."""
    return (p.seq, tuple((m, c.ready, c.needed, c.movable, c.key, c.traced_issue) for m, c in p.colls.items()))
