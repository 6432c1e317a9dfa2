"""The demo: fsdp-sched against FSDP2-like, torch's scheduler and SimpleFSDP-like, at a glance.

Traces a reference model's FSDP training step (forward and backward graphs, on a fake process
group: no GPU and no data move), then for each graph and each baseline B (FSDP2-like, torch's
overlap scheduler, SimpleFSDP-like) writes B back on a copy of the graph and runs
``scheduler.optimize_schedule`` with its defaults (no cost model given: the schedule with the
least worst-case regret over the family of plausible cost models) at B's peak memory. Every
graph is judged as written (:func:`scheduler.check.written.judge_graph`): step time re-exported under
the analytic cost model and under torch's own estimators, peak memory by the counts a budget
bounds (re-export and liveness). Prints, per graph, each baseline and fsdp-sched at its peak: step ms under both models
(with fsdp-sched's speedup), peak GiB, and the compile seconds of torch's pass and of
``optimize_schedule`` (export, solve, choose, install; torch's pass timed once, after its
modules are imported); then geometric means. Progress is logged on stderr.

    python benchmarks/demo.py                                      # llama3-8b, 8 layers, 64 ranks
    python benchmarks/demo.py --model llama3-debug --n-layers 2 --world-size 8    # in seconds

Writes ``summary.json`` (every figure), ``equal_memory.txt`` (the full table with lower bounds
and headroom) and a Pareto picture per graph and cost model under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness import equal_memory  # noqa: E402
from harness.judged import PRODUCT, display  # noqa: E402

logger = logging.getLogger("benchmarks.demo")

GRAPHS = ("forward", "backward")


def glance(c: equal_memory.Comparison, cost_models: tuple[str, ...], title: str) -> str:
    """Each baseline, then fsdp-sched at its peak: step ms under each model (with the speedup),
    peak memory, compile s; the lower bound last."""
    peaks = [j.max_peak_bytes for j in (*c.baselines.values(), *c.products.values()) if j.ok]
    unit, per = _mem_unit(max(peaks, default=1))
    width = 34
    head = (f"{'':<{width}}" + "".join(f"{'step ms (' + m + ')':>20}" for m in cost_models)
            + f"{'peak ' + unit:>10}{'compile s':>11}")
    lines = [title, head, "-" * len(head)]
    for name, base in c.baselines.items():
        lines.append(f"{display(name):<{width}}" + "".join(f"{_ms(base.step_ms(m)):>13}{'':>7}" for m in cost_models)
                     + f"{base.max_peak_bytes / per:>10.2f}{_s(base.compile_s):>11}")
        mine = [c.product_for(name, m) for m in cost_models]
        label = f"  {PRODUCT} at the same peak"
        if not all(p is not None and p.ok for p in mine):
            error = next((p.error for p in mine if p is not None and p.error), "not solved")
            lines.append(f"{label:<{width}}{error}")
            continue
        cells = "".join(f"{_ms(p.step_ms(m)):>13}{_x(base.step_ms(m) / p.step_ms(m), p.max_peak_bytes, base):>7}"
                        for p, m in zip(mine, cost_models))
        lines.append(f"{label:<{width}}{cells}{mine[0].max_peak_bytes / per:>10.2f}{_s(mine[0].compile_s):>11}")
    lines.append(f"{'(lower bound, any schedule)':<{width}}"
                 + "".join(f"{_ms(c.lower_bounds_ms[m]):>13}{'':>7}" for m in cost_models))
    for name, reason in c.unavailable.items():
        lines.append(f"{display(name)}: unavailable ({reason})")
    return "\n".join(lines)


def _mem_unit(peak_bytes: int) -> tuple[str, int]:
    for unit, per in (("GiB", 2**30), ("MiB", 2**20)):
        if peak_bytes >= per:
            return unit, per
    return "KiB", 2**10


def _ms(ms: float) -> str:
    return f"{ms:.2f}" if ms >= 10 else f"{ms:.3f}" if ms >= 0.1 else f"{ms:.4f}"


def _x(speedup: float, peak_bytes: int, base: Any) -> str:
    return f" x{speedup:.2f}" if peak_bytes <= base.max_peak_bytes else " over"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(comparisons: list[equal_memory.Comparison], cost_models: tuple[str, ...], title: str) -> str:
    """Geometric means over the graphs: speedups at equal memory per model and baseline, and the
    compile seconds of fsdp-sched against torch's pass on the same graphs."""
    rows = [r for c in comparisons for r in c.rows]
    lines = [title, "fsdp-sched at equal memory (geometric mean over the graphs of the speedup on the written graph):"]
    for m in cost_models:
        per = []
        for b in dict.fromkeys(r.baseline for r in rows):
            g = geomean([r.speedup for r in rows if r.cost_model == m and r.baseline == b and r.speedup])
            per.append(f"x{g:.2f} vs {display(b)}" if g else f"- vs {display(b)}")
        lines.append(f"  {m + ' cost model:':<22}{', '.join(per)}")
    ours = [p.compile_s for c in comparisons for p in c.products.values() if p.compile_s is not None]
    torch_s = {c.graph: j.compile_s for c in comparisons for n, j in c.baselines.items() if j.compile_s is not None}
    ratios = [p.compile_s / torch_s[c.graph] for c in comparisons if c.graph in torch_s
              for p in c.products.values() if p.compile_s is not None]
    if ours:
        line = f"compile time per graph: fsdp-sched {sum(ours) / len(ours):.1f} s (mean of {len(ours)} solves)"
        if torch_s:
            line += (f", torch's scheduler {sum(torch_s.values()) / len(torch_s):.1f} s (mean of {len(torch_s)}); "
                     f"fsdp-sched / torch x{geomean(ratios):.1f} (geometric mean)")
        lines.append(line)
    return "\n".join(lines)


def quiet_loggers() -> None:
    """Progress at INFO, without the per-call lines of torch's pre-bucketing and of the export
    (torch's FSDP pass sets its logger to INFO on import, so import it first)."""
    import torch._inductor.fx_passes.fsdp  # noqa: F401

    for noisy in ("torch._inductor.fx_passes.fsdp", "scheduler.export.structure", "scheduler.export.dag",
                  "torch._inductor.fx_passes.overlap_scheduling"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from solvers.search import DEFAULT_TIME_LIMIT_S

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="reference model preset (default %(default)s)")
    ap.add_argument("--n-layers", type=int, default=8, help="decoder layers to trace (default %(default)s)")
    ap.add_argument("--world-size", type=int, default=64, help="FSDP ranks, 8 per node (default %(default)s)")
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                    help="fsdp-sched's work limit per solve, s (default: optimize_schedule's, %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("fsdp-sched-out"), help="output directory (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print summary.json instead of the tables")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    if args.n_layers < 1 or args.world_size < 2 or not (math.isfinite(args.time_limit) and args.time_limit > 0):
        ap.error("--n-layers must be >= 1, --world-size >= 2 and --time-limit a finite number > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from models import capture_fsdp_graphs, list_presets

    if args.model not in list_presets():
        raise SystemExit(f"demo.py: error: unknown model {args.model!r}; choose one of {', '.join(list_presets())}")
    quiet_loggers()
    from models.capture import fake_process_group
    from scheduler.costs.models import Cluster
    from scheduler.options import SolverOptions

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    where = f"{args.model}, {args.n_layers} layers, {args.world_size} ranks"
    logger.info("tracing %s on a fake process group", where)
    captured = capture_fsdp_graphs(args.model, world_size=args.world_size, n_layers=args.n_layers)
    cluster = Cluster(n_gpus=args.world_size, gpus_per_node=min(8, args.world_size))
    solver = SolverOptions(time_limit_s=args.time_limit)
    comparisons, tables, data = [], [], {"model": args.model, "n_layers": args.n_layers,
                                         "world_size": args.world_size, "time_limit_s": args.time_limit}
    with fake_process_group(args.world_size):
        for g in GRAPHS:
            logger.info("%s graph: each baseline written back, fsdp-sched at its peak", g)
            c = equal_memory.compare(getattr(captured, g), graph=g, cluster=cluster, solver=solver)
            comparisons.append(c)
            data[g] = c.to_json()
            data[g]["files"] = [str(equal_memory.plot(c, m, args.out / f"{g}_{m}_equal_memory.png"))
                                for m in equal_memory.COST_MODELS]
            tables.append(glance(c, equal_memory.COST_MODELS,
                                 f"== {g} graph: {where}; each baseline, then fsdp-sched at its peak memory =="))
            if not args.json:
                print("\n" + tables[-1], flush=True)
    wall_s = time.perf_counter() - t0
    text = summary(comparisons, equal_memory.COST_MODELS, f"== summary: {where}, forward and backward ==")
    data["wall_s"] = wall_s
    rows = [r for c in comparisons for r in c.rows]
    (args.out / "summary.json").write_text(json.dumps(data, indent=1, default=str))
    (args.out / "equal_memory.txt").write_text("\n\n".join(tables) + "\n\n" + text + "\n\n"
                                               + equal_memory.format_table(rows) + "\n\n"
                                               + equal_memory.headline(rows) + "\n")
    if args.json:
        print(json.dumps(data, default=str))
    else:
        print("\n" + text)
        print(f"{wall_s:.0f} s in all; summary.json, equal_memory.txt and pictures in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
