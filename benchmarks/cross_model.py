"""Cross-model regret: fsdp-sched solved under one cost model, judged under others, and the robust default.

No cost model is the machine. For every graph (forward / backward of each model):

1. budget = the FSDP2-like peak: the largest of the re-export, liveness and torch-tracker
   peaks of the FSDP2-like schedule written back (``--budget none``: no limit);
2. candidates, each written back on a copy and judged on the written graph under every model of
   the family (:func:`scheduler.costs.family.cost_model_family`: analytic and torch, each with
   bandwidths x0.7 and x1.3): fsdp-sched solved under analytic alone and under torch alone
   (``optimize_schedule(cost_model=...)``), fsdp-sched with its default (no cost model: the
   least worst-case regret over the family), and the baselines (FSDP2-, SimpleFSDP-,
   AutoParallel-like, traced, torch's overlap scheduler);
3. the regret of candidate c under model m: ``t_m(c) / min t_m - 1`` over the candidates that
   fit; prints every candidate's step under each model, its regret under analytic and torch and
   its worst regret over the family. The robust default's target: at most 2 % worst regret.

    python benchmarks/cross_model.py                       # llama3-8b at 8 layers + a foreign style
    python benchmarks/cross_model.py llama3-debug:2:4
    python benchmarks/cross_model.py llama3-8b:8:64 --budget none --json cross.json

A model is ``preset:n_layers:world_size`` or ``foreign:style:n_layers:world_size`` (a style of
``tests/foreign_models.py``, captured with plain torch.compile).
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
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from run import capture_spec  # noqa: E402  (benchmarks/run.py)

logger = logging.getLogger("benchmarks.cross_model")

DEFAULT_MODELS = ("llama3-8b:8:64", "foreign:tied:8:64")
BASE = ("analytic", "torch")
BASELINES = ("fsdp2", "simplefsdp", "autoparallel", "traced", "torch-overlap")
#: the robust default's target: at most this worst-case regret over the family
TARGET_REGRET = 0.02
#: the robust default's candidate
ROBUST = "fsdp-sched (robust default)"


def cross_case(gm: Any, *, cluster: Any, work_limit: float, budget_of: str = "fsdp2") -> dict[str, Any]:
    """Every candidate of one graph judged under the family (module docstring)."""
    from scheduler.compare.judged import judge_baseline, judge_product
    from scheduler.costs.family import cost_model_family
    from scheduler.options import SolverOptions

    family = cost_model_family(cluster)
    solver = SolverOptions(work_limit=work_limit)
    judged = {name: judge_baseline(gm, name, family, cluster=cluster) for name in BASELINES}
    budget = judged["fsdp2"].max_peak_bytes if budget_of == "fsdp2" else None
    for label, model in ((f"fsdp-sched under {m}", m) for m in BASE):
        judged[label] = judge_product(gm, budget, family, cost_model=model, cluster=cluster, solver=solver, name=label)
    judged[ROBUST] = judge_product(gm, budget, family, cluster=cluster, solver=solver, name=ROBUST)
    fitting = {n: j for n, j in judged.items() if j.ok and (budget is None or j.max_peak_bytes <= budget)}
    best = {label: min(j.step_ms(label) for j in fitting.values()) for label in family}
    rows = {}
    for name, j in judged.items():
        if not j.ok:
            rows[name] = {"error": j.error}
            continue
        regret = {label: j.step_ms(label) / best[label] - 1 for label in family}
        rows[name] = {"step_ms": {label: j.step_ms(label) for label in family}, "regret": regret,
                      "worst_regret": max(regret.values()), "fits": name in fitting, "compile_s": j.compile_s,
                      "peak_bytes": j.max_peak_bytes}
    return {"budget_bytes": budget, "labels": list(family), "rows": rows}


def run(models: list[str], work_limit: float, budget_of: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    from models.capture import fake_process_group
    from scheduler.costs.hardware import Cluster

    out = []
    for spec in models:
        t0 = time.perf_counter()
        graphs, world_size = capture_spec(spec)
        logger.info("captured %s in %.1f s", spec, time.perf_counter() - t0)
        cluster = Cluster(n_gpus=world_size, gpus_per_node=min(8, world_size))
        for kind in kinds:
            t0 = time.perf_counter()
            with fake_process_group(world_size):
                case = cross_case(getattr(graphs, kind), cluster=cluster, work_limit=work_limit,
                                  budget_of=budget_of)
            case.update(model=spec, graph=kind, time_s=time.perf_counter() - t0)
            out.append(case)
            print(_format(case), flush=True)
    return out


def _format(case: dict[str, Any]) -> str:
    from solvers.core import fmt_bytes

    budget = "none" if case["budget_bytes"] is None else f"{fmt_bytes(case['budget_bytes'])} (FSDP2-like peak)"
    labels = case["labels"]
    lines = [f"\n== {case['model']} {case['graph']}: budget {budget}, {case['time_s']:.0f} s ==",
             f"{'candidate':<30}" + "".join(f"{label:>18}" for label in labels)
             + "".join(f"{'regret ' + b:>17}" for b in BASE) + f"{'worst regret':>14}"]
    for name, r in case["rows"].items():
        if "error" in r:
            lines.append(f"{name:<30}unavailable: {r['error'][:120]}")
            continue
        mark = "" if r["fits"] else "  (over budget)"
        lines.append(f"{name:<30}" + "".join(f"{r['step_ms'][label]:18.4g}" for label in labels)
                     + "".join(f"{r['regret'][b]:17.2%}" for b in BASE) + f"{r['worst_regret']:14.2%}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from solvers.search import DEFAULT_WORK_LIMIT

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="preset:n_layers:world_size or foreign:style:n_layers:world_size")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_WORK_LIMIT,
                        help="work limit per solve, s (default: optimize_schedule's, %(default)s)")
    parser.add_argument("--budget", choices=("fsdp2", "none"), default="fsdp2",
                        help="the FSDP2-like peak (default) or no limit")
    parser.add_argument("--graph", choices=("forward", "backward", "both"), default="both",
                        help="which graphs of each model (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    kinds = ("forward", "backward") if args.graph == "both" else (args.graph,)
    cases = run(args.models, args.time_limit, args.budget, kinds)
    if args.json:
        args.json.write_text(json.dumps(cases, indent=1))
    robust = [c["rows"][ROBUST] for c in cases if "worst_regret" in c["rows"][ROBUST]]
    if robust:
        print(f"\nrobust default: worst regret {max(max(r['regret'][b] for b in BASE) for r in robust):.2%} under "
              f"analytic / torch, {max(r['worst_regret'] for r in robust):.2%} over the family "
              f"(target <= {TARGET_REGRET:.0%}; {len(robust)} of {len(cases)} graphs solved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
