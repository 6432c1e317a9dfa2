"""The ``fsdp-sched`` command line: trace, solve, sweep.

- ``fsdp-sched trace`` / ``solve`` (:mod:`scheduler.cli.solve`): model -> DAG JSON files; DAG
  JSON (or a model) -> schedule, report, Chrome trace, Gantt chart.
- ``fsdp-sched sweep`` (:mod:`scheduler.cli.sweep`): a list of budgets -> table and Pareto plot.

The comparison with the baselines (the demo) is the evaluation harness's, outside the library:
``python benchmarks/demo.py``.

Sizes are read and written human-readably ("40GiB", "512MB"), times in ms. A bad argument or
file ends with one line ``fsdp-sched: error: ...`` and exit status 2.
"""

from __future__ import annotations

import logging
import sys

from scheduler.cli.common import CliError, budget_arg, resolve_budget
from scheduler.cli.parser import build_parser

__all__ = ["budget_arg", "build_parser", "main", "resolve_budget"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``fsdp-sched`` command line; returns the exit status (0 ok, 2 user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.func(args)
    except CliError as e:
        print(f"fsdp-sched: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        if args.verbose:
            raise
        print(f"fsdp-sched: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdp-sched: interrupted", file=sys.stderr)
        return 130

