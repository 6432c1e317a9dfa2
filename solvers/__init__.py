"""Solvers and heuristics over the cost-annotated DAG. Nothing here imports torch."""

from solvers.problem import Collective, Problem
from solvers.schedule import (
    Bucket,
    InfeasibleBudgetError,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    Step,
)

__all__ = [
    "Bucket",
    "Collective",
    "InfeasibleBudgetError",
    "Problem",
    "Schedule",
    "ScheduleError",
    "SolveResult",
    "SolveStatus",
    "Step",
]

from solvers.dispatch import available_solvers, solve  # noqa: E402

__all__ += ["available_solvers", "solve"]
