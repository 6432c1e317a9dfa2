"""CP-SAT against its MILP twin on small traced graphs: step time and solve time.

For each model and graph (forward, backward) at each budget (none, traced-order peak), both
solvers run through the shared solve loop with the same time limit; the table gives the
simulated step time, the peak, the wall time of the solve and the MILP's step relative to
CP-SAT's.

    python benchmarks/milp_vs_cpsat.py --models llama3-8b --n-layers 2 --time-limit 30
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):  # this repository's library and its harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama3-8b"])
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from models import capture_fsdp_graphs
    from scheduler import Cluster, export_dag, simulate
    from solvers import Problem, solve

    cluster = Cluster(n_gpus=args.world_size, gpus_per_node=8)
    print(f"command: `python benchmarks/milp_vs_cpsat.py --models {' '.join(args.models)} --n-layers {args.n_layers} "
          f"--world-size {args.world_size} --time-limit {args.time_limit:g}`; machine: {platform.node()} "
          f"({platform.machine()}); date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print("| model | graph | budget | CP-SAT step ms | CP-SAT s | MILP step ms | MILP s | MILP / CP-SAT |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        graphs = capture_fsdp_graphs(model, world_size=args.world_size, n_layers=args.n_layers)
        for g in ("forward", "backward"):
            problem = Problem.from_dag(export_dag(getattr(graphs, g), cluster=cluster))
            traced_peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
            for label, budget in (("none", None), ("traced peak", traced_peak)):
                out = {}
                for solver in ("cpsat", "milp"):
                    t0 = time.perf_counter()
                    res = solve(problem, solver=solver, mem_budget_bytes=budget, work_limit=args.time_limit)
                    out[solver] = (res.objective_ms, time.perf_counter() - t0)
                (c_ms, c_s), (m_ms, m_s) = out["cpsat"], out["milp"]
                print(f"| {model} ({args.n_layers} layers) | {g} | {label} | {c_ms:.3f} | {c_s:.1f} | {m_ms:.3f} | "
                      f"{m_s:.1f} | {m_ms / c_ms:.4f} |", flush=True)


if __name__ == "__main__":
    main()
