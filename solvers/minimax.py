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
                (2) peak(s) <= B under every model (peak is bytes: models agree on it)
                (3) no bucket of several collectives over ``max_bucket_bytes`` of payload

where ``t_m(s)`` is the simulated step time of ``s`` under ``P_m``
(:func:`solvers.core.simulate`: the execution model every solver and judge shares).

A start over the budget is first moved under it: the score is (bytes over ``B``, worst-case
regret, total), compared in that order, so moves that lower the excess come first (and the
result is refused when the excess stays).

Search: first-improvement local search. Moves (:func:`_neighbours`): merge two consecutive
buckets of a chain (all-gathers keep the earlier issue and wait, reduce-scatters the later),
or move one bucket's issue or wait by ``k`` gaps for ``k`` in :attr:`MinimaxConfig.steps`.
Moves are scanned cyclically from the one after the last accepted; a neighbour is simulated
under the model of largest regret first and rejected as soon as one model's regret exceeds the
current worst, so most rejected moves cost one simulation (and one build of the schedule,
counted as one more). The search stops after a full scan without gain or when
:attr:`MinimaxConfig.max_simulations` are spent: work is counted in simulations, not seconds,
so every rank gets the same schedule from the same graph.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from solvers.config import SIMULATED_NODES_PER_S
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule
from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.units import fmt_bytes
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
    #: largest payload of a merged bucket in bytes (None: no cap)
    max_bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_simulations < 1:
            raise ValueError(f"max_simulations must be >= 1, got {self.max_simulations}")
        if not self.steps or any(k < 1 for k in self.steps):
            raise ValueError(f"steps must be positive gap distances, got {self.steps}")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes < 1:
            raise ValueError(f"max_bucket_bytes must be >= 1 or None, got {self.max_bucket_bytes}")

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
        mem_budget_bytes: peak-memory budget (bytes); None: no limit.

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
    result = MinimaxResult(schedule=schedule, step_ms={label: sims[label].step_ms for label in search.labels},
                           regret=regret, peak_bytes=peak, moves=moves, simulations=search.simulations,
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

    def evaluate_entries(self, entries: list[Entry], bar: tuple[int, float, float]):
        ordered = chain_ordered(self.p0, entries)
        if ordered is None:
            return None
        self.simulations += 1  # building the schedule costs about a simulation
        try:
            schedule = from_entries(self.p0, ordered)
        except ValueError:
            return None
        return self.evaluate(schedule, bar)

    def evaluate(self, schedule: Schedule, bar: tuple[int, float, float] | None):
        """(schedule, (excess bytes over the budget, worst regret, total), sims by label) when
        ``schedule`` is valid and its score is below ``bar`` (None: any valid one), else None.
        Simulates the models in :attr:`order` and stops at the first that rules it out."""
        sims = {}
        excess, worst, total = 0, -float("inf"), 0.0
        for label in self.order:
            p = self.problems[label]
            try:
                sim = simulate(p.dag, schedule, problem=p)
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


def _entries(schedule: Schedule) -> list[Entry]:
    issue, wait = schedule.positions()
    return [(b, issue[k], wait[k]) for k, b in enumerate(schedule.buckets)]


def _neighbours(p: Problem, entries: list[Entry], config: MinimaxConfig) -> list[list[Entry]]:
    """Every schedule one move from ``entries`` (module docstring), merges first, as entry
    lists (:func:`solvers.periodic.chain_ordered` keeps each chain's issue order)."""
    index = {m: (key, i) for key, names in p.chains.items() for i, m in enumerate(names)}
    by_chain: dict[tuple, list[int]] = {}
    for e, (bk, _, _) in enumerate(entries):
        if bk.members[0] in index:
            by_chain.setdefault(index[bk.members[0]][0], []).append(e)
    out: list[list[Entry]] = []
    for key, es in by_chain.items():
        es.sort(key=lambda e: index[entries[e][0].members[0]][1])
        gather = p.colls[entries[es[0]][0].members[0]].coll_type == "all_gather"
        for a, b in zip(es, es[1:]):
            (b1, i1, w1), (b2, i2, w2) = entries[a], entries[b]
            members = tuple(sorted(b1.members + b2.members, key=lambda m: index[m][1]))
            if config.max_bucket_bytes is not None and \
                    sum(p.colls[m].payload_bytes for m in members) > config.max_bucket_bytes:
                continue
            # all-gathers: ready by the earlier need; reduce-scatters: every gradient in first
            issue, wait = (min(i1, i2), min(w1, w2)) if gather else (max(i1, i2), max(w1, w2))
            out.append([x for e, x in enumerate(entries) if e not in (a, b)] + [(Bucket(members), issue, wait)])
    for e, (bk, i, w) in enumerate(entries):
        if bk.members[0] not in index:
            continue  # fixed collectives stay where they are
        lo = max(p.colls[m].ready for m in bk.members)
        hi = min(p.colls[m].needed for m in bk.members)
        for k in config.steps:
            for d in (-k, k):
                if lo <= i + d <= w:
                    out.append([*entries[:e], (bk, i + d, w), *entries[e + 1:]])
                if i <= w + d <= hi:
                    out.append([*entries[:e], (bk, i, w + d), *entries[e + 1:]])
    return out


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
