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
- :func:`robust_schedule`: the candidate best in the worst case across cost models
  (:mod:`scheduler.robust`), among fsdp-sched solved under each base model and the baselines.

Merging buckets needs an initialised process group in which the graph's groups resolve (a fake
one is enough, e.g. ``models.capture.fake_process_group``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.api import optimize_schedule
from scheduler.costs import Cluster
from scheduler.dag import export_dag
from scheduler.judge import liveness_peak, torch_tracker_peak
from scheduler.robust import BASE_COST_MODELS, cost_model_family, robust_key, worst_regret
from scheduler.writeback import apply_schedule
from solvers.core import InfeasibleBudgetError, Problem, ScheduleError, fmt_bytes, parse_bytes, simulate
from solvers.heuristics import HEURISTICS
from solvers.registry import solve

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: name of torch's overlap scheduler as a baseline (:func:`rewrite_baseline`)
TORCH_BASELINE = "torch"
#: baselines :func:`robust_schedule` considers besides its own solves
ROBUST_BASELINES = ("fsdp2", "simplefsdp", "autoparallel", "traced", TORCH_BASELINE)


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


# --------------------------------------------------------------------------------------------
# the robust choice on an FX graph
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class RobustResult:
    """What :func:`robust_schedule` found: the choice, and every candidate as judged."""

    #: name of the chosen candidate
    chosen: str
    #: the chosen rewritten graph (a copy: the input graph is not modified)
    gm: Any = dataclasses.field(repr=False)
    mem_budget_bytes: int | None
    #: every candidate that could be written back, judged under every model of the family
    judged: dict[str, Judged]
    #: candidates that were dropped (not made, or over the budget) and why
    dropped: dict[str, str]
    #: names of the candidates solved by fsdp-sched, by the label of the model solved under
    solved_under: dict[str, str]
    time_s: float = 0.0

    @property
    def fitting(self) -> list[str]:
        return sorted(n for n, j in self.judged.items() if j.fits(self.mem_budget_bytes))

    def step_ms_by_model(self) -> dict[str, dict[str, float]]:
        """Model label -> fitting candidate -> re-exported step time (ms)."""
        labels = next(iter(self.judged.values())).step_ms
        return {label: {n: self.judged[n].step_ms[label] for n in self.fitting} for label in labels}

    def worst_regret(self) -> dict[str, float]:
        return worst_regret(self.step_ms_by_model())

    def table(self) -> str:
        """Step time (ms) of every fitting candidate under every model, its worst regret."""
        times = self.step_ms_by_model()
        worst = self.worst_regret()
        head = f"{'candidate':<24}" + "".join(f"{label:>16}" for label in times) + f"{'worst regret':>14}"
        lines = [head, "-" * len(head)]
        for n in self.fitting:
            mark = " <- robust" if n == self.chosen else ""
            lines.append(f"{n:<24}" + "".join(f"{times[label][n]:16.2f}" for label in times)
                         + f"{worst[n]:14.2%}{mark}")
        return "\n".join(lines)


def robust_schedule(
    gm: "torch.fx.GraphModule",
    mem_budget: int | str | None = None,
    *,
    cluster: Cluster | None = None,
    cost_models: Mapping[str, Any] | None = None,
    solve_under: Sequence[str] = BASE_COST_MODELS,
    baselines: Sequence[str] = ROBUST_BASELINES,
    time_limit_s: float = 15.0,
) -> RobustResult:
    """The schedule of ``gm`` that is best in the worst case across cost models.

    Candidates: :func:`scheduler.optimize_schedule` at ``mem_budget`` under each model of
    ``solve_under`` (labels of the family) and each baseline of ``baselines``
    (:func:`rewrite_baseline`), each on its own copy of ``gm``. Each rewritten graph is
    re-exported and simulated under every model of ``cost_models`` (default
    :func:`scheduler.robust.cost_model_family` of ``cluster``); those whose re-export, liveness
    and torch tracker peaks are all within the budget compete, and
    :func:`scheduler.robust.robust_key` chooses. ``gm`` itself is not modified: the result
    holds the chosen rewritten copy. Needs an
    initialised process group in which the graph's groups resolve (a fake one is enough).

    Args:
        mem_budget: bytes or a string like ``"40GiB"``; None: no limit.
        time_limit_s: time limit of each solve (default 15 s).

    Raises:
        InfeasibleBudgetError: no candidate's rewritten graph fits the budget (states the
            smallest peak).
    """
    t0 = time.perf_counter()
    budget = parse_bytes(mem_budget)
    family = dict(cost_models) if cost_models is not None else cost_model_family(cluster)
    unknown = [label for label in solve_under if label not in family]
    if unknown:
        raise ValueError(f"solve_under {unknown} are not models of the family {list(family)}")
    graphs, dropped, solved_under = _candidate_graphs(gm, budget, family, cluster=cluster, solve_under=solve_under,
                                                      baselines=baselines, time_limit_s=time_limit_s)
    judged = {}
    for i, (name, g) in enumerate(graphs.items()):
        logger.info("robust: judging %s (%d/%d) under %d cost models", name, i + 1, len(graphs), len(family))
        judged[name] = judge(g, family, name=name, cluster=cluster, keep_graph=True)
    result = RobustResult(chosen="", gm=None, mem_budget_bytes=budget, judged=judged, dropped=dropped,
                          solved_under=solved_under)
    _drop_over_budget(result)
    if not result.fitting:
        raise _none_fits(judged, budget)
    result.chosen = robust_key(result.step_ms_by_model())
    result.gm = judged[result.chosen].gm
    for j in judged.values():
        j.gm = None  # the copies are large; the result keeps the chosen one
    result.time_s = time.perf_counter() - t0
    logger.info("robust: chose %s (worst regret %.2f %%) among %d candidates in %.1f s", result.chosen,
                100 * result.worst_regret()[result.chosen], len(result.fitting), result.time_s)
    return result


def _candidate_graphs(gm, budget, family, *, cluster, solve_under, baselines, time_limit_s):
    """Name -> rewritten copy of ``gm``; name -> why a candidate was not made; and the
    product's candidate names -> the label solved under."""
    graphs: dict[str, Any] = {}
    dropped: dict[str, str] = {}
    solved_under: dict[str, str] = {}
    for label in solve_under:
        name = f"fsdp-sched[{label}]"
        logger.info("robust: solving under %s (limit %g s)", label, time_limit_s)
        try:
            graphs[name] = rewrite_product(gm, budget, cost_model=family[label], cluster=cluster,
                                           time_limit_s=time_limit_s)
            solved_under[name] = label
        except (InfeasibleBudgetError, ScheduleError) as e:
            dropped[name] = f"{type(e).__name__}: {e}"
    for name in baselines:
        logger.info("robust: writing back baseline %s", name)
        try:
            graphs[name] = rewrite_baseline(gm, name, cluster=cluster)
        except Exception as e:  # torch's pass fails on some graphs; one baseline must not stop the others
            dropped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return graphs, dropped, solved_under


def _drop_over_budget(result: RobustResult) -> None:
    for name, j in result.judged.items():
        if not j.fits(result.mem_budget_bytes):
            result.dropped[name] = (f"over budget: peak {fmt_bytes(j.peak_bytes)} > "
                                    f"{fmt_bytes(result.mem_budget_bytes)} on the rewritten graph")


def _none_fits(judged: Mapping[str, Judged], budget: int | None) -> Exception:
    if not judged:
        return ScheduleError("no candidate could be written back")
    least = min(judged.values(), key=lambda j: j.peak_bytes)
    return InfeasibleBudgetError(
        f"no rewritten graph keeps peak memory under {fmt_bytes(budget)}; the smallest is "
        f"{fmt_bytes(least.peak_bytes)} ({least.name}): raise mem_budget to at least that",
        budget_bytes=budget or 0, min_peak_bytes=least.peak_bytes)
