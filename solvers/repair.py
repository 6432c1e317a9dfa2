"""Repair by the excess: the one way a schedule that counts over its budget is made again.

A schedule is made under a *model budget* by something that holds one count of memory (the
CP-SAT model's, the simulator's), then counted by a stricter judge (the simulator, or the
rewritten graph's liveness count and torch's tracker). When the judge counts it over the real
budget by ``excess`` bytes, it is made again under a model budget lowered by that excess: the
counts differ by a margin that hardly moves between nearby schedules, so one or two rounds
bring it under. The solve loop (:mod:`solvers.driver`) repairs its models' schedules this way,
and the choice among written graphs (:mod:`scheduler.verify`) its polished ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Repair(Generic[T]):
    """What :func:`repair_by_excess` made."""

    #: the first result the judge counts within the budget (None: none within the rounds)
    fitting: T | None
    #: every result made, in order (the first is made under the starting model budget)
    made: tuple[T, ...]
    #: the model budget of each result of ``made`` (bytes)
    model_budgets: tuple[int | None, ...]


def repair_by_excess(make: Callable[[int | None], T | None], excess_bytes: Callable[[T], int],
                     start_budget_bytes: int | None, *,
                     rounds: int, model_peak_bytes: Callable[[T], int] | None = None) -> Repair[T]:
    """Make a result under ``start_budget_bytes``, then, while the judge counts it over,
    make it again under a lower model budget, at most ``rounds`` more times.

    Args:
        make: ``model_budget_bytes -> result``, or None when nothing can be made under it
            (the repair stops there).
        excess_bytes: the judge's count of a result less the real budget (<= 0: it fits).
        start_budget_bytes: the model budget of the first attempt (None: no budget, so
            nothing to repair).
        rounds: most repairs after the first attempt (0: the first attempt only).
        model_peak_bytes: the result's peak by the maker's own count, when it may lie under
            the model budget: the next model budget is then lowered from the lesser of the two
            (``min(model budget, model peak) - excess - 1``), so each round asks for less than
            the last result had.
    """
    made: list[T] = []
    budgets: list[int | None] = []
    model_budget = start_budget_bytes
    for _ in range(rounds + 1):
        result = make(model_budget)
        if result is None:
            break
        made.append(result)
        budgets.append(model_budget)
        excess = excess_bytes(result)
        if excess <= 0 or model_budget is None:
            return Repair(fitting=result, made=tuple(made), model_budgets=tuple(budgets))
        base = model_budget if model_peak_bytes is None else min(model_budget, model_peak_bytes(result))
        model_budget = base - excess - 1
        if model_budget <= 0:
            break
    return Repair(fitting=None, made=tuple(made), model_budgets=tuple(budgets))
