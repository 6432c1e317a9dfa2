"""The search's first stage: the starts (:mod:`solvers.search`).

Bucket granularity decides most of a step, and no local move changes it: merging one pair of
neighbouring buckets shifts the pipeline and loses, where merging every pair wins; and the cost
models disagree on it (one model's best bucket holds a few transformer blocks' all-gathers,
another's twice as many). So the search starts from a fixed set of
whole schedules, evaluated exactly:

- the graph as traced, the caller's baselines (torch's overlap scheduler read back from the graph
  it writes, :mod:`scheduler.torch_overlap`), the caller's starts, and the heuristics (FSDP2-like,
  the per-block plan, SimpleFSDP-like, AutoParallel-like), as they are and shrunk to the budget
  by their own ladders; the traced order, the caller's baselines and the heuristics that fit are
  the *baselines* (:attr:`Objective.baseline_ms`);
- regular bucketings (:class:`Regrouping`) of each chain of mergeable collectives: ``size``
  blocks per bucket, a first bucket of ``head`` and a last of ``tail``, each bucket issued
  ``ahead`` buckets early (deeper only while the budget holds them); chain after chain, each on
  top of the best of the chain before;
- the best few of those over the budget moved under it at their peak (:func:`fit_by_delays`):
  a regular start a few bytes over keeps all its overlap but the prefetches at the peak.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from solvers.core.evaluate import evaluator_of
from solvers.core.plan import PlannedBucket, build_schedule, chain_ordered, chain_units
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule
from solvers.core.simulator import peak_step
from solvers.heuristics import HEURISTICS, fsdp2_schedule
from solvers.objective import Evaluated, Objective, SearchConfig, schedule_content


logger = logging.getLogger(__name__)


def starts(objective: Objective, config: SearchConfig, extra: Sequence[tuple[str, Schedule]] = (),
           baselines: Sequence[tuple[str, Schedule]] = ()) -> tuple[list[Evaluated], int | None]:
    """Every start that fits the budget, best first (:meth:`Objective.regret_key`; ties keep the
    order tried), and the smallest peak of all starts, fitting or not (bytes; None when none was
    valid). Sets ``objective.reference_ms`` and ``objective.baseline_ms``.

    ``extra`` and ``baselines`` are named schedules of the graph tried as they are; those of
    ``baselines`` that fit count as baselines too, as the traced order and the heuristics do.

    The starts are evaluated as they are first; then the :attr:`SearchConfig.fit_starts` best
    of those over the budget are moved under it (:func:`fit_by_delays`): a regular start a few
    bytes over the budget keeps almost all its overlap."""
    p = objective.primary
    # each distinct schedule evaluated once: those tried, by the hash of their content (a
    # digest of each would cost more than evaluating some of them)
    seen: dict[int, list[Schedule]] = {}
    tried: list[Evaluated] = []

    def consider(name: str, schedule: Schedule | None) -> Evaluated | None:
        if schedule is None:
            return None
        content = schedule_content(schedule)
        h = hash(content)
        if any(schedule_content(s) == content for s in seen.get(h, ())):
            return None
        seen.setdefault(h, []).append(schedule)
        e = objective.evaluate(schedule, name, h)
        if e is not None:
            tried.append(e)
        return e

    consider("traced", p.traced_schedule())
    for name, schedule in baselines:
        consider(name, schedule)
    baseline_names = {"traced", *(name for name, _ in baselines), *HEURISTICS,
                      *(f"{name}, shrunk to the budget" for name in HEURISTICS)}
    for name, schedule in extra:
        consider(name, schedule)
    for name, fn in HEURISTICS.items():
        if name == "traced":
            continue
        unshrunk = fn(p, mem_budget_bytes=None)
        consider(name, unshrunk.schedule)
        # the heuristic's own ladder down to the budget, whose first rung is ``unshrunk``: when that
        # fits, the ladder ends there and its schedule was tried already
        if objective.mem_budget_bytes is not None and unshrunk.peak_bytes > objective.mem_budget_bytes:
            try:
                consider(f"{name}, shrunk to the budget", fn(p, mem_budget_bytes=objective.mem_budget_bytes).schedule)
            except InfeasibleBudgetError:
                pass
    # regular bucketings, chain after chain, each on top of the best of the chain before
    base = fsdp2_schedule(p)
    deepest = max(config.start_aheads)
    deep_names: set[str] = set()
    every = regroupings(p, config.start_sizes, config.start_aheads)
    for chain in sorted(p.chains, key=repr):
        found = []
        entries, units = _entries_of(base), chain_units(p, p.chains[chain])
        for r in every:
            if r.chain != chain or (e := consider(f"regular {r.describe()}", _regroup(p, entries, units, r))) is None:
                continue
            found.append(e)
            if r.ahead != deepest or not objective.fits(e):
                continue
            for ahead in config.start_deep_aheads:  # deeper while they fit (SearchConfig.start_deep_aheads)
                deep = dataclasses.replace(r, ahead=ahead)
                d = consider(f"regular {deep.describe()}", _regroup(p, entries, units, deep))
                if d is None:
                    continue
                if not objective.fits(d):
                    tried.pop()  # ``d``, the last tried: over the budget, not a start to move under it
                    break
                found.append(d)
                deep_names.add(d.name)
        if found:
            _set_reference(objective, [e for e in tried if e.name not in deep_names])
            base = min(found, key=lambda e: (not objective.fits(e), objective.regret_key(e))).schedule
    _set_reference(objective, [e for e in tried if e.name not in deep_names])
    if objective.mem_budget_bytes is not None and config.fit_moves:
        # near misses first: delays fix a prefetch too many at the peak, not a bucket too large
        near = objective.mem_budget_bytes * (1 + config.near_miss_share)
        over = sorted((e for e in tried if not objective.fits(e)),
                      key=lambda e: (e.peak_bytes > near, objective.regret_key(e)))
        fitted = 0
        for e in over[:config.fit_starts * config.fit_tries_per_start]:
            moved = fit_by_delays(p, e.schedule, objective.mem_budget_bytes, max_moves=config.fit_moves)
            objective.evaluations += config.fit_moves * FIT_MOVES_COUNTED
            fitted += consider(f"{e.name}, moved under the budget", moved) is not None
            if fitted == config.fit_starts:
                break
    smallest = min((e.peak_bytes for e in tried), default=None)
    fitting = sorted((e for e in tried if objective.fits(e)), key=objective.regret_key)
    # the deep starts are candidates, not references: a prefetch deeper than any regular start's
    # is far ahead under one model of the family and would pull the regret towards that model
    _set_reference(objective, [e for e in fitting or tried if e.name not in deep_names] or fitting or tried)
    fit_baselines = [e for e in fitting if e.name in baseline_names]
    objective.baseline_ms = ({label: max(_TINY_MS, min(e.step_ms(label) for e in fit_baselines))
                              for label in objective.labels} if fit_baselines else {})
    fitting.sort(key=objective.regret_key)
    return fitting, smallest


def fit_by_delays(problem: Problem, schedule: Schedule, mem_budget_bytes: int, *, max_moves: int = 8
                  ) -> Schedule | None:
    """``schedule`` moved under ``mem_budget_bytes`` by a few local moves at its peak, or None.

    Each move takes one movable bucket alive at the step where memory peaks over the budget and
    shortens its life across it: an all-gather issued before the peak is issued after the next
    compute node instead (its buffer no longer overlaps the peak), a reduce-scatter in flight is
    waited at the peak's step (its input freed sooner). Of the moves that lower the peak, the
    fastest that fits is taken, else the one with the lowest peak; at most ``max_moves`` moves.
    A regular start a little over the budget so keeps all its prefetches but the ones at the peak.
    """
    evaluator = evaluator_of(problem)
    peak = evaluator.evaluate(schedule).peak_bytes
    for _ in range(max_moves):
        if peak <= mem_budget_bytes:
            return schedule
        at = peak_step(problem, schedule, peak)  # where the peak is
        best: tuple[tuple, Schedule, int] | None = None
        for cand in _peak_moves(problem, schedule, at):
            e = evaluator.evaluate(cand)
            if e.peak_bytes >= peak:
                continue
            fits = e.peak_bytes <= mem_budget_bytes
            key = (not fits, e.step_ms if fits else e.peak_bytes, e.step_ms)
            if best is None or key < best[0]:
                best = (key, cand, e.peak_bytes)
        if best is None:
            return None
        _, schedule, peak = best
    return schedule if peak <= mem_budget_bytes else None


def _peak_moves(problem: Problem, schedule: Schedule, k: int) -> list[Schedule]:
    """Schedules one move away from ``schedule`` (see :func:`fit_by_delays`) at step ``k``."""
    steps = list(schedule.steps)
    where = {(s.kind, s.ref): i for i, s in enumerate(steps) if s.kind != "node"}
    out = []
    for b, bucket in enumerate(schedule.buckets):
        c = problem.colls[bucket.members[0]]
        i, w = where[("issue", b)], where[("wait", b)]
        if not c.movable or not i <= k < w:
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
        out.append(Schedule(schedule.buckets, tuple(moved), schedule.split_groups))
    return out


#: the least reference step time (ms)
_TINY_MS = 1e-12
#: evaluations one move of :func:`fit_by_delays` is counted as (the candidates it tries at a
#: peak: a few buckets are alive there), so that the starts' work is a count, not a duration
FIT_MOVES_COUNTED = 4


def head_sizes(size: int) -> tuple[int, ...]:
    """Units in the first bucket of a regular bucketing of ``size`` units per bucket, the order
    tried: one block alone (nothing overlaps the first all-gather or the last reduce-scatter,
    so a small one is exposed least), a regular bucket, or one block more (it takes the
    remainder the middle would leave)."""
    return tuple(dict.fromkeys((1, size, size + 1)))


def tail_sizes(size: int) -> tuple[int, ...]:
    """Units in the last bucket of a regular bucketing of ``size`` units per bucket, the order
    tried: one or two blocks (the last bucket's time is exposed at the end of the chain), or a
    regular bucket."""
    return tuple(dict.fromkeys((1, 2, size)))


def _set_reference(objective: Objective, evaluated: Sequence[Evaluated]) -> None:
    """Each model's reference: the fastest of ``evaluated`` that fits under it (or of all, when
    none fits)."""
    pool = [e for e in evaluated if objective.fits(e)] or list(evaluated)
    # a graph with nothing to time (no compute, empty collectives) runs in 0 ms: any positive
    # reference then orders schedules by step time alike
    objective.reference_ms = {label: max(_TINY_MS, min(e.step_ms(label) for e in pool)) for label in objective.labels}


@dataclasses.dataclass(frozen=True)
class Regrouping:
    """A regular bucketing of one chain: its collectives in units of one block each
    (:func:`~solvers.core.plan.chain_units`), ``head`` units in the first bucket, ``size`` in each
    of the middle ones (the last of them takes what is left), ``tail`` in the last; every bucket
    issued ``ahead`` buckets early."""

    chain: tuple
    size: int
    head: int
    tail: int
    ahead: int

    def __post_init__(self) -> None:
        if min(self.size, self.head, self.tail, self.ahead) < 1:
            raise ValueError(f"a regrouping needs size, head, tail and ahead >= 1, got {self}")

    def describe(self) -> str:
        return f"head {self.head}, {self.size} per bucket, tail {self.tail}, {self.ahead} ahead"


def _group_sizes(n: int, head: int, size: int, tail: int) -> list[int] | None:
    """Units per bucket of ``n`` units bucketed ``head``, ``size``, ... , ``tail``; None when
    ``n`` is fewer than ``head + tail``."""
    if head + tail > n:
        return None
    middle = n - head - tail
    return [head] + [size] * (middle // size) + ([middle % size] if middle % size else []) + [tail]


def regroup(p: Problem, schedule: Schedule, r: Regrouping) -> Schedule | None:
    """``schedule`` with chain ``r.chain`` bucketed by ``r`` (other buckets kept); None when
    that is no valid schedule ."""
    return _regroup(p, _entries_of(schedule), chain_units(p, p.chains[r.chain]), r)


def _entries_of(schedule: Schedule) -> list[PlannedBucket]:
    """``schedule``'s buckets as a plan (bucket, issue gap, wait gap)."""
    issued_at, waited_at = schedule.positions()
    return [(b, issued_at[k], waited_at[k]) for k, b in enumerate(schedule.buckets)]


def _regroup(p: Problem, entries: Sequence[PlannedBucket], units: Sequence[tuple[str, ...]], r: Regrouping
             ) -> Schedule | None:
    """:func:`regroup` of the schedule of ``entries`` (:func:`_entries_of`), chain ``r.chain``
    in ``units`` (:func:`~solvers.core.plan.chain_units`): the starts regroup one schedule many
    ways, and read its entries and the chain's units once."""
    names = p.chains[r.chain]
    sizes = _group_sizes(len(units), r.head, r.size, r.tail)
    if sizes is None:
        return None
    groups, at = [], 0
    for k in sizes:
        groups.append(tuple(m for u in units[at:at + k] for m in u))
        at += k
    in_chain = set(names)
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
        return build_schedule(p, ordered)
    except ValueError:
        return None


def regroupings(p: Problem, sizes: Sequence[int], aheads: Sequence[int]) -> list[Regrouping]:
    """The regular bucketings :func:`starts` tries, in a fixed order: for every chain
    of at least two units, each ``size`` of ``sizes``, a first bucket of each of
    :func:`head_sizes`, a last of each of :func:`tail_sizes`, each issue-ahead of ``aheads``;
    distinct bucketings only."""
    out: list[Regrouping] = []
    for key in sorted(p.chains, key=repr):
        n = len(chain_units(p, p.chains[key]))
        if n < 2:
            continue
        seen: set[tuple[int, ...]] = set()
        for size in sizes:
            for head in head_sizes(size):
                for tail in tail_sizes(size):
                    counts = _group_sizes(n, head, size, tail)
                    if counts is None or tuple(counts) in seen:
                        continue
                    seen.add(tuple(counts))
                    out.extend(Regrouping(key, size, head, tail, a) for a in aheads)
    return out
