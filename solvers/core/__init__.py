"""The execution model, at the bottom of every layer: imports nothing else of the project.

- :mod:`solvers.core.units`: bytes and times, parsed and formatted.
- :mod:`solvers.core.schedule`: the :class:`Schedule` every solver and heuristic returns, and
  the shared :class:`SolveResult`.
- :mod:`solvers.core.plan`: the :class:`PlannedBucket` the search and the heuristics build
  schedules from.
- :mod:`solvers.core.problem`: the :class:`Problem`, plain data extracted once from a
  cost-annotated DAG.
- :mod:`solvers.core.simulator`: the execution model of the repository's ``DESIGN.md``, by which every
  schedule is judged.
- :mod:`solvers.core.validator`: checks any schedule against the problem and a budget.
"""

from solvers.core.problem import Collective, Problem
from solvers.core.schedule import (
    Bucket,
    InfeasibleBudgetError,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    StageRecord,
    Step,
)
from solvers.core.simulator import ScheduleInvalidError, SimResult, simulate, simulate_ranks
from solvers.core.units import US_PER_MS, fmt_bytes, fmt_ms, parse_bytes
from solvers.core.validator import validate_schedule

__all__ = [
    "Bucket",
    "Collective",
    "InfeasibleBudgetError",
    "Problem",
    "Schedule",
    "ScheduleError",
    "ScheduleInvalidError",
    "SimResult",
    "SolveResult",
    "SolveStatus",
    "StageRecord",
    "Step",
    "US_PER_MS",
    "fmt_bytes",
    "fmt_ms",
    "parse_bytes",
    "simulate",
    "simulate_ranks",
    "validate_schedule",
]
