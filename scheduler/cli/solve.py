"""``fsdp-sched trace`` (model -> DAG JSON files) and ``fsdp-sched solve`` (DAG JSON or a model
-> schedule, report, Chrome trace, Gantt chart).

``solve`` on a DAG (a file, or ``--model`` exported under ``--cost-model``) is
:func:`scheduler.solve_dag`: the DAG's own cost model decides. ``solve --model ... --robust`` is
:func:`scheduler.optimize_schedule` on the traced graph without a cost model: the robust
default, chosen on the written graph. ``--solver`` and ``--work-limit`` are
:class:`scheduler.SolverOptions`' ``solver`` and ``work_limit``."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from scheduler.api import REPORT_KEY, SCHEDULE_KEY, optimize_schedule
from scheduler.solving import solve_dag
from scheduler.cli.common import (
    GRAPHS,
    CliError,
    cluster_of,
    ensure_out_dir,
    fmt_bytes,
    heuristic_sim,
    infeasible_budget,
    input_dag,
    resolve_budget,
    trace_model,
    write_pictures,
)
from scheduler.export.dagfile import save_dag
from scheduler.options import AgreementOptions, SolverOptions
from solvers.core import InfeasibleBudgetError, Problem, simulate
from solvers.core.order import problem_of
from solvers.registry import available_solvers

logger = logging.getLogger(__name__)


def cmd_trace(args: argparse.Namespace) -> int:
    graphs = GRAPHS if args.graph == "both" else (args.graph,)
    dags, _ = trace_model(args, graphs)
    out = ensure_out_dir(Path(args.out))
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
    if args.robust and not args.model:
        raise CliError("--robust judges the written graph under several cost models: it needs --model (a DAG "
                       "file has no graph to write back)")
    if args.robust and args.cost_model:
        raise CliError("--robust judges under a family of cost models; --cost-model picks one: give one of them")
    dag, captured = (input_dag(args), None) if not args.robust else _traced(args)
    problem = Problem.from_dag(dag)
    budget = _budget(args.budget, problem)
    solver = SolverOptions(solver=args.solver, work_limit=args.work_limit)
    logger.info("solving %s with %s, budget %s, a work limit of %g work units%s", dag.graph.get("name"), args.solver,
                fmt_bytes(budget), args.work_limit, ", robust" if args.robust else "")
    out = ensure_out_dir(Path(args.out))
    stem = str(dag.graph.get("name", "graph"))
    if args.robust:
        schedule, report = _solve_robust(args, getattr(captured, args.graph), budget, solver)
        schedule = schedule or problem.traced_schedule()  # None: nothing was written
    else:
        try:
            schedule, report = solve_dag(dag, budget, solver=solver)
        except InfeasibleBudgetError as e:
            raise infeasible_budget(e) from None
    problem = problem_of(problem, schedule)  # the installed schedule may run compute in torch's order
    sim = simulate(problem.dag, schedule, problem=problem)
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


def _budget(arg, problem: Problem) -> int | None:
    """The budget in bytes: a size, none, or relative to the FSDP2-like peak in the model."""
    if isinstance(arg, str) and arg != "none":
        fsdp2, _ = heuristic_sim(problem, "fsdp2")
        traced, _ = heuristic_sim(problem, "traced")
        return resolve_budget(arg, fsdp2.peak_bytes, min(fsdp2.peak_bytes, traced.peak_bytes))
    return resolve_budget(arg, 0)


def _traced(args: argparse.Namespace):
    """(DAG of ``args.graph``, the captured graphs) of ``--model``."""
    dags, captured = trace_model(args, (args.graph,))
    return dags[args.graph], captured


def _solve_robust(args: argparse.Namespace, gm, budget: int | None, solver: SolverOptions):
    """``optimize_schedule`` on ``gm`` without a cost model (this process alone, on a fake
    process group): the schedule installed, over the traced graph (None when nothing was
    written), and its report."""
    from models.capture import fake_process_group  # torch and the models only for commands that trace

    with fake_process_group(args.world_size):
        try:
            optimize_schedule(gm, budget, cluster=cluster_of(args), solver=solver,
                              agreement=AgreementOptions(enabled=False))
        except InfeasibleBudgetError as e:
            raise infeasible_budget(e) from None
    return gm.meta[SCHEDULE_KEY], gm.meta[REPORT_KEY]
