"""Solvers and heuristics over the cost-annotated DAG. Nothing here imports torch.

Layers, bottom up (each imports only the ones above it in this list):

- :mod:`solvers.core`: units, problem and schedule types, the simulator (execution model),
  the validator;
- :mod:`solvers.heuristics`: today's FSDP schedules (traced, FSDP2, SimpleFSDP, AutoParallel);
  :mod:`solvers.warmstart`: the one place that makes warm starts from them;
- :mod:`solvers.config`, :mod:`solvers.model`: the solver-neutral model (formulation, data,
  extraction, hints); :mod:`solvers.periodic`: repeating layers; :mod:`solvers.minimax`: the
  local search on the simulator (worst-case regret across cost models; with one model, the
  solve loop's final polish);
- :mod:`solvers.decompose`: per-layer templates and rolling windows over a window solver;
  :mod:`solvers.driver`: the one solve loop;
- :mod:`solvers.cpsat`, :mod:`solvers.milp`: the two backends of the model;
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
