"""Pieces shared by the commands: argument types, model -> DAGs, tables and pictures."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import networkx as nx

from scheduler.whatif import plots
from scheduler.costs.hardware import Cluster
from scheduler.export.dag import DagError, export_dag
from scheduler.export.dagfile import dag_to_json, load_dag
from solvers.core import InfeasibleBudgetError, parse_bytes, simulate, units
from solvers.registry import solve

logger = logging.getLogger(__name__)

GRAPHS = ("forward", "backward")


class CliError(Exception):
    """A user error: printed as one line, exit status 2. ``kind`` names it in a JSON error
    object (``--json``): the library error it stands for, or ``"CliError"``."""

    def __init__(self, message: str, *, kind: str = "CliError") -> None:
        super().__init__(message)
        self.kind = kind


def infeasible_budget(e: InfeasibleBudgetError, flag: str = "--budget") -> CliError:
    """The command line's words for a budget no schedule reaches: its own ``flag`` where the
    library's message names ``mem_budget``, from the error's figures (not its text)."""
    budget = f"{flag} {fmt_bytes(e.mem_budget_bytes)} ({e.mem_budget_bytes} B)"
    if e.min_peak_bytes is None:
        return CliError(f"no schedule keeps peak memory under {budget}: raise {flag}", kind=type(e).__name__)
    return CliError(f"no schedule keeps peak memory under {budget}; the smallest peak found is "
                    f"{fmt_bytes(e.min_peak_bytes)} ({e.min_peak_bytes} B): raise {flag} to at least that",
                    kind=type(e).__name__)


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
        if not (math.isfinite(f) and f > 0):
            raise argparse.ArgumentTypeError(
                f"bad budget {text!r}: a multiple of the FSDP2-like peak must be a finite number > 0, like '0.8x'")
        return text.strip()
    try:
        return parse_bytes(text)  # type: ignore[return-value]
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad budget: {e}; or 'auto', 'none', '0.8x'") from None


def cost_model_arg(text: str) -> str:
    """``--cost-model``: a name (analytic, torch) or a spec of parts (table:PATH,
    profile:PATH, compute:torch+table:PATH, ...: :class:`scheduler.costs.spec.CostSpec`),
    checked now (files read) so that a bad name or file fails before any model is traced."""
    from scheduler.costs.spec import resolve_cost_model

    try:
        resolve_cost_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None
    return text.strip() if ":" in text else text.strip().lower()


def positive_float(text: str) -> float:
    """A finite number > 0 (a time limit, a bandwidth): "inf" and "nan" are refused, since
    the solvers would not honour them as the user meant."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}; give a finite number > 0") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def _int_at_least(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}; give an integer >= {least}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def world_size_arg(text: str) -> int:
    """``--world-size``: FSDP shards over at least two ranks."""
    return _int_at_least(text, 2)


def out_dir_arg(text: str) -> str:
    """``--out``: a directory, created when the command writes. Checked while parsing, before
    any model is traced, so that a path that cannot be a directory fails at once; nothing is
    created here (argparse runs this on the default too)."""
    path = Path(text)
    try:
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(
                f"{text!r} is a file; give a directory (it is created if missing)")
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise argparse.ArgumentTypeError(
                f"cannot create directory {text!r}: {str(existing)!r} is a file; give a directory (it is created if missing)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write in {str(existing)!r}; give a writable directory")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot use {text!r} as a directory: {e.strerror or e}") from None
    return text


def db_arg(text: str) -> str:
    """``--db``: a SQLite file in an existing directory (the file itself is created if missing)."""
    path = Path(text)
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a SQLite file name")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(
                f"directory {str(path.parent)!r} of {text!r} does not exist; give a file in an existing directory")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot use {text!r} as a SQLite file: {e.strerror or e}") from None
    return text


def ensure_out_dir(out: Path) -> Path:
    """Create the ``--out`` directory; a failure (a race with the parse-time check, a full or
    read-only disk) is a :class:`CliError`."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out {str(out)!r}: cannot create the directory: {e.strerror or e}") from None
    return out


def resolve_budget(spec: str | int | None, fsdp2_peak_bytes: int, floor_bytes: int = 0, *,
                   arg: str = "--budget") -> int | None:
    """Bytes of a :func:`budget_arg` value; "auto" is 0.9 x ``fsdp2_peak_bytes``, raised to
    ``floor_bytes`` (the smallest peak a baseline reached) when that is higher, so that it is
    reachable. A multiple that comes to less than a byte or more than
    :data:`~solvers.core.units.MAX_BYTES` is a :class:`CliError` naming ``arg``."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, int):
        return spec
    if spec == "auto":
        return max(int(0.9 * fsdp2_peak_bytes), floor_bytes)
    budget = float(spec[:-1]) * fsdp2_peak_bytes
    if not 1 <= budget <= units.MAX_BYTES:
        raise CliError(f"{arg} {spec}: {spec} of the FSDP2-like peak {fmt_bytes(fsdp2_peak_bytes)} is "
                       f"{budget:.3g} bytes; a budget must come to 1 byte up to 2**63 - 1 bytes")
    return int(budget)


def fmt_bytes(n: float | None) -> str:
    """Bytes for a table; "none" for no budget."""
    return "none" if n is None else units.fmt_bytes(n)


def fmt_ms(ms: float | None) -> str:
    """ms for a table; "-" when unknown."""
    return "-" if ms is None else units.fmt_ms(ms)


# --------------------------------------------------------------------------------------------
# model -> DAGs
# --------------------------------------------------------------------------------------------
def cluster_of(args: argparse.Namespace):
    kw: dict[str, Any] = {"n_gpus": args.world_size}
    if getattr(args, "inter_node_gbps", None):
        kw["inter_node_gbps"] = args.inter_node_gbps
    try:
        return Cluster(**kw)
    except ValueError as e:
        raise CliError(str(e)) from None


def trace_model(args: argparse.Namespace, graphs: tuple[str, ...] = GRAPHS) -> tuple[dict[str, nx.DiGraph], Any]:
    """Capture ``args.model`` and export the requested graphs: (name -> DAG, CapturedGraphs)."""
    from models import capture_fsdp_graphs, list_presets  # torch and the models only for commands that trace

    if args.model not in list_presets():
        raise CliError(f"unknown model {args.model!r}; choose one of {', '.join(list_presets())}")
    if args.world_size < 2:
        raise CliError(f"--world-size must be >= 2, got {args.world_size}")
    logger.info("tracing %s (%s layers) on %d ranks", args.model, args.n_layers or "all", args.world_size)
    t0 = time.perf_counter()
    captured = capture_fsdp_graphs(args.model, world_size=args.world_size, n_layers=args.n_layers)
    cluster = cluster_of(args)
    dags = {}
    for g in graphs:
        gm = getattr(captured, g)
        gm.meta.setdefault("fsdp_graph_kind", g)
        dags[g] = export_dag(gm, cost_model=getattr(args, "cost_model", None), cluster=cluster, name=g)
    logger.info("traced in %.1f s", time.perf_counter() - t0)
    return dags, captured


def load_dag_file(path: str) -> nx.DiGraph:
    """The DAG in ``path``, a file written by ``fsdp-sched trace``; any reason it cannot be read
    is a :class:`CliError` naming the file."""
    p = Path(path)
    if not p.exists():
        raise CliError(f"no such DAG file: {path} (give a DAG JSON file written by `fsdp-sched trace`)")
    if not p.is_file():
        raise CliError(f"{path} is not a file; give a DAG JSON file written by `fsdp-sched trace`")
    try:
        return load_dag(p)
    except DagError as e:
        raise CliError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {path}: {e}") from None
    except RecursionError:  # JSON nested deeper than the parser can follow
        raise CliError(f"{path} is not an fsdp-sched DAG file (its JSON is nested too deeply)") from None


def dag_hash(dag: nx.DiGraph) -> str:
    return hashlib.sha256(json.dumps(dag_to_json(dag), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------
def heuristic_sim(problem, name: str):
    """(SimResult, SolveResult) of heuristic ``name`` without a budget."""
    if name == "traced":
        return simulate(problem.dag, problem.traced_schedule(), problem=problem), None
    res = solve(problem, solver=name, work_limit=10.0)
    return simulate(problem.dag, res.schedule, problem=problem), res


def write_pictures(sim, problem, out: Path, stem: str, budget: int | None) -> list[Path]:
    return [
        plots.gantt(sim, problem, out / f"{stem}_gantt.png"),
        plots.memory(sim, out / f"{stem}_memory.png", budget_bytes=budget,
                     title=f"{stem}: memory, peak {fmt_bytes(sim.peak_bytes)}, budget {fmt_bytes(budget)}"),
        sim.write_chrome_trace(out / f"{stem}_trace.json", problem=problem),
    ]


def row(name: str, sim=None, *, solve_s: float | None = None, gap: float | None = None,
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




def input_dag(args: argparse.Namespace) -> nx.DiGraph:
    if args.dag and args.model:
        raise CliError("give a DAG file or --model, not both")
    if args.dag:
        if getattr(args, "cost_model", None):
            raise CliError("--cost-model prices a traced model (--model); a DAG file keeps the costs it was traced "
                           "with: re-trace it with `fsdp-sched trace --cost-model ...`")
        return load_dag_file(args.dag)
    if args.model:
        dags, _ = trace_model(args, (args.graph,))
        return dags[args.graph]
    raise CliError("give a DAG file (from `fsdp-sched trace`) or --model")
