"""Time per schedule: ``simulate()`` against the fast evaluator (``solvers.core.evaluate``).

For each graph (forward and backward of a preset, ``models.capture_fsdp_graphs`` on a fake
process group) exported with the analytic cost model, and each schedule:

* the heuristics' schedules (traced, FSDP2-like, SimpleFSDP-like, AutoParallel-like): one
  ``simulate(dag, schedule, problem=p)`` against one ``Evaluator(p).evaluate(schedule)``;
* neighbours of the minimax polish (``solvers.polish._neighbours`` of the FSDP2-like schedule):
  the schedule built from the plan (``solvers.core.plan.build_schedule``) and simulated, against
  ``Evaluator.read_plan`` + ``evaluate`` (what the polish does now);
* with ``--family`` (default on): the same graph exported under the robust option's six cost
  models (``scheduler.costs.family.cost_model_family``), one schedule judged under all six:
  six simulations against ``ModelEvaluator.evaluate`` (memory counted once, six timelines).

Every evaluation is checked equal to its simulation (step time, both peaks) before it is timed;
the table says whether the evaluator takes its fast path on the graph (``Evaluator.fast``) and
how many of the checked evaluations it handed to the simulator instead.
Times are CPU seconds of this process (``time.process_time``), the median of ``--repeats``
runs, so that other processes on a shared machine disturb them less; the evaluator's one-time
build per problem is printed beside them.

    taskset -c 0 python benchmarks/evaluate_speed.py                         # llama3-8b, 8 and 32 layers, 64 ranks
    taskset -c 0 python benchmarks/evaluate_speed.py --graphs llama3-8b:8:64 --no-family
    python benchmarks/evaluate_speed.py --graphs llama3-debug:2:4            # seconds

Capturing llama3-8b at 32 layers takes about a minute, each export some seconds.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from compile_time import ensure_fake_group  # noqa: E402  (benchmarks/compile_time.py)
from run import parse_model_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger("benchmarks.evaluate_speed")

DEFAULT_GRAPHS = ("llama3-8b:8:64", "llama3-8b:32:64")
KINDS = ("forward", "backward")
HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")


def cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median CPU time of ``fn`` over ``repeats`` runs (ms)."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def same(sim, ev) -> bool:
    return (abs(sim.step_ms - ev.step_ms) <= 1e-9 * max(1.0, sim.step_ms) and sim.peak_bytes == ev.peak_bytes
            and sim.tracker_peak_bytes == ev.tracker_peak_bytes)


def rows_of(graph: str, kind: str, gm: Any, cluster: Any, repeats: int, neighbours: int,
            family: bool) -> list[dict[str, Any]]:
    import scheduler
    from solvers import solve
    from solvers.core.evaluate import Evaluator, ModelEvaluator
    from solvers.core.problem import Problem
    from solvers.core.simulator import simulate
    from solvers.core.plan import build_schedule, chain_ordered
    from solvers.polish import PolishConfig, _neighbours, _plan_of

    dag = scheduler.export_dag(gm, cost_model="analytic", cluster=cluster)
    p = Problem.from_dag(dag)
    t0 = time.process_time()
    ev = Evaluator(p)
    build_s = time.process_time() - t0
    if not ev.fast:
        logger.warning("%s %s: the evaluator falls back to the simulator: %s", graph, kind, ev.reason)
    base = {"graph": graph, "kind": kind, "nodes": dag.number_of_nodes(), "seq": p.n, "build_s": build_s,
            "fast": ev.fast}
    rows = []
    schedules = {h: solve(p, solver=h).schedule for h in HEURISTICS}
    for name, s in schedules.items():
        before = ev.fallbacks
        if not same(simulate(dag, s, problem=p), ev.evaluate(s)):
            raise AssertionError(f"{graph} {kind} {name}: the evaluator differs from the simulator")
        rows.append({**base, "schedule": name, "buckets": len(s.buckets), "fell_back": f"{ev.fallbacks - before}/1",
                     "simulate_ms": cpu_ms(lambda: simulate(dag, s, problem=p), repeats),
                     "evaluate_ms": cpu_ms(lambda: ev.evaluate(s), max(repeats, 20))})
    moves = list(_neighbours(p, _plan_of(schedules["fsdp2"]), PolishConfig()))
    random.Random(0).shuffle(moves)
    picked = [o for o in (chain_ordered(p, e) for e in moves) if o is not None][:neighbours]
    before = ev.fallbacks
    for o in picked:
        if not same(simulate(dag, build_schedule(p, o), problem=p), ev.evaluate(ev.read_plan(o))):
            raise AssertionError(f"{graph} {kind}: the evaluator differs from the simulator on a neighbour")
    if picked:
        fell_back = f"{ev.fallbacks - before}/{len(picked)}"
        sim_ms = cpu_ms(lambda: [simulate(dag, build_schedule(p, o), problem=p) for o in picked], repeats) / len(picked)
        ev_ms = cpu_ms(lambda: [ev.evaluate(ev.read_plan(o)) for o in picked], repeats) / len(picked)
        rows.append({**base, "schedule": f"{len(picked)} polish neighbours (build + judge)",
                     "buckets": len(schedules["fsdp2"].buckets), "fell_back": fell_back, "simulate_ms": sim_ms,
                     "evaluate_ms": ev_ms})
    if family:
        from scheduler.costs.family import cost_model_family

        problems = {label: Problem.from_dag(scheduler.export_dag(gm, cost_model=m, cluster=cluster))
                    for label, m in cost_model_family(cluster).items()}
        models = ModelEvaluator(problems)
        for name in ("traced", "fsdp2"):
            s = schedules[name]
            before = sum(e.fallbacks for e in models.evaluators.values())
            evals = models.evaluate(s)
            fell_back = f"{sum(e.fallbacks for e in models.evaluators.values()) - before}/{len(problems)}"
            for label, q in problems.items():
                if not same(simulate(q.dag, s, problem=q), evals[label]):
                    raise AssertionError(f"{graph} {kind} {name} under {label}: the evaluator differs")
            rows.append({**base, "schedule": f"{name} x {len(problems)} cost models", "buckets": len(s.buckets),
                         "fell_back": fell_back,
                         "simulate_ms": cpu_ms(lambda: [simulate(q.dag, s, problem=q) for q in problems.values()],
                                               repeats),
                         "evaluate_ms": cpu_ms(lambda: models.evaluate(s), max(repeats, 20))})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| graph | kind | nodes (schedulable) | fast | schedule | buckets | simulated instead | simulate (ms) | "
             "evaluate (ms) | speedup | evaluator build (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['kind']} | {r['nodes']} ({r['seq']}) | {'yes' if r['fast'] else 'no'} | "
                     f"{r['schedule']} | {r['buckets']} | {r['fell_back']} | {r['simulate_ms']:.2f} | "
                     f"{r['evaluate_ms']:.3f} | {r['simulate_ms'] / r['evaluate_ms']:.0f}x | {r['build_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", nargs="+", default=list(DEFAULT_GRAPHS),
                    help="preset:n_layers:world_size (default: %(default)s)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement, median (default: %(default)s)")
    ap.add_argument("--neighbours", type=int, default=50, help="polish neighbours timed (default: %(default)s)")
    ap.add_argument("--family", action=argparse.BooleanOptionalAction, default=True,
                    help="also judge under the six cost models of the robust option (default on)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import scheduler
    from models import capture_fsdp_graphs

    rows: list[dict[str, Any]] = []
    for spec in args.graphs:
        preset, n_layers, world_size = parse_model_spec(spec)
        ensure_fake_group(world_size)
        t0 = time.perf_counter()
        graphs = capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        cluster = scheduler.Cluster(n_gpus=world_size, gpus_per_node=min(8, world_size))
        for kind in args.kinds:
            rows += rows_of(spec, kind, getattr(graphs, kind), cluster, args.repeats, args.neighbours, args.family)
            logger.info("%s %s done", spec, kind)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
