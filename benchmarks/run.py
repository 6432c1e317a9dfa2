"""Regenerate the comparison tables and memory / step-time Pareto frontiers.

For every model and graph (forward, backward), simulated with the analytic cost model:

* a comparison table like ``benchmarks/compare.py``: at budgets {none, traced-order peak,
  FSDP2-like peak, 0.9 x FSDP2-like peak}, step ms, exposed communication ms, peak GiB, number of
  collectives, solve time and gap for the traced order, FSDP2-like, SimpleFSDP-like (greedy),
  AutoParallel-like, torch's ``overlap_scheduling`` and fsdp-sched (each of ``--solvers``);
* a Pareto frontier: fsdp-sched (``--pareto-solver``, default cpsat) at ``--budgets`` budgets
  swept between the smallest heuristic peak and the unconstrained peak, with the baselines
  marked, as a table and a PNG per model and graph.

Traced graphs are cached as DAG JSON under ``--cache-dir`` (default ``benchmarks/cache``), keyed
by model, layers, world size, GPUs per node, capture options and the DAG schema version, so reruns do not re-trace
(``--no-cache`` forces a trace). torch's scheduler needs the FX GraphModule, so its row is
computed only when the graph is traced in this run and stored next to the DAG as JSON
(``<key>-<graph>-torch.json``); a cached run reuses that row.

    python benchmarks/run.py                                  # llama3-8b, -70b, -405b, world 64
    python benchmarks/run.py --models llama3-8b --n-layers 4 --time-limit 10 --out benchmarks/out/run
    python benchmarks/run.py --quick --out /tmp/quick         # llama3-debug, 2 layers, world 8 (< 60 s)

Writes, under ``--out``: ``<model>.md`` / ``<model>.json`` (rows of both tables),
``pareto-<model>-<graph>.png``, and ``summary.md`` (all tables with the header line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):  # this repository's library and its harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

logger = logging.getLogger("benchmarks.run")

HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")
DEFAULT_MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")
GRAPHS = ("forward", "backward")
TORCH_METHOD = "torch overlap_scheduling"
CACHE_VERSION = 1
DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"


def spec_world_size(spec: str) -> int:
    """The world size of a model spec (:func:`capture_spec`)."""
    parts = spec.split(":")
    return int(parts[3] if parts[0] == "foreign" else parts[2])


#: data-parallel modes of a preset spec's fourth field -> capture options (``hsdpR``: HSDP with
#: R replicas of the shard group)
def _dp_options(mode: str) -> dict[str, Any]:
    if mode == "ddp":
        return {"dp_mode": "replicate"}
    if mode.startswith("hsdp") and mode[4:].isdigit():
        return {"dp_mode": "hybrid_shard", "replicate_size": int(mode[4:])}
    raise SystemExit(f"data-parallel mode {mode!r}: expected ddp or hsdpR (R replicas, e.g. hsdp8)")


def capture_spec(spec: str) -> tuple[Any, int]:
    """(object with .forward / .backward graphs, world size) of a model spec: a preset
    ``preset:n_layers:world_size`` (captured by ``models/``; a fourth field ``ddp`` or ``hsdpR``
    picks that data parallelism instead of FSDP) or ``foreign:style:n_layers:world_size`` (a
    style of ``tests/foreign_models.py``, captured with plain torch.compile, none of our
    metadata), as ``cross_model.py`` and ``equal_memory.py`` take them."""
    parts = spec.split(":")
    if parts[0] == "foreign" and len(parts) == 4:
        tests = str(Path(__file__).resolve().parents[1] / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from foreign_models import capture as capture_foreign

        world_size = int(parts[3])
        return capture_foreign(parts[1], n_layers=int(parts[2]), world_size=world_size), world_size
    if len(parts) not in (3, 4):
        raise SystemExit(f"model {spec!r}: expected preset:n_layers:world_size[:ddp|:hsdpR] or "
                         "foreign:style:n_layers:world_size")
    from models import capture_fsdp_graphs

    options = _dp_options(parts.pop()) if len(parts) == 4 else {}
    preset, n_layers, world_size = parse_model_spec(":".join(parts))
    return capture_fsdp_graphs(preset, world_size=world_size, n_layers=n_layers, **options), world_size


def parse_model_spec(spec: str) -> tuple[str, int, int]:
    """(preset, n_layers, world_size) of a model spec ``preset:n_layers:world_size``, as the
    benchmarks taking several models write them (``equal_memory.py``, ``writeback_agreement.py``)."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise SystemExit(f"model {spec!r}: expected preset:n_layers:world_size, e.g. llama3-8b:8:64")
    return parts[0], int(parts[1]), int(parts[2])


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------
def _gib(b: float | None) -> float | None:
    return None if b is None else round(b / 2**30, 6)


def _fmt_bytes(b: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.3f} {unit}"
    return f"{int(b)} B"


def _mem_unit(max_bytes: float) -> tuple[str, float]:
    """The binary unit the table's memory columns are written in (GiB down to KiB)."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if max_bytes >= f:
            return unit, float(f)
    return "KiB", float(1 << 10)


def _row(graph: str, budget_label: str, method: str, *, budget: int | None = None, res=None, sim=None,
         note: str = "") -> dict:
    row: dict[str, Any] = {"graph": graph, "budget": budget_label, "budget_bytes": budget,
                           "budget_gib": _gib(budget), "method": method}
    if sim is not None:
        row.update({
            "step_ms": round(sim.step_ms, 3),
            "exposed_ms": round(sim.exposed_comm_ms, 3),
            "peak_bytes": int(sim.peak_bytes),
            "peak_gib": _gib(sim.peak_bytes),
            "n_coll": sim.n_collectives,
        })
    if res is not None:
        row["solve_s"] = round(res.solve_time_s, 2)
        row["gap_pct"] = round(100 * res.gap, 2) if res.solver in ("cpsat", "milp") else None
    row["note"] = note
    return row


# --------------------------------------------------------------------------------------------
# traced graphs, cached
# --------------------------------------------------------------------------------------------
def parse_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` capture options; VALUE is read as JSON when it parses (``true``, ``4``),
    as a string otherwise."""
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(val)
        except json.JSONDecodeError:
            opts[key] = val
    return opts


def cache_key(model: str, n_layers: int | None, world_size: int, gpus_per_node: int,
              options: dict[str, Any]) -> str:
    from scheduler.export.schema import SCHEMA_VERSION

    ident = json.dumps({"v": CACHE_VERSION, "dag_schema": SCHEMA_VERSION, "model": model, "n_layers": n_layers, "world_size": world_size,
                        "gpus_per_node": gpus_per_node, "options": options}, sort_keys=True, default=str)
    digest = hashlib.sha1(ident.encode()).hexdigest()[:10]
    return f"{model}-{n_layers if n_layers is not None else 'all'}l-w{world_size}-g{gpus_per_node}-{digest}"


def load_graphs(model: str, args: argparse.Namespace, cluster) -> dict[str, tuple[Any, dict]]:
    """graph name -> (DAG, torch-baseline row), from the cache or by tracing (then cached)."""
    from scheduler import export_dag
    from scheduler.export.dag import DagError
    from scheduler.export.dagfile import load_dag, save_dag

    key = cache_key(model, args.n_layers, args.world_size, args.gpus_per_node, args.options)
    paths = {g: (args.cache_dir / f"{key}-{g}.json", args.cache_dir / f"{key}-{g}-torch.json") for g in args.graphs}
    if not args.no_cache and all(d.exists() and t.exists() for d, t in paths.values()):
        try:
            out = {g: (load_dag(d), json.loads(t.read_text())["row"]) for g, (d, t) in paths.items()}
            logger.info("cache hit: %s (%s) from %s", model, key, args.cache_dir)
            return out
        except (DagError, json.JSONDecodeError, KeyError) as e:
            logger.warning("cache entry %s unreadable (%s); re-tracing", key, e)
    else:
        logger.info("cache %s: %s (%s)", "disabled" if args.no_cache else "miss", model, key)

    from models import capture_fsdp_graphs
    from scheduler.compare.baselines import simulate_torch_baseline

    t = time.perf_counter()
    logger.info("capture: tracing %s (%s layers, world %d)", model, args.n_layers or "all", args.world_size)
    graphs = capture_fsdp_graphs(model, world_size=args.world_size, n_layers=args.n_layers, **args.options)
    logger.info("traced %s in %.1f s", model, time.perf_counter() - t)
    out = {}
    for g, (dpath, tpath) in paths.items():
        gm = getattr(graphs, g)
        dag = export_dag(gm, cluster=cluster)
        try:
            tsim = simulate_torch_baseline(gm, cluster=cluster)
            trow = _row(g, "torch rule (+1GB/5%)", TORCH_METHOD, sim=tsim)
        except Exception as e:  # reported in the table, not hidden
            trow = _row(g, "-", TORCH_METHOD, note=f"unavailable: {type(e).__name__}: {str(e)[:80]}")
        save_dag(dag, dpath)
        tpath.write_text(json.dumps({"key": key, "model": model, "graph": g, "row": trow}, indent=1))
        out[g] = (dag, trow)
    logger.info("cached %s as %s-*.json in %s", model, key, args.cache_dir)
    return out


# --------------------------------------------------------------------------------------------
# comparison and Pareto sweep
# --------------------------------------------------------------------------------------------
def _solve_row(problem, dag, gname: str, label: str, budget: int | None, solver: str, method: str,
               time_limit: float) -> tuple[dict, Any]:
    from scheduler import simulate
    from solvers import InfeasibleBudgetError, solve

    try:
        r = solve(problem, solver=solver, mem_budget_bytes=budget, work_limit=time_limit)
    except InfeasibleBudgetError as e:
        note = f"infeasible (min peak {_fmt_bytes(e.min_peak_bytes)})" if e.min_peak_bytes else "infeasible"
        return _row(gname, label, method, budget=budget, note=note), None
    sim = simulate(dag, r.schedule, problem=problem)
    return _row(gname, label, method, budget=budget, res=r, sim=sim, note="; ".join(r.notes)), sim


def run_graph(gname: str, dag, torch_row: dict, args: argparse.Namespace, model: str) -> tuple[list[dict], list[dict]]:
    """(comparison rows, Pareto rows) of one graph; writes its Pareto PNG."""
    from scheduler.whatif import plots
    from solvers import Problem

    problem = Problem.from_dag(dag)
    base = {}
    for h in HEURISTICS:
        row, sim = _solve_row(problem, dag, gname, "none", None, h, h, args.time_limit)
        base[h] = (row, sim)
    traced_peak = base["traced"][0]["peak_bytes"]
    fsdp2_peak = base["fsdp2"][0]["peak_bytes"]
    budgets = [("none", None), ("traced peak", traced_peak), ("FSDP2 peak", fsdp2_peak),
               ("0.9 x FSDP2 peak", int(0.9 * fsdp2_peak))]
    rows: list[dict] = [dict(torch_row)]
    unconstrained: dict[str, dict] = {}
    for label, budget in budgets:
        for h in HEURISTICS:
            if budget is None:
                rows.append(base[h][0])
            else:
                rows.append(_solve_row(problem, dag, gname, label, budget, h, h, args.time_limit)[0])
        for s in args.solvers:
            row, _ = _solve_row(problem, dag, gname, label, budget, s, f"fsdp-sched {s}", args.time_limit)
            rows.append(row)
            if budget is None:
                unconstrained[s] = row
        logger.info("%s %s: budget %s done", model, gname, label)
    rows.append({"graph": gname, "budget": "-", "method": "analytic lower bound",
                 "step_ms": round(problem.lower_bound_ms(), 3), "note": ""})

    # Pareto sweep: budgets from the smallest heuristic peak up to the unconstrained peak
    ps = args.pareto_solver
    free = unconstrained.get(ps) or _solve_row(problem, dag, gname, "none", None, ps, f"fsdp-sched {ps}", args.time_limit)[0]
    heur_peaks = [r["peak_bytes"] for r, _ in base.values() if "peak_bytes" in r]
    lo = min(heur_peaks)
    hi = free.get("peak_bytes", max(heur_peaks))
    if hi <= lo:  # the unconstrained schedule is already leaner than every heuristic: sweep the heuristics' range
        lo, hi = min(heur_peaks + [hi]), max(heur_peaks + [hi])
    n = max(args.budgets, 1)
    sweep = [int(lo + (hi - lo) * i / (n - 1)) for i in range(n)] if n > 1 else [int(hi)]
    prows: list[dict] = []
    for i, b in enumerate(sweep):
        if i == n - 1 and b >= free.get("peak_bytes", b + 1):
            row = {**free, "budget": f"sweep {i + 1}/{n}", "budget_bytes": b, "budget_gib": _gib(b)}
        else:
            row, _ = _solve_row(problem, dag, gname, f"sweep {i + 1}/{n}", b, ps, f"fsdp-sched {ps}", args.time_limit)
        prows.append(row)
    solved = [r for r in prows if "peak_bytes" in r]
    front = plots.pareto_front([(r["peak_bytes"], r["step_ms"]) for r in solved])
    for r in prows:
        r["on_front"] = "peak_bytes" in r and (r["peak_bytes"], r["step_ms"]) in front
    logger.info("%s %s: Pareto sweep of %d budgets done (%d on the frontier)", model, gname, n, len(front))

    marks = {h: base[h][0] for h in HEURISTICS if "peak_bytes" in base[h][0]}
    if "peak_bytes" in torch_row:
        marks["torch"] = torch_row
    if args.out is not None:
        png = args.out / f"pareto-{model}-{gname}.png"
        plots.pareto(solved, png, baselines=marks,
                     title=f"{model} {gname} ({args.n_layers or 'all'} layers, world {args.world_size}): "
                           f"step time vs peak memory")
        logger.info("wrote %s", png)
    return rows, prows


COMPARE_COLS = ["graph", "budget", "budget_mem", "method", "step_ms", "exposed_ms", "peak_mem", "n_coll",
                "solve_s", "gap_pct", "note"]
PARETO_COLS = ["graph", "budget", "budget_mem", "method", "step_ms", "exposed_ms", "peak_mem", "n_coll",
               "solve_s", "on_front", "note"]
NOTE_CHARS = 120


def to_markdown(rows: list[dict], cols: list[str]) -> str:
    """Markdown table; ``budget_mem`` / ``peak_mem`` are ``budget_bytes`` / ``peak_bytes`` in the
    binary unit that fits the largest of them (named in the header), notes are shortened."""
    top = max([r.get(k) or 0 for r in rows for k in ("budget_bytes", "peak_bytes")] + [1])
    unit, f = _mem_unit(top)
    names = {"budget_mem": f"budget_{unit}", "peak_mem": f"peak_{unit}"}

    def cell(r: dict, c: str) -> str:
        if c in ("budget_mem", "peak_mem"):
            b = r.get("budget_bytes" if c == "budget_mem" else "peak_bytes")
            return "" if b is None else f"{b / f:.3f}"
        v = r.get(c)
        if v is None:
            return ""
        v = str(v).replace("|", "/")
        return v if len(v) <= NOTE_CHARS else v[:NOTE_CHARS - 3] + "..."

    lines = ["| " + " | ".join(names.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, c) for c in cols) + " |")
    return "\n".join(lines)


def header_line(argv: list[str]) -> str:
    return (f"command: `{shlex.join(['python', 'benchmarks/run.py', *argv])}`; machine: {platform.node()} "
            f"({platform.processor() or platform.machine()}); date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None, help=f"model presets (default {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--n-layers", type=int, default=None, help="override the presets' layer count")
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default 64)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=GRAPHS)
    ap.add_argument("--solvers", nargs="+", default=["cpsat"], choices=["cpsat", "milp"])
    ap.add_argument("--pareto-solver", default="cpsat", choices=["cpsat", "milp"])
    ap.add_argument("--time-limit", type=float, default=None, help="limit per solve, s (default 30)")
    ap.add_argument("--budgets", type=int, default=None, help="budgets in the Pareto sweep (default 6)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="capture option (models.capture_fsdp_graphs), e.g. activation_checkpointing=true")
    ap.add_argument("--out", type=Path, default=None, help="write markdown tables, JSON and PNGs here")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--no-cache", action="store_true", help="re-trace even when a cached DAG exists")
    ap.add_argument("--quick", action="store_true",
                    help="llama3-debug, 2 layers, world 8, 1 s solves, 3 budgets (CI; < 60 s)")
    args = ap.parse_args(argv)
    quick = {"models": ["llama3-debug"], "n_layers": 2, "world_size": 8, "time_limit": 1.0, "budgets": 3}
    full = {"models": list(DEFAULT_MODELS), "n_layers": None, "world_size": 64, "time_limit": 30.0, "budgets": 6}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.gpus_per_node = min(args.gpus_per_node, args.world_size)
    args.options = parse_options(args.option)
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from scheduler import Cluster

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(n_gpus=args.world_size, gpus_per_node=args.gpus_per_node)
    t0 = time.perf_counter()
    header = header_line(raw)
    sections = [f"# fsdp-sched benchmarks\n\n{header}\n"]
    for model in args.models:
        tm = time.perf_counter()
        graphs = load_graphs(model, args, cluster)
        rows: list[dict] = []
        prows: list[dict] = []
        for g in args.graphs:
            dag, trow = graphs[g]
            r, p = run_graph(g, dag, trow, args, model)
            rows += r
            prows += p
        title = f"{model} ({args.n_layers or 'all'} layers), world {args.world_size}, {args.gpus_per_node} GPUs/node"
        md = (f"## {title}\n\n{header}; {time.perf_counter() - tm:.0f} s\n\n### comparison\n\n"
              f"{to_markdown(rows, COMPARE_COLS)}\n\n### Pareto sweep ({args.pareto_solver}, {args.budgets} budgets)\n\n"
              f"{to_markdown(prows, PARETO_COLS)}\n")
        sections.append(md)
        print("\n" + md, flush=True)
        if args.out is not None:
            (args.out / f"{model}.md").write_text(md)
            (args.out / f"{model}.json").write_text(json.dumps(
                {"model": model, "n_layers": args.n_layers, "world_size": args.world_size,
                 "gpus_per_node": args.gpus_per_node, "options": args.options, "header": header,
                 "comparison": rows, "pareto": prows}, indent=1))
    if args.out is not None:
        (args.out / "summary.md").write_text("\n".join(sections))
    logger.info("done in %.1f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
