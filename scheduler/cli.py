"""The ``fsdp-sched`` command line: demo, trace, solve, sweep.

- ``fsdp-sched demo``: trace a reference model, compare every baseline with fsdp-sched under a
  memory budget, print a table and write pictures and Chrome traces.
- ``fsdp-sched trace``: model -> DAG JSON files (forward and backward).
- ``fsdp-sched solve``: DAG JSON (or a model) -> schedule, report, Chrome trace, Gantt chart.
- ``fsdp-sched sweep``: a list of budgets -> table and Pareto plot; results are kept in SQLite
  so that an interrupted sweep resumes where it stopped. Points run sequentially, in local
  processes (``--workers N``), or on an existing Dask (``--address tcp://HOST:PORT``) or Ray
  (``--address ray://HOST:PORT``) cluster; progress is shown on stderr.

Sizes are read and written human-readably ("40GiB", "512MB"), times in ms. A bad argument or
file ends with one line ``fsdp-sched: error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import logging
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import networkx as nx

logger = logging.getLogger(__name__)

GRAPHS = ("forward", "backward")
HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# argument types
# --------------------------------------------------------------------------------------------
def budget_arg(text: str) -> str | int:
    """``--budget``: a size ("40GiB", "1.5 GB"), "auto" (0.9 x the FSDP2-like peak), a multiple
    of that peak ("0.8x"), or "none"."""
    t = text.strip().lower()
    if t in ("auto", "none"):
        return t
    if t.endswith("x"):
        try:
            f = float(t[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad budget {text!r}: a multiple is written like '0.8x'") from None
        if not f > 0:
            raise argparse.ArgumentTypeError(f"bad budget {text!r}: the multiple must be > 0")
        return text.strip()
    from scheduler.api import parse_bytes

    try:
        return parse_bytes(text)  # type: ignore[return-value]
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad budget: {e}; or 'auto', 'none', '0.8x'") from None


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return v


def resolve_budget(spec: str | int | None, fsdp2_peak_bytes: int, floor_bytes: int = 0) -> int | None:
    """Bytes of a :func:`budget_arg` value; "auto" is 0.9 x ``fsdp2_peak_bytes``, raised to
    ``floor_bytes`` (the smallest peak a baseline reached) when that is higher, so that it is
    reachable."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, int):
        return spec
    if spec == "auto":
        return max(int(0.9 * fsdp2_peak_bytes), floor_bytes)
    return int(float(spec[:-1]) * fsdp2_peak_bytes)


def fmt_bytes(n: float | None) -> str:
    from solvers.problem import fmt_bytes as f

    return "none" if n is None else f(n)


def fmt_ms(ms: float | None) -> str:
    from solvers.problem import fmt_ms as f

    return "-" if ms is None else f(ms)


# --------------------------------------------------------------------------------------------
# model -> DAGs
# --------------------------------------------------------------------------------------------
def _cluster(args: argparse.Namespace):
    from scheduler.costs import Cluster

    kw: dict[str, Any] = {"n_gpus": args.world_size}
    if getattr(args, "inter_node_gbps", None):
        kw["inter_node_gbps"] = args.inter_node_gbps
    try:
        return Cluster(**kw)
    except ValueError as e:
        raise CliError(str(e)) from None


def trace_model(args: argparse.Namespace, graphs: tuple[str, ...] = GRAPHS) -> tuple[dict[str, nx.DiGraph], Any]:
    """Capture ``args.model`` and export the requested graphs: (name -> DAG, CapturedGraphs)."""
    from models import capture_fsdp_graphs, list_presets
    from scheduler.dag import export_dag

    if args.model not in list_presets():
        raise CliError(f"unknown model {args.model!r}; choose one of {', '.join(list_presets())}")
    if args.world_size < 2:
        raise CliError(f"--world-size must be >= 2, got {args.world_size}")
    logger.info("tracing %s (%s layers) on %d ranks", args.model, args.n_layers or "all", args.world_size)
    t0 = time.perf_counter()
    captured = capture_fsdp_graphs(args.model, world_size=args.world_size, n_layers=args.n_layers)
    cluster = _cluster(args)
    dags = {}
    for g in graphs:
        gm = getattr(captured, g)
        gm.meta.setdefault("fsdp_graph_kind", g)
        dags[g] = export_dag(gm, cluster=cluster, name=g)
    logger.info("traced in %.1f s", time.perf_counter() - t0)
    return dags, captured


def load_dag_file(path: str) -> nx.DiGraph:
    from scheduler.dag import DagError, load_dag

    p = Path(path)
    if not p.is_file():
        raise CliError(f"no such DAG file: {path}")
    try:
        return load_dag(p)
    except DagError as e:
        raise CliError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {path}: {e}") from None


def dag_hash(dag: nx.DiGraph) -> str:
    from scheduler.dag import dag_to_json

    return hashlib.sha256(json.dumps(dag_to_json(dag), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------
def heuristic_sim(problem, name: str):
    """(SimResult, SolveResult) of heuristic ``name`` without a budget."""
    from scheduler.simulator import simulate
    from solvers.dispatch import solve

    if name == "traced":
        return simulate(problem.dag, problem.traced_schedule(), problem=problem), None
    res = solve(problem, solver=name, time_limit_s=10.0)
    return simulate(problem.dag, res.schedule, problem=problem), res


def write_pictures(sim, problem, out: Path, stem: str, budget: int | None) -> list[Path]:
    from scheduler import plots

    return [
        plots.gantt(sim, problem, out / f"{stem}_gantt.png"),
        plots.memory(sim, out / f"{stem}_memory.png", budget_bytes=budget,
                     title=f"{stem}: memory, peak {fmt_bytes(sim.peak_bytes)}, budget {fmt_bytes(budget)}"),
        sim.write_chrome_trace(out / f"{stem}_trace.json", problem=problem),
    ]


def _row(name: str, sim=None, *, solve_s: float | None = None, gap: float | None = None,
         budget: int | None = None, note: str = "") -> dict[str, Any]:
    if sim is None:
        return {"schedule": name, "note": note}
    return {
        "schedule": name,
        "step_ms": sim.step_ms,
        "exposed_comm_ms": sim.exposed_comm_ms,
        "peak_bytes": sim.peak_bytes,
        "n_collectives": sim.n_collectives,
        "solve_time_s": solve_s,
        "gap": gap,
        "fits_budget": None if budget is None else sim.peak_bytes <= budget,
        "note": note,
    }


def format_table(rows: list[dict[str, Any]], title: str = "") -> str:
    head = f"{'schedule':<14}{'step':>12}{'exposed comm':>14}{'peak':>13}{'fits':>6}{'#coll':>7}{'solve':>9}{'gap':>7}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"{r['schedule']:<14}{r['note']}")
            continue
        fits = {None: "-", True: "yes", False: "NO"}[r.get("fits_budget")]
        solve = "-" if r.get("solve_time_s") is None else f"{r['solve_time_s']:.2f} s"
        gap = "-" if r.get("gap") is None else f"{r['gap']:.1%}"
        line = (f"{r['schedule']:<14}{fmt_ms(r['step_ms']):>12}{fmt_ms(r['exposed_comm_ms']):>14}"
                f"{fmt_bytes(r['peak_bytes']):>13}{fits:>6}{r['n_collectives']:>7}{solve:>9}{gap:>7}")
        if r.get("note"):
            line += f"  {r['note']}"
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from scheduler.api import solve_dag
    from scheduler.simulator import simulate
    from solvers.problem import Problem
    from solvers.schedule import InfeasibleBudgetError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
                rows.append(_row(name, note=f"unavailable: {type(e).__name__}: {e}"))
                continue
            sims[name] = sim
            rows.append(_row(name, sim, solve_s=None if res is None else time.perf_counter() - t0))
        fsdp2_peak = sims["fsdp2"].peak_bytes if "fsdp2" in sims else sims["traced"].peak_bytes
        budget = resolve_budget(args.budget, fsdp2_peak, min(s.peak_bytes for s in sims.values()))
        for r in rows:
            if "step_ms" in r and budget is not None:
                r["fits_budget"] = r["peak_bytes"] <= budget
        logger.info("%s: running torch's overlap scheduler", g)
        try:
            from scheduler.baselines import simulate_torch_baseline

            t0 = time.perf_counter()
            tsim = simulate_torch_baseline(getattr(captured, g), cluster=_cluster(args))
            rows.append(_row("torch", tsim, solve_s=time.perf_counter() - t0, budget=budget))
            sims["torch"] = tsim
        except Exception as e:
            rows.append(_row("torch", note=f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        logger.info("%s: solving with %s under budget %s (limit %g s)", g, args.solver, fmt_bytes(budget), args.time_limit)
        try:
            schedule, report = solve_dag(dag, budget, solver=args.solver, time_limit_s=args.time_limit)
            sim = simulate(dag, schedule, problem=problem)
            note = f"fell back to {report.solver}" if report.fell_back else report.status
            rows.append(_row("fsdp-sched", sim, solve_s=report.solve_time_s, gap=report.gap, budget=budget, note=note))
            written = write_pictures(sim, problem, out, g, budget)
            summary[g] = {"budget_bytes": budget, "rows": rows, "report": report.to_json(),
                          "files": [str(p) for p in written]}
        except InfeasibleBudgetError as e:
            rows.append(_row("fsdp-sched", note=f"infeasible: {e}"))
            summary[g] = {"budget_bytes": budget, "rows": rows, "files": []}
            if "traced" in sims:
                write_pictures(sims["traced"], problem, out, f"{g}_traced", budget)
        if args.json:
            continue
        print()
        print(format_table(rows, f"== {g} graph: {args.model}, {args.n_layers or 'all'} layers, "
                                 f"{args.world_size} ranks, budget {fmt_bytes(budget)} =="))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print(f"\npictures, Chrome traces (open in https://ui.perfetto.dev) and summary.json in {out}/")
    return 0


# --------------------------------------------------------------------------------------------
# trace
# --------------------------------------------------------------------------------------------
def cmd_trace(args: argparse.Namespace) -> int:
    from scheduler.dag import save_dag

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


# --------------------------------------------------------------------------------------------
# solve
# --------------------------------------------------------------------------------------------
def _input_dag(args: argparse.Namespace) -> nx.DiGraph:
    if args.dag and args.model:
        raise CliError("give a DAG file or --model, not both")
    if args.dag:
        return load_dag_file(args.dag)
    if args.model:
        dags, _ = trace_model(args, (args.graph,))
        return dags[args.graph]
    raise CliError("give a DAG file (from `fsdp-sched trace`) or --model")


def cmd_solve(args: argparse.Namespace) -> int:
    from scheduler.api import solve_dag
    from scheduler.simulator import simulate
    from solvers.dispatch import available_solvers
    from solvers.problem import Problem
    from solvers.schedule import InfeasibleBudgetError

    if args.solver not in available_solvers():
        raise CliError(f"unknown solver {args.solver!r}; choose one of {', '.join(available_solvers())}")
    dag = _input_dag(args)
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


# --------------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------------
_SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    dag_hash TEXT, solver TEXT, budget_bytes INTEGER, time_limit_s REAL, status TEXT,
    step_ms REAL, exposed_comm_ms REAL, peak_bytes INTEGER, n_collectives INTEGER,
    solve_time_s REAL, gap REAL, error TEXT,
    PRIMARY KEY (dag_hash, solver, budget_bytes))"""
_COLS = ("status", "step_ms", "exposed_comm_ms", "peak_bytes", "n_collectives", "solve_time_s", "gap", "error")


def solve_point(dag_json: dict, solver: str, budget: int, time_limit_s: float) -> dict[str, Any]:
    """One sweep point (runs in a worker process too): a row of the results table."""
    from scheduler.api import solve_dag
    from scheduler.dag import dag_from_json
    from scheduler.simulator import simulate
    from solvers.schedule import InfeasibleBudgetError

    dag = dag_from_json(dag_json)
    try:
        schedule, report = solve_dag(dag, budget, solver=solver, time_limit_s=time_limit_s)
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


def _sweep_on_dask(address: str, data: dict, solver: str, budgets: list[int], time_limit_s: float, store) -> None:
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
        futs = {client.submit(solve_point, data_f, solver, b, time_limit_s, pure=False,
                              key=f"fsdp-sched-point-{b}-{time.time_ns()}"): b for b in budgets}
        futures = list(futs)
        for fut in as_completed(futures, loop=client.loop):
            store(futs[fut], fut.result())
    finally:
        for f in futures:
            if not f.done():
                f.cancel()
        client.close()


def _sweep_on_ray(address: str, data: dict, solver: str, budgets: list[int], time_limit_s: float, store) -> None:
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
        refs = {remote.remote(data_ref, solver, b, time_limit_s): b for b in budgets}
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
    from scheduler import plots
    from scheduler.dag import dag_to_json
    from solvers.dispatch import available_solvers
    from solvers.problem import Problem

    if args.solver not in available_solvers():
        raise CliError(f"unknown solver {args.solver!r}; choose one of {', '.join(available_solvers())}")
    _check_address(args.address)
    dag = _input_dag(args)
    problem = Problem.from_dag(dag)
    baselines = {}
    for name in HEURISTICS:
        try:
            baselines[name] = heuristic_sim(problem, name)[0]
        except Exception as e:
            logger.warning("baseline %s unavailable: %s", name, e)
    fsdp2_peak = (baselines.get("fsdp2") or baselines["traced"]).peak_bytes
    budgets = sorted({b for b in (resolve_budget(s, fsdp2_peak) for s in args.budgets) if b is not None}, reverse=True)
    if not budgets:
        raise CliError("--budgets needs at least one size")
    key = dag_hash(dag)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db_path = Path(args.db) if args.db else out / "sweep.sqlite"
    db = sqlite3.connect(db_path)
    db.execute(_SCHEMA)
    done = {b for (b,) in db.execute("SELECT budget_bytes FROM results WHERE dag_hash=? AND solver=?", (key, args.solver))}
    todo = [b for b in budgets if b not in done]
    if done & set(budgets):
        logger.info("resuming: %d of %d points already in %s", len(budgets) - len(todo), len(budgets), db_path)

    progress = _Progress(len(todo), enabled=args.progress)

    def store(b: int, row: dict[str, Any]) -> None:
        db.execute(f"INSERT OR REPLACE INTO results (dag_hash, solver, budget_bytes, time_limit_s, {', '.join(_COLS)}) "
                   f"VALUES (?, ?, ?, ?, {', '.join('?' * len(_COLS))})",
                   (key, args.solver, b, args.time_limit, *(row.get(c) for c in _COLS)))
        db.commit()
        res = (f"step {fmt_ms(row['step_ms'])}, peak {fmt_bytes(row['peak_bytes'])}" if row.get("step_ms") is not None
               else row["status"])
        progress.update(f"budget {fmt_bytes(b)}: {res}")

    data = dag_to_json(dag)
    try:
        if not todo:
            pass
        elif args.address:
            if args.workers > 1:
                logger.warning("--workers is ignored with --address: the cluster's workers solve the points")
            run = _sweep_on_ray if args.address.startswith("ray://") else _sweep_on_dask
            run(args.address, data, args.solver, todo, args.time_limit, store)
        elif args.workers > 1 and len(todo) > 1:
            with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(todo))) as pool:
                futs = {pool.submit(solve_point, data, args.solver, b, args.time_limit): b for b in todo}
                for fut in concurrent.futures.as_completed(futs):
                    store(futs[fut], fut.result())
        else:
            for b in todo:
                store(b, solve_point(data, args.solver, b, args.time_limit))
    finally:
        progress.close()

    q = db.execute(f"SELECT budget_bytes, {', '.join(_COLS)} FROM results WHERE dag_hash=? AND solver=? ORDER BY budget_bytes DESC",
                   (key, args.solver))
    rows = [dict(zip(("budget_bytes", *_COLS), r)) for r in q if r[0] in budgets]
    db.close()
    solved = [r for r in rows if r["step_ms"] is not None]
    png = plots.pareto(solved, out / f"{dag.graph.get('name', 'graph')}_pareto.png", baselines=baselines,
                       title=f"{dag.graph.get('name', 'graph')}: {args.solver} over {len(budgets)} budgets")
    if args.json:
        print(json.dumps({"dag_hash": key, "solver": args.solver, "points": rows, "pareto_png": str(png),
                          "baselines": {k: v.summary() for k, v in baselines.items()}}))
        return 0
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
    print(f"Pareto plot: {png}; results: {db_path}")
    return 0


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _model_args(p: argparse.ArgumentParser, *, default_model: str | None, default_layers: int | None) -> None:
    p.add_argument("--model", default=default_model,
                   help="reference model preset: llama3-debug, llama3-8b, llama3-70b, llama3-405b"
                        + (f" (default {default_model})" if default_model else ""))
    p.add_argument("--n-layers", type=positive_int, default=default_layers,
                   help="decoder layers to trace (default %(default)s; fewer is faster)")
    p.add_argument("--world-size", type=positive_int, default=64,
                   help="FSDP ranks, also the cluster size for the cost model (default %(default)s, 8 per node)")
    p.add_argument("--inter-node-gbps", type=positive_float, default=None,
                   help="inter-node bus bandwidth per GPU in GB/s (default: the Cluster default, 50)")


def _solve_args(p: argparse.ArgumentParser, *, budget_default: str, time_limit: float) -> None:
    p.add_argument("--solver", default="cpsat",
                   help="cpsat (default), milp, or a heuristic: traced, fsdp2, simplefsdp, autoparallel")
    p.add_argument("--budget", type=budget_arg, default=budget_default,
                   help="peak-memory budget: a size such as 40GiB or 512MB, 'auto' (0.9 x the FSDP2-like "
                        "peak, at least the smallest baseline peak), a multiple of that peak such as 0.8x, or 'none' (default %(default)s)")
    p.add_argument("--time-limit", type=positive_float, default=time_limit,
                   help="solver time limit per graph in seconds (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsdp-sched", description="Solver-based scheduling of FSDP collectives under a memory budget.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", help="compare fsdp-sched with FSDP2, SimpleFSDP, AutoParallel and torch on a model",
                       description="Trace a reference model, simulate the traced order, the FSDP2, SimpleFSDP and "
                                   "AutoParallel-like heuristics, torch's overlap scheduler and fsdp-sched under a "
                                   "budget, print a comparison per graph and write Gantt / memory pictures and "
                                   "Chrome traces.")
    _model_args(p, default_model="llama3-8b", default_layers=8)
    _solve_args(p, budget_default="auto", time_limit=20.0)
    p.add_argument("--out", default="fsdp-sched-out", help="output directory (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of tables")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("trace", help="trace a model into DAG JSON files",
                       description="Capture a reference model's FSDP forward / backward graphs and save them as "
                                   "cost-annotated DAG JSON (input of solve and sweep).")
    _model_args(p, default_model="llama3-8b", default_layers=8)
    p.add_argument("--graph", choices=("forward", "backward", "both"), default="both",
                   help="which graph to save (default %(default)s)")
    p.add_argument("--out", default="fsdp-sched-out", help="output directory (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the written paths as JSON")
    p.set_defaults(func=cmd_trace)

    for name, helptext in (("solve", "solve one graph: schedule, report, Chrome trace, Gantt chart"),
                           ("sweep", "solve one graph for many budgets: table and Pareto plot")):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("dag", nargs="?", help="DAG JSON file from `fsdp-sched trace` (or use --model)")
        _model_args(p, default_model=None, default_layers=8)
        p.add_argument("--graph", choices=GRAPHS, default="backward",
                       help="with --model: the graph to solve (default %(default)s)")
        p.add_argument("--out", default="fsdp-sched-out", help="output directory (default %(default)s)")
        p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
        if name == "solve":
            _solve_args(p, budget_default="none", time_limit=20.0)
            p.set_defaults(func=cmd_solve)
        else:
            p.add_argument("--solver", default="cpsat", help="solver to sweep (default %(default)s)")
            p.add_argument("--budgets", type=budget_arg, nargs="+", default=["1.0x", "0.9x", "0.8x", "0.7x"],
                           help="budgets: sizes (40GiB) or multiples of the FSDP2-like peak (0.8x) "
                                "(default: 1.0x 0.9x 0.8x 0.7x)")
            p.add_argument("--time-limit", type=positive_float, default=10.0,
                           help="solver time limit per point in seconds (default %(default)s)")
            p.add_argument("--workers", type=positive_int, default=1,
                           help="solve points in N local processes (default 1: sequential)")
            p.add_argument("--address", default=None, metavar="URL",
                           help="solve the points on an existing cluster: a Dask scheduler (tcp://HOST:PORT, "
                                "needs dask[distributed]) or a Ray cluster (ray://HOST:PORT, needs ray); the "
                                "workers need fsdp-sched installed")
            p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                           help="show progress on stderr: a tqdm bar if tqdm is installed and stderr is a "
                                "terminal, else one line per point (default: on)")
            p.add_argument("--db", default=None,
                           help="SQLite results file; finished points are skipped on rerun (default OUT/sweep.sqlite)")
            p.set_defaults(func=cmd_sweep)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
