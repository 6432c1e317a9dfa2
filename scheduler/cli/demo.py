"""``fsdp-sched demo``: fsdp-sched against FSDP2-like, torch's scheduler and SimpleFSDP-like, at a glance.

Traces a reference model's FSDP training step (forward and backward graphs, on a fake process
group: no GPU and no data move), then for each graph and each baseline B (FSDP2-like, torch's
overlap scheduler, SimpleFSDP-like) writes B back on a copy of the graph and runs
``scheduler.optimize_schedule`` with its defaults (no cost model given: the schedule with the
least worst-case regret over the family of plausible cost models) at B's peak memory
(:func:`scheduler.compare.equal_memory.compare`). Every graph is judged as written
(:func:`scheduler.check.written.judge_graph`): step time re-exported under the analytic cost
model and under torch's own estimators, peak memory by the counts a budget bounds (re-export
and liveness).

Prints, per graph, each baseline and fsdp-sched at its peak: step ms under both models (with
fsdp-sched's speedup), peak memory, and the compile seconds of torch's pass and of
``optimize_schedule`` (export, solve, choose, install; solved every time, never read from the
schedule cache); then the headline per cost model: the speedup against the best baseline that
fits (geometric mean over the graphs and baselines) and against each baseline; the compile
time; where the files went. ``-v`` shows the progress log.

    fsdp-sched demo                                                # llama3-8b, 8 layers, 64 ranks
    fsdp-sched demo --model llama3-debug --n-layers 2 --world-size 8     # in seconds
    python benchmarks/demo.py                                      # the same, from a clone

Writes ``summary.json`` (every figure), ``equal_memory.txt`` (the full table with lower bounds
and headroom) and a Pareto picture per graph and cost model under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from scheduler.cli.common import CliError, ensure_out_dir
from scheduler.compare import equal_memory
from scheduler.compare.judged import PRODUCT, display

logger = logging.getLogger(__name__)

GRAPHS = ("forward", "backward")


def cmd_demo(args: argparse.Namespace) -> int:
    from models import capture_fsdp_graphs, list_presets

    if args.model not in list_presets():
        raise CliError(f"unknown model {args.model!r}; choose one of {', '.join(list_presets())}")
    quiet_loggers(args.verbose)
    from models.capture import fake_process_group
    from scheduler.costs.hardware import Cluster
    from scheduler.options import SolverOptions

    t0 = time.perf_counter()
    out = ensure_out_dir(Path(args.out))
    where = f"{args.model}, {args.n_layers} layers, {args.world_size} ranks"
    logger.info("tracing %s on a fake process group", where)
    captured = capture_fsdp_graphs(args.model, world_size=args.world_size, n_layers=args.n_layers)
    cluster = Cluster(n_gpus=args.world_size, gpus_per_node=min(8, args.world_size))
    solver = SolverOptions(work_limit=args.work_limit)
    comparisons, tables = [], []
    data: dict[str, Any] = {"model": args.model, "n_layers": args.n_layers, "world_size": args.world_size,
                            "work_limit": args.work_limit}
    if not args.json:
        print(f"fsdp-sched demo: {where}, traced on a fake process group and priced for a modelled cluster of "
              f"{cluster.n_gpus} {cluster.gpu_spec.name} GPUs ({cluster.gpus_per_node} per node)", flush=True)
    with fake_process_group(args.world_size):
        for g in GRAPHS:
            logger.info("%s graph: each baseline written back, fsdp-sched at its peak", g)
            c = equal_memory.compare(getattr(captured, g), graph=g, cluster=cluster, solver=solver)
            comparisons.append(c)
            data[g] = c.to_json()
            data[g]["files"] = [str(equal_memory.plot(c, m, out / f"{g}_{m}_equal_memory.png"))
                                for m in equal_memory.COST_MODELS]
            tables.append(glance(c, equal_memory.COST_MODELS, f"== {g} graph: each baseline, then {PRODUCT} at "
                                                               f"its peak memory =="))
            if not args.json:
                print("\n" + tables[-1], flush=True)
    wall_s = time.perf_counter() - t0
    rows = [r for c in comparisons for r in c.rows]
    text = summary(comparisons, equal_memory.COST_MODELS, args.work_limit)
    data["wall_s"] = wall_s
    (out / "summary.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "equal_memory.txt").write_text("\n\n".join(tables) + "\n\n" + text + "\n\n"
                                          + equal_memory.format_table(rows) + "\n\n"
                                          + equal_memory.headline(rows) + "\n")
    if args.json:
        print(json.dumps(data, default=str))
    else:
        print("\n" + text)
        print(f"{wall_s:.0f} s in all; summary.json, equal_memory.txt (every row, lower bounds) and pictures in "
              f"{out}/" + ("" if args.verbose else " (-v shows the progress log)"))
    return 0


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


def summary(comparisons: list[equal_memory.Comparison], cost_models: tuple[str, ...], work_limit: float) -> str:
    """The headline per cost model (the speedup against the best baseline that fits, geometric
    mean over the graphs and baselines, and its worst row; then against each baseline), and the
    compile seconds of fsdp-sched against torch's pass on the same graphs."""
    rows = [r for c in comparisons for r in c.rows]
    baselines = list(dict.fromkeys(r.baseline for r in rows))
    lines = [f"== {PRODUCT} at each baseline's peak memory, on the written graphs (geometric means over "
             f"{len(comparisons)} graphs x {len(baselines)} baselines) =="]
    for m in cost_models:
        mine = [r for r in rows if r.cost_model == m]
        ok = [r for r in mine if r.speedup is not None]
        if not ok:
            lines.append(f"{m} cost model: no written graph of {PRODUCT} fits")
            continue
        worst = min(ok, key=lambda r: r.speedup_vs_best)
        lines.append(f"{m} cost model: x{geomean([r.speedup_vs_best for r in ok]):.2f} vs the best baseline that fits"
                     f" (worst x{worst.speedup_vs_best:.2f}: {worst.graph}, at the peak of {display(worst.baseline)})")
        per = [f"x{g:.2f} vs {display(b)}" for b in baselines
               if (g := geomean([r.speedup for r in ok if r.baseline == b])) is not None]
        slower, missing = sum(r.speedup < 1 for r in ok), len(mine) - len(ok)
        lines.append("  " + ", ".join(per) + (f"; slower than the baseline in {slower} of {len(mine)}" if slower else "")
                     + (f"; no graph within the budget in {missing} of {len(mine)}" if missing else ""))
    ours = [p.compile_s for c in comparisons for p in c.products.values() if p.compile_s is not None]
    torch_s = {c.graph: j.compile_s for c in comparisons for j in c.baselines.values() if j.compile_s is not None}
    ratios = [p.compile_s / torch_s[c.graph] for c in comparisons if c.graph in torch_s
              for p in c.products.values() if p.compile_s is not None]
    if ours:
        line = (f"compile time per graph: {PRODUCT} {sum(ours) / len(ours):.1f} s (mean of {len(ours)} solves of "
                f"{work_units(work_limit)})")
        if torch_s:
            line += (f", torch's scheduler {sum(torch_s.values()) / len(torch_s):.1f} s; {PRODUCT} / torch "
                     f"x{geomean(ratios):.1f} (geometric mean)")
        lines.append(line)
    return "\n".join(lines)


def quiet_loggers(verbose: int = 0) -> None:
    """No per-call lines of torch's pre-bucketing and of the export unless asked twice (torch's
    FSDP pass sets its logger to INFO on import, so import it first)."""
    import torch._inductor.fx_passes.fsdp  # noqa: F401

    level = logging.DEBUG if verbose >= 2 else logging.WARNING
    for noisy in ("torch._inductor.fx_passes.fsdp", "scheduler.export.structure", "scheduler.export.dag",
                  "torch._inductor.fx_passes.overlap_scheduling"):
        logging.getLogger(noisy).setLevel(level)


def work_units(work_limit: float) -> str:
    """``SolverOptions.work_limit`` as what it counts: deterministic work, not seconds."""
    return f"{work_limit:g} work unit{'' if work_limit == 1 else 's'}"


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


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
