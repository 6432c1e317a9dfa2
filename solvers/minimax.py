"""Minimax polish: one schedule that is good under every cost model at once.

The robust choice (:mod:`scheduler.robust`) picks, among candidates solved under one cost model
or a blend of two, the one whose worst-case regret across a family of cost models is least.
None of those candidates aims at the worst case itself: on llama3-8b's 8-layer backward the
best of them regrets 4.1 % under torch's estimators with bandwidths 30 % lower (BENCHMARKS.md
section 10), where a schedule solved under torch's model alone is best. This module searches
the worst case directly, on the simulator, from the best such candidate.

Formulation. One graph priced by each cost model ``m`` of a family ``M`` (a
:class:`~solvers.core.problem.Problem` ``P_m`` each: same nodes, collectives and bytes, other
times), a reference step time ``R_m > 0`` per model (the best known under ``m``), a budget ``B``:

    minimise    max_m  t_m(s) / R_m - 1          the worst-case regret
    then        sum_m  t_m(s) / R_m              ties: the total
    subject to  (1) ``s`` is a valid schedule of the graph: members of a bucket share a
                    chain and are consecutive in it, every chain issues in order, issue and
                    wait within each bucket's window (:func:`_neighbours`, and
                    :func:`solvers.periodic.chain_ordered`)
                (2) peak(s) <= B under every model (peak is bytes: models agree on it), by
                    both counts of the simulator: the execution model's and torch's
                    ``MemoryTracker`` rules on the written graph (``max_peak_bytes``)
                (3) no bucket of several collectives over ``max_bucket_bytes`` of payload

where ``t_m(s)`` is the simulated step time of ``s`` under ``P_m``
(:func:`solvers.core.simulate`: the execution model every solver and judge shares; the search
reads it, with both peaks, from :class:`solvers.core.evaluate.ModelEvaluator`, which gives the
simulator's numbers from work that grows with the buckets and counts memory once for all models).

A start over the budget is first moved under it: the score is (bytes over ``B``, worst-case
regret, total), compared in that order, so moves that lower the excess come first (and the
result is refused when the excess stays).

Search: first-improvement local search. Moves (:func:`_neighbours`): merge two consecutive
buckets of a chain (all-gathers keep the earlier issue and wait, reduce-scatters the later);
move the boundary between two consecutive buckets of a chain by one unit (a run of one
block's collectives, :func:`chain_units`) or one collective (:func:`_transfers`); or move one
bucket's issue or wait by ``k`` gaps for ``k`` in :attr:`MinimaxConfig.steps`. Transfers reach
what a merge and a split would only together: on llama3-debug's backward the best schedule moves one all-gather from
the first bucket to the second, and a merge alone breaks the budget by torch's tracker (2.54 %
worst regret without transfers, 1.72 % with).
Moves are scanned cyclically from the one after the last accepted; a neighbour is simulated
under the model of largest regret first and rejected as soon as one model's regret exceeds the
current worst, so most rejected moves cost one simulation (and one build of the schedule,
counted as one more). The search stops after a full scan without gain or when
:attr:`MinimaxConfig.max_simulations` are spent: work is counted in simulations, not seconds,
so every rank gets the same schedule from the same graph.

Regrouped starts (:func:`regrouped_starts`). The moves above change one bucket at a time, and
bucket granularity is not reachable that way: on llama3-8b's 32-layer forward the schedule
solved under our model puts two layers in each all-gather bucket, the one solved under torch's
estimators four; a schedule between them needs every bucket regrouped at once, and the polish
accepts no move from either (4.01 % worst regret). The generator rebuilds one
chain at a time as a regular bucketing (:class:`Regrouping`): the chain's collectives in units
of one repeated block (the export's ``block``; a collective outside every block is a unit of
its own), ``head`` units in the first bucket, ``size`` in each of the next, ``tail`` in the
last, every bucket issued ``ahead`` buckets early (all-gathers at the wait of the bucket
``ahead`` before; reduce-scatters as soon as their gradients are ready, waited at the issue
of the bucket ``ahead`` after). Each is simulated under every model; the
:attr:`MinimaxConfig.regroup_starts` best that fit the budget are starts for the polish. On
that forward the best has three layers per bucket (the embedding and four layers first, the
output projection alone last), issued two buckets ahead: 2.63 % worst regret, 2.61 % polished.

Refined starts (:func:`refinements`, :attr:`MinimaxConfig.regroup_refine`). Where one model
wants n blocks per bucket and another n + 1, the compromise cuts blocks: the best bucketing in
blocks is refined collective by collective (its middle size within half a block either way,
its head a block shorter or longer, one more bucket of issue-ahead). On that forward 29
collectives per bucket (3.2 layers; the embedding and three layers first, three ahead) regret
2.40 % before the polish, and 1.85 % on the written graph after a polish of
:attr:`MinimaxConfig.regroup_work` (6) times a start's work: such a start lies farther from
a local optimum than a solver's schedule (after a start's 1,716 simulations it was at 2.2 %).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from solvers.config import SIMULATED_NODES_PER_S
from solvers.core.evaluate import ModelEvaluator, Plan
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule
from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.units import fmt_bytes
from solvers.heuristics import window
from solvers.periodic import chain_ordered, from_entries

logger = logging.getLogger(__name__)

#: a regret counts as lower only below the current one by more than this (float noise)
_EPS = 1e-12

Entry = tuple[Bucket, int, int]  # (bucket, issue gap, wait gap)



@dataclasses.dataclass(frozen=True, kw_only=True)
class MinimaxConfig:
    """Limits of :func:`polish`."""

    #: deterministic work limit, in simulations: one per model and neighbour tried (fewer when a
    #: neighbour is rejected early), and one more per neighbour for building its schedule (about
    #: as costly). 4000 take about 40 s on llama3-8b's 8-layer backward (2357 nodes) on one
    #: core of the CI machine; :meth:`for_work` sizes it by a time
    max_simulations: int = 4000
    #: gap distances a bucket's issue or wait is moved by, largest first
    steps: tuple[int, ...] = (8, 2, 1)
    #: move the boundary between consecutive buckets by one unit or collective (:func:`_transfers`)
    transfers: bool = True
    #: largest payload of a merged bucket in bytes (None: no cap)
    max_bucket_bytes: int | None = None
    #: regrouped starts :func:`regrouped_starts` returns (0: none; the robust choice asks for some)
    regroup_starts: int = 0
    #: units (blocks) per bucket in the regular bucketings tried (:class:`Regrouping.size`)
    regroup_sizes: tuple[int, ...] = (1, 2, 3, 4)
    #: buckets of issue-ahead tried (:class:`Regrouping.ahead`)
    regroup_aheads: tuple[int, ...] = (1, 2)
    #: regular bucketings of single collectives :func:`regrouped_starts` returns beside the
    #: others (0: none): the best bucketing in blocks refined collective by collective
    #: (:func:`refinements`)
    regroup_refine: int = 0
    #: the polish from a refined start gets this many times :attr:`max_simulations`: it starts
    #: farther from a local optimum than a solver's schedule (on llama3-8b's 32-layer forward
    #: one needed about 10,000 simulations to settle, where a start gets 1,716)
    regroup_work: float = 1.0

    def __post_init__(self) -> None:
        if self.max_simulations < 1:
            raise ValueError(f"max_simulations must be >= 1, got {self.max_simulations}")
        if not self.steps or any(k < 1 for k in self.steps):
            raise ValueError(f"steps must be positive gap distances, got {self.steps}")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes < 1:
            raise ValueError(f"max_bucket_bytes must be >= 1 or None, got {self.max_bucket_bytes}")
        if self.regroup_starts < 0:
            raise ValueError(f"regroup_starts must be >= 0, got {self.regroup_starts}")
        if not self.regroup_sizes or any(k < 1 for k in self.regroup_sizes):
            raise ValueError(f"regroup_sizes must be positive unit counts, got {self.regroup_sizes}")
        if not self.regroup_aheads or any(a < 1 for a in self.regroup_aheads):
            raise ValueError(f"regroup_aheads must be positive bucket counts, got {self.regroup_aheads}")
        if self.regroup_refine < 0:
            raise ValueError(f"regroup_refine must be >= 0, got {self.regroup_refine}")
        if not self.regroup_work >= 1:
            raise ValueError(f"regroup_work must be >= 1 (a multiple of max_simulations), got {self.regroup_work}")

    @classmethod
    def for_work(cls, work_s: float, problem: Problem, *, nodes_per_s: float = SIMULATED_NODES_PER_S,
                 **fields) -> "MinimaxConfig":
        """A config whose limit is about ``work_s`` seconds of simulating ``problem``'s graph on
        the CI machine (:data:`SIMULATED_NODES_PER_S`; at least one simulation); ``fields`` set
        the others."""
        nodes = max(1, problem.dag.number_of_nodes())
        return cls(max_simulations=max(1, int(work_s * nodes_per_s / nodes)), **fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MinimaxResult:
    """What :func:`polish` found (the start itself when no move gained)."""

    schedule: Schedule
    #: model label -> simulated step time of ``schedule`` (ms)
    step_ms: dict[str, float]
    #: model label -> ``step_ms / reference - 1``
    regret: dict[str, float]
    peak_bytes: int
    #: moves accepted
    moves: int
    simulations: int
    solve_time_s: float
    #: why the search stopped
    stopped: str

    @property
    def worst_regret(self) -> float:
        return max(self.regret.values())


def polish(problems: Mapping[str, Problem], start: Schedule, reference_ms: Mapping[str, float],
           mem_budget_bytes: int | None = None, config: MinimaxConfig = MinimaxConfig()) -> MinimaxResult:
    """Lower the worst-case regret of ``start`` across the models of ``problems`` (module
    docstring).

    Args:
        problems: model label -> the graph priced by that model (same collectives, same
            nodes in the same order; the first problem's chains and windows define the moves).
        start: a schedule of that graph; one over ``mem_budget_bytes`` is first moved under it
            (moves that lower the excess are taken before any other).
        reference_ms: model label -> the best step time known under that model (ms, > 0), e.g.
            the best candidate's; the regret under ``m`` is ``t_m / reference_ms[m] - 1``.
        mem_budget_bytes: peak-memory budget (bytes) by the execution model's count (the
            memory the written graph holds); None: no limit.

    Raises:
        ValueError: no problem, problems of different graphs, a reference missing or not > 0,
            or a start that is not a valid schedule of them.
        InfeasibleBudgetError: the moves could not bring the start under the budget (states
            the smallest peak reached).
    """
    t0 = time.perf_counter()
    search = _Search(problems, reference_ms, mem_budget_bytes)
    current = search.evaluate(start, None)
    if current is None:
        raise ValueError("the start schedule is not a valid schedule of the problems' graph")
    schedule, score, sims = current
    moves, k, unchanged = 0, 0, 0
    stopped = "converged: no move lowers the worst-case regret"
    neighbours = _neighbours(search.p0, _entries(schedule), config)
    while neighbours and unchanged < len(neighbours):
        if search.simulations >= config.max_simulations:
            stopped = f"work limit: {config.max_simulations} simulations"
            break
        k %= len(neighbours)
        found = search.evaluate_entries(neighbours[k], score)
        if found is not None:
            schedule, score, sims = found
            moves += 1
            unchanged = 0
            neighbours = _neighbours(search.p0, _entries(schedule), config)
            logger.debug("minimax move %d: excess %d B, worst regret %.4f (%d simulations)", moves, score[0],
                         score[1], search.simulations)
        else:
            unchanged += 1
        k += 1  # the scan goes on from the next move, not from the first
    peak = max(s.peak_bytes for s in sims.values())
    if score[0] > 0:
        raise InfeasibleBudgetError(
            f"the minimax polish could not bring its start under the budget of {fmt_bytes(mem_budget_bytes or 0)}: "
            f"the smallest peak it reached is {fmt_bytes(peak)} ({peak} B); start from a schedule that fits",
            budget_bytes=mem_budget_bytes or 0, min_peak_bytes=peak)
    regret = {label: sims[label].step_ms / search.reference[label] - 1 for label in search.labels}
    result = MinimaxResult(schedule=search.schedule_of(schedule),
                           step_ms={label: sims[label].step_ms for label in search.labels}, regret=regret,
                           peak_bytes=peak, moves=moves, simulations=search.simulations,
                           solve_time_s=time.perf_counter() - t0, stopped=stopped)
    logger.info("minimax polish: worst-case regret %.2f %% after %d moves, %d simulations, %.1f s (%s)",
                100 * result.worst_regret, moves, search.simulations, result.solve_time_s, stopped)
    return result


class _Search:
    """The models, the references and the simulation count of one :func:`polish`."""

    def __init__(self, problems: Mapping[str, Problem], reference_ms: Mapping[str, float],
                 mem_budget_bytes: int | None):
        if not problems:
            raise ValueError("polish needs at least one cost model's problem")
        self.labels = list(problems)
        self.problems = dict(problems)
        self.p0 = self.problems[self.labels[0]]
        for label, p in self.problems.items():
            if p.seq != self.p0.seq or p.colls.keys() != self.p0.colls.keys():
                raise ValueError(f"problem {label!r} is not the same graph as {self.labels[0]!r}: "
                                 "every model must price the same export")
        missing = [label for label in self.labels if not reference_ms.get(label, 0) > 0]
        if missing:
            raise ValueError(f"reference step times must be > 0 for every model; missing or not > 0: {missing}")
        self.reference = {label: float(reference_ms[label]) for label in self.labels}
        self.mem_budget_bytes = mem_budget_bytes
        self.simulations = 0
        #: model labels, the one of largest regret first (rejects most neighbours at once)
        self.order = list(self.labels)
        self.evaluator = ModelEvaluator(self.problems)

    def evaluate_entries(self, entries: list[Entry], bar: tuple[int, float, float]):
        """:meth:`evaluate` of the schedule of ``entries`` (:func:`solvers.periodic.from_entries`)
        without building it: an accepted one is returned as its :class:`~solvers.core.evaluate.Plan`
        (:func:`_entries` reads it, :meth:`schedule_of` builds the schedule)."""
        ordered = chain_ordered(self.p0, entries)
        if ordered is None:
            return None
        # counted as one simulation, the cost of building the schedule before the evaluator read
        # entries directly, so that work limits keep their meaning
        self.simulations += 1
        try:
            plan = self.evaluator.plan_entries(ordered)
        except ValueError:
            return None
        return self.evaluate(plan, bar)

    def schedule_of(self, schedule: Schedule | Plan) -> Schedule:
        """The schedule of an accepted plan (:meth:`evaluate_entries`), as ``from_entries`` builds it."""
        if isinstance(schedule, Plan):
            return schedule.schedule or from_entries(self.p0, list(schedule.entries))
        return schedule

    def evaluate(self, schedule: Schedule | Plan, bar: tuple[int, float, float] | None):
        """(schedule, (excess bytes over the budget, worst regret, total), evaluations by label)
        when ``schedule`` is valid and its score is below ``bar`` (None: any valid one), else
        None. Evaluates the models in :attr:`order` (:class:`~solvers.core.evaluate.ModelEvaluator`:
        the simulator's numbers, memory counted once) and stops at the first that rules it out;
        each model evaluated counts as one simulation."""
        plan = schedule if isinstance(schedule, Plan) else self.evaluator.plan(schedule)
        evaluation = self.evaluator.lazy(plan)
        sims = {}
        excess, worst, total = 0, -float("inf"), 0.0
        for label in self.order:
            try:
                sim = evaluation(label)
            except ScheduleInvalidError:
                return None
            finally:
                self.simulations += 1
            if self.mem_budget_bytes is not None:
                excess = max(excess, sim.peak_bytes - self.mem_budget_bytes, 0)
            r = sim.step_ms / self.reference[label] - 1
            if bar is not None and (excess > bar[0] or (excess == bar[0] and r > bar[1] + _EPS)):
                return None
            sims[label] = sim
            worst, total = max(worst, r), total + r
        if bar is not None and excess == bar[0] and not (
                worst < bar[1] - _EPS or (worst <= bar[1] + _EPS and total < bar[2] - _EPS)):
            return None
        ratio = {label: sims[label].step_ms / self.reference[label] for label in self.labels}
        self.order = sorted(self.labels, key=lambda label: -ratio[label])
        return schedule, (excess, worst, total), sims


def _entries(schedule: Schedule | Plan) -> list[Entry]:
    if isinstance(schedule, Plan) and schedule.entries is not None:
        return list(schedule.entries)  # the buckets and gaps of the schedule they build, in its order
    issue, wait = schedule.positions()
    return [(b, issue[k], wait[k]) for k, b in enumerate(schedule.buckets)]


def _neighbours(p: Problem, entries: list[Entry], config: MinimaxConfig) -> list[list[Entry]]:
    """Every schedule one move from ``entries`` (module docstring), merges first, then
    transfers, then shifts, as entry lists (:func:`solvers.periodic.chain_ordered` keeps each
    chain's issue order)."""
    index = {m: (key, i) for key, names in p.chains.items() for i, m in enumerate(names)}
    by_chain: dict[tuple, list[int]] = {}
    for e, (bk, _, _) in enumerate(entries):
        if bk.members[0] in index:
            by_chain.setdefault(index[bk.members[0]][0], []).append(e)
    merges: list[list[Entry]] = []
    transfers: list[list[Entry]] = []
    for key, es in by_chain.items():
        es.sort(key=lambda e: index[entries[e][0].members[0]][1])
        gather = p.colls[entries[es[0]][0].members[0]].coll_type == "all_gather"
        for a, b in zip(es, es[1:]):
            rest = [x for e, x in enumerate(entries) if e not in (a, b)]
            (b1, i1, w1), (b2, i2, w2) = entries[a], entries[b]
            members = tuple(sorted(b1.members + b2.members, key=lambda m: index[m][1]))
            if _fits_cap(p, members, config):
                # all-gathers: ready by the earlier need; reduce-scatters: every gradient in first
                issue, wait = (min(i1, i2), min(w1, w2)) if gather else (max(i1, i2), max(w1, w2))
                merged = _placed(p, members, issue, wait)
                if merged is not None:
                    merges.append(rest + [merged])
            if config.transfers:
                transfers.extend(rest + pair for pair in _transfers(p, entries[a], entries[b], gather, config))
    shifts: list[list[Entry]] = []
    for e, (bk, i, w) in enumerate(entries):
        if bk.members[0] not in index:
            continue  # fixed collectives stay where they are
        lo = max(p.colls[m].ready for m in bk.members)
        hi = min(p.colls[m].needed for m in bk.members)
        for k in config.steps:
            for d in (-k, k):
                if lo <= i + d <= w:
                    shifts.append([*entries[:e], (bk, i + d, w), *entries[e + 1:]])
                if i <= w + d <= hi:
                    shifts.append([*entries[:e], (bk, i, w + d), *entries[e + 1:]])
    return merges + transfers + shifts


def _placed(p: Problem, members: tuple[str, ...], issue: int, wait: int) -> Entry | None:
    """A bucket of ``members`` at these gaps, moved into its window (issued once every member
    is ready, waited before any is needed: a merged reduce-scatter whose result compute reads
    is waited by that read); None when the window is empty."""
    lo, hi = window(p, members)
    issue = max(issue, lo)
    if issue > hi:
        return None
    return Bucket(members), issue, min(max(wait, issue), hi)


def _fits_cap(p: Problem, members: Sequence[str], config: MinimaxConfig) -> bool:
    """A bucket of ``members`` is within :attr:`MinimaxConfig.max_bucket_bytes` (one alone
    always is: it is no merge)."""
    return config.max_bucket_bytes is None or len(members) < 2 or \
        sum(p.colls[m].payload_bytes for m in members) <= config.max_bucket_bytes


def _transfers(p: Problem, first: Entry, second: Entry, gather: bool,
               config: MinimaxConfig) -> list[list[Entry]]:
    """The moves of the boundary between consecutive buckets of one chain: the first bucket's
    last unit (:func:`chain_units`) or last collective to the second, the second's first unit
    or first collective to the first (a unit of one collective is one move). The bucket that
    gives keeps its issue and wait (still valid for fewer members). The one that takes keeps
    them where the piece allows: an all-gather is waited no later than the piece's need (and
    issued no later than that), a reduce-scatter issued no earlier than the piece's gradients
    are ready (and waited no earlier)."""
    (b1, i1, w1), (b2, i2, w2) = first, second

    def taking(members: tuple[str, ...], piece: tuple[str, ...], issue: int, wait: int) -> Entry | None:
        if gather:
            wait = min(wait, min(p.colls[m].needed for m in piece))
            return _placed(p, members, min(issue, wait), wait)
        issue = max(issue, max(p.colls[m].ready for m in piece))
        return _placed(p, members, issue, max(wait, issue))

    out: list[list[Entry | None]] = []
    if len(b1.members) > 1:  # the first bucket's tail joins the second
        for k in sorted({len(chain_units(p, b1.members)[-1]), 1}):
            if k < len(b1.members):
                piece = b1.members[-k:]
                out.append([(Bucket(b1.members[:-k]), i1, w1), taking(piece + b2.members, piece, i2, w2)])
    if len(b2.members) > 1:  # the second bucket's head joins the first
        for k in sorted({len(chain_units(p, b2.members)[0]), 1}):
            if k < len(b2.members):
                piece = b2.members[:k]
                out.append([taking(b1.members + piece, piece, i1, w1), (Bucket(b2.members[k:]), i2, w2)])
    return [pair for pair in out  # type: ignore[misc]
            if all(e is not None and _fits_cap(p, e[0].members, config) for e in pair)]


#: the units a :class:`Regrouping` counts in
UNITS = ("block", "collective")


@dataclasses.dataclass(frozen=True)
class Regrouping:
    """A regular bucketing of one chain (module docstring): units of one block each (``unit``
    ``"block"``, :func:`chain_units`) or of one collective (``"collective"``), ``head`` units in
    the first bucket, ``size`` in each of the middle ones (the last of them takes what is left),
    ``tail`` in the last; every bucket issued ``ahead`` buckets early."""

    chain: tuple
    size: int
    head: int
    tail: int
    ahead: int
    unit: str = "block"

    def __post_init__(self) -> None:
        if min(self.size, self.head, self.tail, self.ahead) < 1:
            raise ValueError(f"a regrouping needs size, head, tail and ahead >= 1, got {self}")
        if self.unit not in UNITS:
            raise ValueError(f"a regrouping counts in one of {UNITS}, got unit={self.unit!r}")

    def describe(self) -> str:
        units = "" if self.unit == "block" else " collectives"
        return f"head {self.head}, {self.size}{units} per bucket, tail {self.tail}, {self.ahead} ahead"


def chain_units(p: Problem, names: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` (one chain, in chain order) in runs of consecutive collectives of one block
    (the export's ``block``); a collective outside every block is a unit of its own."""
    units: list[list[str]] = []
    for n in names:
        block = p.colls[n].block
        if units and block is not None and p.colls[units[-1][-1]].block == block:
            units[-1].append(n)
        else:
            units.append([n])
    return [tuple(u) for u in units]


def _units(p: Problem, names: Sequence[str], unit: str) -> list[tuple[str, ...]]:
    """``names`` (one chain) in the units a :class:`Regrouping` counts in (:data:`UNITS`)."""
    return chain_units(p, names) if unit == "block" else [(n,) for n in names]


def _block_runs(p: Problem, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The units of ``names`` (:func:`chain_units`) that are runs of one block's collectives."""
    return [u for u in chain_units(p, names) if p.colls[u[0]].block is not None]


def _group_sizes(n: int, head: int, size: int, tail: int) -> list[int] | None:
    """Units per bucket of ``n`` units bucketed ``head``, ``size``, ... , ``tail``; None when
    ``n`` is fewer than ``head + tail``."""
    if head + tail > n:
        return None
    middle = n - head - tail
    return [head] + [size] * (middle // size) + ([middle % size] if middle % size else []) + [tail]


def regroup(p: Problem, schedule: Schedule, r: Regrouping) -> Schedule | None:
    """``schedule`` with chain ``r.chain`` bucketed by ``r`` (other buckets kept); None when
    that is no valid schedule (a bucket over :attr:`MinimaxConfig.max_bucket_bytes` is the
    caller's to rule out)."""
    names = p.chains[r.chain]
    units = _units(p, names, r.unit)
    sizes = _group_sizes(len(units), r.head, r.size, r.tail)
    if sizes is None:
        return None
    groups, at = [], 0
    for k in sizes:
        groups.append(tuple(m for u in units[at:at + k] for m in u))
        at += k
    in_chain = set(names)
    entries = _entries(schedule)
    kept = [e for e in entries if e[0].members[0] not in in_chain]
    issued = [i for bk, i, _ in entries if bk.members[0] in in_chain]
    waited = [w for bk, _, w in entries if bk.members[0] in in_chain]
    ready = [max(p.colls[m].ready for m in g) for g in groups]
    needed = [min(p.colls[m].needed for m in g) for g in groups]
    if p.colls[names[0]].coll_type == "all_gather":
        # each waited where its first member is needed, issued at the wait of ``ahead`` before
        issue = [needed[k - r.ahead] if k >= r.ahead else min(issued) for k in range(len(groups))]
        placed = [(Bucket(g), min(max(ready[k], issue[k]), needed[k]), needed[k]) for k, g in enumerate(groups)]
    else:
        # each issued when its last gradient is ready, waited at the issue of ``ahead`` after
        wait = [ready[k + r.ahead] if k + r.ahead < len(groups) else max(waited) for k in range(len(groups))]
        placed = [(Bucket(g), ready[k], max(min(wait[k], needed[k]), ready[k])) for k, g in enumerate(groups)]
    ordered = chain_ordered(p, kept + placed)
    if ordered is None:
        return None
    try:
        return from_entries(p, ordered)
    except ValueError:
        return None


def regroupings(p: Problem, config: MinimaxConfig = MinimaxConfig()) -> list[Regrouping]:
    """The regular bucketings :func:`regrouped_starts` tries, in a fixed order: for every chain
    of at least two units, each ``size`` of :attr:`MinimaxConfig.regroup_sizes`, a first bucket
    of 1, ``size`` or ``size + 1`` units, a last of 1, 2 or ``size``, each issue-ahead of
    :attr:`MinimaxConfig.regroup_aheads`; distinct bucketings only."""
    out: list[Regrouping] = []
    for key in sorted(p.chains, key=repr):
        n = len(chain_units(p, p.chains[key]))
        if n < 2:
            continue
        seen: set[tuple[int, ...]] = set()
        for size in config.regroup_sizes:
            for head in dict.fromkeys((1, size, size + 1)):
                for tail in dict.fromkeys((1, 2, size)):
                    sizes = _group_sizes(n, head, size, tail)
                    if sizes is None or tuple(sizes) in seen:
                        continue
                    seen.add(tuple(sizes))
                    out.extend(Regrouping(key, size, head, tail, a) for a in config.regroup_aheads)
    return out


def refinements(p: Problem, coarse: Regrouping, config: MinimaxConfig = MinimaxConfig()) -> list[Regrouping]:
    """Regular bucketings of single collectives around ``coarse`` (one in blocks), in a fixed
    order: ``coarse``'s head, a block shorter and a block longer; every middle size within
    half a block of ``coarse``'s, collective by collective; ``coarse``'s tail; each issue-ahead
    of :attr:`MinimaxConfig.regroup_aheads` and one more than ``coarse``'s. A block is the
    chain's most common run of one block's collectives; empty when it has none.

    Where the models want between n and n + 1 blocks per bucket, boundaries inside a block
    are the compromise: on llama3-8b's 32-layer forward 29 collectives per bucket (3.2 layers,
    the embedding and three layers first, three ahead) regret 2.40 % before any polish, where
    the best in whole blocks regrets 2.58 % (module docstring)."""
    names = p.chains[coarse.chain]
    units = _units(p, names, coarse.unit)
    runs = [len(u) for u in _block_runs(p, names)]
    if not runs:
        return []
    block = max(sorted(set(runs)), key=runs.count)
    head = sum(len(u) for u in units[:coarse.head])
    tail = sum(len(u) for u in units[len(units) - coarse.tail:])
    size = sum(len(u) for u in units[coarse.head:coarse.head + coarse.size])
    out = []
    for h in dict.fromkeys(h for h in (head, head - block, head + block) if h >= 1):
        for k in range(max(1, size - block // 2), size + block // 2 + 1):
            out.extend(Regrouping(coarse.chain, k, h, tail, a, unit="collective")
                       for a in dict.fromkeys((*config.regroup_aheads, coarse.ahead + 1)))
    return out


def regrouped_starts(problems: Mapping[str, Problem], start: Schedule, reference_ms: Mapping[str, float],
                     mem_budget_bytes: int | None = None,
                     config: MinimaxConfig = MinimaxConfig()) -> list[tuple[Regrouping, Schedule, float]]:
    """The :attr:`MinimaxConfig.regroup_starts` regular bucketings of ``start``'s chains
    (:func:`regroupings`, one chain at a time) of least worst-case regret across
    ``problems`` that fit ``mem_budget_bytes``, best first: (regrouping, schedule, worst
    regret); then the :attr:`MinimaxConfig.regroup_refine` best refinements of the best of
    them (:func:`refinements`, counted in collectives) not already among them. Starts for
    :func:`polish` that its one-bucket moves cannot reach (module docstring). Tries them in
    order until :attr:`MinimaxConfig.max_simulations` are spent (deterministic); empty when
    none fits or ``regroup_starts`` is 0.

    Raises:
        ValueError: as :func:`polish`.
    """
    if config.regroup_starts == 0:
        return []
    t0 = time.perf_counter()
    search = _Search(problems, reference_ms, mem_budget_bytes)
    seen = {start.digest()}
    tried = 0

    def score(candidates: Sequence[Regrouping]) -> list[tuple[Regrouping, Schedule, float]]:
        nonlocal tried
        scored: list[tuple[tuple[float, float], int, Regrouping, Schedule]] = []
        for r in candidates:
            if search.simulations >= config.max_simulations:
                break
            schedule = regroup(search.p0, start, r)
            search.simulations += 1  # building it costs about a simulation
            digest = None if schedule is None else schedule.digest()
            if digest is None or digest in seen:
                continue
            seen.add(digest)
            if config.max_bucket_bytes is not None and any(
                    len(bk.members) > 1 and sum(search.p0.colls[m].payload_bytes for m in bk.members)
                    > config.max_bucket_bytes for bk in schedule.buckets):
                continue
            tried += 1
            found = search.evaluate(schedule, None)
            if found is None or found[1][0] > 0:
                continue
            scored.append(((found[1][1], found[1][2]), tried, r, schedule))
        scored.sort(key=lambda x: (x[0], x[1]))
        return [(r, schedule, key[0]) for key, _, r, schedule in scored]

    coarse = score(regroupings(search.p0, config))
    best = coarse[:config.regroup_starts]
    if config.regroup_refine and coarse:
        best += score(refinements(search.p0, coarse[0][0], config))[:config.regroup_refine]
    logger.info("minimax regroup: %d regular bucketings fit of %d tried (%d simulations, %.1f s)%s", len(coarse),
                tried, search.simulations, time.perf_counter() - t0,
                "".join(f"; {r.describe()}: worst-case regret {100 * regret:.2f} %" for r, _, regret in best))
    return best


def reference_times(problems: Mapping[str, Problem], schedules: Sequence[Schedule],
                    mem_budget_bytes: int | None = None) -> dict[str, float]:
    """Model label -> the least simulated step time under that model among ``schedules`` that
    fit ``mem_budget_bytes`` (the reference :func:`polish` measures regret against).

    Raises:
        ValueError: no schedule fits.
    """
    best: dict[str, float] = {}
    for schedule in schedules:
        sims = {label: simulate(p.dag, schedule, problem=p) for label, p in problems.items()}
        if mem_budget_bytes is not None and max(s.peak_bytes for s in sims.values()) > mem_budget_bytes:
            continue
        for label, sim in sims.items():
            best[label] = min(best.get(label, float("inf")), sim.step_ms)
    if len(best) != len(problems):
        raise ValueError("no schedule fits the budget: there is no reference to measure regret against")
    return best


@dataclasses.dataclass(frozen=True)
class Anatomy:
    """Where one schedule's step time goes under one cost model (:func:`anatomy`)."""

    step_ms: float
    #: busy time of the compute stream (nodes, prologues, bucket copies)
    compute_ms: float
    #: time the compute stream waits for collectives: ``step_ms = compute_ms + exposed_ms``
    exposed_ms: float
    #: busy time of the busiest communication stream
    comm_busy_ms: float
    #: the part of ``exposed_ms`` spent waiting for the first bucket (in the schedule's order)
    #: that exposes anything
    first_exposed_ms: float
    buckets: int


def anatomy(problems: Mapping[str, Problem], schedules: Mapping[str, Schedule]) -> dict[str, dict[str, Anatomy]]:
    """Name -> model label -> :class:`Anatomy` of each schedule simulated under each model.

    Why a schedule regrets under one model and not another: a step is the compute stream's busy
    time plus what it waits for collectives, so a model under which the communication stream
    is busier than the compute stream charges every bucket's payload and fixed cost, and one
    under which compute dominates charges only what the first buckets expose."""
    out: dict[str, dict[str, Anatomy]] = {}
    for name, schedule in schedules.items():
        out[name] = {}
        for label, p in problems.items():
            sim = simulate(p.dag, schedule, problem=p)
            exposed = [sim.bucket_exposed_ms[k] for k in sorted(sim.bucket_exposed_ms) if sim.bucket_exposed_ms[k] > 0]
            out[name][label] = Anatomy(step_ms=sim.step_ms, compute_ms=sim.compute_ms,
                                       exposed_ms=sim.exposed_comm_ms, comm_busy_ms=max(sim.comm_ms.values(), default=0.0),
                                       first_exposed_ms=exposed[0] if exposed else 0.0, buckets=sim.n_collectives)
    return out


def block_bucket_ms(problems: Mapping[str, Problem], max_blocks: int = 8) -> dict[str, list[float]]:
    """Model label -> the communication time (ms) of one bucket of the first ``k`` whole blocks
    of the longest chain, for ``k`` = 1 .. ``max_blocks`` (fewer when the chain has fewer): how
    each model prices bucket size. A model whose time per block falls with ``k`` rewards
    large buckets; under one that is linear in the payload, size buys nothing but fewer fixed
    costs. Empty lists where no chain has a block."""
    out: dict[str, list[float]] = {}
    for label, p in problems.items():
        chain = max(p.chains.values(), key=len, default=())
        blocks = _block_runs(p, chain)
        out[label] = [p.bucket_comm_ms([m for u in blocks[:k] for m in u])
                      for k in range(1, min(max_blocks, len(blocks)) + 1)]
    return out
