"""``fsdp-sched demo``: trace a reference model, compare every baseline with fsdp-sched under a
memory budget, print a table per graph and write pictures and Chrome traces; then the headline:
fsdp-sched at each baseline's peak against that baseline, judged on the rewritten graphs under
both cost models (:mod:`scheduler.equal_memory`), with a Pareto picture per graph and model."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from scheduler.api import solve_dag
from scheduler.cli.common import (
    GRAPHS,
    CliError,
    cluster_of,
    ensure_out_dir,
    fmt_bytes,
    format_table,
    heuristic_sim,
    resolve_budget,
    row,
    trace_model,
    write_pictures,
)
from solvers.core import InfeasibleBudgetError, Problem, simulate
from solvers.heuristics import HEURISTICS
from solvers.registry import available_solvers

logger = logging.getLogger(__name__)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.solver not in available_solvers():  # before the model is traced, which is slow
        raise CliError(f"unknown solver {args.solver!r}; choose one of {', '.join(available_solvers())}")
    out = ensure_out_dir(Path(args.out))
    dags, captured = trace_model(args)
    summary: dict[str, Any] = {}
    for g in GRAPHS:
        dag = dags[g]
        problem = Problem.from_dag(dag)
        rows, sims = [], {}
        for name in HEURISTICS:
            logger.info("%s: simulating %s", g, name)
            t0 = time.perf_counter()
            try:
                sim, res = heuristic_sim(problem, name)
            except Exception as e:  # one failing baseline must not hide the others
                rows.append(row(name, note=f"unavailable: {type(e).__name__}: {e}"))
                continue
            sims[name] = sim
            rows.append(row(name, sim, solve_s=None if res is None else time.perf_counter() - t0))
        fsdp2_peak = sims["fsdp2"].peak_bytes if "fsdp2" in sims else sims["traced"].peak_bytes
        budget = resolve_budget(args.budget, fsdp2_peak, min(s.peak_bytes for s in sims.values()))
        for r in rows:
            if "step_ms" in r and budget is not None:
                r["fits_budget"] = r["peak_bytes"] <= budget
        logger.info("%s: running torch's overlap scheduler", g)
        try:
            from scheduler.baselines import simulate_torch_baseline  # imports torch's inductor

            t0 = time.perf_counter()
            tsim = simulate_torch_baseline(getattr(captured, g), cost_model=args.cost_model, cluster=cluster_of(args))
            rows.append(row("torch", tsim, solve_s=time.perf_counter() - t0, budget=budget))
            sims["torch"] = tsim
        except Exception as e:
            rows.append(row("torch", note=f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        logger.info("%s: solving with %s under budget %s (limit %g s)", g, args.solver, fmt_bytes(budget), args.time_limit)
        try:
            schedule, report = solve_dag(dag, budget, solver=args.solver, time_limit_s=args.time_limit)
            sim = simulate(dag, schedule, problem=problem)
            note = f"fell back to {report.solver}" if report.fell_back else report.status
            rows.append(row("fsdp-sched", sim, solve_s=report.solve_time_s, gap=report.gap, budget=budget, note=note))
            written = write_pictures(sim, problem, out, g, budget)
            summary[g] = {"budget_bytes": budget, "rows": rows, "report": report.to_json(),
                          "files": [str(p) for p in written]}
        except InfeasibleBudgetError as e:
            rows.append(row("fsdp-sched", note=f"infeasible: {e}"))
            summary[g] = {"budget_bytes": budget, "rows": rows, "files": []}
            if "traced" in sims:
                write_pictures(sims["traced"], problem, out, f"{g}_traced", budget)
        if args.json:
            continue
        print()
        print(format_table(rows, f"== {g} graph: {args.model}, {args.n_layers or 'all'} layers, "
                                 f"{args.world_size} ranks, budget {fmt_bytes(budget)} =="))
    summary["equal_memory"], text = _equal_memory(args, captured, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print(text)
        print(f"\npictures, Chrome traces (open in https://ui.perfetto.dev) and summary.json in {out}/")
    return 0


def _equal_memory(args: argparse.Namespace, captured: Any, out: Path) -> tuple[dict[str, Any], str]:
    """The headline: fsdp-sched at each baseline's peak against it, on the rewritten graphs,
    under both cost models; Pareto pictures; (JSON summary, printed text)."""
    from models.capture import fake_process_group
    from scheduler import equal_memory

    rows, data = [], {}
    with fake_process_group(args.world_size):
        for g in GRAPHS:
            logger.info("%s: equal-memory comparison with each baseline (limit %g s per solve)", g, args.time_limit)
            comparison = equal_memory.compare(getattr(captured, g), graph=g, cluster=cluster_of(args),
                                              time_limit_s=args.time_limit)
            rows += comparison.rows
            data[g] = comparison.to_json()
            data[g]["files"] = [str(equal_memory.plot(comparison, m, out / f"{g}_{m}_equal_memory.png"))
                                for m in equal_memory.COST_MODELS]
            for name, reason in comparison.unavailable.items():
                logger.warning("%s: baseline %s unavailable at equal memory: %s", g, name, reason)
    title = (f"\n== headline: fsdp-sched at equal memory with each baseline ({args.model}, {args.n_layers or 'all'} "
             "layers; budget = the baseline's peak; both judged on the rewritten graph) ==")
    return data, f"{equal_memory.format_table(rows, title)}\n\n{equal_memory.headline(rows)}"
