"""fsdp-sched: solver-based scheduling of FSDP collectives.

Pipeline (one module per step): ``models`` (capture) -> :mod:`scheduler.export.dag` (export) ->
:mod:`scheduler.costs.models` (costs) -> ``solvers`` (solve) -> :mod:`solvers.core.simulator` /
:mod:`solvers.core.validator` (check) -> :mod:`scheduler.writeback` (write back);
:mod:`scheduler.api` ties them together as ``optimize_schedule``.

Attributes are loaded lazily so that importing the torch-free parts (simulate, validate)
does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_EXPORTS = {
    "export_dag": "scheduler.export.dag",
    "save_dag": "scheduler.export.dagfile",
    "load_dag": "scheduler.export.dagfile",
    "DagError": "scheduler.export.dag",
    "Cluster": "scheduler.costs.hardware",
    "GPUSpec": "scheduler.costs.hardware",
    "GPU_PRESETS": "scheduler.costs.hardware",
    "AnalyticCostModel": "scheduler.costs.models",
    "TorchCostModel": "scheduler.costs.torch_model",
    "TableCostModel": "scheduler.costs.models",
    "ProfileCostModel": "scheduler.costs.models",
    "CoverageCheck": "scheduler.costs.annotate",
    "CollectiveTable": "scheduler.costs.tables",
    "annotate_costs": "scheduler.costs.annotate",
    "MeasuredCostModel": "scheduler.costs.measure",
    "simulate": "solvers.core.simulator",
    "simulate_ranks": "solvers.core.simulator",
    "SimResult": "solvers.core.simulator",
    "ScheduleInvalidError": "solvers.core.simulator",
    "validate_schedule": "solvers.core.validator",
    "optimize_schedule": "scheduler.api",
    "solve_dag": "scheduler.solving",
    "ScheduleReport": "scheduler.report",
    "parse_bytes": "solvers.core.units",
    "backend": "scheduler.integrate.compile",
    "inductor_post_grad_pass": "scheduler.integrate.compile",
    "graph_trainer_pass": "scheduler.integrate.graph_trainer",
    "apply_schedule": "scheduler.writeback",
    "cost_model_family": "scheduler.costs.family",
    "SolverOptions": "scheduler.options",
    "AgreementOptions": "scheduler.options",
    "WriteBackOptions": "scheduler.options",
    "SearchConfig": "solvers.objective",
    "Schedule": "solvers.core.schedule",
    "Bucket": "solvers.core.schedule",
    "SolveResult": "solvers.core.schedule",
    "SolveStatus": "solvers.core.schedule",
    "InfeasibleBudgetError": "solvers.core.schedule",
    "ScheduleError": "solvers.core.schedule",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A public name, or a submodule (``scheduler.integrate.compile.backend`` works after a bare
    ``import scheduler``, as an eager package would allow), loaded on first use."""
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
