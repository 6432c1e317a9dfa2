"""Answer in seconds: the default solve against a 60 s solve on 16-layer graphs.

Graphs: llama3-8b at 16 layers on 64 ranks (``models.capture_fsdp_graphs``) and a 16-layer
foreign style of ``tests/foreign_models.py`` (64 ranks), forward and backward, analytic cost
model; budgets 1.0x and 1.2x of the traced peak. For each: the wall time and step of the
default solve (``solvers.solve(problem, mem_budget_bytes=...)``: the search of
:mod:`solvers.search` with its default work limit, ``solvers.search.DEFAULT_WORK_LIMIT``),
the step of a solve with ``work_limit=60`` (the same stages with 30 times the work: more
windows and a longer polish), and their difference: what the default leaves on the table. Run
it on one core, as the target is stated:

    taskset -c 0 python benchmarks/solve_time.py
    taskset -c 0 python benchmarks/solve_time.py --graphs llama --kinds backward --json out.json

Both solves are deterministic (the same schedule on every run); wall times depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

logger = logging.getLogger("benchmarks.solve_time")

GRAPHS = ("llama", "foreign")
KINDS = ("forward", "backward")
BUDGET_FACTORS = (1.0, 1.2)
LONG_LIMIT_S = 60.0
FOREIGN_STYLE = "alternating"


def capture(graph: str) -> dict[str, Any]:
    """kind -> FX graph of the 16-layer ``graph`` on 64 ranks."""
    if graph == "llama":
        from models import capture_fsdp_graphs

        g = capture_fsdp_graphs("llama3-8b", world_size=64, n_layers=16)
        return {"forward": g.forward, "backward": g.backward}
    import foreign_models as fm

    c = fm.capture(FOREIGN_STYLE, n_layers=16, world_size=64, dim=2048)
    return {"forward": c.forward, "backward": c.backward}


def rows_of(name: str, dag: Any) -> list[dict[str, Any]]:
    from solvers import Problem, solve
    from solvers.core.simulator import simulate

    p = Problem.from_dag(dag)
    peak = simulate(dag, p.traced_schedule(), problem=p).peak_bytes
    out = []
    for f in BUDGET_FACTORS:
        budget = int(peak * f)
        t0 = time.perf_counter()
        default = solve(p, mem_budget_bytes=budget)
        wall_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        long = solve(p, mem_budget_bytes=budget, work_limit=LONG_LIMIT_S)
        long_s = time.perf_counter() - t0
        row = {"graph": name, "budget": f, "default_s": wall_s, "default_ms": default.objective_ms,
               "long_s": long_s, "long_ms": long.objective_ms,
               "diff": default.objective_ms / long.objective_ms - 1, "lower_bound_ms": p.lower_bound_ms()}
        logger.info("%s %.1fx: default %.3f ms in %.1f s; 60 s %.3f ms in %.1f s", name, f, row["default_ms"], wall_s,
                    row["long_ms"], long_s)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=GRAPHS)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("solvers").setLevel(logging.WARNING)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scheduler import export_dag

    rows = []
    for graph in args.graphs:
        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
        gms = capture(graph)
        for kind in args.kinds:
            label = f"{'llama3-8b' if graph == 'llama' else FOREIGN_STYLE} x16 {kind}"
            rows += rows_of(label, export_dag(gms[kind], cost_model="analytic"))
    print("| graph | budget | default solve (s) | default step (ms) | 60 s step (ms) | default vs 60 s | bound (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['graph']} | {r['budget']:.1f}x | {r['default_s']:.1f} | {r['default_ms']:.3f} | "
              f"{r['long_ms']:.3f} | {r['diff']:+.2%} | {r['lower_bound_ms']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
