"""Graphs we did not capture: fsdp-sched against the baselines on tests/foreign_models.py.

Every model style of ``tests/foreign_models.py`` (plain ``torch.compile`` + ``aot_autograd``,
SimpleFSDP-style parametrizations, no helper of ``models/``), scaled to 16 layers on a fake
process group of 64 ranks, forward and backward, under both cost models ("analytic" and
"torch", as ``export_dag(cost_model=...)``), at budgets 1.0x and 1.2x of the traced peak
(the larger of the re-export's and the reference liveness count's peaks: every column must
hold the budget by the re-export and the liveness count, as
``optimize_schedule`` does).

Schedules compared, each judged on the graph *written back*: the schedule is applied to a
copy of the graph (``scheduler.apply_schedule``), the copy re-exported with the same cost model
and simulated in its own order; torch's scheduler rewrites its own copy, judged the same way.

- traced: the order as captured;
- FSDP2-like: one bucket per block of the *true* blocks (from the capture's oracle), prefetch
  one block ahead, shrunk to the budget;
- SimpleFSDP-like: greedy size-capped buckets;
- torch: ``scheduler.compare.baselines.torch_overlap_schedule`` without and with
  ``pre_bucketing_fsdp_collectives`` ("unavailable" when it raises TorchBaselineError);
- fsdp-sched: what a user runs, ``scheduler.optimize_schedule(gm, mem_budget=..., cost_model=...)``
  with its other defaults (the search, then :func:`scheduler.check.written.choose`: its schedule, its
  next best starts and the traced order are written back in turn and the first whose written
  graph fits is installed), judged on the graph it returns. ``--solve-under each`` (default)
  gives it the row's cost model; ``--solve-under robust`` gives it none (the robust default:
  one solve per graph and budget, judged under each cost model of the rows).
  ``--product solver`` judges the solver's own schedule instead (``solvers.solve_budgets``,
  budgets in increasing order so the smaller budget's best is a start at the larger).

Per row: step ms of each (``over`` when the written-back peak exceeds the budget), the best
baseline that fits, and fsdp-sched's speedup over it; at the end the geometric mean and the
rows where fsdp-sched is slower.

    python benchmarks/foreign.py                    # all styles, 2 processes
    python benchmarks/foreign.py --styles tied sac --jobs 1 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests", REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

logger = logging.getLogger("benchmarks.foreign")

STYLES = ("tied", "alternating", "sac", "tp", "fp32", "moe")
COST_MODELS = ("analytic", "torch")
BUDGET_FACTORS = (1.0, 1.2)
BASELINES = ("traced", "fsdp2", "simplefsdp", "torch", "torch+prebucket")
WORLD = 64
#: what "fsdp-sched" is: "api" (optimize_schedule's returned graph) or "solver" (set by --product)
PRODUCT = "api"
#: the cost model optimize_schedule gets: "each" (the row's) or "robust" (none; set by --solve-under)
SOLVE_UNDER = "each"
#: (graph id, budget) -> optimize_schedule's graph without a cost model, solved once for every row
_ROBUST: dict[tuple[int, int], Any] = {}


def _dim(style: str) -> int:
    # the MoE step runs on real CPU tensors (.tolist() of its split sizes): keep it small
    return 512 if style == "moe" else 2048


def _with_true_blocks(dag: Any, gm: Any, true_blocks: dict[str, int | None]) -> Any:
    """``dag`` with every parameter collective's block taken from the capture's oracle."""
    import foreign_models as fm

    for coll, param in gm.meta[fm.TRUTH_KEY].items():
        if coll in dag.nodes:
            dag.nodes[coll]["block"] = true_blocks.get(param)
    return dag


def _judge(gm: Any, cost_model: str) -> tuple[float, int]:
    """(step ms, peak bytes) of ``gm`` as written: re-exported and simulated in its order; the
    peak is the larger of the re-export's and the reference liveness count's (the counts a
    budget bounds, for every column alike)."""
    from scheduler.check.written import judge_graph

    figures = judge_graph(gm, cost_model)
    return figures.step_ms, figures.max_peak_bytes


def _written(gm: Any, problem: Any, schedule: Any, cost_model: str) -> tuple[float, int]:
    from scheduler import apply_schedule

    g = copy.deepcopy(gm)
    apply_schedule(g, problem, schedule)
    return _judge(g, cost_model)


def _torch(gm: Any, cost_model: str, prebucket: bool) -> tuple[float, int] | str:
    from scheduler.compare.baselines import TorchBaselineError, torch_overlap_schedule

    try:
        return _judge(torch_overlap_schedule(gm, pre_bucketing_fsdp_collectives=prebucket), cost_model)
    except TorchBaselineError as e:
        logger.info("torch baseline (prebucket=%s) unavailable: %s", prebucket, str(e).splitlines()[0][:120])
        return "unavailable"


def graph_rows(style: str, kind: str, gm: Any, true_blocks: dict, cost_model: str) -> list[dict[str, Any]]:
    """The rows of one graph under one cost model (both budgets)."""
    from scheduler import export_dag
    from solvers import InfeasibleBudgetError, Problem, solve, solve_budgets

    dag = export_dag(gm, cost_model=cost_model)
    p = Problem.from_dag(dag)  # blocks as inferred: what fsdp-sched and SimpleFSDP-like see
    p_true = Problem.from_dag(_with_true_blocks(export_dag(gm, cost_model=cost_model), gm, true_blocks))
    peak = _judge(gm, cost_model)[1]  # the traced graph's peak by the counts a budget bounds
    budgets = [int(peak * f) for f in BUDGET_FACTORS]
    torch_runs = {"torch": _torch(gm, cost_model, False), "torch+prebucket": _torch(gm, cost_model, True)}
    t0 = time.perf_counter()
    ours = _api(gm, budgets, cost_model) if PRODUCT == "api" else solve_budgets(p, budgets)
    solve_s = (time.perf_counter() - t0) / len(budgets)
    rows = []
    for f, budget in zip(BUDGET_FACTORS, budgets):
        row: dict[str, Any] = {"style": style, "graph": kind, "cost_model": cost_model, "budget": f,
                               "budget_bytes": budget, "solve_s": round(solve_s, 1)}
        for name in ("traced", "fsdp2", "simplefsdp"):
            q = p_true if name == "fsdp2" else p
            try:
                row[name] = _written(gm, q, solve(q, solver=name, mem_budget_bytes=budget).schedule, cost_model)
            except InfeasibleBudgetError:
                row[name] = "over"
        row.update(torch_runs)
        r = ours[budget]
        if isinstance(r, Exception):
            row["fsdp-sched"] = "over"
        elif PRODUCT == "api":
            row["fsdp-sched"] = _judge(r, cost_model)
        else:
            row["fsdp-sched"] = _written(gm, p, r.schedule, cost_model)
        rows.append(_score(row))
    return rows


def _api(gm: Any, budgets: list[int], cost_model: str) -> dict[int, Any]:
    """The graph ``optimize_schedule`` returns at each budget (or its InfeasibleBudgetError)."""
    from scheduler import optimize_schedule
    from solvers import InfeasibleBudgetError

    out: dict[int, Any] = {}
    for budget in budgets:
        if SOLVE_UNDER == "robust" and (id(gm), budget) in _ROBUST:
            out[budget] = _ROBUST[(id(gm), budget)]
            continue
        g = copy.deepcopy(gm)
        try:
            out[budget] = optimize_schedule(g, mem_budget=budget,
                                            cost_model=None if SOLVE_UNDER == "robust" else cost_model)
        except InfeasibleBudgetError as e:
            out[budget] = e
        if SOLVE_UNDER == "robust":
            _ROBUST[(id(gm), budget)] = out[budget]
    return out


def _score(row: dict[str, Any]) -> dict[str, Any]:
    """Best baseline that fits the budget (on the written-back graph) and the speedup over it."""

    def fits(v: Any) -> bool:
        return isinstance(v, tuple) and v[1] <= row["budget_bytes"]

    fitting = {b: row[b][0] for b in BASELINES if fits(row[b])}
    row["best_baseline"] = min(fitting, key=fitting.get) if fitting else None
    ours = row["fsdp-sched"]
    if fitting and fits(ours):
        row["speedup"] = fitting[row["best_baseline"]] / ours[0]
    else:
        row["speedup"] = None
    return row


def style_rows(style: str, cost_models: tuple[str, ...], product: str = "api", solve_under: str = "each"
               ) -> list[dict[str, Any]]:
    """Capture ``style`` (16 layers, 64 ranks) and score both graphs under every cost model."""
    global PRODUCT, SOLVE_UNDER
    PRODUCT, SOLVE_UNDER = product, solve_under  # a spawned worker starts from the module's defaults
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import foreign_models as fm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    captured = fm.capture(style, n_layers=16, world_size=WORLD, dim=_dim(style))
    rows = []
    for kind, gm in (("forward", captured.forward), ("backward", captured.backward)):
        for cm in cost_models:
            t0 = time.perf_counter()
            try:
                rows += graph_rows(style, kind, gm, captured.true_blocks, cm)
            except Exception as e:  # noqa: BLE001 - one failing graph is a row, not the end of the run
                logger.exception("%s %s %s failed", style, kind, cm)
                rows.append({"style": style, "graph": kind, "cost_model": cm, "error": f"{type(e).__name__}: {e}"})
            logger.info("%s %s %s done in %.0f s", style, kind, cm, time.perf_counter() - t0)
    return rows


def _cell(v: Any, budget: int) -> str:
    if not isinstance(v, tuple):
        return str(v)
    return f"{v[0]:.3f}" + ("" if v[1] <= budget else " (over)")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| style | graph | cost | budget | traced | FSDP2-like | SimpleFSDP-like | torch | torch + pre-bucketing "
            "| fsdp-sched | best baseline | speedup |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['style']} | {r['graph']} | {r['cost_model']} | - | error: {r['error'][:80]} |"
                         + " |" * 7)
            continue
        cells = [_cell(r[k], r["budget_bytes"]) for k in (*BASELINES, "fsdp-sched")]
        sp = f"{r['speedup']:.3f}x" if r["speedup"] is not None else "n/a"
        lines.append(f"| {r['style']} | {r['graph']} | {r['cost_model']} | {r['budget']:.1f}x | "
                     + " | ".join(cells) + f" | {r['best_baseline']} | {sp} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    sps = [r["speedup"] for r in rows if r.get("speedup") is not None]
    if not sps:
        return "no comparable rows"
    geo = math.exp(sum(math.log(s) for s in sps) / len(sps))
    slower = [r for r in rows if r.get("speedup") is not None and r["speedup"] < 1 - 1e-9]
    out = [f"geometric mean speedup over the best baseline that fits: {geo:.3f}x over {len(sps)} rows; "
           f"slower on {len(slower)} row(s)"]
    out += [f"  slower: {r['style']} {r['graph']} {r['cost_model']} {r['budget']:.1f}x: {r['speedup']:.3f}x vs "
            f"{r['best_baseline']}" for r in slower]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    ap.add_argument("--cost-models", nargs="+", default=list(COST_MODELS), choices=COST_MODELS)
    ap.add_argument("--jobs", type=int, default=2, help="styles traced and solved in parallel (processes)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--product", choices=("api", "solver"), default="api",
                    help="judge optimize_schedule's returned graph (default) or the solver's own schedule")
    ap.add_argument("--solve-under", choices=("each", "robust"), default="each",
                    help="optimize_schedule with the row's cost model (default) or with none (the robust default)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    work = [(s, tuple(args.cost_models), args.product, args.solve_under) for s in args.styles]
    ctx = multiprocessing.get_context("spawn")  # one fake process group per process
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        per_style = pool.starmap(style_rows, work, chunksize=1)
    rows = [r for rs in per_style for r in rs]
    print(table(rows))
    print()
    print(summary(rows))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
