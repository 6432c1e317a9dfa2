"""The argument parser of ``fsdp-sched``: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import functools
import json
import logging

from scheduler.cli.common import (
    GRAPHS,
    budget_arg,
    cost_model_arg,
    db_arg,
    out_dir_arg,
    positive_float,
    positive_int,
    world_size_arg,
)
from scheduler.cli.demo import cmd_demo
from scheduler.cli.measure import cmd_measure, mesh_arg, out_file_arg, sizes_arg
from scheduler.cli.solve import cmd_solve, cmd_trace
from scheduler.cli.sweep import DEFAULT_SWEEP_POINTS, cmd_sweep
from scheduler.costs.tables import COLLECTIVES as MEASURED_COLLECTIVES
from scheduler.costs.tables import DEFAULT_TABLE_SIZES
from solvers.search import DEFAULT_WORK_LIMIT


class _Parser(argparse.ArgumentParser):
    """One line per error, no usage dump; with ``json_errors``, the error as a JSON object on
    stdout too (``--json`` on the command line)."""

    def __init__(self, *args, json_errors: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str):
        if self.json_errors:
            print(json.dumps({"error": {"type": "ArgumentError", "message": f"{message} (see --help)"}}))
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _verbosity(p: argparse.ArgumentParser) -> None:
    """``-v`` / ``-q`` after the command too (``fsdp-sched demo -v``); given before it, they are
    not undone (SUPPRESS: absent unless given)."""
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="more logging (-v: progress, -vv: debug)")
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="warnings and errors only")


def _model_args(p: argparse.ArgumentParser, *, default_model: str | None, default_layers: int | None) -> None:
    p.add_argument("--model", default=default_model,
                   help="reference model preset: llama3-debug, llama3-8b, llama3-70b, llama3-405b"
                        + (f" (default {default_model})" if default_model else ""))
    p.add_argument("--n-layers", type=positive_int, default=default_layers,
                   help="decoder layers to trace (default %(default)s; fewer is faster)")
    p.add_argument("--world-size", type=world_size_arg, default=64,
                   help="FSDP ranks, also the cluster size for the cost model (default %(default)s, 8 per node)")
    p.add_argument("--inter-node-gbps", type=positive_float, default=None,
                   help="inter-node bus bandwidth per GPU in GB/s (default: the Cluster default, 50)")
    p.add_argument("--cost-model", type=cost_model_arg, default=None, metavar="MODEL",
                   help="how a traced model's nodes and collectives are priced: analytic (roofline + NCCL "
                        "alpha-beta), torch (torch's own roofline and NCCL estimators), "
                        "table:PATH (collective times measured: a CSV from `fsdp-sched measure` or nccl-tests "
                        "output), profile:PATH (compute times from a torch.profiler Chrome trace of one step), "
                        "or parts joined by '+' (compute:torch+table:PATH, profile:TRACE+table:PATH); open parts "
                        "are priced by the analytic model; a DAG file keeps the costs it was traced with; without it, "
                        "solve --robust judges under a family of models")


def _solve_args(p: argparse.ArgumentParser, *, budget_default: str, work_limit: float) -> None:
    p.add_argument("--solver", default="cpsat",
                   help="cpsat (default), milp, or a heuristic: traced, fsdp2, perblock, simplefsdp, autoparallel")
    p.add_argument("--budget", type=budget_arg, default=budget_default,
                   help="peak-memory budget: a size such as 40GiB or 512MB, 'auto' (0.9 x the FSDP2-like "
                        "peak, at least the smallest baseline peak), a multiple of that peak such as 0.8x, or 'none' (default %(default)s)")
    p.add_argument("--work-limit", "--time-limit", dest="work_limit", type=positive_float, default=work_limit,
                   help="work limit of the search per graph, in work units: deterministic work, not wall "
                        "time, so every rank finds the same schedule (SolverOptions.work_limit; default %(default)s; "
                        "--time-limit is its old name)")


def build_parser(*, json_errors: bool = False) -> argparse.ArgumentParser:
    """The parser; ``json_errors``: a bad argument is also printed as a JSON error object."""
    parser = _Parser(prog="fsdp-sched", description="Solver-based scheduling of FSDP collectives under a memory budget.",
                     json_errors=json_errors)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v: debug; for demo: -v progress, -vv debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.set_defaults(log_level=logging.INFO)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=functools.partial(_Parser, json_errors=json_errors))

    p = sub.add_parser("demo", help="fsdp-sched against FSDP2-like, torch's scheduler and SimpleFSDP-like",
                       description="Trace a reference model's FSDP step on a fake process group, write each "
                                   "baseline back, run fsdp-sched at each baseline's peak memory and print the "
                                   "comparison on the written graphs (about a minute at the defaults).")
    p.add_argument("--model", default="llama3-8b", help="reference model preset (default %(default)s)")
    p.add_argument("--n-layers", type=positive_int, default=8, help="decoder layers to trace (default %(default)s)")
    p.add_argument("--world-size", type=world_size_arg, default=64,
                   help="FSDP ranks, 8 per node (default %(default)s)")
    p.add_argument("--work-limit", "--time-limit", dest="work_limit", type=positive_float, default=DEFAULT_WORK_LIMIT,
                   help="fsdp-sched's work limit per solve, in work units: deterministic work, not wall time "
                        "(SolverOptions.work_limit; default %(default)s; --time-limit is its old name)")
    p.add_argument("--out", type=out_dir_arg, default="fsdp-sched-out", help="output directory (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the tables")
    _verbosity(p)
    p.set_defaults(func=cmd_demo, log_level=logging.WARNING)

    p = sub.add_parser("trace", help="trace a model into DAG JSON files",
                       description="Capture a reference model's FSDP forward / backward graphs and save them as "
                                   "cost-annotated DAG JSON (input of solve and sweep).")
    _model_args(p, default_model="llama3-8b", default_layers=8)
    p.add_argument("--graph", choices=("forward", "backward", "both"), default="both",
                   help="which graph to save (default %(default)s)")
    p.add_argument("--out", type=out_dir_arg, default="fsdp-sched-out", help="output directory (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the written paths as JSON")
    p.set_defaults(func=cmd_trace)

    for name, helptext in (("solve", "solve one graph: schedule, report, Chrome trace, Gantt chart"),
                           ("sweep", "solve one graph for many budgets: table and Pareto plot")):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("dag", nargs="?", help="DAG JSON file from `fsdp-sched trace` (or use --model)")
        _model_args(p, default_model=None, default_layers=8)
        p.add_argument("--graph", choices=GRAPHS, default="backward",
                       help="with --model: the graph to solve (default %(default)s)")
        p.add_argument("--out", type=out_dir_arg, default="fsdp-sched-out", help="output directory (default %(default)s)")
        p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
        if name == "solve":
            _solve_args(p, budget_default="none", work_limit=DEFAULT_WORK_LIMIT)
            p.add_argument("--robust", action="store_true",
                           help="with --model: optimize_schedule on the traced graph without a cost model, as "
                                "the library does by default: the schedule with the least worst-case regret over "
                                "analytic and torch cost models with bandwidths +-30 %%, written back and judged "
                                "on the written graph (without it, the DAG exported under --cost-model is solved "
                                "under that model alone)")
            p.set_defaults(func=cmd_solve)
        else:
            p.add_argument("--solver", default="cpsat", help="solver to sweep (default %(default)s)")
            p.add_argument("--budgets", type=budget_arg, nargs="+", default=None,
                           help="budgets: sizes (40GiB) or multiples of the FSDP2-like peak (0.8x) (default: "
                                f"{DEFAULT_SWEEP_POINTS} budgets from the smallest peak any schedule of the search "
                                "reaches to the larger of the traced peak and that of the schedule solved without "
                                "a budget, evenly spaced)")
            p.add_argument("--work-limit", "--time-limit", dest="work_limit", type=positive_float,
                           default=DEFAULT_WORK_LIMIT,
                           help="work limit of the search per point, in work units: deterministic work, not "
                                "wall time (default %(default)s; --time-limit is its old name)")
            p.add_argument("--workers", type=positive_int, default=1,
                           help="solve points in N local processes (default 1: sequential)")
            p.add_argument("--address", default=None, metavar="URL",
                           help="solve the points on an existing cluster: a Dask scheduler (tcp://HOST:PORT, "
                                "needs dask[distributed]) or a Ray cluster (ray://HOST:PORT, needs ray); the "
                                "workers need fsdp-sched installed")
            p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                           help="show progress on stderr: a tqdm bar if tqdm is installed and stderr is a "
                                "terminal, else one line per point (default: on)")
            p.add_argument("--db", type=db_arg, default=None,
                           help="SQLite results file; finished points are skipped on rerun (default OUT/sweep.sqlite)")
            p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("measure", help="time the collectives on this job's process group and write a table",
                       description="Time all-gather, reduce-scatter, all-reduce and all-to-all on the process "
                                   "group this command runs on (launch it on every rank, e.g. with torchrun) at "
                                   "a range of sizes, and write a CSV (collective,group_size,nodes,input_bytes,ms) "
                                   "that --cost-model table:PATH reads.")
    p.add_argument("--out", type=out_file_arg, default="collectives.csv", help="CSV file to write (default %(default)s)")
    p.add_argument("--sizes", type=sizes_arg, default=DEFAULT_TABLE_SIZES, metavar="SIZES",
                   help="per-rank input sizes, comma-separated (default 4KiB,16KiB,...,64MiB: powers of 4)")
    p.add_argument("--collectives", type=_collectives_arg, default=MEASURED_COLLECTIVES, metavar="NAMES",
                   help=f"comma-separated, of {','.join(MEASURED_COLLECTIVES)} (default: all)")
    p.add_argument("--mesh", type=mesh_arg, default=None, metavar="AxB",
                   help="the job's device mesh (8x8: dp 8 x tp 8): measure this rank's group along every "
                        "dimension instead of the whole group")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed samples per size (median; default %(default)s)")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed samples per size (default %(default)s)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process group backend when none is initialised (default: nccl with CUDA, else gloo)")
    p.add_argument("--json", action="store_true",
                   help="print the table's rows and the noisy ones as JSON (rank 0) instead of the CSV")
    p.set_defaults(func=cmd_measure)
    return parser


def _collectives_arg(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in MEASURED_COLLECTIVES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown collective(s) {bad or text!r}; choose from {', '.join(MEASURED_COLLECTIVES)}")
    return names
