"""fsdp-sched: solver-based scheduling of FSDP collectives.

Pipeline (one module per step): ``models`` (capture) -> :mod:`scheduler.dag` (export) ->
:mod:`scheduler.costs` (costs) -> ``solvers`` (solve) -> :mod:`scheduler.simulator` /
:mod:`scheduler.validator` (check) -> :mod:`scheduler.writeback` (write back);
:mod:`scheduler.api` ties them together as ``optimize_schedule``.

Attributes are loaded lazily so that importing the torch-free parts (simulate, validate)
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "export_dag": "scheduler.dag",
    "save_dag": "scheduler.dag",
    "load_dag": "scheduler.dag",
    "DagError": "scheduler.dag",
    "Cluster": "scheduler.costs",
    "GPUSpec": "scheduler.costs",
    "GPU_PRESETS": "scheduler.costs",
    "AnalyticCostModel": "scheduler.costs",
    "TorchCostModel": "scheduler.costs",
    "TableCostModel": "scheduler.costs",
    "annotate_costs": "scheduler.costs",
    "MeasuredCostModel": "scheduler.measure",
    "simulate": "scheduler.simulator",
    "SimResult": "scheduler.simulator",
    "ScheduleInvalidError": "scheduler.simulator",
    "validate_schedule": "scheduler.validator",
    "optimize_schedule": "scheduler.api",
    "solve_dag": "scheduler.api",
    "ScheduleReport": "scheduler.api",
    "parse_bytes": "scheduler.api",
    "backend": "scheduler.api",
    "apply_schedule": "scheduler.writeback",
    "Schedule": "solvers.schedule",
    "Bucket": "solvers.schedule",
    "SolveResult": "solvers.schedule",
    "SolveStatus": "solvers.schedule",
    "InfeasibleBudgetError": "solvers.schedule",
    "ScheduleError": "solvers.schedule",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
