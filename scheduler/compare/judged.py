"""Baselines and fsdp-sched written back on copies of a graph, judged on the written graphs.

What is written back is what counts. Each schedule compared here is written into a copy of the
FX graph and the copy is judged as written by :func:`scheduler.check.written.judge_graph` (re-exported
and simulated in its node order; peak memory by the re-export, the reference liveness count and
torch's ``MemoryTracker``), once per cost model of the comparison:

- :func:`judge_baseline`: a heuristic of :data:`solvers.heuristics.HEURISTICS` (traced order,
  FSDP2-like, SimpleFSDP-like, AutoParallel-like) written back with
  :func:`scheduler.writeback.apply_schedule`, or torch's overlap scheduler
  (:data:`TORCH`, :func:`scheduler.compare.baselines.torch_overlap_schedule`), or torch's manual
  scheduler with the per-block plan (:data:`TORCH_MANUAL`,
  :func:`scheduler.compare.baselines.torch_manual_schedule`, the graph trainer's bucketing), timed;
- :func:`judge_product`: :func:`scheduler.optimize_schedule` on a copy, one rank's view (no
  agreement), timed end to end (export, solve, choose, install).

Every pass is timed alike (:func:`timed_pass`): a full garbage collection before it, so that it
does not collect an earlier pass's garbage, what the process holds then frozen for the pass (as
``optimize_schedule`` freezes it itself), and a full collection of what the pass made after it,
on its clock, so that a pass that leaves its garbage for later (``optimize_schedule`` runs no
full collection during the call) pays for it as one that collects as it goes does.

Merging buckets needs an initialised process group in which the graph's groups resolve (a fake
one is enough, ``models.capture.fake_process_group``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.compare.baselines import TorchBaselineError, torch_manual_schedule, torch_overlap_schedule
from scheduler.api import REPORT_KEY, SCHEDULE_KEY, optimize_schedule
from scheduler.check.written import Figures, judge_graph
from scheduler.costs.family import cost_model_label
from scheduler.export.dag import export_dag
from scheduler.integrate import cache
from scheduler.options import AgreementOptions, SolverOptions
from scheduler.report import ScheduleReport
from scheduler.torch_overlap import TORCH, TORCH_NO_PREBUCKETING, VARIANTS
from scheduler.writeback import apply_schedule, split_all_gathers
from solvers.core import InfeasibleBudgetError, Problem, Schedule, ScheduleError, fmt_bytes
from solvers.heuristics import HEURISTICS
from solvers.registry import solve

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: torch's baselines (its overlap scheduler with its FSDP pre-bucketing, as torch runs it by
#: default, and without) -> the options of :func:`scheduler.compare.baselines.torch_overlap_schedule`
TORCH_BASELINES: dict[str, dict[str, Any]] = dict(VARIANTS)
#: torch's manual scheduler with one bucket per block and direction (the graph trainer's plan)
TORCH_MANUAL = "torch-manual"
#: a baseline's name with this suffix: that baseline with its all-gathers moved to a second
#: process group of the same ranks wherever they share a group with reduce-scatters (as the
#: graph trainer's ``reassign_collective_pgs_pass`` does; :func:`scheduler.writeback.split_all_gathers`)
AG_STREAM = "+ag-stream"
#: name of fsdp-sched's written graph
PRODUCT = "fsdp-sched"
#: display names
DISPLAY = {"traced": "traced order", "fsdp2": "FSDP2-like", "simplefsdp": "SimpleFSDP-like",
           "autoparallel": "AutoParallel-like", TORCH: "torch's scheduler",
           TORCH_NO_PREBUCKETING: "torch's scheduler (no pre-bucketing)", TORCH_MANUAL: "per-block plan",
           PRODUCT: PRODUCT}


def display(name: str) -> str:
    if name.endswith(AG_STREAM):
        return f"{display(name.removesuffix(AG_STREAM))}, 2nd AG stream"
    return DISPLAY.get(name, name)


@dataclasses.dataclass(kw_only=True)
class Judged:
    """One written graph, judged under every cost model of a comparison."""

    name: str
    #: cost model label -> the written graph's figures under it (empty when it was not made)
    figures: dict[str, Figures] = dataclasses.field(default_factory=dict)
    #: wall time of writing the graph (s): torch's pass, or ``optimize_schedule`` end to end,
    #: with the collection of its garbage after it (:func:`timed_pass`); None for the heuristics
    #: (no compile pass: a runtime's fixed rule)
    compile_s: float | None = None
    #: why the graph could not be made (None when it was)
    error: str | None = None
    #: the schedule written, over the traced graph's problem (None for torch's graphs)
    schedule: Schedule | None = None
    #: fsdp-sched's report (None for the baselines)
    report: ScheduleReport | None = None
    #: the written graph, kept only when asked
    graph: Any = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return bool(self.figures)

    @property
    def max_peak_bytes(self) -> int:
        """The largest peak of the written graph by any count under any model: what a budget
        must hold."""
        return max(f.max_peak_bytes for f in self.figures.values())

    def step_ms(self, cost_model: str) -> float:
        return self.figures[cost_model].step_ms

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "error": self.error, "compile_s": self.compile_s,
                "peak_bytes": self.max_peak_bytes if self.ok else None,
                "figures": {m: f.to_json() for m, f in self.figures.items()},
                "report": self.report.to_json() if self.report is not None else None}


@contextlib.contextmanager
def timed_pass() -> Iterator[list[float]]:
    """Time a pass: yields a list whose one item is set, once the block ends (raising or not),
    to its wall time in s, counted from after a full garbage collection to the end of a full
    collection of what the pass made (module docstring)."""
    gc.collect()
    frozen = not gc.get_freeze_count()
    if frozen:  # the collection after the pass then scans what it made, not the whole process
        gc.freeze()
    took = [0.0]
    t0 = time.perf_counter()
    try:
        yield took
    finally:
        gc.collect()
        took[0] = time.perf_counter() - t0
        if frozen:
            gc.unfreeze()


#: the cost models of a comparison: names (``"analytic"``, ``"torch"``), or label -> a cost model
#: or its name (such as :func:`scheduler.costs.family.cost_model_family`)
CostModels = Sequence[str] | Mapping[str, Any]


def judge_under(gm: "torch.fx.GraphModule", cost_models: CostModels, cluster: Any = None) -> dict[str, Figures]:
    """``gm`` as written, judged under each of ``cost_models`` (:func:`scheduler.check.written.judge_graph`),
    by label."""
    models = cost_models if isinstance(cost_models, Mapping) else {m: m for m in cost_models}
    return {label: judge_graph(gm, model, cluster) for label, model in models.items()}


def torch_pass(gm: "torch.fx.GraphModule", name: str, *, cluster: Any = None) -> "torch.fx.GraphModule":
    """torch's pass ``name`` (a key of :data:`TORCH_BASELINES`) on ``gm`` itself, as
    :func:`judge_baseline` times it; the rewritten module."""
    return torch_overlap_schedule(gm, cluster=cluster, inplace=True, **TORCH_BASELINES[name])


def product_pass(gm: "torch.fx.GraphModule", mem_budget_bytes: int | None, *, cost_model: Any = None,
                 cluster: Any = None, solver: SolverOptions = SolverOptions()) -> None:
    """``optimize_schedule`` on ``gm`` itself, as :func:`judge_product` times it: this rank alone,
    the schedule cache off (its time is a solve's, never a cache hit's).

    Raises:
        As :func:`scheduler.optimize_schedule`.
    """
    with cache.disabled():
        optimize_schedule(gm, mem_budget_bytes, cost_model=cost_model, cluster=cluster, solver=solver,
                          agreement=AgreementOptions(enabled=False))


def judge_baseline(gm: "torch.fx.GraphModule", name: str, cost_models: CostModels, *, cluster: Any = None,
                   keep_graph: bool = False) -> Judged:
    """Baseline ``name`` written back on a copy of ``gm`` and judged (module docstring). A
    baseline that cannot be made (torch's pass fails on some graphs) keeps the reason in
    ``error``.

    Raises:
        ValueError: an unknown name.
    """
    known = [*sorted(HEURISTICS), *sorted(TORCH_BASELINES), TORCH_MANUAL]
    base = name.removesuffix(AG_STREAM)
    if base not in known:
        raise ValueError(f"unknown baseline {name!r}; choose one of {known}, each optionally with {AG_STREAM!r}")
    out = Judged(name=name)
    split = name != base
    name = base
    try:
        if name in TORCH_BASELINES:
            import torch._inductor.fx_passes.overlap_scheduling  # noqa: F401  (its import is not the pass's time)

            written = copy.deepcopy(gm)
            with timed_pass() as took:
                written = torch_pass(written, name, cluster=cluster)
            out.compile_s = took[0]
        elif name == TORCH_MANUAL:
            written = copy.deepcopy(gm)
            with timed_pass() as took:
                written = torch_manual_schedule(written, cluster=cluster, inplace=True)
            out.compile_s = took[0]
        else:
            problem = Problem.from_dag(export_dag(gm, cluster=cluster))
            out.schedule = solve(problem, solver=name).schedule  # the heuristics read no budget
            written = copy.deepcopy(gm)
            if split:
                out.schedule = out.schedule.with_split(problem.splittable_groups())
            if out.schedule.digest() != problem.traced_schedule().digest():
                apply_schedule(written, problem, out.schedule)
        if split and name not in HEURISTICS:
            groups = Problem.from_dag(export_dag(written, cluster=cluster)).splittable_groups()
            if not groups:
                raise ValueError("no group of the written graph runs all-gathers beside other collectives")
            split_all_gathers(written, groups)
    except (TorchBaselineError, ScheduleError, ValueError, RuntimeError) as e:
        out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("baseline %s unavailable: %s", display(name), out.error)
        return out
    out.figures = judge_under(written, cost_models, cluster)
    out.graph = written if keep_graph else None
    logger.info("%s: peak %s, %s%s", display(name), fmt_bytes(out.max_peak_bytes), _steps(out),
                "" if out.compile_s is None else f", pass {out.compile_s:.1f} s")
    return out


def judge_product(gm: "torch.fx.GraphModule", mem_budget_bytes: int | None, cost_models: CostModels, *,
                  cost_model: Any = None, cluster: Any = None, solver: SolverOptions = SolverOptions(),
                  name: str = PRODUCT, keep_graph: bool = False) -> Judged:
    """fsdp-sched on a copy of ``gm``: ``optimize_schedule(copy, mem_budget_bytes,
    cost_model=cost_model, ...)`` (None: the robust default) on this rank alone, with the
    schedule cache off (solved, whatever an earlier run stored), timed, then judged under
    ``cost_models``. When no schedule fits, ``error`` says why."""
    written = copy.deepcopy(gm)
    logger.info("%s: optimize_schedule at %s under %s (a work limit of %g work unit%s)", name,
                fmt_bytes(mem_budget_bytes or 0), "the robust default" if cost_model is None else
                cost_model_label(cost_model), solver.work_limit, "" if solver.work_limit == 1 else "s")
    try:
        with timed_pass() as took:
            product_pass(written, mem_budget_bytes, cost_model=cost_model, cluster=cluster, solver=solver)
    except (InfeasibleBudgetError, ScheduleError) as e:
        out = Judged(name=name, compile_s=took[0], error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        logger.warning("%s: no schedule: %s", name, out.error)
        return out
    out = Judged(name=name, compile_s=took[0], schedule=written.meta.get(SCHEDULE_KEY),
                 report=written.meta[REPORT_KEY])
    out.figures = judge_under(written, cost_models, cluster)
    out.graph = written if keep_graph else None
    logger.info("%s: %.1f s, peak %s, %s", name, out.compile_s, fmt_bytes(out.max_peak_bytes), _steps(out))
    return out


def _steps(j: Judged) -> str:
    return ", ".join(f"{f.step_ms:.2f} ms under {m}" for m, f in j.figures.items())
