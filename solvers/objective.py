"""What the search of :mod:`solvers.search` optimises and the values it is tuned by.

:class:`SearchConfig` holds every tuning value of the search; :class:`Ordering` the one order of
schedules every stage uses (step time under one cost model; with several, the worst-case
regret, with a weighted penalty for a step slower than the best baseline's, :func:`regret`;
between finished schedules, and in the ``strict`` stage's polish, first the slowdown against
the best baseline under the strict models; in the polish, first the bytes over the budget);
:class:`Objective` the models a schedule is judged under, their evaluator and the budget;
:class:`Evaluated` a schedule with its evaluation under every model. The stages
(:mod:`solvers.starts`, :mod:`solvers.search`, :mod:`solvers.polish`) share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from solvers.config import CpSatConfig, MilpConfig, renamed_fields
from solvers.core.evaluate import Evaluation, ModelEvaluator
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule, ScheduleError
from solvers.core.simulator import ScheduleInvalidError


@renamed_fields(window_s="window_work")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Every tuning value of the search (module docstring)."""

    #: blocks per bucket of the regular bucketings tried as starts
    start_sizes: tuple[int, ...] = (1, 2, 3, 4)
    #: buckets of issue-ahead of the regular bucketings tried as starts
    start_aheads: tuple[int, ...] = (1, 2)
    #: deeper issue-aheads tried, in order, for a regular bucketing that fits the budget at the
    #: deepest of ``start_aheads``, and kept only where they fit: a budget with room for several
    #: buckets in flight (a joint graph at the per-block plan's peak) is used by a deeper
    #: prefetch that the polish's moves of one issue at a time do not reach, while under a tight
    #: budget they would crowd out of the fitting stage the starts it can move under the budget.
    #: They are candidates but not the regret's references (the fastest start under each model):
    #: far ahead under one model of the family, they would pull the worst case towards it
    start_deep_aheads: tuple[int, ...] = (4,)
    #: moves a start over the budget may take to get under it (each evaluates the buckets alive
    #: at the peak, delayed or waited sooner)
    fit_moves: int = 8
    #: starts over the budget moved under it: the best of them by the objective that can be
    fit_starts: int = 4
    #: starts over the budget tried per one of ``fit_starts`` (most cannot be moved under it,
    #: and each try costs ``fit_moves`` peaks' worth of moves)
    fit_tries_per_start: int = 4
    #: starts over the budget by at most this share of it are tried first
    near_miss_share: float = 0.05
    #: share of the work limit the CP-SAT windows get (0: no windows); the polish gets the rest
    window_share: float = 0.5
    #: deterministic work of one window (work units of ``SolverOptions.work_limit``, on the
    #: backend's deterministic clock). Was ``window_s``, which still works for one release
    #: (deprecated)
    window_work: float = 0.3
    #: collectives a window frees (about three transformer blocks)
    window_members: int = 27
    #: collectives between the first of one window and the first of the next (None: half of
    #: ``window_members``, so that the collectives at a window's edge, whose neighbours outside
    #: stay fixed, are in the middle of the next one)
    window_stride: int | None = None
    #: sweeps over the windows at most (a sweep that gains nothing ends them)
    window_sweeps: int = 2
    #: schedules the polish starts from: the best start, and with several cost models the fastest
    #: start under each (the work is shared among them)
    polish_starts: int = 3
    #: gap distances the polish moves one issue or wait by, largest first
    polish_steps: tuple[int, ...] = (8, 2, 1)
    #: after the polish, move the issues of buckets on a link that streams share past the
    #: exposed transfers of the other streams on it (:func:`solvers.polish.link_pass`), in this
    #: many rounds over the cost models (0: no such stage): a transfer beside a waited one
    #: slows it, and the polish's moves of one issue at a time do not get a queue of them out
    #: of its way
    link_rounds: int = 2
    #: placements the links stage tries per model and round (the whole, then halves of it)
    link_trials: int = 6
    #: last, issue the buckets the compute stream waits on earlier, also ahead of buckets of
    #: their chain needed before them (:func:`solvers.polish.ahead_pass`),
    #: trying at most this many earlier gaps per bucket (0: no such stage): every other stage
    #: issues a chain in the order of need, so on a FIFO stream a bucket ready early waits
    #: for one ready late, and the polish's moves of a few gaps seldom get one out of a queue
    ahead_trials: int = 4
    #: with several cost models, the weight of a step slower than the best baseline's (the
    #: traced order and the heuristics that fit) under some model, on top of the regret against
    #: the fastest start (:func:`regret`): a schedule that loses to a baseline
    #: under one plausible model is what a user without a trusted model cannot accept, while a
    #: large gain under one model must not be given up for a tiny one under another (0: the
    #: regret alone)
    baseline_weight: float = 10.0
    #: the cost models under which a schedule must not be slower than the best baseline, before
    #: anything else counts: the nominal models a user judges by (the family's unscaled ones,
    #: labelled so in every family: under a table they take the table's times too).
    #: Their slowdown against the baseline decides first between polished schedules, so that a
    #: regret under a scaled model, which the minimax leaves as the worst case, never buys a
    #: loss to a baseline under one of them (labels absent from the objective are ignored)
    strict_models: tuple[str, ...] = ("analytic", "torch")
    #: share of the polish's work the ``strict`` stage gets at least, when every polished
    #: schedule loses to a baseline under a strict model (and more where the polish left work)
    strict_share: float = 0.25
    #: calibration of the polish's work units: DAG nodes per work unit (about a second of one
    #: core) evaluated (:mod:`solvers.core.evaluate`) as the polish counts them (one model's
    #: evaluation of one neighbour, or the building of one); ``work`` units on a graph of
    #: ``n`` nodes are ``work`` x this / ``n`` of them, a number of the graph and the limit
    #: alone, so that every rank polishes alike
    evaluated_nodes_per_s: float = 1e7
    #: the CP-SAT backend's knobs and decision space (:class:`solvers.config.CpSatConfig`), for
    #: the windows of ``solver="cpsat"``
    cpsat: CpSatConfig = CpSatConfig()
    #: the MILP backend's knobs and decision space (:class:`solvers.config.MilpConfig`), for the
    #: windows of ``solver="milp"``
    milp: MilpConfig = MilpConfig()

    def __post_init__(self) -> None:
        if not self.start_sizes or min(self.start_sizes) < 1 or not self.start_aheads or min(self.start_aheads) < 1:
            raise ValueError(f"start_sizes and start_aheads must be positive counts, got {self.start_sizes} and "
                             f"{self.start_aheads}")
        if any(a <= max(self.start_aheads) for a in self.start_deep_aheads):
            raise ValueError(f"start_deep_aheads must be deeper than every start_aheads ({self.start_aheads}), got "
                             f"{self.start_deep_aheads}")
        if self.ahead_trials < 0:
            raise ValueError(f"ahead_trials must be >= 0, got {self.ahead_trials}")
        if self.link_rounds < 0 or self.link_trials < 1:
            raise ValueError(f"link_rounds must be >= 0 and link_trials >= 1, got {self.link_rounds} and "
                             f"{self.link_trials}")
        if self.fit_moves < 0 or self.fit_starts < 0 or self.fit_tries_per_start < 1:
            raise ValueError(f"fit_moves and fit_starts must be >= 0 and fit_tries_per_start >= 1, got "
                             f"{self.fit_moves}, {self.fit_starts} and {self.fit_tries_per_start}")
        if not self.near_miss_share >= 0:
            raise ValueError(f"near_miss_share must be >= 0, got {self.near_miss_share}")
        if not 0 <= self.window_share <= 1:
            raise ValueError(f"window_share must be in [0, 1], got {self.window_share}")
        if self.window_work <= 0 or self.window_members < 2 or self.window_sweeps < 0:
            raise ValueError("window_work must be > 0, window_members >= 2 and window_sweeps >= 0")
        if self.window_stride is not None and self.window_stride < 1:
            raise ValueError(f"window_stride must be >= 1 or None, got {self.window_stride}")
        if self.polish_starts < 1:
            raise ValueError(f"polish_starts must be >= 1, got {self.polish_starts}")
        if not self.polish_steps or min(self.polish_steps) < 1:
            raise ValueError(f"polish_steps must be positive gap distances, got {self.polish_steps}")
        if not self.baseline_weight >= 0:
            raise ValueError(f"baseline_weight must be >= 0, got {self.baseline_weight}")
        if not 0 <= self.strict_share <= 1:
            raise ValueError(f"strict_share must be in [0, 1], got {self.strict_share}")
        if not isinstance(self.strict_models, tuple) or not all(isinstance(m, str) for m in self.strict_models):
            raise ValueError(f"strict_models must be a tuple of cost model labels, got {self.strict_models!r}")
        if not self.evaluated_nodes_per_s > 0:
            raise ValueError(f"evaluated_nodes_per_s must be > 0, got {self.evaluated_nodes_per_s}")
        if not isinstance(self.cpsat, CpSatConfig) or not isinstance(self.milp, MilpConfig):
            raise TypeError(f"cpsat={self.cpsat!r} must be a solvers.config.CpSatConfig and milp={self.milp!r} a "
                            "solvers.config.MilpConfig")


#: a score (:meth:`Ordering.improves`) is lower only where it is lower by more than this in its
#: first unequal term: float noise between two equally fast schedules must not count as a gain,
#: or the polish would walk on it
SCORE_TOLERANCE = 1e-12

#: relative growth of a simulated step time taken as float noise (the same times summed in
#: another order), not as slower
SAME_STEP = 1e-9


def baseline_loss(step_ms: float, baseline_ms: float | None) -> float:
    """How much slower than ``baseline_ms`` a step is (0 when not slower or no baseline)."""
    return max(0.0, step_ms / baseline_ms - 1) if baseline_ms is not None else 0.0


def regret(step_ms: float, reference_ms: float, baseline_ms: float | None = None, weight: float = 0.0) -> float:
    """The regret of a step time under one model: ``step / reference - 1``, plus ``weight``
    times how much slower than ``baseline_ms`` it is (the best baseline's step under that model;
    None: no baseline). :class:`Ordering` orders schedules by it in every stage."""
    r = step_ms / reference_ms - 1
    if baseline_ms is not None and weight and step_ms > baseline_ms:
        r += weight * (step_ms / baseline_ms - 1)
    return r


class Ordering:
    """The one order of schedules of the search, smaller better; every stage compares by it.

    A schedule's *score* is (bytes over the budget, slowdown against the best baseline under the
    worst strict model, worst-case regret over the models, sum of the regrets) (:func:`regret`,
    :func:`baseline_loss`), compared term by term. :meth:`key` is the score of a schedule that
    fits, for sorting and choosing (with one model its regret terms are the step time itself:
    the regret is that over a positive reference, so the order is the same);
    :meth:`improves` and :meth:`rules_out` compare a score against a bar as the polish accepts
    a move: lower beyond :data:`SCORE_TOLERANCE`, from a partial score as models are added.

    Args:
        labels: the cost models' labels, in the objective's order.
        mem_budget_bytes: the budget (None: none).
        reference_ms: label -> the regret's reference step (the fastest start's), > 0.
        baseline_ms: label -> the best baseline's step (absent: no baseline under that model).
        baseline_weight: weight of a slowdown against the baseline in the regret.
        strict_models: labels whose slowdown against the baseline comes first (empty: none).
    """

    def __init__(self, labels: Sequence[str], mem_budget_bytes: int | None, reference_ms: Mapping[str, float],
                 baseline_ms: Mapping[str, float] | None = None, baseline_weight: float = 0.0,
                 strict_models: Sequence[str] = ()):
        self.labels = list(labels)
        self.mem_budget_bytes = mem_budget_bytes
        self.reference_ms = dict(reference_ms)
        self.baseline_ms = dict(baseline_ms or {})
        self.baseline_weight = baseline_weight
        #: the strict labels with a baseline (without one nothing is lost)
        self.strict = frozenset(label for label in strict_models if label in self.baseline_ms)

    def regret(self, label: str, step_ms: float) -> float:
        return regret(step_ms, self.reference_ms[label], self.baseline_ms.get(label), self.baseline_weight)

    def loss(self, label: str, step_ms: float) -> float:
        """The slowdown against the baseline under ``label`` when it is strict, else 0."""
        return baseline_loss(step_ms, self.baseline_ms[label]) if label in self.strict else 0.0

    def excess(self, peak_bytes: int) -> int:
        """Bytes over the budget (0: it fits)."""
        return max(peak_bytes - self.mem_budget_bytes, 0) if self.mem_budget_bytes is not None else 0

    def key(self, step_ms: Mapping[str, float]) -> tuple[float, float, float]:
        """(strict slowdown, worst-case regret, sum of regrets) of a schedule of these steps per
        label (ms); with one model (strict slowdown, step, step)."""
        loss = max((self.loss(label, step_ms[label]) for label in self.strict), default=0.0)
        if len(self.labels) == 1:
            t = step_ms[self.labels[0]]
            return (loss, t, t)
        regrets = [self.regret(label, step_ms[label]) for label in self.labels]
        return (loss, max(regrets), sum(regrets))

    @staticmethod
    def rules_out(excess: int, loss: float, worst: float, bar: tuple[int, float, float, float]) -> bool:
        """A partial score (models still to add only raise its terms) is already no lower than
        ``bar`` in its first unequal term."""
        return excess > bar[0] or (excess == bar[0] and (
            loss > bar[1] + SCORE_TOLERANCE or (loss >= bar[1] - SCORE_TOLERANCE and worst > bar[2] + SCORE_TOLERANCE)))

    @staticmethod
    def improves(score: tuple[int, float, float, float], bar: tuple[int, float, float, float]) -> bool:
        """``score`` is lower than ``bar`` beyond :data:`SCORE_TOLERANCE` (a lower excess, of
        equal excess a lower loss, then a lower worst case, then a lower sum)."""
        excess, loss, worst, total = score
        return excess < bar[0] or (excess == bar[0] and (
            loss < bar[1] - SCORE_TOLERANCE or (loss <= bar[1] + SCORE_TOLERANCE and (
                worst < bar[2] - SCORE_TOLERANCE or (worst <= bar[2] + SCORE_TOLERANCE and total < bar[3] - SCORE_TOLERANCE)))))


@dataclasses.dataclass
class Evaluated:
    """A schedule and its evaluation under every model of the objective."""

    schedule: Schedule
    sims: dict[str, Evaluation]
    name: str = ""
    #: the start this schedule was found from (None: it is a start itself)
    origin: "Evaluated | None" = None
    #: ``hash(schedule_content(schedule))``, made on first use (:meth:`same_schedule`)
    _content_hash: int | None = dataclasses.field(default=None, repr=False, compare=False)

    def same_schedule(self, other: "Evaluated") -> bool:
        """Whether the two schedules are equal (equal digests), compared by their contents'
        hashes first: most schedules differ, and a digest of each costs more than its hash."""
        if self.schedule is other.schedule:
            return True
        return self.content_hash == other.content_hash and \
            schedule_content(self.schedule) == schedule_content(other.schedule)

    @property
    def content_hash(self) -> int:
        """``hash(schedule_content(schedule))`` (within this process; never a digest)."""
        if self._content_hash is None:
            self._content_hash = hash(schedule_content(self.schedule))
        return self._content_hash

    @property
    def start(self) -> "Evaluated":
        """The start this schedule was found from (itself when it is one)."""
        return self.origin if self.origin is not None else self

    @property
    def peak_bytes(self) -> int:
        """Peak memory by the execution model's count (the same under every model): what the
        written graph holds, and what the budget bounds."""
        return max(s.peak_bytes for s in self.sims.values())

    def step_ms(self, label: str) -> float:
        return self.sims[label].step_ms


class Objective:
    """The models a schedule is judged under and the budget it must hold.

    Args:
        problems: model label -> the graph priced by that model; the first is the primary one
            (its chains and issue ranges define the moves; CP-SAT models it).
        mem_budget_bytes: peak-memory budget by the execution model's count; None: no limit.
        baseline_weight: :attr:`SearchConfig.baseline_weight`; with one model it has no use (the
            key is the step time) and is 0.
        strict_models: :attr:`SearchConfig.strict_models`; with one model, none.
    """

    def __init__(self, problems: Mapping[str, Problem], mem_budget_bytes: int | None, baseline_weight: float = 0.0,
                 strict_models: tuple[str, ...] = ()):
        # the evaluator refuses no problem, and problems of different graphs
        self.evaluator = ModelEvaluator(problems)
        self.problems = dict(problems)
        self.labels = list(problems)
        self.primary = self.problems[self.labels[0]]
        self.mem_budget_bytes = mem_budget_bytes
        #: label -> the reference step time of the regret (the fastest start's), set by the starts
        self.reference_ms: dict[str, float] = {}
        #: label -> the best baseline's step time (the traced order's and the heuristics'), set by
        #: the starts; a slowdown against it weighs :attr:`baseline_weight` more
        self.baseline_ms: dict[str, float] = {}
        self.baseline_weight = baseline_weight if len(self.labels) > 1 else 0.0
        self.strict = tuple(label for label in self.labels if label in strict_models) if len(self.labels) > 1 else ()
        self.evaluations = 0

    def evaluate(self, schedule: Schedule, name: str = "", content_hash: int | None = None) -> Evaluated | None:
        """``schedule`` under every model (:class:`solvers.core.evaluate.ModelEvaluator`: the
        simulator's numbers; memory once, a timeline per model); None when it is no valid
        schedule of the graph. ``content_hash``: :attr:`Evaluated.content_hash` when the caller has it."""
        self.evaluations += 1
        try:
            sims = self.evaluator.evaluate(schedule)
        except (ScheduleInvalidError, ScheduleError, ValueError):
            return None
        return Evaluated(schedule, sims, name, _content_hash=content_hash)

    def fits(self, e: Evaluated) -> bool:
        return self.mem_budget_bytes is None or e.peak_bytes <= self.mem_budget_bytes

    def ordering(self, strict: bool = True) -> Ordering:
        """The order of schedules as it stands (the starts set the references and baselines):
        with the strict models first (``strict``), or by the regret alone."""
        return Ordering(self.labels, self.mem_budget_bytes, self.reference_ms, self.baseline_ms, self.baseline_weight,
                        self.strict if strict else ())

    def key(self, e: Evaluated) -> tuple[float, float, float]:
        """What decides between finished schedules, smaller better (:meth:`Ordering.key`:
        strict slowdown, then :meth:`regret_key`)."""
        return self.ordering().key(_steps(e))

    def regret_key(self, e: Evaluated) -> tuple[float, float]:
        """What orders the starts and the windows, smaller better (:meth:`Ordering.key` without
        the strict models): (worst-case regret, sum of regrets); with one model, the step time."""
        return self.ordering(strict=False).key(_steps(e))[1:]

    def strict_loss(self, e: Evaluated) -> float:
        """How much slower than the best baseline ``e`` is under its worst strict model (0: under
        none)."""
        return self.ordering().key(_steps(e))[0]

    def evaluations_for(self, work: float, config: SearchConfig) -> int:
        """The polish's evaluations (one model's evaluation of one neighbour, as
        :func:`solvers.polish.polish` counts them) in ``work`` work units on this graph."""
        return int(work * config.evaluated_nodes_per_s / max(1, self.primary.dag.number_of_nodes()))


def schedule_content(schedule: Schedule) -> tuple:
    """What :meth:`Schedule.digest` hashes, as a tuple: two schedules have equal contents iff
    they are equal (and so iff their digests are). Comparing contents costs a pass over the
    steps; a digest also serialises and hashes them, which the starts would pay for every
    schedule they try."""
    steps = schedule.steps
    return (tuple(b.members for b in schedule.buckets), tuple([s.kind for s in steps]),
            tuple([s.ref for s in steps]), schedule.split_groups)


def _steps(e: Evaluated) -> dict[str, float]:
    return {label: sim.step_ms for label, sim in e.sims.items()}
