"""Fuzz the whole pass: random programs with functional collectives, random arguments.

Each case is drawn from one seed (its reproducer: ``--start SEED --cases 1``):

- a program of :mod:`random_programs` (``tests/random_programs.py``: all-gathers of parameter
  shards, reduce-scatters and all-reduces, collectives waited several times and far apart,
  all_gather -> wait -> all_reduce chains, zero-size collectives, waits on graph inputs,
  multi-output ops with unread results), traced with make_fx on a gloo group of one rank (the
  collectives are identities there, so results compare bitwise);
- a solver or heuristic run on its DAG directly (``solvers.solve``, with or without a budget);
- an argument combination for :func:`scheduler.optimize_schedule`: a budget (none, a fraction
  of the program's own peak from 0.3 to 1.3, as bytes or a string), a solver, a time limit, a
  payload order, control deps, fallback, a seed; about one case in five replaces one
  argument by a bad value (the ones users tried: ``payload_order="foo"``, ``work_limit`` of
  0, -1, NaN, inf, ``"5"`` or None, ``seed="x"``, a budget of ``2**63``, ``"1e400 GiB"``,
  ``"abc"`` or 0, ...).

A case passes when:

- the direct solve returns a schedule the validator accepts within its budget, or raises
  ``InfeasibleBudgetError``;
- a bad argument raises ``TypeError`` or ``ValueError`` naming it, and the graph's code is
  unchanged;
- otherwise optimize_schedule returns a graph that holds the budget by the liveness count and
  torch's MemoryTracker (for ``control_deps=True``: the same choice written without control
  dependencies, which neither count reads through) and computes the traced graph's results
  bitwise, or raises
  ``InfeasibleBudgetError`` only for a budget below the graph's own peak (the larger of the
  two counts of its traced order), stating a smallest peak no larger than that, at which a
  second call succeeds (``ScheduleError`` is allowed with ``fallback=False`` only).

Anything else is a crash, printed with its seed. Usage (niced, it takes a while on 2 cores)::

    nice -n 10 python benchmarks/fuzz.py --cases 10000 --out fuzz.jsonl

Exit status 1 when a case crashed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import logging
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import random_programs as rp  # noqa: E402
from scheduler import SolverOptions, WriteBackOptions, export_dag, optimize_schedule, validate_schedule  # noqa: E402
from scheduler.check.judge import liveness_peak  # noqa: E402
from solvers import InfeasibleBudgetError, Problem, ScheduleError, solve  # noqa: E402

HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")
#: bad values users passed, per argument (each must raise TypeError or ValueError naming it)
BAD = {
    "payload_order": ["foo", None, 1],
    "work_limit": [0, -1, math.nan, math.inf, "5", None],
    "seed": ["x", -1, 1.5, 2**40],
    "solver": [None, 42, "nope"],
    "num_workers": [-1, 0, "2"],
    "extra_starts": [["x"], "abc"],
    "mem_budget": [2**63, "1e400 GiB", "abc", 0, -5, "40 gigs", math.nan, True],
    "fallback": [1, "yes"],
    "control_deps": ["yes", 2],
}


class Crash(AssertionError):
    """A case ended in a way the pass does not document."""


def draw_arguments(rnd: random.Random, own_peak: int) -> tuple[dict[str, Any], str | None, int | None]:
    """Keyword arguments of optimize_schedule, the argument made bad (None: none) and the budget
    in bytes the good arguments ask for (None: no budget)."""
    budget = None if rnd.random() < 0.2 else max(1, int(own_peak * rnd.uniform(0.3, 1.3)))
    kwargs: dict[str, Any] = {
        "mem_budget": budget if budget is None or rnd.random() < 0.7 else f"{budget} B",
        "solver": rnd.choice(("cpsat", "cpsat", "milp", *HEURISTICS)),
        "work_limit": rnd.choice((0.2, 0.5, 1.0)),
        "payload_order": rnd.choice(("registration", "execution")),
        "control_deps": rnd.random() < 0.2,
        "fallback": rnd.random() < 0.85,
        "seed": rnd.randrange(2**31),
    }
    bad = None
    if rnd.random() < 0.2:
        bad = rnd.choice(sorted(BAD))
        kwargs[bad] = rnd.choice(BAD[bad])
    return kwargs, bad, budget


def optimize(gm: torch.fx.GraphModule, kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    """optimize_schedule with the drawn arguments, the options objects built from them (a bad
    value raises when its object is built, before the graph is touched)."""
    solver = {k: kwargs[k] for k in ("solver", "work_limit", "seed", "num_workers", "fallback", "extra_starts")
              if k in kwargs}
    writeback = {k: kwargs[k] for k in ("payload_order", "control_deps") if k in kwargs}
    return optimize_schedule(gm, kwargs["mem_budget"], solver=SolverOptions(**solver),
                             writeback=WriteBackOptions(**writeback))


def run_case(seed: int, group_name: str) -> str:
    """One case (module docstring); returns its outcome's name, raises :class:`Crash`."""
    rnd = random.Random(seed)
    program = rp.random_program(seed, max_instructions=rnd.choice((8, 14, 14, 30)))
    gm0 = rp.trace_program(program, group_name)
    args = rp.real_program_inputs(program, seed)
    ref = gm0(*args)
    own_peak = liveness_peak(gm0)  # what a budget bounds (torch's tracker count is reported)
    direct_solve(rnd, gm0, own_peak)

    kwargs, bad, budget = draw_arguments(rnd, own_peak)
    gm = copy.deepcopy(gm0)
    code = gm.code
    try:
        out = optimize(gm, kwargs)
    except (TypeError, ValueError) as e:
        if bad is None or isinstance(e, ScheduleError):
            raise Crash(f"good arguments {kwargs} raised {type(e).__name__}: {e}") from e
        if gm.code != code:
            raise Crash(f"bad {bad}={kwargs[bad]!r} raised but the graph changed") from e
        return "bad argument refused"
    except InfeasibleBudgetError as e:
        if bad is not None:
            raise Crash(f"bad {bad}={kwargs[bad]!r} was not refused: InfeasibleBudgetError {e}") from e
        if budget is None or budget >= own_peak:
            raise Crash(f"budget {budget} B at or above the graph's own peak {own_peak} B refused: {e}") from e
        advised = e.min_peak_bytes
        if advised is None or advised > own_peak:
            raise Crash(f"advised {advised} B above the graph's own peak {own_peak} B: {e}") from e
        again = copy.deepcopy(gm0)
        try:
            check_result(optimize(again, {**kwargs, "mem_budget": advised, "control_deps": False}), advised, args,
                         ref)
        except InfeasibleBudgetError as e2:
            raise Crash(f"advised {advised} B, refused there: {e2}") from e2
        return "infeasible, advice holds"
    except ScheduleError as e:
        if kwargs["fallback"] is False and bad is None:
            return "solver failed (fallback=False)"
        raise Crash(f"{type(e).__name__} with fallback={kwargs['fallback']!r}: {e}") from e
    if bad is not None:
        raise Crash(f"bad {bad}={kwargs[bad]!r} was accepted")
    if kwargs["control_deps"]:
        # the memory counts do not read through control_deps wrappers (docs/RELIABILITY.md):
        # the budget is checked on the same choice written without them, the results on both
        check_result(out, None, args, ref)
        out = optimize(copy.deepcopy(gm0), {**kwargs, "control_deps": False})
    check_result(out, budget, args, ref)
    return "rewritten within budget, results equal"


def direct_solve(rnd: random.Random, gm: torch.fx.GraphModule, own_peak: int) -> None:
    """A solver or heuristic on the program's DAG: a valid schedule within its budget, or
    InfeasibleBudgetError."""
    problem = Problem.from_dag(export_dag(gm))
    solver = rnd.choice(("cpsat", "milp", *HEURISTICS))
    budget = None if rnd.random() < 0.3 else max(1, int(own_peak * rnd.uniform(0.5, 1.2)))
    try:
        result = solve(problem, solver=solver, mem_budget_bytes=budget, work_limit=0.5)
    except InfeasibleBudgetError:
        return
    sim = validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
    if budget is not None and sim.peak_bytes > budget:
        raise Crash(f"{solver} returned a schedule over its budget: {sim.peak_bytes} > {budget}")


def check_result(out: torch.fx.GraphModule, budget: int | None, args: tuple, ref: Any) -> None:
    if budget is not None:
        peak = liveness_peak(out)
        if peak > budget:
            raise Crash(f"written graph peaks at {peak} B over the budget {budget} B")
    got = out(*args)
    if len(got) != len(ref) or not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ref, got)):
        raise Crash("the written graph computes different results")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines: one per case (seed, outcome, s)")
    a = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the pass logs every fallback and refusal; the outcome is counted

    from test_writeback import gloo_group

    outcomes: collections.Counter[str] = collections.Counter()
    crashes: list[int] = []
    t0 = time.perf_counter()
    log = a.out.open("a") if a.out else None
    with gloo_group() as group_name:
        for seed in range(a.start, a.start + a.cases):
            t = time.perf_counter()
            try:
                outcome = run_case(seed, group_name)
            except Exception as e:  # a crash: any exception the pass does not document
                outcome = "crash"
                crashes.append(seed)
                print(f"seed {seed}: CRASH {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            outcomes[outcome] += 1
            if log:
                log.write(json.dumps({"seed": seed, "outcome": outcome, "s": round(time.perf_counter() - t, 3)}) + "\n")
                log.flush()
            done = seed - a.start + 1
            if done % 100 == 0 or done == a.cases:
                print(f"{done} cases in {time.perf_counter() - t0:.0f} s: {dict(outcomes)}", flush=True)
    print(f"fuzz: {a.cases} cases (seeds {a.start}..{a.start + a.cases - 1}) in {time.perf_counter() - t0:.0f} s; "
          f"{len(crashes)} crashes {crashes[:20]}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
