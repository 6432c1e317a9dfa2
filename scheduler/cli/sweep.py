"""``fsdp-sched sweep``: a list of budgets -> table and Pareto plot.

Results are kept in SQLite so that an interrupted sweep resumes where it stopped. Points run
sequentially, in local processes (``--workers N``), or on an existing Dask
(``--address tcp://HOST:PORT``) or Ray (``--address ray://HOST:PORT``) cluster; progress is
shown on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from scheduler.whatif import plots
from scheduler.solving import solve_dag
from scheduler.cli.common import (
    CliError,
    dag_hash,
    ensure_out_dir,
    fmt_bytes,
    fmt_ms,
    heuristic_sim,
    input_dag,
    resolve_budget,
)
from scheduler.export.dagfile import dag_from_json, dag_to_json
from scheduler.options import SolverOptions
from solvers.core import InfeasibleBudgetError, Problem, simulate
from solvers.heuristics import HEURISTICS
from solvers.registry import available_solvers
from solvers.search import search

logger = logging.getLogger(__name__)

#: budgets a sweep solves when none are given (:func:`default_budgets`)
DEFAULT_SWEEP_POINTS = 4

_SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    dag_hash TEXT, solver TEXT, budget_bytes INTEGER, time_limit_s REAL, status TEXT,
    step_ms REAL, exposed_comm_ms REAL, peak_bytes INTEGER, n_collectives INTEGER,
    solve_time_s REAL, gap REAL, error TEXT,
    PRIMARY KEY (dag_hash, solver, budget_bytes))"""
_COLS = ("status", "step_ms", "exposed_comm_ms", "peak_bytes", "n_collectives", "solve_time_s", "gap", "error")


def solve_point(dag_json: dict, solver: str, budget: int, work_limit: float) -> dict[str, Any]:
    """One sweep point (runs in a worker process too): a row of the results table."""
    dag = dag_from_json(dag_json)
    try:
        schedule, report = solve_dag(dag, budget, solver=SolverOptions(solver=solver, work_limit=work_limit))
    except InfeasibleBudgetError as e:
        return {"status": "infeasible", "error": str(e), "peak_bytes": e.min_peak_bytes}
    sim = simulate(dag, schedule)
    return {"status": report.status, "step_ms": sim.step_ms, "exposed_comm_ms": sim.exposed_comm_ms,
            "peak_bytes": sim.peak_bytes, "n_collectives": sim.n_collectives,
            "solve_time_s": report.solve_time_s, "gap": report.gap, "error": None}


def _check_address(address: str | None) -> None:
    """Fail early (exit 2) when ``--address`` needs a library that is not installed."""
    if not address:
        return
    import importlib.util

    if address.startswith("ray://"):
        if importlib.util.find_spec("ray") is None:
            raise CliError("ray is not installed; pip install ray")
    elif importlib.util.find_spec("distributed") is None:
        raise CliError("dask is not installed; pip install 'dask[distributed]' (or fsdp-sched[dask])")


class _Progress:
    """Progress of a sweep on stderr: a tqdm bar when tqdm is installed and stderr is a terminal,
    otherwise one line per finished point (``[i/n] budget ...: ...``)."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled and total > 0, time.perf_counter()
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="point", desc="sweep", file=sys.stderr, leave=True)

    def update(self, message: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(message, refresh=True)
            return
        print(f"[{self.n}/{self.total}] {message} ({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _sweep_on_dask(address: str, data: dict, solver: str, budgets: list[int], work_limit: float, store) -> None:
    """Solve the points on an existing Dask cluster (scheduler at ``address``); ``store(budget, row)``
    is called for each point as it finishes, so an interrupted sweep keeps what was done.
    The workers need fsdp-sched installed (``solve_point`` is imported there by name)."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise CliError("dask is not installed; pip install 'dask[distributed]' (or fsdp-sched[dask])") from None
    try:
        client = Client(address, timeout="10s", set_as_default=False)
    except (OSError, TimeoutError, ValueError) as e:
        raise CliError(f"cannot connect to the Dask scheduler at {address}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    futures = []
    try:
        n_workers = len(client.scheduler_info().get("workers", {}))
        logger.info("solving %d points on the Dask cluster at %s (%d workers)", len(budgets), address, n_workers)
        [data_f] = client.scatter([data], broadcast=True)
        futs = {client.submit(solve_point, data_f, solver, b, work_limit, pure=False,
                              key=f"fsdp-sched-point-{b}-{time.time_ns()}"): b for b in budgets}
        futures = list(futs)
        for fut in as_completed(futures, loop=client.loop):
            store(futs[fut], fut.result())
    finally:
        for f in futures:
            if not f.done():
                f.cancel()
        client.close()


def _sweep_on_ray(address: str, data: dict, solver: str, budgets: list[int], work_limit: float, store) -> None:
    """Like :func:`_sweep_on_dask` on an existing Ray cluster (``ray://HOST:PORT``)."""
    try:
        import ray
    except ImportError:
        raise CliError("ray is not installed; pip install ray") from None
    try:
        ray.init(address=address, ignore_reinit_error=True, logging_level=logging.WARNING)
    except Exception as e:  # connection errors come in several types
        raise CliError(f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    refs: dict = {}
    try:
        remote = ray.remote(num_cpus=1)(solve_point)
        data_ref = ray.put(data)
        refs = {remote.remote(data_ref, solver, b, work_limit): b for b in budgets}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                store(refs[r], ray.get(r))
    finally:
        for r in refs:
            try:
                ray.cancel(r)
            except Exception:
                pass
        ray.shutdown()


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.solver not in available_solvers():
        raise CliError(f"unknown solver {args.solver!r}; choose one of {', '.join(available_solvers())}")
    _check_address(args.address)
    dag = input_dag(args)
    problem = Problem.from_dag(dag)
    baselines = _baselines(problem)
    fsdp2_peak = (baselines.get("fsdp2") or baselines["traced"]).peak_bytes
    if args.budgets is None:
        # the top of the range: where more memory stops helping (the schedule without a budget)
        _, free = solve_dag(dag, None, solver=SolverOptions(solver=args.solver, work_limit=args.work_limit))
        budgets = default_budgets(problem, max(free.peak_bytes_after, baselines["traced"].peak_bytes))
    else:
        resolved = (resolve_budget(s, fsdp2_peak, arg="--budgets") for s in args.budgets)
        budgets = sorted({b for b in resolved if b is not None}, reverse=True)
    if not budgets:
        raise CliError("--budgets needs at least one size")
    key = dag_hash(dag)
    out = ensure_out_dir(Path(args.out))
    db_path = Path(args.db) if args.db else out / "sweep.sqlite"
    db = _open_db(db_path)
    try:
        done = {b for (b,) in db.execute("SELECT budget_bytes FROM results WHERE dag_hash=? AND solver=?",
                                         (key, args.solver))}
        todo = [b for b in budgets if b not in done]
        if done & set(budgets):
            logger.info("resuming: %d of %d points already in %s", len(budgets) - len(todo), len(budgets), db_path)
        _run_points(args, dag_to_json(dag), todo, _Store(db, key, args, len(todo)))
        q = db.execute(f"SELECT budget_bytes, {', '.join(_COLS)} FROM results WHERE dag_hash=? AND solver=? "
                       "ORDER BY budget_bytes DESC", (key, args.solver))
        rows = monotone([dict(zip(("budget_bytes", *_COLS), r)) for r in q if r[0] in budgets])
    finally:
        db.close()
    solved = [r for r in rows if r["step_ms"] is not None]
    png = plots.pareto(solved, out / f"{dag.graph.get('name', 'graph')}_pareto.png", baselines=baselines,
                       title=f"{dag.graph.get('name', 'graph')}: {args.solver} over {len(budgets)} budgets")
    if args.json:
        print(json.dumps({"dag_hash": key, "solver": args.solver, "points": rows, "pareto_png": str(png),
                          "baselines": {k: v.summary() for k, v in baselines.items()}}))
    else:
        _print_table(rows, baselines)
        if args.budgets is None and len(budgets) == 1:
            print(f"one point: the schedule solved without a budget peaks at {fmt_bytes(budgets[0])}, the smallest peak "
                  "any schedule reaches, so no budget changes it")
        print(f"Pareto plot: {png}; results: {db_path}")
    return 0


def default_budgets(problem: Problem, high_bytes: int, n: int = DEFAULT_SWEEP_POINTS) -> list[int]:
    """``n`` budgets (bytes, largest first) evenly spaced from the smallest peak any start of the
    search reaches (the refusal of a one-byte budget names it: a budget that large admits a
    schedule) to ``high_bytes`` (the sweep gives the larger of the traced peak and the peak of
    the schedule solved without a budget): every point is feasible, and the plot spans the range
    in which the budget decides. Fewer when the range is narrower than ``n`` bytes."""
    try:
        search({"model": problem}, 1, backend=None, starts_only=True)
        low = 1
    except InfeasibleBudgetError as e:
        low = e.min_peak_bytes or high_bytes
    high = max(low, high_bytes)
    return sorted({round(low + (high - low) * i / max(1, n - 1)) for i in range(n)}, reverse=True)


def _open_db(path: Path) -> sqlite3.Connection:
    """The results database at ``path`` with its table; a path SQLite cannot open or a file that
    is not a SQLite database is a :class:`CliError` naming ``--db``."""
    try:
        db = sqlite3.connect(path)
    except sqlite3.Error as e:
        raise CliError(f"results file {str(path)!r} (--db): cannot open it with SQLite: {e}") from None
    try:
        db.execute(_SCHEMA)
        db.execute(f"SELECT dag_hash, solver, budget_bytes, time_limit_s, {', '.join(_COLS)} FROM results LIMIT 0")
    except sqlite3.Error as e:
        db.close()
        raise CliError(f"results file {str(path)!r} (--db): not a sweep's SQLite results file ({e}); give a new "
                       "file name or one an earlier sweep wrote") from None
    return db


def monotone(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """More memory never gives a slower step: a point slower than one at a smaller budget
    takes that point's schedule (it fits the larger budget too), with status ``"smaller"``.
    The points are solved independently (in parallel), so this is applied afterwards, to the
    results; :func:`solvers.solve_budgets` instead feeds the smaller budget's schedule in as
    a start. Returns the rows in the order given."""
    best: dict[str, Any] | None = None
    out: dict[int, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["budget_bytes"]):
        if r["step_ms"] is not None and (best is None or r["step_ms"] <= best["step_ms"]):
            best = r
        elif best is not None:
            logger.info("budget %s: the schedule of budget %s is faster (%s vs %s); reporting it",
                        fmt_bytes(r["budget_bytes"]), fmt_bytes(best["budget_bytes"]), fmt_ms(best["step_ms"]),
                        fmt_ms(r["step_ms"]) if r["step_ms"] is not None else r["status"])
            r = {**best, "budget_bytes": r["budget_bytes"], "status": "smaller"}
        out[r["budget_bytes"]] = r
    return [out[r["budget_bytes"]] for r in rows]


def _baselines(problem: Problem) -> dict:
    """Each heuristic's simulation without a budget (the reference points of the plot)."""
    out = {}
    for name in HEURISTICS:
        try:
            out[name] = heuristic_sim(problem, name)[0]
        except Exception as e:
            logger.warning("baseline %s unavailable: %s", name, e)
    return out


class _Store:
    """Writes each finished point to the results table at once (so an interrupted sweep keeps
    it) and reports progress."""

    def __init__(self, db: sqlite3.Connection, key: str, args: argparse.Namespace, total: int):
        self.db, self.key, self.args = db, key, args
        self.progress = _Progress(total, enabled=args.progress)

    def __call__(self, b: int, row: dict[str, Any]) -> None:
        self.db.execute(
            f"INSERT OR REPLACE INTO results (dag_hash, solver, budget_bytes, time_limit_s, {', '.join(_COLS)}) "
            f"VALUES (?, ?, ?, ?, {', '.join('?' * len(_COLS))})",
            (self.key, self.args.solver, b, self.args.work_limit, *(row.get(c) for c in _COLS)))
        self.db.commit()
        res = (f"step {fmt_ms(row['step_ms'])}, peak {fmt_bytes(row['peak_bytes'])}"
               if row.get("step_ms") is not None else row["status"])
        self.progress.update(f"budget {fmt_bytes(b)}: {res}")


def _run_points(args: argparse.Namespace, data: dict, todo: list[int], store: _Store) -> None:
    """Solve the points ``todo``: on a cluster, in local processes, or one after another."""
    try:
        if not todo:
            return
        if args.address:
            if args.workers > 1:
                logger.warning("--workers is ignored with --address: the cluster's workers solve the points")
            run = _sweep_on_ray if args.address.startswith("ray://") else _sweep_on_dask
            run(args.address, data, args.solver, todo, args.work_limit, store)
        elif args.workers > 1 and len(todo) > 1:
            with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(todo))) as pool:
                futs = {pool.submit(solve_point, data, args.solver, b, args.work_limit): b for b in todo}
                for fut in concurrent.futures.as_completed(futs):
                    store(futs[fut], fut.result())
        else:
            for b in todo:
                store(b, solve_point(data, args.solver, b, args.work_limit))
    finally:
        store.progress.close()


def _print_table(rows: list[dict[str, Any]], baselines: dict) -> None:
    head = f"{'budget':>14}{'status':>12}{'step':>12}{'exposed comm':>14}{'peak':>13}{'#coll':>7}{'solve':>9}{'gap':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["step_ms"] is None:
            print(f"{fmt_bytes(r['budget_bytes']):>14}{r['status']:>12}  min peak found {fmt_bytes(r['peak_bytes'])}"
                  if r["peak_bytes"] else f"{fmt_bytes(r['budget_bytes']):>14}{r['status']:>12}")
            continue
        print(f"{fmt_bytes(r['budget_bytes']):>14}{r['status']:>12}{fmt_ms(r['step_ms']):>12}"
              f"{fmt_ms(r['exposed_comm_ms']):>14}{fmt_bytes(r['peak_bytes']):>13}{r['n_collectives']:>7}"
              f"{r['solve_time_s']:>8.2f}s{r['gap']:>7.1%}")
    for name, s in baselines.items():
        print(f"{'(' + name + ')':>14}{'':>12}{fmt_ms(s.step_ms):>12}{fmt_ms(s.exposed_comm_ms):>14}"
              f"{fmt_bytes(s.peak_bytes):>13}{s.n_collectives:>7}")
