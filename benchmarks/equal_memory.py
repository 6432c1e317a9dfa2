"""Equal memory against each baseline: fsdp-sched at peak(B) vs B, on the rewritten graphs.

For every graph (forward / backward of each model), each baseline B (FSDP2-like, torch 2.13's
overlap scheduler, SimpleFSDP-like) and each cost model (analytic, torch):
``scheduler.equal_memory.compare`` writes B back and judges it (peak(B) = the largest of the
re-export, liveness and torch-tracker peaks), runs ``optimize_schedule`` on a copy at
``mem_budget = peak(B)`` under that cost model, and judges its rewritten graph the same way.
Prints one table per model (speedup vs B and vs the best baseline that fits) and the headline
(geometric means; issue 13's target: never slower than B, at least x1.10 vs the best baseline
that fits).

    python benchmarks/equal_memory.py                          # llama3-8b at 8 layers, 64 ranks
    python benchmarks/equal_memory.py llama3-8b:32:64 --time-limit 10
    python benchmarks/equal_memory.py llama3-debug:2:4 --time-limit 2 --json eq.json
    python benchmarks/equal_memory.py foreign:tied:8:64 foreign:moe:8:64 --time-limit 5

A model is ``preset:n_layers:world_size`` or ``foreign:style:n_layers:world_size`` (a style of
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

from run import capture_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("llama3-8b:8:64",)


def run(models: list[str], time_limit_s: float) -> tuple[list[Any], list[dict[str, Any]]]:
    """All rows, and the JSON of every comparison."""
    from models.capture import fake_process_group
    from scheduler import equal_memory
    from scheduler.costs import Cluster

    rows, data = [], []
    for spec in models:
        t0 = time.perf_counter()
        graphs, world_size = capture_spec(spec)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        mine = []
        for kind in ("forward", "backward"):
            t0 = time.perf_counter()
            with fake_process_group(world_size):
                comparison = equal_memory.compare(getattr(graphs, kind), graph=kind,
                                                  cluster=Cluster(n_gpus=world_size), time_limit_s=time_limit_s,
                                                  on_row=_progress)
            mine += comparison.rows
            data.append({"model": spec, "time_s": time.perf_counter() - t0, **comparison.to_json()})
            for name, reason in comparison.unavailable.items():
                print(f"{spec} {kind}: baseline {name} unavailable: {reason}", flush=True)
        print(equal_memory.format_table(mine, f"\n== {spec} =="), flush=True)
        rows += mine
    return rows, data


def _progress(row: Any) -> None:
    logger.info("%s vs %s under %s: %s ms vs %.2f ms", row.graph, row.baseline, row.cost_model, row.product_ms,
                row.baseline_ms)


def main(argv: list[str] | None = None) -> int:
    from scheduler import equal_memory

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="preset:n_layers:world_size or foreign:style:n_layers:world_size")
    parser.add_argument("--time-limit", type=float, default=15.0, help="seconds per solve (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the comparisons to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    t0 = time.perf_counter()
    rows, data = run(args.models, args.time_limit)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    print(f"\n{equal_memory.headline(rows)}\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
