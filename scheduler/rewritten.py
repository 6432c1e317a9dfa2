"""Rewritten graphs, judged on themselves under several cost models.

What is written back is what counts (issue 13): a schedule is compared with another by the
graph each one writes, not by the model's prediction. This module makes such graphs and
judges them; :mod:`scheduler.robust` (a choice across cost models) and
:mod:`scheduler.equal_memory` (the product against each baseline at the baseline's peak) build
on it.

- :func:`rewrite_baseline`: a copy of the graph as a baseline writes it: the graph as traced,
  a heuristic of :data:`solvers.heuristics.HEURISTICS` written back with
  :func:`scheduler.apply_schedule`, or torch's overlap scheduler (``"torch"``).
- :func:`rewrite_product`: a copy rewritten by :func:`scheduler.optimize_schedule`.
- :func:`judge`: the rewritten graph re-exported and simulated in its node order under every
  given cost model (step time, ms), and its peak memory by the re-export, the reference
  liveness count (:func:`scheduler.judge.liveness_peak`) and torch's ``MemoryTracker``
  (:func:`scheduler.judge.torch_tracker_peak`); a budget must hold all three.

Merging buckets needs an initialised process group in which the graph's groups resolve (a fake
one is enough, e.g. ``models.capture.fake_process_group``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scheduler.dag import export_dag
from scheduler.judge import liveness_peak, torch_tracker_peak
from scheduler.writeback import apply_schedule
from solvers.core import Problem, simulate
from solvers.heuristics import HEURISTICS
from solvers.registry import solve

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: name of torch's overlap scheduler as a baseline (:func:`rewrite_baseline`)
TORCH_BASELINE = "torch"


@dataclasses.dataclass(kw_only=True)
class Judged:
    """One rewritten graph as judged on itself (times in ms, memory in bytes)."""

    name: str
    #: re-exported step time per cost-model label
    step_ms: dict[str, float]
    #: peak of the re-export simulated in node order
    reexport_peak_bytes: int
    #: reference liveness count (collective inputs alive until their wait, aliases counted once)
    liveness_peak_bytes: int
    #: torch's MemoryTracker, every device counted
    tracker_peak_bytes: int
    n_collectives: int
    #: the rewritten graph (None once dropped to save memory)
    gm: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """The largest of the three peaks: what a budget must hold."""
        return max(self.reexport_peak_bytes, self.liveness_peak_bytes, self.tracker_peak_bytes)

    def fits(self, mem_budget_bytes: int | None) -> bool:
        return mem_budget_bytes is None or self.peak_bytes <= mem_budget_bytes


def rewrite_baseline(gm: "torch.fx.GraphModule", name: str, *, cluster: Any = None) -> "torch.fx.GraphModule":
    """A copy of ``gm`` rewritten by baseline ``name`` (``gm`` is not modified).

    Args:
        name: ``"traced"`` (the copy as it is), a heuristic of
            :data:`solvers.heuristics.HEURISTICS` (``"fsdp2"``, ``"simplefsdp"``,
            ``"autoparallel"``; solved without a budget on the analytic export: they do not
            read costs), or ``"torch"`` (:func:`scheduler.baselines.torch_overlap_schedule`
            priced for ``cluster``, torch's default memory allowance).

    Raises:
        ValueError: an unknown name.
        scheduler.baselines.TorchBaselineError: torch's pass failed on this graph.
    """
    if name == TORCH_BASELINE:
        from scheduler.baselines import torch_overlap_schedule  # imports torch's inductor

        return torch_overlap_schedule(gm, cluster=cluster)
    if name not in HEURISTICS:
        raise ValueError(f"unknown baseline {name!r}; choose one of {sorted(HEURISTICS) + [TORCH_BASELINE]}")
    out = copy.deepcopy(gm)
    if name == "traced":
        return out
    problem = Problem.from_dag(export_dag(out, cluster=cluster))
    apply_schedule(out, problem, solve(problem, solver=name).schedule)
    return out


def rewrite_product(
    gm: "torch.fx.GraphModule",
    mem_budget_bytes: int | None,
    *,
    cost_model: Any = None,
    cluster: Any = None,
    time_limit_s: float = 15.0,
) -> "torch.fx.GraphModule":
    """A copy of ``gm`` rewritten by :func:`scheduler.optimize_schedule` at ``mem_budget_bytes``
    under ``cost_model`` (one rank's view: no agreement). Its report is at
    ``meta["fsdp_sched_report"]``.

    Raises:
        InfeasibleBudgetError: no schedule fits the budget in the model.
    """
    from scheduler.api import optimize_schedule

    return optimize_schedule(copy.deepcopy(gm), mem_budget_bytes, cost_model=cost_model, cluster=cluster,
                             time_limit_s=time_limit_s, agree=False)


def judge(gm: "torch.fx.GraphModule", cost_models: Mapping[str, Any], *, name: str = "", cluster: Any = None,
          keep_graph: bool = False) -> Judged:
    """Judge ``gm`` as written (module docstring) under every model of ``cost_models`` (label ->
    a cost model or its name, priced on ``cluster``). Keeps ``gm`` on the result if asked."""
    if not cost_models:
        raise ValueError("judge needs at least one cost model")
    step_ms: dict[str, float] = {}
    sim = None
    for label, model in cost_models.items():
        problem = Problem.from_dag(export_dag(gm, cost_model=model, cluster=cluster))
        sim = simulate(problem.dag, problem=problem)
        step_ms[label] = sim.step_ms
    assert sim is not None
    judged = Judged(name=name, step_ms=step_ms, reexport_peak_bytes=sim.peak_bytes,
                    liveness_peak_bytes=liveness_peak(gm), tracker_peak_bytes=torch_tracker_peak(gm),
                    n_collectives=sim.n_collectives, gm=gm if keep_graph else None)
    logger.debug("judged %s: %s, peak %d B", name, step_ms, judged.peak_bytes)
    return judged
