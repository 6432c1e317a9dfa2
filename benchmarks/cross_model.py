"""Cross-model regret: solve under one cost model, judge under another, and the robust choice.

For every graph (forward / backward of each model):

1. budget = the FSDP2-like peak: the largest of the re-export, liveness and torch-tracker
   peaks of the FSDP2-like schedule written back (``--budget none``: no limit);
2. :func:`scheduler.rewritten.robust_schedule` at that budget: fsdp-sched solved under A
   (``optimize_schedule(cost_model=A)``) for A in {analytic, torch}, and the baselines
   (FSDP2-, SimpleFSDP-, AutoParallel-like, traced, torch's overlap scheduler), each written
   back and judged on its rewritten graph under every model of the family (analytic and torch,
   each with bandwidths x0.7 and x1.3);
3. prints, for A, B in {analytic, torch}: the step time under B of the graph solved under A and
   its regret against the best rewritten graph under B that fits; then the regret of the robust
   choice under each base model and its worst case over the whole family.

    python benchmarks/cross_model.py                       # llama3-8b at 8 layers + a foreign style
    python benchmarks/cross_model.py llama3-debug:2:4 --time-limit 3
    python benchmarks/cross_model.py --json cross.json
    python benchmarks/cross_model.py llama3-8b:8:64 --budget none   # where the models disagree most
    python benchmarks/cross_model.py llama3-8b:8:64 --budget none --solve-under family
    python benchmarks/cross_model.py llama3-8b:32:64 --time-limit 10 --graph forward --anatomy

``--anatomy`` also prints where the step time goes (:func:`solvers.minimax.anatomy`) for the
robust choice, the best candidate under each model of the family and FSDP2-like: compute,
exposed waits (the first of them apart), the communication stream's busy time; and what each
model charges for one bucket of 1 to 8 whole blocks (:func:`solvers.minimax.block_bucket_ms`).

A model is ``preset:n_layers:world_size`` or ``foreign:style:n_layers:world_size`` (a style of
``tests/foreign_models.py``, captured with plain torch.compile).
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
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from run import capture_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("llama3-8b:8:64", "foreign:tied:8:64")
BASE = ("analytic", "torch")
#: the robust choice's target (issue 13): at most this regret
TARGET_REGRET = 0.02


def cross_rows(gm: Any, *, cluster: Any, time_limit_s: float, budget_of: str = "fsdp2",
               solve_under: str = "base", with_anatomy: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The A x B rows and the robust row of one graph (module docstring); ``budget_of``:
    ``"fsdp2"`` (the FSDP2-like peak) or ``"none"``; ``solve_under``: ``"base"`` (one solve
    under each of analytic and torch) or ``"family"`` (one under each of the six models);
    ``with_anatomy``: the robust row also carries :func:`anatomy_of`."""
    from scheduler.rewritten import rewrite_baseline, robust_schedule
    from scheduler.robust import cost_model_family
    from scheduler.verify import judge_graph

    budget = None
    if budget_of == "fsdp2":
        budget = judge_graph(rewrite_baseline(gm, "fsdp2", cluster=cluster), cluster=cluster).max_peak_bytes
    labels = BASE if solve_under == "base" else tuple(cost_model_family(cluster))
    result = robust_schedule(gm, budget, cluster=cluster, time_limit_s=time_limit_s, solve_under=labels)
    times = result.step_ms_by_model()
    rows = []
    for solved, a in result.solved_under.items():
        for b in BASE:
            fits = solved in result.fitting
            best = min(times[b].values())
            step = result.judged[solved].figures.step_ms[b]
            rows.append({"candidate": solved, "solved_under": a, "judged_under": b, "step_ms": step, "best_ms": best,
                         "best": min(times[b], key=times[b].get), "regret": step / best - 1 if fits else None,
                         "fits": fits})
    worst = result.worst_regret()
    robust = {"chosen": result.chosen, "budget_bytes": budget, "worst_regret_family": worst[result.chosen],
              "regret": {b: times[b][result.chosen] / min(times[b].values()) - 1 for b in BASE},
              "dropped": result.dropped, "time_s": result.time_s, "table": result.table()}
    if with_anatomy:
        robust["anatomy"] = anatomy_of(gm, result, cluster=cluster)
    return rows, robust


def anatomy_of(gm: Any, result: Any, *, cluster: Any) -> dict[str, Any]:
    """Where the step time goes under each model of the family (:func:`solvers.minimax.anatomy`,
    simulated on the traced graph's problems) for the robust choice, the best fitting candidate
    under each model and FSDP2-like, and each model's price of a bucket of 1 to 8 whole blocks."""
    from scheduler.dag import export_dag
    from scheduler.robust import cost_model_family
    from solvers.core.problem import Problem
    from solvers.minimax import anatomy, block_bucket_ms

    family = cost_model_family(cluster)
    problems = {label: Problem.from_dag(export_dag(gm, cost_model=m, cluster=cluster)) for label, m in family.items()}
    times = result.step_ms_by_model()
    names = [result.chosen, *(min(sorted(t), key=t.get) for t in times.values()), "fsdp2"]
    schedules = {n: result.judged[n].schedule for n in dict.fromkeys(names)
                 if n in result.fitting and result.judged[n].schedule is not None}
    table = anatomy(problems, schedules)
    return {"rows": {n: {label: dataclasses.asdict(a) for label, a in row.items()} for n, row in table.items()},
            "block_bucket_ms": block_bucket_ms(problems)}


def run(models: list[str], time_limit_s: float, budget_of: str = "fsdp2",
        solve_under: str = "base", kinds: tuple[str, ...] = ("forward", "backward"),
        with_anatomy: bool = False) -> list[dict[str, Any]]:
    from models.capture import fake_process_group
    from scheduler.costs import Cluster

    out = []
    for spec in models:
        t0 = time.perf_counter()
        graphs, world_size = capture_spec(spec)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        cluster = Cluster(n_gpus=world_size)
        for kind in kinds:
            t0 = time.perf_counter()
            with fake_process_group(world_size):
                rows, robust = cross_rows(getattr(graphs, kind), cluster=cluster, time_limit_s=time_limit_s,
                                          budget_of=budget_of, solve_under=solve_under, with_anatomy=with_anatomy)
            case = {"model": spec, "graph": kind, "rows": rows, "robust": robust, "time_s": time.perf_counter() - t0}
            out.append(case)
            print(_format(case), flush=True)
    return out


def _format(case: dict[str, Any]) -> str:
    from solvers.core import fmt_bytes

    r = case["robust"]
    budget = "none" if r["budget_bytes"] is None else f"{fmt_bytes(r['budget_bytes'])} (FSDP2-like peak)"
    lines = [f"\n== {case['model']} {case['graph']}: budget {budget}, "
             f"{case['time_s']:.0f} s ==",
             f"{'candidate':<36}{'solved under':<14}{'judged under':<14}{'step ms':>10}{'best ms':>10}  "
             f"{'best':<36}{'regret':>8}"]
    for row in case["rows"]:
        regret = "over budget" if row["regret"] is None else f"{row['regret']:.2%}"
        lines.append(f"{row['candidate']:<36}{row['solved_under']:<14}{row['judged_under']:<14}{row['step_ms']:10.2f}"
                     f"{row['best_ms']:10.2f}  {row['best']:<36}{regret:>8}")
    per = ", ".join(f"{b} {v:.2%}" for b, v in r["regret"].items())
    lines.append(f"robust choice: {r['chosen']}: regret {per}; worst over the family {r['worst_regret_family']:.2%}")
    lines += [f"  dropped {k}: {v[:160]}" for k, v in r["dropped"].items()]
    lines.append(r["table"])
    if "anatomy" in r:
        lines += _format_anatomy(r["anatomy"])
    return "\n".join(lines)


def _format_anatomy(a: dict[str, Any]) -> list[str]:
    lines = ["where the step goes (ms): step = compute + exposed waits (the first of them); comm = the "
             "communication stream's busy time",
             f"{'candidate':<36}{'model':<18}{'step':>9}{'compute':>9}{'exposed':>9}{'first':>8}{'comm':>9}"
             f"{'buckets':>9}"]
    for name, row in a["rows"].items():
        for label, x in row.items():
            lines.append(f"{name:<36}{label:<18}{x['step_ms']:9.4g}{x['compute_ms']:9.4g}{x['exposed_ms']:9.4g}"
                         f"{x['first_exposed_ms']:8.4g}{x['comm_busy_ms']:9.4g}{x['buckets']:9d}")
    lines.append("one bucket of k whole blocks (ms), k = 1, 2, ...:")
    lines += [f"  {label:<18}" + " ".join(f"{t:7.4g}" for t in ts) for label, ts in a["block_bucket_ms"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="preset:n_layers:world_size or foreign:style:n_layers:world_size")
    parser.add_argument("--time-limit", type=float, default=15.0, help="seconds per solve (default %(default)s)")
    parser.add_argument("--budget", choices=("fsdp2", "none"), default="fsdp2",
                        help="the FSDP2-like peak (default) or no limit")
    parser.add_argument("--solve-under", choices=("base", "family"), default="base",
                        help="solve under analytic and torch (default), or under all six models of the "
                             "family (three times the solves: candidates good at the bandwidth extremes)")
    parser.add_argument("--graph", choices=("forward", "backward", "both"), default="both",
                        help="which graphs of each model (default %(default)s)")
    parser.add_argument("--anatomy", action="store_true",
                        help="also print where the step time goes under each model (module docstring)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    kinds = ("forward", "backward") if args.graph == "both" else (args.graph,)
    cases = run(args.models, args.time_limit, args.budget, args.solve_under, kinds, args.anatomy)
    if args.json:
        args.json.write_text(json.dumps(cases, indent=1))
    worst = max(c["robust"]["worst_regret_family"] for c in cases)
    worst_base = max(max(c["robust"]["regret"].values()) for c in cases)
    print(f"\nrobust choice: worst regret {worst_base:.2%} under analytic / torch, {worst:.2%} over the family "
          f"(target <= {TARGET_REGRET:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
