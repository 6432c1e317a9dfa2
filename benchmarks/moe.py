"""A DeepSeek-V3-16B-style MoE step (FSDP x expert parallelism): fsdp-sched against torch's pass at the traced peak.

The model is ``models``' ``"dsv3-16b"`` preset (:mod:`models.moe`: torchtitan's deepseek_v3 16B
flavour, MLA attention, 64 routed experts top-6 with 2 shared, experts split over expert-parallel
groups of ``--ep`` ranks by ``all_to_all_single`` with split sizes read by ``.tolist()``, FSDP
over every rank for the dense parameters and over the efsdp ranks for the experts), captured at
``--layers`` layers on a fake process group of ``--world`` ranks as partitioned forward and
backward graphs. Each graph is written back by every contender on a copy and judged as written
(:mod:`scheduler.compare.judged`: re-exported and simulated) under each cost model of ``--cost-models``:

- torch's ``schedule_overlap_bucketing`` with its FSDP pre-bucketing (its default) and without;
- the traced order and fsdp-sched's heuristics (FSDP2-like, SimpleFSDP-like, AutoParallel-like);
- fsdp-sched: ``optimize_schedule(gm, mem_budget=<the traced peak>)`` with no cost model (its
  default), timed end to end.

Budgets (``--budgets``): the traced graph's peak, and the larger peak of torch's two written
graphs (fsdp-sched at equal memory with torch); a peak is the larger of the re-export's and the
liveness count's, what a budget bounds. A contender whose written graph peaks higher than the
budget is marked ``over``. Per contender: collectives in the written graph (all-gathers of each
group), step ms under each cost model, peak, compile time (the pass's wall time on this machine,
one run); for fsdp-sched its status, the candidate installed and its report's notes.

    python benchmarks/moe.py                               # 8 layers, 64 ranks, EP 8, both graphs
    python benchmarks/moe.py --graphs forward --json moe.json
    python benchmarks/moe.py --preset dsv3-debug --world 4 --layers 3     # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness.output import finish  # noqa: E402  (benchmarks/harness)

logger = logging.getLogger("benchmarks.moe")

PRESET = "dsv3-16b"
COST_MODELS = ("analytic", "torch")
TORCH_PASSES = ("torch-overlap", "torch-overlap-no-prebucketing")
HEURISTIC_BASELINES = ("traced", "fsdp2", "simplefsdp", "autoparallel")
PRODUCT = "fsdp-sched"
#: budgets: the traced graph's peak, and the larger peak of torch's two passes (equal memory with it)
BUDGETS = ("traced", "torch")
SHORT = {"torch-overlap": "torch (pre-bucketed)", "torch-overlap-no-prebucketing": "torch (no pre-bucketing)",
         "traced": "traced", "fsdp2": "FSDP2-like", "simplefsdp": "SimpleFSDP-like", "autoparallel": "AP-like",
         PRODUCT: PRODUCT}


def collectives_by_group(gm: Any) -> dict[str, int]:
    """Collectives of ``gm`` by ``type@group`` (a merged bucket counts once)."""
    from scheduler.export.dag import export_dag

    dag = export_dag(gm, coverage_check=None)
    out: dict[str, int] = {}
    for _, a in dag.nodes(data=True):
        if a["kind"] == "collective":
            key = f"{a['coll_type']}@{a['group_name']}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def judge_graph_kind(gm: Any, kind: str, cost_models: tuple[str, ...], budgets: tuple[str, ...]
                     ) -> list[dict[str, Any]]:
    """Every contender on one graph, at each budget of ``budgets`` (module docstring)."""
    from scheduler.compare.judged import judge_baseline, judge_product

    base = {name: judge_baseline(gm, name, cost_models, keep_graph=True)
            for name in (*TORCH_PASSES, *HEURISTIC_BASELINES)}
    by_group = {name: collectives_by_group(j.graph) if j.graph is not None else None for name, j in base.items()}
    for j in base.values():
        j.graph = None
    peaks = {"traced": base["traced"].max_peak_bytes,
             "torch": max([base[t].max_peak_bytes for t in TORCH_PASSES if base[t].ok] or [0]) or None}
    rows = []
    for budget_name in budgets:
        budget = peaks[budget_name]
        if budget is None:
            logger.warning("no budget %r: neither of torch's passes ran", budget_name)
            continue
        contenders = dict(base)
        contenders[PRODUCT] = product = judge_product(gm, budget, cost_models, keep_graph=True)
        by_group[PRODUCT] = collectives_by_group(product.graph) if product.graph is not None else None
        product.graph = None
        row: dict[str, Any] = {"graph": kind, "budget": budget_name, "budget_bytes": budget, "contenders": {}}
        for name, j in contenders.items():
            report = j.report
            row["contenders"][name] = {
                "error": j.error, "compile_s": j.compile_s,
                "peak_bytes": j.max_peak_bytes if j.ok else None,
                "fits": j.ok and j.max_peak_bytes <= budget,
                "step_ms": {m: f.step_ms for m, f in j.figures.items()},
                "collectives": next(iter(j.figures.values())).n_collectives if j.ok else None,
                "by_group": by_group[name],
                "status": getattr(report, "status", None),
                "chosen": getattr(report, "chosen_candidate", None),
                "notes": list(getattr(report, "notes", []) or []),
            }
        rows.append(row)
    return rows


def run(n_layers: int, world_size: int, ep_size: int | None, kinds: tuple[str, ...], cost_models: tuple[str, ...],
        budgets: tuple[str, ...] = BUDGETS, preset: str = PRESET) -> list[dict[str, Any]]:
    """Capture ``preset`` and judge each graph of ``kinds``; one fake world throughout (the
    merges resolve the groups the capture made). ``ep_size`` None: the preset's."""
    from models import capture_fsdp_graphs
    from models.capture import fake_process_group

    rows = []
    with fake_process_group(world_size):
        t0 = time.perf_counter()
        captured = capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers, ep_size=ep_size)
        capture_s = time.perf_counter() - t0
        ep_size = captured.config.ep_size
        logger.info("captured %s at %d layers on %d ranks (EP %d) in %.1f s", preset, n_layers, world_size,
                    ep_size, capture_s)
        for kind in kinds:
            t0 = time.perf_counter()
            for row in judge_graph_kind(getattr(captured, kind), kind, cost_models, budgets):
                row.update(model=preset, n_layers=n_layers, world_size=world_size, ep_size=ep_size,
                           capture_s=round(capture_s, 1))
                rows.append(row)
            logger.info("%s judged in %.0f s", kind, time.perf_counter() - t0)
    return rows


def format_rows(rows: list[dict[str, Any]], cost_models: tuple[str, ...]) -> str:
    out = []
    for r in rows:
        out.append(f"\n{r['model']} {r['graph']}, {r['n_layers']} layers, {r['world_size']} ranks, EP {r['ep_size']}: "
                   f"budget = {r['budget']} peak {r['budget_bytes'] / 2**30:.3f} GiB (capture {r['capture_s']} s)")
        out.append("| contender | " + " | ".join(f"step ms {m}" for m in cost_models)
                   + " | peak GiB | collectives | all-gathers by group | compile s |")
        out.append("|---|" + "---|" * (len(cost_models) + 4))
        for name, c in r["contenders"].items():
            if c["error"]:
                out.append(f"| {SHORT[name]} | unavailable: {c['error'][:90]} |" + " |" * (len(cost_models) + 3))
                continue
            steps = [f"{c['step_ms'][m]:.1f}" for m in cost_models]
            peak = f"{c['peak_bytes'] / 2**30:.3f}" + ("" if c["fits"] else " over")
            ags = ", ".join(f"{k.split('@')[1]}: {v}" for k, v in (c["by_group"] or {}).items()
                            if k.startswith("all_gather"))
            compile_s = "-" if c["compile_s"] is None else f"{c['compile_s']:.1f}"
            out.append(f"| {SHORT[name]} | " + " | ".join(steps) + f" | {peak} | {c['collectives']} | {ags} | "
                       f"{compile_s} |")
        product = r["contenders"][PRODUCT]
        out.append(f"fsdp-sched: status {product['status']}, installed {product['chosen']}; notes: "
                   + ("; ".join(product["notes"]) or "none"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from models import MOE_PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks traced (default %(default)s)")
    ap.add_argument("--world", type=int, default=64, help="ranks of the fake process group (default %(default)s)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the preset's, 8)")
    ap.add_argument("--preset", default=PRESET, choices=sorted(MOE_PRESETS),
                    help="MoE preset of models/moe.py (default %(default)s; dsv3-debug for a smoke run)")
    ap.add_argument("--graphs", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    ap.add_argument("--cost-models", nargs="+", default=list(COST_MODELS), choices=COST_MODELS)
    ap.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=BUDGETS,
                    help="the traced graph's peak and/or the larger peak of torch's passes")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("solvers", "scheduler", "models", "harness", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    t0 = time.perf_counter()
    cost_models = tuple(args.cost_models)
    rows = run(args.layers, args.world, args.ep, tuple(args.graphs), cost_models, tuple(args.budgets), args.preset)
    return finish(format_rows(rows, cost_models), rows, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
