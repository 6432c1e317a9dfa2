"""What each stage of the search gains: the search with one stage taken out, against all its stages.

For each graph (forward and backward of a preset, ``models.capture_fsdp_graphs``) at its traced
peak (the count a budget holds, ``judge_graph(gm).max_peak_bytes``), the graph is exported once
per cost model of the default family (:func:`scheduler.cost_model_family`) and
:func:`solvers.search.search` runs on it in three modes: under the family (the default of
``optimize_schedule``, worst-case regret), under the analytic model alone and under torch's
estimators alone. Each mode runs every stage (``whole plan``, the row's label) and every stage but one:

* ``no regular starts``: only one block per bucket issued one bucket ahead (``start_sizes=(1,)``,
  ``start_aheads=(1,)``) besides the heuristics;
* ``no fit``: no start over the budget moved under it (``fit_starts=0``);
* ``no windows``: the CP-SAT windows get no work (``window_share=0``; the polish gets it all);
* ``no polish``: the windows get all the work (``window_share=1``);
* ``no strict``: no strict model (``strict_models=()``), so the stage that repairs a loss to a
  baseline under the nominal models never runs;
* ``no ahead``: no ahead stage (``ahead_trials=0``).

``--budget-of fsdp2`` solves at the peak of FSDP2-like's written graph instead of the traced
peak (the budget of ``equal_memory.py``'s FSDP2-like rows).

Every schedule is evaluated on the execution model under all six models; the table gives the
step under the analytic and torch models, the worst regret over the six (against the fastest
schedule any variant found under each model) and the CPU seconds of the search. The search's
figures are the model's, before write-back (the write-back is judged by ``equal_memory.py``).

    taskset -c 0 python benchmarks/stages.py                          # llama3-8b, 8 layers, 64 ranks
    taskset -c 0 python benchmarks/stages.py --graphs llama3-8b:32:64 --json stages32.json
    taskset -c 0 python benchmarks/stages.py --kinds forward --budget-of fsdp2     # where strict runs
"""

from __future__ import annotations

import argparse
import dataclasses
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

from compile_time import ensure_fake_group  # noqa: E402
from run import parse_model_spec  # noqa: E402

logger = logging.getLogger("benchmarks.stages")

VARIANTS: dict[str, dict[str, Any]] = {
    "whole plan": {},
    "no regular starts": {"start_sizes": (1,), "start_aheads": (1,)},
    "no fit": {"fit_starts": 0},
    "no windows": {"window_share": 0.0},
    "no polish": {"window_share": 1.0},
    "no strict": {"strict_models": ()},
    "no ahead": {"ahead_trials": 0},
}


def run_graph(spec: str, kind: str, budget_of: str | None = None) -> list[dict[str, Any]]:
    import scheduler
    from models import capture_fsdp_graphs
    from scheduler.check.written import judge_graph
    from scheduler.costs.pricing import export_problems
    from solvers.core.evaluate import ModelEvaluator
    from solvers.cpsat import CpSatBackend
    from solvers.search import SearchConfig, search

    preset, n_layers, world_size = parse_model_spec(spec)
    ensure_fake_group(world_size)
    gm = getattr(capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers), kind)
    if budget_of is None:
        budget, where = judge_graph(gm).max_peak_bytes, ""
    else:
        from scheduler.compare.judged import judge_baseline

        budget, where = judge_baseline(gm, budget_of, ("analytic",)).max_peak_bytes, f" @{budget_of}"
    problems = export_problems(gm, scheduler.cost_model_family(), None)
    labels = list(problems)
    evaluator = ModelEvaluator(problems)
    rows = []
    for mode in ("family", labels[0], "torch"):
        subset = problems if mode == "family" else {mode: problems[mode]}
        for variant, fields in VARIANTS.items():
            started = time.process_time()
            result = search(subset, budget, backend=CpSatBackend(), config=SearchConfig(**fields))
            cpu_s = time.process_time() - started
            steps = {label: e.step_ms for label, e in evaluator.evaluate(result.schedule).items()}
            rows.append({"graph": f"{spec} {kind}{where}", "mode": mode, "variant": variant, "cpu_s": cpu_s,
                         "steps_ms": steps, "budget_bytes": budget,
                         "stages": [dataclasses.asdict(s) for s in result.stages]})
            logger.info("%s %s %s / %s: analytic %.2f ms, torch %.2f ms in %.1f s CPU", spec, kind, mode, variant,
                        steps[labels[0]], steps["torch"], cpu_s)
    best = {label: min(r["steps_ms"][label] for r in rows) for label in labels}
    for r in rows:
        r["worst_regret"] = max(r["steps_ms"][label] / best[label] - 1 for label in labels)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'graph':30} {'mode':9} {'variant':18} {'analytic ms':>11} {'torch ms':>9} {'worst regret':>12} {'CPU s':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['graph']:30} {r['mode']:9} {r['variant']:18} {r['steps_ms']['analytic']:11.3f} "
              f"{r['steps_ms']['torch']:9.3f} {100 * r['worst_regret']:11.2f}% {r['cpu_s']:6.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=["llama3-8b:8:64"], help="preset:n_layers:world_size")
    parser.add_argument("--kinds", nargs="+", choices=("forward", "backward"), default=["forward", "backward"])
    parser.add_argument("--budget-of", choices=("fsdp2",), help="solve at this baseline's written peak "
                        "(default: the traced peak)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = [r for spec in args.graphs for kind in args.kinds for r in run_graph(spec, kind, args.budget_of)]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
