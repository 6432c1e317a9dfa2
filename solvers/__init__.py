"""Solvers and heuristics over the cost-annotated DAG. Nothing here imports torch.

Layers, bottom up (each imports only the ones above it in this list):

- :mod:`solvers.core`: units, the problem and the one schedule type, the plan that builds
  schedules (:mod:`solvers.core.plan`: (bucket, issue gap, wait gap) per bucket), the
  execution model (the simulator, its fast exact twin :mod:`solvers.core.evaluate`, the
  validator);
- :mod:`solvers.heuristics`: today's FSDP schedules (traced, FSDP2, SimpleFSDP, AutoParallel);
- the search's stages: :mod:`solvers.starts` (starts), :mod:`solvers.config` /
  :mod:`solvers.model` / :mod:`solvers.cpsat` / :mod:`solvers.milp` (the window model and its
  two backends), :mod:`solvers.polish` (the local search);
- :mod:`solvers.search`: the search, its stages in order (starts, windows, polish);
- :mod:`solvers.registry`: names -> solvers, ``solve()``.
"""

from solvers.core import (
    Bucket,
    Collective,
    InfeasibleBudgetError,
    Problem,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    Step,
)
from solvers.registry import available_solvers, solve, solve_budgets

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
    "available_solvers",
    "solve",
    "solve_budgets",
]
