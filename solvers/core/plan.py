"""The plan: a schedule as the search builds it, one :class:`PlannedBucket` per bucket (its
members, issue gap and wait gap; gaps as in :mod:`solvers.core.schedule`). The starts, the
polish, the models' extraction and the heuristics build their schedules from plans; a plan is
read by the evaluator without building its schedule
(:meth:`solvers.core.evaluate.Evaluator.read_plan`).

- :func:`build_schedule`: the schedule of a plan, buckets issued in one gap in chain order.
- :func:`chain_ordered`: a plan with every chain's buckets issued in order (the FIFO rule of
  every stage of the search but its last, :func:`solvers.polish.ahead_pass`).
- :func:`chain_units`: a chain counted in blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule


class PlannedBucket(NamedTuple):
    """One bucket of a plan: issued in gap ``issue_at`` and waited in gap ``wait_at`` (a tuple,
    so that the search's many plans stay cheap to build and unpack)."""

    bucket: Bucket
    issue_at: int
    wait_at: int

    @property
    def members(self) -> tuple[str, ...]:
        return self.bucket.members


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


def chain_ordered(problem: Problem, plan: list[PlannedBucket]) -> list[PlannedBucket] | None:
    """``plan`` with every chain's buckets issued in chain order (the models' FIFO rule): a
    bucket that would be issued before its predecessor is issued with it instead (and waited no
    earlier). None when that is after one of its members is needed."""
    plan = list(plan)
    entry_of = {m: e for e, (bk, _, _) in enumerate(plan) for m in bk.members}
    for names in problem.chains.values():
        floor, seen = 0, set()
        for n in names:
            e = entry_of[n]
            if e in seen:
                continue
            seen.add(e)
            bk, i, w = plan[e]
            if i < floor:
                if floor > min(problem.colls[m].needed for m in bk.members):
                    return None
                plan[e] = PlannedBucket(bk, floor, max(w, floor))
            floor = max(floor, plan[e][1])
    return plan


def chain_key(problem: Problem, planned: PlannedBucket) -> tuple:
    """The order of :func:`build_schedule`'s buckets: by issue gap, then in chain order (need,
    then ready, of the first member), as the streams run them."""
    c = problem.colls[planned[0].members[0]]
    return (planned[1], c.needed, c.ready, c.traced_issue, planned[0].members)


def build_schedule(problem: Problem, plan: Sequence[PlannedBucket]) -> Schedule:
    """The schedule of ``plan``; buckets issued in one gap go in chain order (:func:`chain_key`),
    and inside a gap as :meth:`Problem.schedule_at` places them."""
    plan = sorted(plan, key=lambda e: chain_key(problem, e))
    return problem.schedule_at([e[0] for e in plan], [e[1] for e in plan], [e[2] for e in plan])
