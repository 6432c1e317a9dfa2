"""``fsdp-sched trace`` (model -> DAG JSON files) and ``fsdp-sched solve`` (DAG JSON or a model
-> schedule, report, Chrome trace, Gantt chart)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from scheduler.api import solve_dag
from scheduler.cli.common import (
    GRAPHS,
    CliError,
    fmt_bytes,
    heuristic_sim,
    input_dag,
    resolve_budget,
    trace_model,
    write_pictures,
)
from scheduler.dag import save_dag
from solvers.core import InfeasibleBudgetError, Problem, simulate
from solvers.registry import available_solvers

logger = logging.getLogger(__name__)


def cmd_trace(args: argparse.Namespace) -> int:
    graphs = GRAPHS if args.graph == "both" else (args.graph,)
    dags, _ = trace_model(args, graphs)
    out = Path(args.out)
    paths = {}
    for g, dag in dags.items():
        path = out / f"{args.model}-{g}.dag.json"
        save_dag(dag, path)
        paths[g] = str(path)
        logger.info("wrote %s (%d nodes)", path, dag.number_of_nodes())
    if args.json:
        print(json.dumps(paths))
    else:
        for g, p in paths.items():
            print(f"{g}: {p}")
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    if args.solver not in available_solvers():
        raise CliError(f"unknown solver {args.solver!r}; choose one of {', '.join(available_solvers())}")
    dag = input_dag(args)
    problem = Problem.from_dag(dag)
    budget = args.budget
    if isinstance(budget, str) and budget != "none":
        fsdp2, _ = heuristic_sim(problem, "fsdp2")
        traced, _ = heuristic_sim(problem, "traced")
        budget = resolve_budget(budget, fsdp2.peak_bytes, min(fsdp2.peak_bytes, traced.peak_bytes))
    else:
        budget = resolve_budget(budget, 0)
    logger.info("solving %s with %s, budget %s, limit %g s", dag.graph.get("name"), args.solver,
                fmt_bytes(budget), args.time_limit)
    try:
        schedule, report = solve_dag(dag, budget, solver=args.solver, time_limit_s=args.time_limit)
    except InfeasibleBudgetError as e:
        raise CliError(f"budget {fmt_bytes(budget)} cannot be met: {e}") from None
    sim = simulate(dag, schedule, problem=problem)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = str(dag.graph.get("name", "graph"))
    (out / f"{stem}_schedule.json").write_text(json.dumps(schedule.to_json()))
    (out / f"{stem}_report.json").write_text(json.dumps(report.to_json(), indent=1))
    files = [out / f"{stem}_schedule.json", out / f"{stem}_report.json",
             *write_pictures(sim, problem, out, stem, budget)]
    if args.json:
        print(json.dumps({"report": report.to_json(), "sim": sim.summary(), "files": [str(f) for f in files]}))
    else:
        print(report)
        print("wrote " + ", ".join(str(f) for f in files))
    return 0
