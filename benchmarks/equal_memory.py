"""Equal memory against each baseline: fsdp-sched at peak(B) vs B, on the written graphs.

For every graph (forward / backward of each model), each baseline B (FSDP2-like, torch 2.13's
overlap scheduler, SimpleFSDP-like) and each cost model (analytic, torch):
:func:`scheduler.compare.equal_memory.compare` writes B back and judges it (peak(B) = the largest of the
re-export, liveness and torch-tracker peaks), runs ``optimize_schedule`` on a copy at
``mem_budget = peak(B)`` and judges its written graph the same way. ``--solve-under robust``
(default) runs it as users do, without a cost model (one solve per budget, judged under both
models); ``--solve-under each`` solves under each judging model alone. Prints one table per
model (speedup vs B and vs the best baseline that fits, the lower bound and the headroom) and
the headline (geometric means; the target: never slower than B, at least x1.10 vs the best
baseline that fits).

    python benchmarks/equal_memory.py                          # llama3-8b at 8 layers, 64 ranks
    python benchmarks/equal_memory.py llama3-8b:32:64 --time-limit 10
    python benchmarks/equal_memory.py llama3-debug:2:4 --json eq.json
    python benchmarks/equal_memory.py llama3-8b:8:64 --solve-under each
    python benchmarks/equal_memory.py foreign:tied:8:64 foreign:moe:8:64

A model is ``preset:n_layers:world_size[:ddp|:hsdpR]`` or ``foreign:style:n_layers:world_size`` (a style of
``tests/foreign_models.py``, captured with plain torch.compile: graphs we did not capture).
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
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run import capture_spec, spec_world_size  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("llama3-8b:8:64",)


def run(models: list[str], work_limit: float, solve_under: str, cost_models: tuple[str, ...] | None = None,
        gpus_per_node: int = 8, baselines: tuple[str, ...] | None = None, all_gather_stream: str = "shared",
        kinds: tuple[str, ...] = ("forward", "backward"), merge_all_reduces: bool = False
        ) -> tuple[list[Any], list[dict[str, Any]]]:
    """All rows, and the JSON of every comparison."""
    from scheduler.compare import equal_memory
    from models.capture import fake_process_group
    from scheduler.costs.hardware import Cluster
    from scheduler.options import SolverOptions

    rows, data = [], []
    for spec in models:
        t0 = time.perf_counter()
        world_size = spec_world_size(spec)
        # one fake world from the capture to the last comparison: the groups a capture makes
        # beside the world (a foreign style's expert or tensor-parallel group) must resolve when
        # its graphs are merged and written back
        with fake_process_group(world_size):
            graphs, _ = capture_spec(spec)
            logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
            mine = []
            for kind in kinds:
                t0 = time.perf_counter()
                comparison = equal_memory.compare(
                    getattr(graphs, kind), graph=kind,
                    cluster=Cluster(n_gpus=world_size, gpus_per_node=min(gpus_per_node, world_size)),
                    cost_models=cost_models or equal_memory.COST_MODELS, baselines=baselines or equal_memory.BASELINES,
                    solver=SolverOptions(work_limit=work_limit, all_gather_stream=all_gather_stream,
                                         merge_all_reduces=merge_all_reduces),
                    solve_under=solve_under, on_row=_progress)
                mine += comparison.rows
                data.append({"model": spec, "time_s": time.perf_counter() - t0, **comparison.to_json()})
                for name, reason in comparison.unavailable.items():
                    print(f"{spec} {kind}: baseline {name} unavailable: {reason}", flush=True)
        print(equal_memory.format_table(mine, f"\n== {spec} =="), flush=True)
        rows += mine
    return rows, data


def _progress(row: Any) -> None:
    logger.info("%s vs %s under %s: %s ms vs %.2f ms", row.graph, row.baseline, row.cost_model,
                "-" if row.product_ms is None else f"{row.product_ms:.2f}", row.baseline_ms)


def main(argv: list[str] | None = None) -> int:
    from scheduler.compare import equal_memory
    from solvers.search import DEFAULT_WORK_LIMIT

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="preset:n_layers:world_size or foreign:style:n_layers:world_size")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_WORK_LIMIT,
                        help="work limit per solve, s (default: optimize_schedule's, %(default)s)")
    parser.add_argument("--solve-under", choices=equal_memory.SOLVE_UNDER, default="robust",
                        help="robust: no cost model, as users run it (default); each: under each judging model")
    parser.add_argument("--cost-models", nargs="+", default=None,
                        help="the models every graph is judged under (default: analytic and torch); a measured "
                             "table by name, e.g. table:h100/h100_dp32_tp8.csv (benchmarks/convert_autoparallel_tables.py)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs per node of the modelled cluster (1: every rank on a node of its own)")
    parser.add_argument("--baselines", nargs="+", default=None,
                        help="baselines (default: FSDP2-like, torch's scheduler, SimpleFSDP-like): a heuristic, "
                             "torch-overlap, torch-manual (the per-block plan), each optionally with the suffix "
                             "+ag-stream (its all-gathers on a second group of the same ranks)")
    parser.add_argument("--all-gather-stream", choices=("shared", "choose", "separate"), default="shared",
                        help="fsdp-sched's SolverOptions.all_gather_stream (default: shared)")
    parser.add_argument("--merge-all-reduces", action="store_true",
                        help="fsdp-sched's SolverOptions.merge_all_reduces (merged all-reduces round differently)")
    parser.add_argument("--kinds", nargs="+", choices=("forward", "backward"), default=["forward", "backward"],
                        help="the graphs compared (default: both)")
    parser.add_argument("--json", type=Path, help="also write the comparisons to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    t0 = time.perf_counter()
    rows, data = run(args.models, args.time_limit, args.solve_under,
                     tuple(args.cost_models) if args.cost_models else None, args.gpus_per_node,
                     tuple(args.baselines) if args.baselines else None, args.all_gather_stream, tuple(args.kinds),
                     args.merge_all_reduces)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    print(f"\n{equal_memory.headline(rows)}\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
