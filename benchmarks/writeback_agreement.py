"""What is written back is what counts: prediction vs the re-exported rewritten graph.

For every model, graph (forward / backward), heuristic schedule and cost model:

1. export the captured graph with the cost model and solve it with the heuristic
   (``solvers.solve(problem, solver=...)``: FSDP2-like, SimpleFSDP-like, AutoParallel-like);
2. predicted: ``scheduler.simulate(dag, schedule)`` on the original DAG (the solver's view);
3. write the schedule back (``scheduler.apply_schedule``: torch's merge functions), re-export
   the rewritten graph with the same cost model and simulate it in its traced order;
4. judge the rewritten graph on torch's side: the reference liveness count
   (``scheduler.check.judge.liveness_peak``) and torch's ``MemoryTracker``
   (``scheduler.check.judge.torch_tracker_peak``, every device counted).

Prints one row per case: predicted and re-exported step time (ms) and their difference, the
predicted, re-exported, reference and torch peaks (MiB). Re-exported and reference peaks must
be equal (exit status 1 otherwise).

    python benchmarks/writeback_agreement.py                       # the default models
    python benchmarks/writeback_agreement.py llama3-debug:2:4 --cost-models analytic
    python benchmarks/writeback_agreement.py --json out.json

A model is ``preset:n_layers:world_size``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run import parse_model_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("llama3-debug:2:4", "llama3-8b:2:8", "llama3-70b:1:16")
DEFAULT_SCHEDULES = ("fsdp2", "simplefsdp", "autoparallel")
DEFAULT_COST_MODELS = ("analytic", "torch")
MiB = 1 << 20


def _cost_model(name: str, cluster: Any) -> Any:
    # objects rather than names, so that the script also runs on versions before the resolver
    from scheduler.costs.models import AnalyticCostModel
    from scheduler.costs.torch_model import TorchCostModel

    return {"analytic": AnalyticCostModel, "torch": TorchCostModel}[name](cluster)


def agreement_row(gm: Any, *, world_size: int, schedule: str, cost_model: str, cluster: Any = None) -> dict[str, Any]:
    """One case (see the module docstring); ``gm`` is not modified."""
    from models.capture import fake_process_group
    from scheduler import apply_schedule, export_dag, simulate
    from scheduler.costs.hardware import Cluster
    from scheduler.check.judge import liveness_peak, torch_tracker_peak
    from solvers import Problem, solve

    cluster = cluster or Cluster()
    model = _cost_model(cost_model, cluster)
    gm = copy.deepcopy(gm)
    with fake_process_group(world_size):
        dag = export_dag(gm, cost_model=model, cluster=cluster)
        problem = Problem.from_dag(dag)
        result = solve(problem, solver=schedule)
        predicted = simulate(dag, result.schedule, problem=problem)
        apply_schedule(gm, problem, result.schedule)
        dag2 = export_dag(gm, cost_model=model, cluster=cluster)
        problem2 = Problem.from_dag(dag2)
        again = simulate(dag2, problem2.traced_schedule(), problem=problem2)
    return {
        "schedule": schedule,
        "cost_model": cost_model,
        "merged_buckets": sum(len(b.members) > 1 for b in result.schedule.buckets),
        "predicted_ms": predicted.step_ms,
        "reexported_ms": again.step_ms,
        "diff_pct": 100.0 * (again.step_ms - predicted.step_ms) / predicted.step_ms,
        "predicted_peak_bytes": predicted.peak_bytes,
        "reexported_peak_bytes": again.peak_bytes,
        "reference_peak_bytes": liveness_peak(gm),
        "torch_peak_bytes": torch_tracker_peak(gm),
    }


def run(models: list[str], schedules: list[str], cost_models: list[str]) -> list[dict[str, Any]]:
    from models import capture_fsdp_graphs

    rows = []
    for spec in models:
        preset, n_layers, world_size = parse_model_spec(spec)
        t0 = time.perf_counter()
        graphs = capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        for kind in ("forward", "backward"):
            for schedule in schedules:
                for cost_model in cost_models:
                    row = agreement_row(
                        getattr(graphs, kind), world_size=world_size, schedule=schedule, cost_model=cost_model
                    )
                    rows.append({"model": spec, "graph": kind, **row})
                    print(_format(rows[-1]), flush=True)
    return rows


HEADER = (
    f"{'model':18s} {'graph':8s} {'schedule':12s} {'cost':8s} {'bkts':>4s} {'pred ms':>10s} {'re-exp ms':>10s} "
    f"{'diff %':>7s} {'pred MiB':>10s} {'re-exp MiB':>10s} {'ref MiB':>10s} {'torch MiB':>10s}"
)


def _format(r: dict[str, Any]) -> str:
    return (
        f"{r['model']:18s} {r['graph']:8s} {r['schedule']:12s} {r['cost_model']:8s} {r['merged_buckets']:4d} "
        f"{r['predicted_ms']:10.4f} {r['reexported_ms']:10.4f} {r['diff_pct']:+7.2f} "
        f"{r['predicted_peak_bytes'] / MiB:10.3f} {r['reexported_peak_bytes'] / MiB:10.3f} "
        f"{r['reference_peak_bytes'] / MiB:10.3f} {r['torch_peak_bytes'] / MiB:10.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), help="preset:n_layers:world_size")
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES))
    parser.add_argument("--cost-models", nargs="+", default=list(DEFAULT_COST_MODELS), choices=DEFAULT_COST_MODELS)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(HEADER)
    rows = run(args.models, args.schedules, args.cost_models)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    worst = max(abs(r["diff_pct"]) for r in rows)
    bad_peaks = [r for r in rows if r["reexported_peak_bytes"] != r["reference_peak_bytes"]]
    print(f"\nworst step-time difference {worst:.2f} %; re-exported peak != reference peak in {len(bad_peaks)} rows")
    return 1 if bad_peaks else 0


if __name__ == "__main__":
    sys.exit(main())
