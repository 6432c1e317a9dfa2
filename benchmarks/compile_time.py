"""Compile time a user pays: ``optimize_schedule`` against torch's overlap scheduler, in seconds.

For each graph (forward and backward of a preset, ``models.capture_fsdp_graphs``) and budget
factor f:

* budget: f x the traced graph's own peak by the counts a budget bounds
  (``scheduler.check.written.judge_graph(gm).max_peak_bytes``: re-export and liveness);
* export: wall time of ``scheduler.export_dag(gm)`` alone;
* torch: wall time of torch's ``schedule_overlap_bucketing`` on a deep copy, called as this repo
  calls it (``harness.baselines.torch_overlap_schedule(copy, inplace=True)``), one timed run
  after one warm-up run on another copy (the warm time is reported); torch's memory limit is
  its own (traced peak + max(1 GB, 5 %)), so it does not depend on f;
* fsdp-sched: wall time of ``scheduler.optimize_schedule(copy, mem_budget=budget)`` with its
  defaults (no cost model: the robust default), the first call for this graph and budget, and
  its ratio to torch's time;
* cache (``--cache``, default on): with ``FSDP_SCHED_CACHE`` pointing to a fresh temporary
  directory, one call that fills the cache and one on another deep copy (a hit, if the cache
  answers: the "hit?" column says whether the report shows a sign of one);
* from the report (``gm.meta["fsdp_sched_report"]``): the re-exported step of the chosen graph
  (under the analytic model, the first of the family) against torch's rewritten graph judged
  the same way (``judge_graph(torch_graph)``), the chosen candidate, ``solve_time_s`` /
  ``verify_time_s`` (the judging of the written candidates), and the wall time of each stage of
  the plan (``report.stages``: torch (its pass read back as starts), starts, windows, polish, judge).

The cold call runs with ``FSDP_SCHED_CACHE`` set to a fresh empty directory too, so that no
earlier run's cache can answer it. Run on one core, as the targets are stated per core:

    taskset -c 0 python benchmarks/compile_time.py                       # llama3-8b, 8 and 32 layers, 64 ranks
    taskset -c 0 python benchmarks/compile_time.py --graphs llama3-8b:8:64
    taskset -c 0 python benchmarks/compile_time.py --graphs llama3-8b:8:64 --budgets 1.0 1.2 --json ct.json
    taskset -c 0 python benchmarks/compile_time.py --graphs llama3-debug:2:4 --no-cache   # seconds

A graph is ``preset:n_layers:world_size``. The fake process group is (re)initialised to each
graph's world size, so graphs of different world sizes may share one run. Wall times depend on
the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run import parse_model_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger("benchmarks.compile_time")

DEFAULT_GRAPHS = ("llama3-8b:8:64", "llama3-8b:32:64")
KINDS = ("forward", "backward")
CACHE_ENV = "FSDP_SCHED_CACHE"


# --------------------------------------------------------------------------------------------
# process group, cache directory, timing
# --------------------------------------------------------------------------------------------
def ensure_fake_group(world_size: int) -> None:
    """A fake process group of ``world_size`` ranks, rank 0: the graphs' collectives resolve
    their group by name, so it must have the world size the graph was traced with."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@contextlib.contextmanager
def cache_dir(path: str) -> Iterator[None]:
    """``$FSDP_SCHED_CACHE`` set to ``path`` for the block, restored afterwards."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    """(fn's result, its wall time in s), after a garbage collection so that an earlier
    call's garbage is not collected on this call's clock."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------
def stages_of(report: Any) -> list[tuple[str, float]]:
    """(name, wall_s) of each record in ``report.stages``, if the report has them (records as
    objects or dicts); [] otherwise."""
    out = []
    for record in getattr(report, "stages", None) or []:
        if isinstance(record, dict):
            name, wall_s = record.get("name"), record.get("wall_s")
        else:
            name, wall_s = getattr(record, "name", None), getattr(record, "wall_s", None)
        if name is not None and wall_s is not None:
            out.append((str(name), float(wall_s)))
    return out


def fmt_stages(stages: list[tuple[str, float]]) -> str:
    """"starts 0.4 / search 3.1 / ...": stages of one name summed, in the order they first ran."""
    total: dict[str, float] = {}
    for name, wall_s in stages:
        total[name] = total.get(name, 0.0) + wall_s
    return " / ".join(f"{name} {wall_s:.1f}" for name, wall_s in total.items()) or "-"


def cache_hit_sign(report: Any) -> bool | None:
    """Whether the report says its schedule came from the cache: a true ``cache_hit``
    attribute, a stage or note naming a cache hit; None when the report says nothing either
    way (no such attribute, stage or note)."""
    hit = getattr(report, "cache_hit", None)
    if hit is not None:
        return bool(hit)
    texts = [name for name, _ in stages_of(report)] + [str(n) for n in getattr(report, "notes", [])]
    if any("cache" in t.lower() and "hit" in t.lower() for t in texts):
        return True
    if any("cache" in t.lower() for t in texts):
        return False
    return None


def report_of(gm: Any) -> Any:
    from scheduler.api import REPORT_KEY

    return gm.meta[REPORT_KEY]


# --------------------------------------------------------------------------------------------
# one graph
# --------------------------------------------------------------------------------------------
def rows_of(spec: str, kind: str, gm: Any, budget_factors: list[float], use_cache: bool,
            tmp_root: str) -> list[dict[str, Any]]:
    """The rows of one graph: one per budget factor."""
    from harness.baselines import torch_overlap_schedule
    from scheduler import export_dag, optimize_schedule
    from scheduler.check.written import judge_graph

    label = f"{spec} {kind}"
    traced = judge_graph(gm)
    traced_peak_bytes = traced.max_peak_bytes
    logger.info("%s: %d nodes, traced peak %.2f GiB, step %.3f ms", label, len(gm.graph.nodes),
                traced_peak_bytes / 2**30, traced.step_ms)

    _, export_s = timed(export_dag, gm)
    logger.info("%s: export %.2f s", label, export_s)

    _, torch_first_s = timed(torch_overlap_schedule, copy.deepcopy(gm), inplace=True)
    torch_gm, torch_s = timed(torch_overlap_schedule, copy.deepcopy(gm), inplace=True)
    torch_judged = judge_graph(torch_gm)
    logger.info("%s: torch %.2f s (first run %.2f s), step %.3f ms, peak %.2f GiB", label, torch_s, torch_first_s,
                torch_judged.step_ms, torch_judged.max_peak_bytes / 2**30)

    rows = []
    for f in budget_factors:
        budget = int(traced_peak_bytes * f)
        tag = f"{label} {f:.1f}x"
        logger.info("%s: optimize_schedule (cold) at %.2f GiB", tag, budget / 2**30)
        with cache_dir(tempfile.mkdtemp(prefix="cold-", dir=tmp_root)):
            out, sched_s = timed(optimize_schedule, copy.deepcopy(gm), mem_budget=budget)
        report = report_of(out)
        stages = stages_of(report)
        logger.info("%s: fsdp-sched %.2f s (%.1fx torch), re-exported %.3f ms by %s; stages %s", tag, sched_s,
                    sched_s / torch_s, report.reexported_step_ms or math.nan, report.chosen_candidate,
                    fmt_stages(stages))
        row: dict[str, Any] = {
            "graph": spec, "kind": kind, "budget": f, "mem_budget_bytes": budget,
            "traced_peak_bytes": traced_peak_bytes, "traced_step_ms": traced.step_ms,
            "export_s": export_s, "torch_first_s": torch_first_s, "torch_s": torch_s,
            "torch_step_ms": torch_judged.step_ms, "torch_peak_bytes": torch_judged.max_peak_bytes,
            "fsdp_sched_s": sched_s, "ratio": sched_s / torch_s,
            "step_ms_after": report.step_ms_after, "reexported_step_ms": report.reexported_step_ms,
            "chosen_candidate": report.chosen_candidate, "solver": report.solver, "status": report.status,
            "solve_time_s": report.solve_time_s, "verify_time_s": report.verify_time_s,
            "stages": [{"name": n, "wall_s": s} for n, s in stages],
            "cache_fill_s": None, "cache_hit_s": None, "cache_hit": None, "cache_hit_step_ms": None,
        }
        if use_cache:
            with cache_dir(tempfile.mkdtemp(prefix="cache-", dir=tmp_root)):
                logger.info("%s: optimize_schedule filling a fresh cache", tag)
                _, row["cache_fill_s"] = timed(optimize_schedule, copy.deepcopy(gm), mem_budget=budget)
                logger.info("%s: optimize_schedule again on the same cache", tag)
                hit_gm, row["cache_hit_s"] = timed(optimize_schedule, copy.deepcopy(gm), mem_budget=budget)
            hit_report = report_of(hit_gm)
            row["cache_hit"] = cache_hit_sign(hit_report)
            row["cache_hit_step_ms"] = hit_report.reexported_step_ms
            row["cache_hit_stages"] = [{"name": n, "wall_s": s} for n, s in stages_of(hit_report)]
            logger.info("%s: cache fill %.2f s, second call %.2f s (report shows a hit: %s), re-exported %.3f ms",
                        tag, row["cache_fill_s"], row["cache_hit_s"], row["cache_hit"],
                        hit_report.reexported_step_ms or math.nan)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _hit_parts(row: dict[str, Any]) -> str:
    """`` (export a / cache b / write-back c)``: where the second call's time went."""
    parts = {s["name"]: s["wall_s"] for s in row.get("cache_hit_stages") or []}
    if not parts:
        return ""
    return " (" + " / ".join(f"{name} {parts[name]:.1f}" for name in ("export", "cache", "write-back")
                             if name in parts) + ")"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| graph | kind | budget | export (s) | torch (s) | fsdp-sched (s) | ratio | cache fill (s) | "
        "cache 2nd call (s) | hit? | step ms: fsdp-sched vs torch | chosen | solve / judge (s) | stages (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = {True: "yes", False: "no", None: "-"}[r["cache_hit"]]
        lines.append(
            f"| {r['graph']} | {r['kind']} | {r['budget']:.1f}x | {r['export_s']:.2f} | {r['torch_s']:.2f} | "
            f"{r['fsdp_sched_s']:.1f} | {r['ratio']:.1f}x | {_opt(r['cache_fill_s'], '.1f')} | "
            f"{_opt(r['cache_hit_s'], '.1f')}{_hit_parts(r)} | {hit} | {_opt(r['reexported_step_ms'], '.3f')} vs "
            f"{r['torch_step_ms']:.3f} | {r['chosen_candidate'] or '-'} | "
            f"{r['solve_time_s']:.1f} / {r['verify_time_s']:.1f} | "
            f"{fmt_stages([(s['name'], s['wall_s']) for s in r['stages']])} |")
    return "\n".join(lines)


def quiet_loggers() -> None:
    """Only this script's progress at INFO: torch's pre-bucketing logs at INFO on every call
    (its module sets its logger's level to INFO on import, so import it first)."""
    import torch._inductor.fx_passes.fsdp  # noqa: F401

    for noisy in ("solvers", "scheduler", "models", "torch._inductor.fx_passes.fsdp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", nargs="+", default=list(DEFAULT_GRAPHS),
                    help="preset:n_layers:world_size (default: %(default)s)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--budgets", nargs="+", type=float, default=[1.0],
                    help="budget factors of the traced peak (default: %(default)s)")
    ap.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                    help="time a cache fill and a second call on it (default on)")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    quiet_loggers()
    specs = [(spec, *parse_model_spec(spec)) for spec in args.graphs]

    from models import capture_fsdp_graphs

    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fsdp-sched-compile-time-") as tmp_root:
        for spec, preset, n_layers, world_size in specs:
            ensure_fake_group(world_size)
            t0 = time.perf_counter()
            graphs = capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers)
            logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
            for kind in args.kinds:
                rows += rows_of(spec, kind, getattr(graphs, kind), args.budgets, args.cache, tmp_root)
    print(format_table(rows))
    print(f"\ngeometric mean of fsdp-sched / torch: {geomean([r['ratio'] for r in rows]):.1f}x"
          + (f"; of the second call on a filled cache / torch: "
             f"{geomean([r['cache_hit_s'] / r['torch_s'] for r in rows]):.1f}x" if args.cache and rows else "")
          + f" ({time.perf_counter() - t_start:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
