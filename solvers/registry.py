"""One entry point for every solver and heuristic: ``solve(problem, solver=...)``.

The table maps names to the modules that implement them; it imports them, nothing imports it
back (no registration side effects, no circle). It is also the one driver of the two model
backends: :data:`BACKENDS` builds each from its config (``SearchConfig.cpsat`` /
``SearchConfig.milp``) and hands the MILP its warm start (CP-SAT's completion); the search of
:mod:`solvers.search` runs either through the solver-neutral :class:`solvers.model.ModelData`.
Neither backend imports the search or the other backend.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

from solvers.core.problem import Problem
from solvers.core.schedule import InfeasibleBudgetError, Schedule, ScheduleError, SolveResult
from solvers.cpsat import CpSatBackend, complete_solution
from solvers.heuristics import HEURISTICS
from solvers.milp import MilpBackend
from solvers.objective import SearchConfig
from solvers.search import DEFAULT_WORK_LIMIT, Started, WindowBackend, search

logger = logging.getLogger(__name__)

#: a solver of your own, as :func:`solve` calls it: ``fn(problem, *, mem_budget_bytes,
#: work_limit, seed, hint, num_workers, extra_starts) -> SolveResult``, every keyword always
#: passed (``hint`` None and ``extra_starts`` empty when none are given); a built-in heuristic is
#: called without ``extra_starts``. One that takes ``time_limit_s`` instead of ``work_limit``
#: (its name before) is still called so for one release, with a DeprecationWarning
SolverFn = Callable[..., SolveResult]

#: the model backends of the search's windows, by solver name: each built from the search's config
BACKENDS: dict[str, Callable[[SearchConfig], WindowBackend]] = {
    "cpsat": lambda config: CpSatBackend(config.cpsat),
    "milp": lambda config: MilpBackend(config.milp, complete=complete_solution),
}


def _solve_with(backend: str) -> SolverFn:
    """The search of :mod:`solvers.search` with ``backend`` for its windows, as a solver of one
    problem; ``hint`` and ``extra_starts`` are starts too (the result is never slower than the
    fastest that fits)."""

    def solve_exact(problem: Problem, *, mem_budget_bytes: int | None = None,
                    work_limit: float = DEFAULT_WORK_LIMIT, seed: int = 0, hint: Schedule | None = None,
                    num_workers: int = 1, extra_starts: Sequence[Schedule] = (),
                    config: SearchConfig = SearchConfig()) -> SolveResult:
        label = str(problem.dag.graph.get("cost_model", "model"))
        return search({label: problem}, mem_budget_bytes, backend=BACKENDS[backend](config),
                      work_limit=work_limit, seed=seed, num_workers=num_workers, config=config,
                      extra_starts=(*((hint,) if hint is not None else ()), *extra_starts))

    solve_exact.__name__ = solve_exact.__qualname__ = f"solve_{backend}"
    return solve_exact


solve_cpsat = _solve_with("cpsat")
solve_milp = _solve_with("milp")
#: the exact solvers (the search of :mod:`solvers.search` with that model backend for its windows)
EXACT_SOLVERS: dict[str, SolverFn] = {"cpsat": solve_cpsat, "milp": solve_milp}
#: every solver and heuristic by name
SOLVERS: dict[str, SolverFn] = {**EXACT_SOLVERS, **HEURISTICS}


def available_solvers() -> list[str]:
    return sorted(SOLVERS)


def solver_name(solver: str | SolverFn) -> str:
    """The name of a solver given by name or as a callable."""
    return solver if isinstance(solver, str) else getattr(solver, "__name__", type(solver).__name__)


def solve(
    problem: Problem,
    *,
    solver: str | SolverFn = "cpsat",
    mem_budget_bytes: int | None = None,
    work_limit: float = DEFAULT_WORK_LIMIT,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    extra_starts: Sequence[Schedule] = (),
    time_limit_s: float | None = None,
) -> SolveResult:
    """Solve ``problem`` with the named solver or heuristic.

    Args:
        solver: "cpsat", "milp", a heuristic name (see :func:`available_solvers`), or a callable
            with the signature of :data:`SolverFn` (your own solver).
        mem_budget_bytes: hard peak-memory budget (bytes); None for no limit.
        work_limit: limit of the solve, in work units of deterministic work (about a second of
            one core each; the model backend's deterministic clock and the polish's counted
            evaluations, never the wall clock), so that every rank stops at the same point and
            gets the same schedule; the search usually stops earlier, when a sweep of windows
            brings no gain.
        seed: solver random seed (fixed for determinism).
        hint: a schedule to warm-start from.
        num_workers: solver threads (1 keeps solves deterministic and cheap).
        extra_starts: exact solvers and callables only: more schedules to start from (e.g. the
            best schedule found at a smaller budget, see :func:`solve_budgets`); the exact
            solvers' result is never slower than the fastest of them that fits.
        time_limit_s: deprecated name of ``work_limit`` (for one release; it warns).

    Raises:
        ValueError: unknown solver name.
        InfeasibleBudgetError: no schedule fits ``mem_budget_bytes``.
        ScheduleError: the solver failed in another way.
    """
    if time_limit_s is not None:
        warnings.warn("solve(time_limit_s=...) is deprecated and will be removed in the next release: use work_limit",
                      DeprecationWarning, stacklevel=2)
        work_limit = time_limit_s
    fn = SOLVERS.get(solver) if isinstance(solver, str) else solver
    if fn is None:
        raise ValueError(f"unknown solver {solver!r}; choose one of {available_solvers()}")
    if mem_budget_bytes is not None and mem_budget_bytes <= 0:
        raise ValueError(f"mem_budget_bytes must be > 0, got {mem_budget_bytes}")
    if work_limit <= 0:
        raise ValueError(f"work_limit must be > 0, got {work_limit}")
    for given in (hint, *extra_starts):
        if given is not None:
            _check_hint_shape(problem, given)
    heuristic = fn in HEURISTICS.values()
    if extra_starts and heuristic:
        raise ValueError(f"extra_starts are taken by the exact solvers {sorted(EXACT_SOLVERS)} and callables only, "
                         f"not by the heuristic {solver_name(solver)!r}")
    more = {} if heuristic else {"extra_starts": tuple(extra_starts)}
    more[_work_keyword(fn)] = work_limit
    result = fn(
        problem,
        mem_budget_bytes=mem_budget_bytes,
        seed=seed,
        hint=hint,
        num_workers=num_workers,
        **more,
    )
    if not result.schedule.buckets and problem.colls:
        raise ScheduleError(
            f"solver {solver_name(solver)!r} returned an empty schedule for a graph with collectives")
    return result


def solve_problems(
    problems: Mapping[str, Problem],
    *,
    solver: str | SolverFn = "cpsat",
    mem_budget_bytes: int | None = None,
    work_limit: float = DEFAULT_WORK_LIMIT,
    seed: int = 0,
    num_workers: int = 1,
    extra_starts: Sequence[Schedule] = (),
    config: SearchConfig = SearchConfig(),
    all_gather_stream: str = "shared",
    baselines: Sequence[tuple[str, Schedule]] = (),
    started: Started | None = None,
    finish: bool = True,
) -> SolveResult:
    """Solve one graph priced by one or several cost models (label -> problem; the first is the
    primary one): the search of :mod:`solvers.search` for ``"cpsat"`` / ``"milp"``, judged under
    all of them; a heuristic or a callable on the primary problem alone. ``baselines`` (named
    schedules, :func:`solvers.search.search`) and ``started`` (the search's first stage run
    already, :func:`solvers.search.begin`) and ``finish`` (:func:`solvers.search.search`) are
    taken by the search only."""
    if isinstance(solver, str) and solver in BACKENDS:
        if started is None:
            check_starts(next(iter(problems.values())), extra_starts, baselines)
        return search(problems, mem_budget_bytes, backend=BACKENDS[solver](config), work_limit=work_limit, seed=seed,
                      num_workers=num_workers, extra_starts=extra_starts, config=config,
                      all_gather_stream=all_gather_stream, baselines=baselines, started=started,
                      finish=finish)
    if started is not None:
        raise ValueError(f"started is the search's first stage: solver {solver_name(solver)!r} runs no search")
    result = solve(next(iter(problems.values())), solver=solver, mem_budget_bytes=mem_budget_bytes,
                 work_limit=work_limit, seed=seed, num_workers=num_workers, extra_starts=extra_starts)
    if all_gather_stream == "separate":  # a heuristic's schedule as it is, its all-gathers on their own stream
        p = next(iter(problems.values()))
        result = dataclasses.replace(result, schedule=result.schedule.with_split(p.splittable_groups()))
    return result


def solve_budgets(problem: Problem, budgets: Iterable[int | None], *, solver: str | SolverFn = "cpsat",
                  **kwargs) -> dict[int | None, SolveResult | Exception]:
    """Solve ``problem`` at several memory budgets (bytes; None: no limit) so that more memory
    never gives a slower step: budgets run in increasing order (None last), and the best
    schedule found at every smaller budget is a start at the larger ones (it fits them). A
    budget that cannot be met maps to its exception (:class:`InfeasibleBudgetError`).
    ``kwargs`` go to :func:`solve`. Returns budget -> result, in the order given."""
    budgets = list(budgets)
    ordered = sorted(set(budgets), key=lambda b: (b is None, b or 0))
    out: dict[int | None, SolveResult | Exception] = {}
    found: list[SolveResult] = []
    exact = (solver in EXACT_SOLVERS) if isinstance(solver, str) else solver in EXACT_SOLVERS.values()
    for budget in ordered:
        starts = (min(found, key=lambda r: r.objective_ms).schedule,) if found and exact else ()
        try:
            out[budget] = solve(problem, solver=solver, mem_budget_bytes=budget, extra_starts=starts, **kwargs)
        except InfeasibleBudgetError as e:
            out[budget] = e
            continue
        found.append(out[budget])
        logger.info("budget %s: step %.3f ms", budget, out[budget].objective_ms)
    return {b: out[b] for b in budgets}


def check_starts(problem: Problem, extra_starts: Sequence[Schedule],
                 baselines: Sequence[tuple[str, Schedule]] = ()) -> None:
    """Every start given to the search is shaped as a schedule of ``problem`` (ValueError if not):
    before :func:`solvers.search.begin`, which would fail deep inside on one that is not."""
    for given in (*extra_starts, *(s for _, s in baselines)):
        _check_hint_shape(problem, given)


def _work_keyword(fn: SolverFn) -> str:
    """The keyword of ``fn``'s work limit: ``work_limit``, or for a solver of one's own written
    before it was renamed, ``time_limit_s`` (with a DeprecationWarning)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: call it as documented
        return "work_limit"
    if "time_limit_s" in params and "work_limit" not in params:
        warnings.warn(f"solver {solver_name(fn)!r} takes time_limit_s, which is deprecated and will not be passed "
                      "after the next release: rename its keyword to work_limit", DeprecationWarning, stacklevel=3)
        return "time_limit_s"
    return "work_limit"


def _check_hint_shape(problem: Problem, hint: Schedule) -> None:
    """A hint must name this problem's collectives and its own buckets; a malformed one would
    otherwise fail deep inside a solver (IndexError). Full validity is the validator's job."""
    members = sorted(m for b in hint.buckets for m in b.members)
    if members != sorted(problem.colls):
        raise ValueError("hint is not a schedule of this graph: its buckets do not list each collective once")
    bad = [s.ref for s in hint.steps if s.kind != "node" and not 0 <= s.ref < len(hint.buckets)]  # type: ignore[operator]
    if bad:
        raise ValueError(f"hint is malformed: steps name buckets {bad[:3]} of {len(hint.buckets)}")
