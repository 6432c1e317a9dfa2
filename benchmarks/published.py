"""Graphs no one here wrote: autoparallel's published FSDP graphs, judged by their measured tables.

Each graph of ``autoparallel/tools/overlap_simulator`` (``--repros DIR``: a checkout of
github.com/meta-pytorch/autoparallel; the files are read there, never copied) is traced on a fake
process group (:mod:`harness.repros`) and written back by each contender on a copy:

- torch's ``schedule_overlap_bucketing`` with its FSDP pre-bucketing (its default) and without;
- the traced order and fsdp-sched's heuristics (FSDP2-like, SimpleFSDP-like, AutoParallel-like);
- fsdp-sched: ``optimize_schedule`` with no cost model (its default) and given the measured
  table (``table:PATH``, the repro's own table converted for its groups).

Every written graph is re-exported and simulated under three judges: **measured** (the
published collective times, interpolated log-log between rows, held at the smallest row
below it as autoparallel's simulator holds them, and torch's roofline for compute), **torch** (torch's estimators) and
**analytic**. Budgets: none, and the largest peak of the traced graph and torch's two graphs
(every contender at that memory). Compile time is the wall time of each pass on this machine,
measured in one run: the least of ``--compile-repeats`` timings of torch's pass and of each
fsdp-sched product, taken in turns (a shared machine's slow spells then land on both; the least
is the pass's own cost, the rest is the machine's). A repeat of fsdp-sched must write the same
schedule (its search is deterministic), or the run fails.

    python benchmarks/published.py --repros ~/autoparallel/autoparallel/tools/overlap_simulator
    python benchmarks/published.py --repros DIR --graphs llama3_8b_fw_64_2d --budgets none --json out.json
    python benchmarks/published.py --repros DIR --torch-starts torch-overlap   # fsdp-sched's torch_starts
    python benchmarks/published.py --repros DIR --compute-order starts            # its compute_order
    python benchmarks/published.py --repros DIR --compile-repeats 1                # one timing of each pass

Prints one table per judge (step ms, ``over`` where a written graph exceeds the budget), the
start of fsdp-sched's search that won (torch's passes are among them) and the summary:
fsdp-sched against the faster of torch's two passes that fits, per judge, geometric mean and
rows slower, and compile time against torch's pass.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness.output import finish  # noqa: E402  (benchmarks/harness)

logger = logging.getLogger("benchmarks.published")

JUDGES = ("measured", "torch", "analytic")
TORCH_PASSES = ("torch-overlap", "torch-overlap-no-prebucketing")
HEURISTIC_BASELINES = ("traced", "fsdp2", "simplefsdp", "autoparallel")
PRODUCT_DEFAULT, PRODUCT_TABLE = "fsdp-sched", "fsdp-sched table"
BUDGETS = ("none", "peak")
#: timings of each timed pass (``--compile-repeats``)
COMPILE_REPEATS = 3


def judges(csv: Path) -> dict[str, Any]:
    """The three judges (module docstring)."""
    from scheduler.costs.hardware import Cluster
    from scheduler.costs.models import TableCostModel
    from scheduler.costs.torch_model import TorchCostModel
    from scheduler.costs.tables import CollectiveTable

    measured = TableCostModel(collectives=CollectiveTable.read(csv), fallback=TorchCostModel(Cluster()),
                              name="measured")
    return {"measured": measured, "torch": "torch", "analytic": "analytic"}


def run_graph(repros: str, name: str, budgets: list[str], products: list[str],
              torch_starts: tuple[str, ...] | None = None, compute_order: str | None = None,
              compile_repeats: int = COMPILE_REPEATS) -> list[dict[str, Any]]:
    """Every row of one graph (runs in a process of its own: the fake process group is global).
    ``torch_starts`` and ``compute_order``: fsdp-sched's ``SolverOptions`` fields (None: their
    defaults); ``compile_repeats``: timings of each timed pass (module docstring)."""
    from scheduler.compare.judged import judge_baseline, judge_product
    from harness.repros import load_repro, table_csv
    from scheduler.options import SolverOptions

    fields = {"torch_starts": torch_starts, "compute_order": compute_order}
    solver = SolverOptions(**{k: v for k, v in fields.items() if v is not None})

    _quiet()
    t0 = time.perf_counter()
    repro = load_repro(repros, name)
    logger.info("%s: traced in %.1f s (%d nodes)", name, time.perf_counter() - t0, len(repro.gm.graph.nodes))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp-sched-published-") as tmp:
        csv = table_csv(repro, Path(tmp) / f"{name}.csv")
        judge = judges(csv)
        base = {b: judge_baseline(repro.gm, b, judge) for b in (*TORCH_PASSES, *HEURISTIC_BASELINES)}
        peak = max(base[b].max_peak_bytes for b in ("traced", *TORCH_PASSES) if base[b].ok)
        for budget_name in budgets:
            budget = None if budget_name == "none" else peak
            contenders = dict(base)
            cost_models = {p: None if p == PRODUCT_DEFAULT else f"table:{csv}" for p in products}
            for product, cost_model in cost_models.items():
                contenders[product] = judge_product(repro.gm, budget, judge, cost_model=cost_model, name=product,
                                                    solver=solver)
            row = _row(name, budget_name, budget, contenders)
            retime(repro.gm, budget, row, cost_models, solver, compile_repeats - 1)
            rows.append(row)
            logger.info("%s at %s: %s", name, budget_name, _summary(rows[-1]))
    return rows


def retime(gm: Any, budget: int | None, row: dict[str, Any], cost_models: dict[str, str | None], solver: Any,
           repeats: int) -> None:
    """Time torch's pass and each fsdp-sched product of ``row`` ``repeats`` more times, in
    turns, on fresh copies of ``gm``, each run as the first timing ran it
    (:func:`scheduler.compare.judged.torch_pass`, :func:`~scheduler.compare.judged.product_pass`); each one's ``compile_s`` becomes the least of its timings,
    all of them in ``compile_runs_s`` (module docstring).

    Raises:
        RuntimeError: a repeat of fsdp-sched wrote another schedule than its first run.
    """
    import copy

    from scheduler.api import SCHEDULE_KEY
    from scheduler.compare.judged import product_pass, timed_pass, torch_pass
    from scheduler.torch_overlap import TORCH

    # a pass that failed (no schedule within the budget, torch's pass refused) has nothing to time again
    timed = {n: c for n, c in row["contenders"].items()
             if n in (TORCH, *cost_models) and c["compile_s"] is not None and c["error"] is None}
    for c in timed.values():
        c["compile_runs_s"] = [c["compile_s"]]
    for _ in range(repeats):
        for name, c in timed.items():
            written = copy.deepcopy(gm)
            if name == TORCH:
                with timed_pass() as took:
                    torch_pass(written, TORCH)
            else:
                with timed_pass() as took:
                    product_pass(written, budget, cost_model=cost_models[name], solver=solver)
                if written.meta[SCHEDULE_KEY].digest() != c["digest"]:
                    raise RuntimeError(f"{row['graph']}: a repeat of {name} wrote another schedule (the search must "
                                       "be deterministic)")
            c["compile_runs_s"].append(took[0])
            c["compile_s"] = min(c["compile_runs_s"])


def _row(graph: str, budget_name: str, budget: int | None, contenders: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"graph": graph, "budget": budget_name, "budget_bytes": budget, "contenders": {}}
    for name, j in contenders.items():
        fits = j.ok and (budget is None or j.max_peak_bytes <= budget)
        report = j.report
        out["contenders"][name] = {
            "error": j.error, "fits": fits, "peak_bytes": j.max_peak_bytes if j.ok else None,
            "compile_s": j.compile_s, "step_ms": {m: f.step_ms for m, f in j.figures.items()},
            "collectives": next(iter(j.figures.values())).n_collectives if j.ok else None,
            "chosen": getattr(report, "chosen_candidate", None), "notes": list(getattr(report, "notes", []) or []),
            # schedules of the search that write-back refused (each one a schedule the DAG
            # allowed and the graph did not)
            "not_written": sum(1 for c in (getattr(report, "candidates", None) or [])
                               if str(c.get("dropped") or "").startswith("not written back")),
            "start": getattr(report, "start", None), "start_gain_ms": report.start_gain_ms() if report else None,
            "torch_starts": list(getattr(report, "torch_starts", []) or []),
            "torch_s": sum(st["wall_s"] for st in getattr(report, "stages", []) or [] if st["name"] == "torch"),
            "digest": j.schedule.digest() if j.schedule is not None else None,
        }
    return out


def best_torch(row: dict[str, Any], judge: str) -> float | None:
    """The faster of torch's two passes that fit, under ``judge``."""
    steps = [c["step_ms"][judge] for n, c in row["contenders"].items() if n in TORCH_PASSES and c["fits"]]
    return min(steps) if steps else None


def ratio(row: dict[str, Any], product: str, judge: str) -> float | None:
    c = row["contenders"].get(product)
    ref = best_torch(row, judge)
    if c is None or not c["fits"] or ref is None:
        return None
    return c["step_ms"][judge] / ref


def _summary(row: dict[str, Any]) -> str:
    parts = []
    for product in (PRODUCT_DEFAULT, PRODUCT_TABLE):
        if product in row["contenders"]:
            rs = [f"{j} x{r:.3f}" for j in JUDGES if (r := ratio(row, product, j)) is not None]
            parts.append(f"{product}: {', '.join(rs) or 'no figure'}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# printing
# --------------------------------------------------------------------------------------------
def format_tables(rows: list[dict[str, Any]]) -> str:
    names = [n for n in (*TORCH_PASSES, *HEURISTIC_BASELINES, PRODUCT_DEFAULT, PRODUCT_TABLE)
             if any(n in r["contenders"] for r in rows)]
    short = {"torch-overlap": "torch", "torch-overlap-no-prebucketing": "torch -pre", "traced": "traced",
             "fsdp2": "FSDP2-like", "simplefsdp": "SimpleFSDP", "autoparallel": "AP-like",
             PRODUCT_DEFAULT: "fsdp-sched", PRODUCT_TABLE: "fsdp-sched tbl"}
    out = []
    for judge in JUDGES:
        out.append(f"\nstep ms under {judge}; ratio = fsdp-sched / the faster torch pass that fits")
        out.append("| graph | budget | " + " | ".join(short[n] for n in names) + " | ratio | ratio tbl |")
        out.append("|---|---|" + "---|" * (len(names) + 2))
        for r in rows:
            cells = []
            for n in names:
                c = r["contenders"].get(n)
                if c is None or c["error"]:
                    cells.append("-")
                else:
                    cells.append(f"{c['step_ms'][judge]:.1f}" + ("" if c["fits"] else " over"))
            rs = [ratio(r, p, judge) for p in (PRODUCT_DEFAULT, PRODUCT_TABLE)]
            out.append(f"| {r['graph']} | {r['budget']} | " + " | ".join(cells) + " | "
                       + " | ".join("-" if x is None else f"x{x:.3f}" for x in rs) + " |")
    out.append("\ncompile s (torch / torch -pre / fsdp-sched / fsdp-sched tbl), collectives written, chosen")
    for r in rows:
        c = r["contenders"]
        times = " / ".join("-" if n not in c or c[n]["compile_s"] is None else f"{c[n]['compile_s']:.1f}"
                           for n in (*TORCH_PASSES, PRODUCT_DEFAULT, PRODUCT_TABLE))
        colls = " / ".join("-" if n not in c or c[n]["collectives"] is None else str(c[n]["collectives"])
                           for n in (*TORCH_PASSES, PRODUCT_DEFAULT, PRODUCT_TABLE))
        chosen = ", ".join(f"{c[n]['chosen']}" + (f" ({c[n]['not_written']} not written back)"
                                                     if c[n].get("not_written") else "")
                           for n in (PRODUCT_DEFAULT, PRODUCT_TABLE) if n in c)
        out.append(f"  {r['graph']} {r['budget']}: {times} s; {colls}; {chosen}")
    out.append("\nfsdp-sched's start that won (its gain under each model, ms; torch's passes as starts: wall s, "
               "skipped)")
    for r in rows:
        for n in (PRODUCT_DEFAULT, PRODUCT_TABLE):
            c = r["contenders"].get(n)
            if not c or not c.get("start"):
                continue
            gain = ", ".join(f"{m} {g:.2f}" for m, g in (c.get("start_gain_ms") or {}).items()) or "-"
            torch = "; ".join(f"{t['name']} {t['wall_s']:.1f} s" + (f" skipped: {t['skipped'][:80]}" if t["skipped"]
                                                                      else "") for t in c.get("torch_starts") or [])
            out.append(f"  {r['graph']} {r['budget']} {n}: {c['start']} (gain {gain}); {torch or 'no torch start'}")
    return "\n".join(out)


def format_summary(rows: list[dict[str, Any]]) -> str:
    out = []
    for product in (PRODUCT_DEFAULT, PRODUCT_TABLE):
        for judge in JUDGES:
            rs = [x for r in rows if (x := ratio(r, product, judge)) is not None]
            if not rs:
                continue
            slower = sum(x > 1.0 + 1e-9 for x in rs)
            out.append(f"{product} under {judge}: geomean x{geomean(rs):.3f}, slower on {slower} of {len(rs)}, "
                       f"worst x{max(rs):.3f}")
    ct = [c["compile_s"] / t for r in rows for p in (PRODUCT_DEFAULT, PRODUCT_TABLE)
          if (c := r["contenders"].get(p)) and c["compile_s"] and (t := _torch_compile_s(r))]
    if ct:
        runs = max((len(c.get("compile_runs_s") or [0]) for r in rows for c in r["contenders"].values()), default=1)
        each = f" (the least of {runs} timings of each)" if runs > 1 else ""
        out.append(f"compile time / torch's pass{each}: geomean {geomean(ct):.2f}x, at most {max(ct):.2f}x")
    tt = [c["torch_s"] / t for r in rows for p in (PRODUCT_DEFAULT, PRODUCT_TABLE)
          if (c := r["contenders"].get(p)) and c.get("torch_s") and (t := _torch_compile_s(r))]
    if tt:
        out.append(f"  of which torch's passes run as starts / torch's pass: geomean {geomean(tt):.2f}x, "
                   f"at most {max(tt):.2f}x")
    return "\n".join(out)


def _torch_compile_s(row: dict[str, Any]) -> float | None:
    c = row["contenders"].get("torch-overlap")
    return c["compile_s"] if c and c["compile_s"] else None


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _quiet() -> None:
    import torch._inductor.fx_passes.fsdp  # noqa: F401  (it sets its logger to INFO on import)

    for noisy in ("solvers", "scheduler", "models", "harness", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _one(args: tuple[str, str, list[str], list[str], tuple[str, ...] | None, str | None, int]
         ) -> list[dict[str, Any]]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run_graph(*args)


def main(argv: list[str] | None = None) -> int:
    from scheduler.options import COMPUTE_ORDERS

    from harness.repros import PUBLISHED_64

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repros", required=True, help="autoparallel's autoparallel/tools/overlap_simulator folder")
    ap.add_argument("--graphs", nargs="+", default=list(PUBLISHED_64), help="repro names (default: %(default)s)")
    ap.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=BUDGETS)
    ap.add_argument("--products", nargs="+", default=[PRODUCT_DEFAULT, PRODUCT_TABLE],
                    choices=[PRODUCT_DEFAULT, PRODUCT_TABLE])
    ap.add_argument("--jobs", type=int, default=1, help="graphs traced and judged at once (one process each)")
    ap.add_argument("--torch-starts", nargs="*", default=None,
                    help="fsdp-sched's SolverOptions.torch_starts (none given: no torch start; default: the option's "
                         "default)")
    ap.add_argument("--compute-order", default=None, choices=COMPUTE_ORDERS,
                    help="fsdp-sched's SolverOptions.compute_order (default: the option's default)")
    ap.add_argument("--compile-repeats", type=int, default=COMPILE_REPEATS,
                    help="timings of torch's pass and of each fsdp-sched product, the least kept (default: "
                         "%(default)s)")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.compile_repeats < 1:
        ap.error(f"--compile-repeats {args.compile_repeats} must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    torch_starts = None if args.torch_starts is None else tuple(args.torch_starts)
    work = [(args.repros, g, args.budgets, args.products, torch_starts, args.compute_order, args.compile_repeats)
            for g in args.graphs]
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with ctx.Pool(max(1, args.jobs), maxtasksperchild=1) as pool:
        for graph_rows in pool.imap(_one, work):
            rows += graph_rows
    return finish(f"{format_tables(rows)}\n\n{format_summary(rows)}", rows, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
