"""Compile time a user pays: ``optimize_schedule`` against torch's overlap scheduler, in seconds.

For each graph (forward and backward of a preset, ``models.capture_fsdp_graphs``) and budget
factor f:

* budget: f x the traced graph's own peak by the counts a budget bounds
  (``scheduler.check.written.judge_graph(gm).max_peak_bytes``: re-export and liveness);
* export: wall time of ``scheduler.export_dag(gm)`` alone;
* torch: wall time of torch's ``schedule_overlap_bucketing`` on a deep copy, called as this repo
  calls it (``scheduler.compare.baselines.torch_overlap_schedule(copy, inplace=True)``), one timed run
  after one warm-up run on another copy (the warm time is reported); torch's memory limit is
  its own (traced peak + max(1 GB, 5 %)), so it does not depend on f;
* fsdp-sched: wall time of ``scheduler.optimize_schedule(copy, mem_budget=budget)`` with its
  defaults (no cost model: the robust default), the first call for this graph and budget, and
  its ratio to torch's time;
* cache (``--cache``, default on), with ``FSDP_SCHED_CACHE`` unset, as a user runs it (the
  per-user default directory, :func:`scheduler.integrate.cache.cache_root`): one call that fills
  the cache (or finds the entry of an earlier run: the "fill" is then a hit itself), then a
  fresh Python process that captures the same graph, takes the same budget and times one
  ``optimize_schedule`` call on it: the cache hit a restarted job or another rank's process
  pays (its imports and its capture not counted; the "hit?" column says whether its report
  shows a hit, and the parts where its time went: export, cache, write-back);
* from the report (``gm.meta["fsdp_sched_report"]``): the re-exported step of the chosen graph
  (under the analytic model, the first of the family) against torch's rewritten graph judged
  the same way (``judge_graph(torch_graph)``), the chosen candidate, ``solve_time_s`` /
  ``verify_time_s`` (the judging of the written candidates), and the wall time of each stage of
  the search (``report.stages``: torch (its pass read back as starts), starts, windows, polish, judge).

The cold call runs with the cache off (``FSDP_SCHED_CACHE=0`` for the call), so that no earlier
run's entry can answer it. Run on one core, as the targets are stated per core:

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
import copy
import json
import logging
import math
import os
import sys
import time
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


def hit_in_a_fresh_process(spec: str, kind: str, budget_factor: float) -> dict[str, Any]:
    """The cache hit a new process pays: this script run again (:func:`fresh_hit`) on ``spec``'s
    ``kind`` graph at ``budget_factor``, ``FSDP_SCHED_CACHE`` unset (the default cache)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, __file__, "--fresh-hit", spec, kind, repr(budget_factor)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the fresh process failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_hit(spec: str, kind: str, budget_factor: float) -> dict[str, Any]:
    """In this (new) process: capture ``spec``, take the budget as :func:`rows_of` does, and time
    one ``optimize_schedule`` call (s), with what its report says of a hit."""
    from models import capture_fsdp_graphs
    from scheduler import optimize_schedule
    from scheduler.check.written import judge_graph

    _, preset, n_layers, world_size = (spec, *parse_model_spec(spec))
    ensure_fake_group(world_size)
    gm = getattr(capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers), kind)
    budget = int(judge_graph(gm).max_peak_bytes * budget_factor)
    out, seconds = timed(optimize_schedule, gm, mem_budget=budget)
    report = report_of(out)
    return {"seconds": seconds, "hit": cache_hit_sign(report), "step_ms": report.reexported_step_ms,
            "stages": [{"name": n, "wall_s": w} for n, w in stages_of(report)]}


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    """(fn's result, its wall time in s), timed as every pass of the comparisons is
    (:func:`scheduler.compare.judged.timed_pass`: a full garbage collection before, the
    collection of what it made after, on its clock)."""
    from scheduler.compare.judged import timed_pass

    with timed_pass() as took:
        out = fn(*args, **kw)
    return out, took[0]


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
def rows_of(spec: str, kind: str, gm: Any, budget_factors: list[float], use_cache: bool) -> list[dict[str, Any]]:
    """The rows of one graph: one per budget factor."""
    from scheduler.compare.baselines import torch_overlap_schedule
    from scheduler import export_dag, optimize_schedule
    from scheduler.check.written import judge_graph
    from scheduler.integrate import cache

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
        logger.info("%s: optimize_schedule (cold, cache off) at %.2f GiB", tag, budget / 2**30)
        with cache.disabled():
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
            "cache_fill_s": None, "cache_fill_hit": None, "cache_hit_s": None, "cache_hit": None,
            "cache_hit_step_ms": None,
        }
        if use_cache:
            logger.info("%s: optimize_schedule on the default cache (%s)", tag, cache.cache_root())
            fill_gm, row["cache_fill_s"] = timed(optimize_schedule, copy.deepcopy(gm), mem_budget=budget)
            row["cache_fill_hit"] = cache_hit_sign(report_of(fill_gm))
            logger.info("%s: the same graph and budget in a fresh process", tag)
            hit = hit_in_a_fresh_process(spec, kind, f)
            row["cache_hit_s"], row["cache_hit"], row["cache_hit_step_ms"] = hit["seconds"], hit["hit"], hit["step_ms"]
            row["cache_hit_stages"] = hit["stages"]
            logger.info("%s: cache fill %.2f s%s, fresh process %.2f s (report shows a hit: %s), re-exported %.3f ms",
                        tag, row["cache_fill_s"], " (itself a hit)" if row["cache_fill_hit"] else "",
                        row["cache_hit_s"], row["cache_hit"], hit["step_ms"] or math.nan)
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
    return " (" + " / ".join(f"{name} {parts[name]:.2f}" for name in ("export", "cache", "write-back")
                             if name in parts) + ")"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| graph | kind | budget | export (s) | torch (s) | fsdp-sched (s) | ratio | cache fill (s) | "
        "hit in a fresh process (s) | hit? | step ms: fsdp-sched vs torch | chosen | solve / judge (s) | stages (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = {True: "yes", False: "no", None: "-"}[r["cache_hit"]]
        lines.append(
            f"| {r['graph']} | {r['kind']} | {r['budget']:.1f}x | {r['export_s']:.2f} | {r['torch_s']:.2f} | "
            f"{r['fsdp_sched_s']:.1f} | {r['ratio']:.1f}x | {_opt(r['cache_fill_s'], '.1f')}"
            f"{' (a hit)' if r.get('cache_fill_hit') else ''} | "
            f"{_opt(r['cache_hit_s'], '.2f')}{_hit_parts(r)} | {hit} | {_opt(r['reexported_step_ms'], '.3f')} vs "
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
                    help="time a call on the default cache and the hit of a fresh process (default on)")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    ap.add_argument("--fresh-hit", nargs=3, metavar=("GRAPH", "KIND", "FACTOR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fresh_hit:  # the second process of a row (hit_in_a_fresh_process)
        quiet_loggers()
        spec, kind, factor = args.fresh_hit
        print(json.dumps(fresh_hit(spec, kind, float(factor))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    quiet_loggers()
    if args.cache:
        os.environ.pop(CACHE_ENV, None)  # the cache as a user finds it: nothing set
    specs = [(spec, *parse_model_spec(spec)) for spec in args.graphs]

    from models import capture_fsdp_graphs

    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for spec, preset, n_layers, world_size in specs:
        ensure_fake_group(world_size)
        t0 = time.perf_counter()
        graphs = capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        for kind in args.kinds:
            rows += rows_of(spec, kind, getattr(graphs, kind), args.budgets, args.cache)
    print(format_table(rows))
    print(f"\ngeometric mean of fsdp-sched / torch: {geomean([r['ratio'] for r in rows]):.1f}x"
          + (f"; the hit of a fresh process on the default cache: {geomean([r['cache_hit_s'] for r in rows]):.2f} s "
             f"(geometric mean), at most {max(r['cache_hit_s'] for r in rows):.2f} s" if args.cache and rows else "")
          + f" ({time.perf_counter() - t_start:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
