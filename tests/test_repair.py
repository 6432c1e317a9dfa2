"""Repair by the excess (solvers.repair): made again under a budget lowered by the excess."""

from __future__ import annotations

from solvers.repair import repair_by_excess


def test_each_round_asks_for_the_excess_less_until_it_fits():
    """A maker whose results count 30 B above the model budget it was given (a judge with a
    constant margin): 1000 B real budget, first model budget 1000; it fits after one repair, at
    a model budget of 1000 - 30 - 1."""
    asked = []

    def make(model_budget):
        asked.append(model_budget)
        return model_budget + 30  # what the judge counts

    repair = repair_by_excess(make, lambda peak: peak - 1000, 1000, rounds=3)
    assert asked == [1000, 969] and repair.fitting == 999 and repair.made == (1030, 999)
    assert repair.model_budgets == (1000, 969)


def test_a_model_peak_below_the_budget_lowers_from_there():
    """The maker's own count (the result's model peak) below its model budget: the next budget
    is lowered from that peak, so the next result is asked to hold less than the last had."""
    asked = []

    def make(model_budget):
        asked.append(model_budget)
        return {"model": min(model_budget, 900) - (len(asked) - 1) * 100, "judged": 1010 - (len(asked) - 1) * 100}

    repair = repair_by_excess(make, lambda r: r["judged"] - 1000, 1000, rounds=2,
                              model_peak_bytes=lambda r: r["model"])
    assert asked == [1000, 900 - 10 - 1]
    assert repair.fitting is not None and repair.fitting["judged"] <= 1000


def test_gives_up_after_its_rounds_or_when_nothing_is_made():
    asked = []
    never = repair_by_excess(lambda b: asked.append(b) or 1001, lambda peak: peak - 1000, 1000, rounds=2)
    assert never.fitting is None and len(never.made) == 3 and asked == [1000, 998, 996]
    assert repair_by_excess(lambda b: None, lambda peak: 0, 1000, rounds=2).made == ()
    # no budget: the first result is the answer, whatever it counts
    free = repair_by_excess(lambda b: 5, lambda peak: 10**9, None, rounds=2)
    assert free.fitting == 5 and free.made == (5,)
    # a budget driven to zero stops the repair
    assert repair_by_excess(lambda b: b + 2000, lambda peak: peak - 1000, 1000, rounds=5).made == (3000,)
