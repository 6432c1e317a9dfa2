"""The starts stage's own work (solvers/starts.py): each distinct schedule evaluated once,
told apart by its content (solvers.objective.schedule_content) as exactly as by its digest, and
no heuristic built again for a budget its first rung already holds.

Graph: the synthetic FSDP backward of tests/test_search.py (4 layers, 8 ranks)."""

from __future__ import annotations

import dataclasses
import itertools

from scheduler.whatif.synthetic import make_fsdp_dag
from solvers import Problem
from solvers.heuristics import HEURISTICS, fsdp2_schedule
from solvers.objective import Evaluated, Objective, SearchConfig, schedule_content
from solvers.starts import regroup, regroupings, starts


def _backward() -> Problem:
    return Problem.from_dag(make_fsdp_dag(n_layers=4, graph_kind="backward", reshard_after_forward=True, seed=1))


def test_contents_are_equal_exactly_when_digests_are():
    """Schedules built apart that are equal (the same regrouping built twice) have equal
    contents; every two that differ (in buckets, in steps, in split streams) have different
    ones."""
    p = _backward()
    base = fsdp2_schedule(p)
    regular = [s for r in regroupings(p, (1, 2), (1, 2)) if (s := regroup(p, base, r)) is not None]
    again = [s for r in regroupings(p, (1, 2), (1, 2)) if (s := regroup(p, base, r)) is not None]
    schedules = [p.traced_schedule(), base, *regular, *again]
    groups = p.splittable_groups()
    if groups:
        schedules.append(base.with_split(groups))
    equal_pairs = unequal_pairs = 0
    for a, b in itertools.combinations(schedules, 2):
        same = a.digest() == b.digest()
        assert (schedule_content(a) == schedule_content(b)) == same
        assert Evaluated(a, {}).same_schedule(Evaluated(b, {})) == same
        equal_pairs += same and a is not b
        unequal_pairs += not same
    assert equal_pairs >= len(regular) and unequal_pairs > len(schedules)
