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


def test_each_distinct_start_is_evaluated_once_and_a_heuristic_that_fits_is_built_once(monkeypatch):
    """Under a budget every heuristic holds as it is, its ladder to the budget would end at the
    schedule already tried: each heuristic is built once, and each distinct start evaluated
    once (every one fits, so every evaluation is a start)."""
    p = _backward()
    calls: dict[str, int] = {}

    def counted(name, fn):
        def run(problem, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(problem, **kwargs)
        return run

    for name, fn in list(HEURISTICS.items()):
        monkeypatch.setitem(HEURISTICS, name, counted(name, fn))
    peaks = [fn(p, mem_budget_bytes=None).peak_bytes for name, fn in HEURISTICS.items() if name != "traced"]
    calls.clear()
    objective = Objective({"m": p}, 4 * max(peaks))
    found, _ = starts(objective, SearchConfig())
    assert calls and all(n == 1 for name, n in calls.items() if name != "traced"), calls
    assert objective.evaluations == len(found)
    assert len({e.schedule.digest() for e in found}) == len(found)


def test_a_heuristic_over_the_budget_is_still_shrunk_to_it():
    """A budget below a heuristic's own peak still gets that heuristic's ladder: the start
    shrunk to the budget is tried and fits."""
    p = _backward()
    own = HEURISTICS["fsdp2"](p, mem_budget_bytes=None).peak_bytes
    shrunk = HEURISTICS["fsdp2"](p, mem_budget_bytes=own - 1)
    objective = Objective({"m": p}, shrunk.peak_bytes)
    found, _ = starts(objective, dataclasses.replace(SearchConfig(), fit_moves=0))
    assert shrunk.peak_bytes < own
    assert any(e.schedule.digest() == shrunk.schedule.digest() for e in found)


def test_the_peak_step_from_the_evaluators_peak_is_the_simulators():
    """fit_by_delays finds where memory peaks by the memory rules alone, stopping at the peak
    the evaluator gave (solvers.core.simulator.peak_step): the same step as a full simulation,
    on every regular start of the graph, the traced order and the FSDP2-like schedule."""
    from solvers.core.evaluate import evaluator_of
    from solvers.core.simulator import peak_step, simulate

    for kind in ("forward", "backward"):
        p = Problem.from_dag(make_fsdp_dag(n_layers=4, graph_kind=kind, reshard_after_forward=True, seed=1))
        base = fsdp2_schedule(p)
        schedules = [p.traced_schedule(), base,
                     *(s for r in regroupings(p, (1, 2, 3), (1, 2, 4)) if (s := regroup(p, base, r)) is not None)]
        steps = set()
        for s in schedules:
            full = simulate(p.dag, s, problem=p)
            assert evaluator_of(p).evaluate(s).peak_bytes == full.peak_bytes
            assert peak_step(p, s, full.peak_bytes) == full.peak_step
            steps.add(full.peak_step)
        assert len(schedules) > 5 and len(steps) > 1  # schedules that peak at different steps
