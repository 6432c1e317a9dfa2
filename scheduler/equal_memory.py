"""The headline at equal memory: fsdp-sched at each baseline's peak against that baseline.

A user compares at equal memory with the tool they use today (issue 13), on the graph that is
written back, under more than one cost model. For each baseline B of :data:`BASELINES`
(FSDP2-like, torch's overlap scheduler, SimpleFSDP-like) and each cost model A of
:data:`COST_MODELS`:

1. B is written back and judged on its rewritten graph like every candidate of
   :mod:`scheduler.verify` (:func:`scheduler.rewritten.judge_baselines`): ``peak(B)`` is the
   largest of its re-export, liveness and torch-tracker peaks (``figures.max_peak_bytes``),
   ``t_A(B)`` its re-exported step time under A;
2. fsdp-sched (:func:`scheduler.rewritten.product_candidate`: ``optimize_schedule`` on a copy,
   cost model A) runs at ``mem_budget = peak(B)``; its rewritten graph is judged the same way
   (``fits`` when all three of its peaks are within ``peak(B)``);
3. speedup vs B = ``t_A(B) / t_A(fsdp-sched)``; speedup vs the best baseline that fits =
   ``min t_A(B')`` over the baselines with ``peak(B') <= peak(B)``, divided by the same;
4. whether a speedup is possible at all: ``bound_A``, the analytic lower bound on the step time
   of any schedule of the graph (:meth:`solvers.core.Problem.lower_bound_ms` of the traced
   graph re-exported under A: the largest of all compute, each communication stream at its
   cheapest after its first collective is ready plus the compute it cannot overlap, and the
   exposed first all-gather; it ignores memory, so at a budget it can only be lower than the
   true optimum), and the headroom of the best baseline over it, ``min t_A(B') / bound_A``:
   the largest speedup vs the best baseline any schedule could reach.

:func:`compare` returns the rows; :func:`format_table`, :func:`headline` and :func:`plot` show
them (the demo and ``benchmarks/equal_memory.py`` print them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.dag import export_dag
from scheduler.rewritten import TORCH_BASELINE, judge_baselines, product_candidate
from scheduler.verify import Candidate
from solvers.core import Problem, fmt_bytes

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: the baselines fsdp-sched is compared with, each at its own peak
BASELINES = ("fsdp2", TORCH_BASELINE, "simplefsdp")
#: the cost models each comparison is made under
COST_MODELS = ("analytic", "torch")
#: display names of the baselines
BASELINE_NAMES = {"fsdp2": "FSDP2-like", TORCH_BASELINE: "torch 2.13 overlap", "simplefsdp": "SimpleFSDP-like"}


@dataclasses.dataclass(kw_only=True)
class Row:
    """fsdp-sched against one baseline under one cost model, at the baseline's peak."""

    graph: str
    baseline: str
    cost_model: str
    #: peak(B): the budget fsdp-sched is given
    budget_bytes: int
    baseline_ms: float
    #: the fastest baseline whose peak is within the budget (B itself at least)
    best_baseline: str
    best_baseline_ms: float
    #: fsdp-sched's rewritten graph (None when no schedule fitted in the model)
    product_ms: float | None = None
    product_peak_bytes: int | None = None
    #: all three peaks of fsdp-sched's rewritten graph within the budget
    fits: bool = False
    solve_time_s: float = 0.0
    note: str = ""
    #: lower bound on any schedule's step time under this cost model (point 4 above)
    lower_bound_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        """``t(B) / t(fsdp-sched)``; None when fsdp-sched has no graph that fits."""
        return self.baseline_ms / self.product_ms if self.product_ms and self.fits else None

    @property
    def speedup_vs_best(self) -> float | None:
        return self.best_baseline_ms / self.product_ms if self.product_ms and self.fits else None

    @property
    def headroom(self) -> float | None:
        """``best_baseline_ms / lower_bound_ms``: the most any schedule could gain on the best
        baseline that fits (x1.00: none)."""
        return self.best_baseline_ms / self.lower_bound_ms if self.lower_bound_ms else None


@dataclasses.dataclass(kw_only=True)
class Comparison:
    """Every row of one graph, the baselines as judged and those that could not be made."""

    graph: str
    rows: list[Row]
    #: name -> each baseline that could be made, judged on its rewritten graph
    baselines: dict[str, Candidate]
    unavailable: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "rows": [{**dataclasses.asdict(r), "speedup": r.speedup, "speedup_vs_best": r.speedup_vs_best,
                      "headroom": r.headroom} for r in self.rows],
            "baselines": {n: {"peak_bytes": c.figures.max_peak_bytes, "step_ms": c.figures.step_ms}
                          for n, c in self.baselines.items()},
            "unavailable": self.unavailable,
        }


def compare(
    gm: "torch.fx.GraphModule",
    *,
    graph: str = "",
    baselines: Sequence[str] = BASELINES,
    cost_models: Sequence[str] = COST_MODELS,
    cluster: Any = None,
    time_limit_s: float = 15.0,
    on_row: Callable[[Row], None] | None = None,
) -> Comparison:
    """fsdp-sched at each baseline's peak against it, under each cost model (module docstring).

    ``gm`` is not modified. Needs an initialised process group in which the graph's groups
    resolve (a fake one is enough). A baseline that cannot be made (torch's pass fails on some
    graphs) is listed in ``unavailable`` with the reason. ``on_row`` is called on each row as
    it is made (progress). Solves at equal budgets under one model are made once.
    """
    logger.info("%s: writing back and judging baselines %s", graph, list(baselines))
    made = judge_baselines(gm, baselines, {m: m for m in cost_models}, cluster=cluster)
    judged = {c.name: c for c in made if c.figures is not None}
    unavailable = {c.name: c.error or "not judged" for c in made if c.figures is None}
    for name, reason in unavailable.items():  # torch's pass fails on some graphs; the others still compare
        logger.warning("%s: baseline %s unavailable: %s", graph, name, reason)
    bounds = lower_bounds(gm, cost_models, cluster=cluster)
    rows: list[Row] = []
    solved: dict[tuple[int, str], tuple[Candidate, float]] = {}
    for name in judged:
        for model in cost_models:
            budget = judged[name].figures.max_peak_bytes
            if (budget, model) not in solved:
                solved[(budget, model)] = _product(gm, budget, model, cluster=cluster, time_limit_s=time_limit_s,
                                                   graph=graph)
            rows.append(_row(graph, name, model, judged, *solved[(budget, model)]))
            rows[-1].lower_bound_ms = bounds[model]
            if on_row is not None:
                on_row(rows[-1])
    return Comparison(graph=graph, rows=rows, baselines=judged, unavailable=unavailable)


def lower_bounds(gm: "torch.fx.GraphModule", cost_models: Sequence[str], *, cluster: Any = None) -> dict[str, float]:
    """Cost model -> lower bound on the step time of any schedule of ``gm`` (ms; module
    docstring, point 4)."""
    return {m: Problem.from_dag(export_dag(gm, cost_model=m, cluster=cluster)).lower_bound_ms() for m in cost_models}


def _product(gm, budget: int, model: str, *, cluster: Any, time_limit_s: float, graph: str) -> tuple[Candidate, float]:
    """(fsdp-sched's candidate at ``budget`` under ``model``, judged under it; solve seconds)."""
    logger.info("%s: fsdp-sched at %s under %s (limit %g s)", graph, fmt_bytes(budget), model, time_limit_s)
    t0 = time.perf_counter()
    product = product_candidate(gm, budget, {model: model}, cluster=cluster, time_limit_s=time_limit_s)
    return product, time.perf_counter() - t0


def _row(graph: str, name: str, model: str, judged: dict[str, Candidate], product: Candidate, seconds: float) -> Row:
    budget = judged[name].figures.max_peak_bytes
    fitting = {n: c.figures.step_ms[model] for n, c in judged.items() if c.figures.max_peak_bytes <= budget}
    best = min(sorted(fitting), key=fitting.get)
    row = Row(graph=graph, baseline=name, cost_model=model, budget_bytes=budget,
              baseline_ms=judged[name].figures.step_ms[model], best_baseline=best, best_baseline_ms=fitting[best],
              solve_time_s=seconds, note=product.error or "")
    p = product.figures
    if p is not None:
        report = product.graph.meta.get("fsdp_sched_report") if product.graph is not None else None
        row.note = f"{report.chosen_candidate or report.solver}, {report.status}" if report is not None else ""
        row.product_ms, row.product_peak_bytes = p.step_ms[model], p.max_peak_bytes
        row.fits = p.max_peak_bytes <= budget
        if not row.fits:
            row.note = f"over budget on the rewritten graph ({fmt_bytes(p.max_peak_bytes)}); {row.note}"
    return row


# --------------------------------------------------------------------------------------------
# showing it
# --------------------------------------------------------------------------------------------
def format_table(rows: Sequence[Row], title: str = "") -> str:
    """One line per (graph, baseline, cost model): budget, both step times, both speedups, the
    lower bound and the headroom of the best baseline over it."""
    head = (f"{'graph':<10}{'baseline':<20}{'cost':<10}{'budget = peak(B)':>17}{'B ms':>11}{'fsdp-sched ms':>15}"
            f"{'vs B':>8}{'best that fits':>22}{'vs best':>9}{'bound ms':>10}{'headroom':>10}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        mine = "-" if r.product_ms is None else f"{r.product_ms:.2f}"
        lines.append(
            f"{r.graph:<10}{BASELINE_NAMES.get(r.baseline, r.baseline):<20}{r.cost_model:<10}"
            f"{fmt_bytes(r.budget_bytes):>17}{r.baseline_ms:11.2f}{mine:>15}{_x(r.speedup):>8}"
            f"{BASELINE_NAMES.get(r.best_baseline, r.best_baseline):>22}{_x(r.speedup_vs_best):>9}"
            f"{_ms(r.lower_bound_ms):>10}{_x(r.headroom):>10}"
            + (f"  {r.note}" if r.note and not r.fits else ""))
    return "\n".join(lines)


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def headline(rows: Sequence[Row]) -> str:
    """Per cost model: geometric-mean speedup vs each baseline and vs the best that fits, the
    worst row, and how many rows lose or do not fit."""
    lines = []
    for model in dict.fromkeys(r.cost_model for r in rows):
        mine = [r for r in rows if r.cost_model == model]
        ok = [r for r in mine if r.speedup is not None]
        per = ", ".join(
            f"x{geomean([r.speedup for r in ok if r.baseline == b]):.2f} vs {BASELINE_NAMES.get(b, b)}"
            for b in dict.fromkeys(r.baseline for r in ok))
        best = geomean([r.speedup_vs_best for r in ok])
        line = f"fsdp-sched at equal memory, {model} cost model: {per or 'no row fits'}"
        if best is not None:
            worst = min(ok, key=lambda r: r.speedup)
            line += (f"; x{best:.2f} vs the best baseline that fits (geomean); worst x{worst.speedup:.2f} "
                     f"({worst.graph}, vs {BASELINE_NAMES.get(worst.baseline, worst.baseline)})")
        room = geomean([r.headroom for r in mine if r.headroom is not None])
        if room is not None:
            line += f"; at most x{room:.2f} possible vs the best baseline (geomean of its headroom over the lower bound)"
        slower = sum(r.speedup < 1 for r in ok)
        missing = len(mine) - len(ok)
        if slower or missing:
            line += f"; slower than B in {slower} rows, no fitting graph in {missing}"
        lines.append(line)
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"x{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(comparison: Comparison, cost_model: str, path: str | Path) -> Path:
    """Pareto picture of one graph under ``cost_model``: each baseline at (peak, step), and
    fsdp-sched at the same budget, an arrow from each baseline to it."""
    from scheduler import plots

    rows = [r for r in comparison.rows if r.cost_model == cost_model]
    base = {BASELINE_NAMES.get(n, n): (c.figures.max_peak_bytes, c.figures.step_ms[cost_model])
            for n, c in comparison.baselines.items()}
    pairs = [(BASELINE_NAMES.get(r.baseline, r.baseline), (r.budget_bytes, r.baseline_ms),
              (r.product_peak_bytes, r.product_ms)) for r in rows if r.product_ms is not None]
    return plots.pareto([p for _, _, p in pairs], path, base, equal_memory=pairs,
                        title=f"{comparison.graph}: fsdp-sched at each baseline's peak ({cost_model} cost model)")
