"""torch's overlap scheduler as starts of the search: how faithful the read-back is, what it costs.

For each of autoparallel's published graphs (``--repros DIR``, :mod:`harness.repros`), one
process each (the fake process group is global):

- **fidelity**: each variant of torch's pass (:data:`scheduler.torch_overlap.VARIANTS`) run as
  a start and read back over the traced problem (:func:`scheduler.readback.read_back`),
  written back with our write-back and judged (:func:`scheduler.check.written.judge_graph`)
  under torch's estimators and the analytic model, against torch's own written graph judged the
  same way; the repairs the read-back made;
- **faithful**: the graph torch writes when run as a start (``reuse=True``) has the digest
  (:func:`scheduler.check.written.graph_digest`) of the graph it writes as torch runs it;
- **cost**: CPU seconds (``time.process_time``, which the load of other processes changes far
  less than the wall time) of torch's pass as torch runs it and as a start, and of
  ``optimize_schedule`` with its defaults (no cost model, no budget) under each
  ``--configs`` of ``SolverOptions.torch_starts`` (``none``, ``pre``: torch's own pass, the
  default, ``both``), each in a fresh process.

    python benchmarks/torch_starts.py --repros DIR [--graphs NAME ...] [--configs none pre both] --json out.json
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
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness.output import finish  # noqa: E402  (benchmarks/harness)

logger = logging.getLogger("benchmarks.torch_starts")

#: ``--configs`` -> ``SolverOptions.torch_starts``
CONFIGS = {"none": (), "pre": ("torch-overlap",), "both": ("torch-overlap", "torch-overlap-no-prebucketing")}
JUDGES = ("torch", "analytic")


def _cpu(fn: Any) -> tuple[Any, float]:
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


def passes(repros: str, name: str) -> dict[str, Any]:
    """Fidelity, faithfulness and cost of torch's pass on one graph (module docstring)."""
    from harness.repros import load_repro
    from scheduler.check.written import graph_digest, judge_graph
    from scheduler.export.dag import export_dag
    from scheduler.readback import TorchPassError, read_back
    from scheduler.torch_overlap import VARIANTS, torch_overlap_schedule
    from scheduler.writeback import apply_schedule, copy_module
    from solvers.core import Problem, simulate

    _quiet()
    gm = load_repro(repros, name).gm
    problems = {m: Problem.from_dag(export_dag(gm, cost_model=m)) for m in JUDGES}
    out: dict[str, Any] = {"graph": name}
    for variant, options in VARIANTS.items():
        row: dict[str, Any] = {}
        copied = copy.deepcopy(gm)
        plain, row["torch_cpu_s"] = _cpu(lambda: torch_overlap_schedule(copied, inplace=True, **options))
        start, row["start_cpu_s"] = _cpu(lambda: torch_overlap_schedule(gm, reuse=True, **options))
        row["same_graph"] = graph_digest(plain) == graph_digest(start)
        try:
            schedule, row["repairs"] = read_back(start, problems["torch"])
        except TorchPassError as e:
            row["error"] = str(e)
            out[variant] = row
            continue
        ours = copy_module(gm)
        apply_schedule(ours, problems["torch"], schedule)
        for judge in JUDGES:
            mine, theirs = judge_graph(ours, judge), judge_graph(plain, judge)
            row[judge] = {"simulated_ms": simulate(problems[judge].dag, schedule, problem=problems[judge]).step_ms,
                          "written_ms": mine.step_ms, "torch_ms": theirs.step_ms,
                          "peak_bytes": mine.max_peak_bytes, "torch_peak_bytes": theirs.max_peak_bytes}
        out[variant] = row
    return out


def product(repros: str, name: str, config: str) -> dict[str, Any]:
    """CPU seconds of ``optimize_schedule`` with ``SolverOptions(torch_starts=CONFIGS[config])``."""
    from harness.repros import load_repro
    from scheduler import AgreementOptions, SolverOptions, optimize_schedule
    from scheduler.api import REPORT_KEY

    _quiet()
    gm = load_repro(repros, name).gm
    _, cpu_s = _cpu(lambda: optimize_schedule(gm, solver=SolverOptions(torch_starts=CONFIGS[config]),
                                              agreement=AgreementOptions(enabled=False)))
    report = gm.meta[REPORT_KEY]
    return {"graph": name, "config": config, "cpu_s": cpu_s, "start": report.start,
            "torch_wall_s": sum(st["wall_s"] for st in report.stages if st["name"] == "torch")}


def _quiet() -> None:
    import torch._inductor.fx_passes.fsdp  # noqa: F401  (it sets its logger to INFO on import)

    for noisy in ("solvers", "scheduler", "models", "harness", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run(job: tuple[str, ...]) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kind, *args = job
    return passes(*args) if kind == "passes" else product(*args)


def format_rows(rows: list[dict[str, Any]]) -> str:
    from scheduler.torch_overlap import VARIANTS

    out = ["fidelity: our write-back of the read-back / torch's own graph (step, judged), repairs; "
           "faithful: the same graph as a start"]
    out.append("| graph | variant | torch | analytic | peak | same graph | torch pass CPU s | as a start | repairs |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    by_graph = {r["graph"]: r for r in rows if "config" not in r}
    for g, r in by_graph.items():
        for v in VARIANTS:
            x = r[v]
            if "error" in x:
                out.append(f"| {g} | {v} | - | - | - | {x['same_graph']} | {x['torch_cpu_s']:.1f} | "
                           f"{x['start_cpu_s']:.1f} | no start: {x['error'][:80]} |")
                continue
            ratio = [x[j]["written_ms"] / x[j]["torch_ms"] for j in JUDGES]
            peak = x["torch"]["peak_bytes"] / x["torch"]["torch_peak_bytes"]
            out.append(f"| {g} | {v} | x{ratio[0]:.3f} | x{ratio[1]:.3f} | x{peak:.3f} | {x['same_graph']} | "
                       f"{x['torch_cpu_s']:.1f} | {x['start_cpu_s']:.1f} | {'; '.join(x['repairs'])[:300]} |")
    products = [r for r in rows if "config" in r]
    if products:
        configs = list(dict.fromkeys(r["config"] for r in products))
        out.append("\noptimize_schedule CPU s (x torch's pass as torch runs it, CPU) and the start that won")
        out.append("| graph | " + " | ".join(configs) + " |")
        out.append("|---|" + "---|" * len(configs))
        ratios: dict[str, list[float]] = {c: [] for c in configs}
        for g, r in by_graph.items():
            base = r["torch-overlap"]["torch_cpu_s"]
            cells = []
            for c in configs:
                p = next((p for p in products if p["graph"] == g and p["config"] == c), None)
                if p is None:
                    cells.append("-")
                    continue
                ratios[c].append(p["cpu_s"] / base)
                cells.append(f"{p['cpu_s']:.1f} (x{p['cpu_s'] / base:.2f}, {p['start']})")
            out.append(f"| {g} | " + " | ".join(cells) + " |")
        out.append(" ".join(f"{c}: geomean x{_geomean(xs):.2f}, at most x{max(xs):.2f};" for c, xs in ratios.items()
                            if xs))
    return "\n".join(out)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> int:
    from harness.repros import PUBLISHED_64

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repros", required=True, help="autoparallel's autoparallel/tools/overlap_simulator folder")
    ap.add_argument("--graphs", nargs="+", default=list(PUBLISHED_64))
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS),
                    help="SolverOptions.torch_starts settings whose optimize_schedule CPU time is measured")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    jobs = [(("passes", args.repros, g)) for g in args.graphs]
    jobs += [("product", args.repros, g, c) for g in args.graphs for c in args.configs]
    rows = []
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for row in pool.imap(_run, jobs):
            logger.info("%s", json.dumps(row)[:300])
            rows.append(row)
    return finish(format_rows(rows), rows, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
