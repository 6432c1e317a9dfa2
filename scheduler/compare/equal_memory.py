"""The headline at equal memory: fsdp-sched at each baseline's peak against that baseline.

A user compares at equal memory with the tool they use today, on the graph that is written
back, under more than one cost model. For each baseline B of :data:`BASELINES` (FSDP2-like,
torch's overlap scheduler, SimpleFSDP-like) and each cost model A of :data:`COST_MODELS`:

1. B is written back and judged on its written graph (:func:`scheduler.compare.judged.judge_baseline`):
   ``peak(B)`` is the larger of its re-export and liveness peaks (the counts a budget bounds), ``t_A(B)`` its
   re-exported step time under A;
2. fsdp-sched (:func:`scheduler.compare.judged.judge_product`: ``optimize_schedule`` on a copy) runs at
   ``mem_budget = peak(B)``. With ``solve_under="robust"`` (default) it runs as users run it,
   without a cost model (the schedule with the least worst-case regret over the family of
   models), once per budget, and its one written graph is judged under every A; with
   ``"each"``, it runs with ``cost_model=A`` for each A and is judged under A. Its written graph
   ``fits`` when both of those peaks are within ``peak(B)``. Each budget is solved on its own,
   as a user would call it (baselines with the same peak share one solve);
3. speedup vs B = ``t_A(B) / t_A(fsdp-sched)``; speedup vs the best baseline that fits =
   ``min t_A(B')`` over the baselines with ``peak(B') <= peak(B)``, divided by the same;
4. whether a speedup is possible at all: ``bound_A``, the analytic lower bound on the step time
   of any schedule of the graph (:meth:`solvers.core.Problem.lower_bound_ms` of the traced
   graph exported under A; it ignores memory, so at a budget it can only be lower than the
   true optimum), and the headroom of the best baseline over it, ``min t_A(B') / bound_A``:
   the largest speedup vs the best baseline any schedule could reach.

:func:`compare` returns the rows; :func:`format_table`, :func:`headline` and :func:`plot` show
them (``fsdp-sched demo``, :mod:`scheduler.cli.demo`, and ``benchmarks/equal_memory.py`` print them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.compare.judged import PRODUCT, TORCH, Judged, display, judge_baseline, judge_product
from scheduler.export.dag import export_dag
from scheduler.options import SolverOptions
from solvers.core import Problem, fmt_bytes

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: the baselines fsdp-sched is compared with, each at its own peak
BASELINES = ("fsdp2", TORCH, "simplefsdp")
#: the cost models each comparison is judged under
COST_MODELS = ("analytic", "torch")
#: how fsdp-sched is solved: as users run it (no cost model), or under each judging model
SOLVE_UNDER = ("robust", "each")


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
    #: fsdp-sched's written graph (None when no schedule fitted)
    product_ms: float | None = None
    product_peak_bytes: int | None = None
    #: fsdp-sched's written graph within the budget by the re-export and the liveness count
    fits: bool = False
    #: wall time of fsdp-sched's optimize_schedule (s)
    compile_s: float | None = None
    #: wall time of the baseline's compile pass (s; None for the heuristics)
    baseline_compile_s: float | None = None
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
    """Every row of one graph, the written graphs judged and the baselines that could not be made."""

    graph: str
    rows: list[Row]
    #: name -> each baseline that could be made, judged on its written graph
    baselines: dict[str, Judged]
    #: (budget bytes, the cost model solved under or None for the robust default) -> fsdp-sched
    products: dict[tuple[int, str | None], Judged]
    unavailable: dict[str, str]
    #: cost model -> the lower bound of point 4 (ms)
    lower_bounds_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def product_for(self, baseline: str, cost_model: str) -> Judged | None:
        """fsdp-sched's written graph at ``baseline``'s peak judged under ``cost_model``."""
        budget = self.baselines[baseline].max_peak_bytes
        return self.products.get((budget, None)) or self.products.get((budget, cost_model))

    def to_json(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "rows": [{**dataclasses.asdict(r), "speedup": r.speedup, "speedup_vs_best": r.speedup_vs_best,
                      "headroom": r.headroom} for r in self.rows],
            "baselines": {n: j.to_json() for n, j in self.baselines.items()},
            "products": [{"budget_bytes": b, "solved_under": m or "robust", **j.to_json()}
                         for (b, m), j in self.products.items()],
            "unavailable": self.unavailable,
            "lower_bounds_ms": self.lower_bounds_ms,
        }


def compare(
    gm: "torch.fx.GraphModule",
    *,
    graph: str = "",
    baselines: Sequence[str] = BASELINES,
    cost_models: Sequence[str] = COST_MODELS,
    cluster: Any = None,
    solver: SolverOptions = SolverOptions(),
    solve_under: str = "robust",
    on_row: Callable[[Row], None] | None = None,
) -> Comparison:
    """fsdp-sched at each baseline's peak against it, under each cost model (module docstring).

    ``gm`` is not modified. Needs an initialised process group in which the graph's groups
    resolve (a fake one is enough). A baseline that cannot be made is listed in
    ``unavailable`` with the reason. ``on_row`` is called on each row as it is made.
    """
    if solve_under not in SOLVE_UNDER:
        raise ValueError(f"solve_under={solve_under!r} must be one of {SOLVE_UNDER}")
    logger.info("%s: writing back and judging the baselines %s", graph, [display(b) for b in baselines])
    made = {name: judge_baseline(gm, name, cost_models, cluster=cluster) for name in baselines}
    judged = {n: j for n, j in made.items() if j.ok}
    unavailable = {n: j.error or "not judged" for n, j in made.items() if not j.ok}
    bounds = lower_bounds(gm, cost_models, cluster=cluster)
    products: dict[tuple[int, str | None], Judged] = {}
    solve_models: list[str | None] = [None] if solve_under == "robust" else list(cost_models)
    for model in solve_models:
        for budget in sorted({j.max_peak_bytes for j in judged.values()}):
            logger.info("%s: fsdp-sched at %s (the peak of %s)", graph, fmt_bytes(budget),
                        ", ".join(display(n) for n, j in judged.items() if j.max_peak_bytes == budget))
            products[(budget, model)] = judge_product(gm, budget, cost_models, cost_model=model, cluster=cluster,
                                                      solver=solver)
    rows: list[Row] = []
    comparison = Comparison(graph=graph, rows=rows, baselines=judged, products=products, unavailable=unavailable,
                            lower_bounds_ms=bounds)
    for name, base in judged.items():
        for model in cost_models:
            rows.append(_row(graph, name, model, judged, comparison.product_for(name, model)))
            rows[-1].lower_bound_ms = bounds[model]
            if on_row is not None:
                on_row(rows[-1])
    return comparison


def lower_bounds(gm: "torch.fx.GraphModule", cost_models: Sequence[str], *, cluster: Any = None) -> dict[str, float]:
    """Cost model -> lower bound on the step time of any schedule of ``gm`` (ms; module
    docstring, point 4)."""
    return {m: Problem.from_dag(export_dag(gm, cost_model=m, cluster=cluster)).lower_bound_ms() for m in cost_models}


def _row(graph: str, name: str, model: str, judged: dict[str, Judged], product: Judged | None) -> Row:
    budget = judged[name].max_peak_bytes
    fitting = {n: j.step_ms(model) for n, j in judged.items() if j.max_peak_bytes <= budget}
    best = min(sorted(fitting), key=fitting.get)
    row = Row(graph=graph, baseline=name, cost_model=model, budget_bytes=budget,
              baseline_ms=judged[name].step_ms(model), best_baseline=best, best_baseline_ms=fitting[best],
              baseline_compile_s=judged[name].compile_s)
    if product is None:
        return row
    row.compile_s = product.compile_s
    row.note = product.error or ""
    if product.ok:
        report = product.report
        row.note = f"{report.chosen_candidate or report.solver}, {report.status}" if report is not None else ""
        row.product_ms, row.product_peak_bytes = product.step_ms(model), product.max_peak_bytes
        row.fits = product.max_peak_bytes <= budget
        if not row.fits:
            row.note = f"over budget on the written graph ({fmt_bytes(product.max_peak_bytes)}); {row.note}"
    return row


# --------------------------------------------------------------------------------------------
# showing it
# --------------------------------------------------------------------------------------------
def format_table(rows: Sequence[Row], title: str = "") -> str:
    """One line per (graph, baseline, cost model): budget, both step times, both speedups, the
    lower bound and the headroom of the best baseline over it."""
    wide = max([20] + [len(display(r.baseline)) + 2 for r in rows])
    best = max([22] + [len(display(r.best_baseline)) + 2 for r in rows])
    head = (f"{'graph':<10}{'baseline':<{wide}}{'cost':<10}{'budget = peak(B)':>17}{'B ms':>11}{'fsdp-sched ms':>15}"
            f"{'vs B':>8}{'best that fits':>{best}}{'vs best':>9}{'bound ms':>10}{'headroom':>10}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        mine = "-" if r.product_ms is None else f"{r.product_ms:.2f}"
        lines.append(
            f"{r.graph:<10}{display(r.baseline):<{wide}}{r.cost_model:<10}"
            f"{fmt_bytes(r.budget_bytes):>17}{r.baseline_ms:11.2f}{mine:>15}{_x(r.speedup):>8}"
            f"{display(r.best_baseline):>{best}}{_x(r.speedup_vs_best):>9}"
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
            f"x{geomean([r.speedup for r in ok if r.baseline == b]):.2f} vs {display(b)}"
            for b in dict.fromkeys(r.baseline for r in ok))
        best = geomean([r.speedup_vs_best for r in ok])
        line = f"fsdp-sched at equal memory, {model} cost model: {per or 'no row fits'}"
        if best is not None:
            worst = min(ok, key=lambda r: r.speedup)
            line += (f"; x{best:.2f} vs the best baseline that fits (geomean); worst x{worst.speedup:.2f} "
                     f"({worst.graph}, vs {display(worst.baseline)})")
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
    from scheduler.whatif import plots

    rows = [r for r in comparison.rows if r.cost_model == cost_model]
    base = {display(n): (j.max_peak_bytes, j.step_ms(cost_model)) for n, j in comparison.baselines.items()}
    pairs = [(display(r.baseline), (r.budget_bytes, r.baseline_ms), (r.product_peak_bytes, r.product_ms))
             for r in rows if r.product_ms is not None]
    return plots.pareto([p for _, _, p in pairs], path, base, equal_memory=pairs,
                        title=f"{comparison.graph}: {PRODUCT} at each baseline's peak ({cost_model} cost model)")
