"""How solve time and quality grow with the number of layers, for both solvers.

For one model (default llama3-405b, world 64) truncated to each of ``--layers`` (the last entry
``all`` is the preset's full depth), for the forward and backward graphs, unconstrained and at
the traced order's peak memory:

* CP-SAT at each of ``--cpsat-limits`` (s) and the MILP (PuLP/CBC) at ``--milp-limit`` (s):
  simulated step, gap to the analytic lower bound, wall time, and from the solve's improvement
  history the time at which it was within 1 % of its final step (``t_1pct_s``) and when it last
  improved (``t_last_s``); the solve's notes;
* the best heuristic (FSDP2-like, SimpleFSDP-like, AutoParallel-like, traced) that fits.

Traced graphs come from the DAG cache of ``benchmarks/run.py`` (traced on a miss).

    python benchmarks/scaling.py --out benchmarks/out/scaling
    python benchmarks/scaling.py --layers 8 16 --graphs forward --cpsat-limits 10   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import run  # noqa: E402  (benchmarks/run.py: cache and table helpers)

logger = logging.getLogger("benchmarks.scaling")

COLS = ["layers", "graph", "budget", "collectives", "method", "limit_s", "solve_s", "t_1pct_s", "t_last_s",
        "step_ms", "gap_pct", "peak_mem", "note"]


def _solve(problem, dag, solver: str, budget: int | None, limit: float) -> dict:
    from scheduler import simulate
    from solvers import InfeasibleBudgetError, ScheduleError, solve

    t = time.perf_counter()
    try:
        r = solve(problem, solver=solver, mem_budget_bytes=budget, work_limit=limit)
    except (InfeasibleBudgetError, ScheduleError) as e:
        return {"solve_s": round(time.perf_counter() - t, 1), "note": f"{type(e).__name__}: {str(e)[:90]}"}
    wall = time.perf_counter() - t
    sim = simulate(dag, r.schedule, problem=problem)
    lb = problem.lower_bound_ms()
    hist = r.history or ((wall, sim.step_ms),)  # a single-model solve: only its end is known
    t_1pct = next(ts for ts, ms in hist if ms <= sim.step_ms * 1.01)
    return {"solve_s": round(wall, 1), "t_1pct_s": round(t_1pct, 1), "t_last_s": round(hist[-1][0], 1),
            "step_ms": round(sim.step_ms, 3),
            "gap_pct": round(100 * (sim.step_ms - lb) / lb, 2), "peak_bytes": sim.peak_bytes,
            "note": "; ".join(n for n in r.notes if not n.startswith("model step"))[:110]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-405b")
    ap.add_argument("--layers", nargs="+", default=["8", "16", "32", "64", "all"])
    ap.add_argument("--graphs", nargs="+", default=list(run.GRAPHS), choices=run.GRAPHS)
    ap.add_argument("--budgets", nargs="+", default=["none", "traced"], choices=["none", "traced"])
    ap.add_argument("--cpsat-limits", nargs="+", type=float, default=[60.0])
    ap.add_argument("--milp-limit", type=float, default=60.0)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cache-dir", type=Path, default=run.DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=None, help="write scaling.md / scaling.json here")
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from models.llama import get_config
    from scheduler import Cluster, simulate
    from solvers import Problem, solve

    cluster = Cluster(n_gpus=args.world_size, gpus_per_node=args.gpus_per_node)
    header = run.header_line(raw).replace("benchmarks/run.py", "benchmarks/scaling.py")
    rows: list[dict] = []
    for layers in args.layers:
        n_layers = None if layers == "all" else int(layers)
        ns = argparse.Namespace(n_layers=n_layers, world_size=args.world_size, gpus_per_node=args.gpus_per_node,
                                options={}, graphs=args.graphs, cache_dir=args.cache_dir, no_cache=False)
        graphs = run.load_graphs(args.model, ns, cluster)
        for g in args.graphs:
            dag, _ = graphs[g]
            problem = Problem.from_dag(dag)
            n_layers_txt = str(n_layers or get_config(args.model).n_layers)
            movable = sum(c.movable for c in problem.colls.values())
            traced_peak = simulate(dag, problem.traced_schedule(), problem=problem).peak_bytes
            for label in args.budgets:
                budget = None if label == "none" else traced_peak
                base = {"layers": n_layers_txt, "graph": g, "budget": label, "collectives": movable,
                        "budget_bytes": budget}
                best = None
                for h in run.HEURISTICS:
                    try:
                        r = solve(problem, solver=h, mem_budget_bytes=budget)
                    except Exception:  # noqa: BLE001 - a heuristic that cannot fit is skipped
                        continue
                    if best is None or r.objective_ms < best[1].objective_ms:
                        best = (h, r)
                if best is not None:
                    lb = problem.lower_bound_ms()
                    rows.append({**base, "method": f"best heuristic ({best[0]})", "step_ms": round(best[1].objective_ms, 3),
                                 "gap_pct": round(100 * (best[1].objective_ms - lb) / lb, 2),
                                 "peak_bytes": best[1].peak_bytes})
                for limit in args.cpsat_limits:
                    rows.append({**base, "method": "cpsat", "limit_s": limit,
                                 **_solve(problem, dag, "cpsat", budget, limit)})
                    logger.info("%s layers %s %s: %s", n_layers_txt, g, label, rows[-1])
                rows.append({**base, "method": "milp", "limit_s": args.milp_limit,
                             **_solve(problem, dag, "milp", budget, args.milp_limit)})
                logger.info("%s layers %s %s: %s", n_layers_txt, g, label, rows[-1])
    md = f"## solve time vs layers: {args.model}, world {args.world_size}\n\n{header}\n\n" + run.to_markdown(rows, COLS)
    print("\n" + md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scaling.md").write_text(md + "\n")
        (args.out / "scaling.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
