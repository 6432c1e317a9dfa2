"""The ``fsdp-sched`` command line: demo, trace, solve, sweep, measure.

- ``fsdp-sched demo`` (:mod:`scheduler.cli.demo`): fsdp-sched against FSDP2-like, torch's
  scheduler and SimpleFSDP-like at each one's peak memory (:mod:`scheduler.compare`).
- ``fsdp-sched trace`` / ``solve`` (:mod:`scheduler.cli.solve`): model -> DAG JSON files; DAG
  JSON (or a model) -> schedule, report, Chrome trace, Gantt chart.
- ``fsdp-sched sweep`` (:mod:`scheduler.cli.sweep`): a list of budgets -> table and Pareto plot.
- ``fsdp-sched measure`` (:mod:`scheduler.cli.measure`): the collectives of this job's process
  group timed -> a table for ``--cost-model table:PATH``.

Sizes are read and written human-readably ("40GiB", "512MB"), times in ms. A bad argument or
file ends with one line ``fsdp-sched: error: ...`` and exit status 2; with ``--json``, the error
is also printed on stdout as ``{"error": {"type": ..., "message": ...}}`` (exit status 2 for a
user error, 1 for any other failure).
"""

from __future__ import annotations

import json
import logging
import sys
import traceback

from scheduler.cli.common import CliError, budget_arg, infeasible_budget, resolve_budget
from scheduler.cli.parser import build_parser
from solvers.core import InfeasibleBudgetError

__all__ = ["budget_arg", "build_parser", "main", "resolve_budget"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``fsdp-sched`` command line; returns the exit status (0 ok, 2 user error, 1 any
    other failure under ``--json``; without it, such a failure raises with its traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    parser = build_parser(json_errors=as_json)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    level = logging.WARNING if args.quiet else max(logging.DEBUG, args.log_level - 10 * args.verbose)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.func(args)
    except CliError as e:
        return _failed(e.kind, str(e), 2, as_json)
    except InfeasibleBudgetError as e:  # a command that did not say which of its flags is the budget
        return _failed(type(e).__name__, str(infeasible_budget(e)), 2, as_json)
    except (ValueError, TypeError) as e:
        if args.verbose and not as_json:
            raise
        return _failed(type(e).__name__, str(e).splitlines()[0] if str(e) else type(e).__name__, 2, as_json)
    except KeyboardInterrupt:
        print("fsdp-sched: interrupted", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": {"type": "KeyboardInterrupt", "message": "interrupted"}}))
        return 130
    except Exception as e:
        if not as_json:
            raise
        if args.verbose:
            traceback.print_exc()
        return _failed(type(e).__name__, str(e) or type(e).__name__, 1, as_json)


def _failed(kind: str, message: str, status: int, as_json: bool) -> int:
    """The error on stderr, in one line; on stdout as a JSON object too with ``--json``."""
    print(f"fsdp-sched: error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": {"type": kind, "message": message}}))
    return status
