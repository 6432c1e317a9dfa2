"""Joint forward + loss + backward graphs against the graph trainer's own style of scheduling.

torchtitan's graph trainer traces a training step as ONE joint graph with make_fx
(:func:`models.capture_joint_graph`) and schedules its collectives with torch's passes. For each
model spec this captures that graph and compares fsdp-sched with three baselines, each written
back on a copy of the graph and judged on the written graph
(:func:`scheduler.compare.judged.judge_baseline`):

- the traced order (``traced``: the graph as make_fx wrote it, one collective per parameter);
- the per-block plan (``torch-manual``: torch's manual scheduler with one all-gather and one
  reduce-scatter bucket per block and direction, as the graph trainer's joint pass buckets,
  :func:`scheduler.compare.baselines.torch_manual_schedule`);
- torch's overlap scheduler (``torch-overlap``, :func:`scheduler.compare.baselines.torch_overlap_schedule`);
  where torch's pass fails on the joint graph, its row says why.

For each baseline B that is made, ``optimize_schedule`` runs on a fresh copy of the traced graph
with its defaults (``cost_model=None``: the robust family) at ``mem_budget = peak(B)``, the peak
the budget holds (the larger of the re-exported model count and the liveness count of B's
written graph, under every judging model), timed end to end; both written graphs are judged
under the analytic and torch cost models (step ms and peaks). The comparison itself is
:func:`scheduler.compare.equal_memory.compare` (baselines sharing a peak share one solve).

    python benchmarks/joint.py                              # llama3-8b, 8 layers, 64 ranks
    python benchmarks/joint.py llama3-8b:2:64 --json joint2.json
    python benchmarks/joint.py llama3-8b:8:64 --sac          # selective activation checkpointing
    python benchmarks/joint.py llama3-debug:2:4 --no-reshard
    python benchmarks/joint.py foreign:tied:8:64 foreign:sac:8:64   # graphs written without models/

A model is ``preset:n_layers:world_size`` (any preset of :mod:`models.llama`). Prints one table
per model (budget, B's and fsdp-sched's step and peak, the speedup and the solve time per cost
model), baselines that could not be made with the reason, and the geometric means per cost model
(:func:`scheduler.compare.equal_memory.headline`). ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):  # this repository's library and its harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from scheduler.compare.equal_memory import COST_MODELS, Comparison, Row, _ms, _x, compare, headline  # noqa: E402
from scheduler.compare.judged import TORCH, TORCH_MANUAL, display  # noqa: E402
from solvers.core import fmt_bytes  # noqa: E402

logger = logging.getLogger("benchmarks.joint")

DEFAULT_MODELS = ("llama3-8b:8:64",)
#: the graph trainer's ways of scheduling a joint graph, each fsdp-sched's budget in turn
BASELINES = ("traced", TORCH_MANUAL, TORCH)


@dataclasses.dataclass(kw_only=True)
class JointRun:
    """One model spec: its joint graph's capture and the comparison on it."""

    spec: str
    #: the spec and its capture options, as the table names it (``llama3-8b:8:64+sac``)
    label: str
    world_size: int
    capture_options: dict[str, Any]
    n_nodes: int
    capture_s: float
    comparison: Comparison
    #: wall time of writing, judging and solving everything of this spec (s)
    compare_s: float

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec, "label": self.label, "world_size": self.world_size,
                "capture_options": self.capture_options, "n_nodes": self.n_nodes, "capture_s": self.capture_s,
                "compare_s": self.compare_s, **self.comparison.to_json()}


def parse_spec(spec: str) -> tuple[str, int, int]:
    """(preset, n_layers, world_size) of ``preset:n_layers:world_size``; a clear error otherwise."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise SystemExit(f"model {spec!r}: expected preset:n_layers:world_size, e.g. llama3-8b:8:64")
    return parts[0], int(parts[1]), int(parts[2])


def capture_options(*, sac: bool, reshard: bool) -> dict[str, Any]:
    """The options of :func:`models.capture_joint_graph` for the flags (selective activation
    checkpointing recomputes the gathers in any case)."""
    options: dict[str, Any] = {"reshard_after_forward": reshard or sac}
    if sac:
        options["activation_checkpointing"] = "selective"
    return options


def run_spec(spec: str, *, sac: bool = False, reshard: bool = True, baselines: Sequence[str] = BASELINES,
             cost_models: Sequence[str] = COST_MODELS, work_limit: float | None = None) -> JointRun:
    """Capture the joint graph of ``spec`` and compare fsdp-sched at each baseline's peak with
    it under each of ``cost_models`` (module docstring). ``work_limit``: the solver's work
    limit (None: ``optimize_schedule``'s default)."""
    import models
    from models.capture import fake_process_group
    from scheduler.costs.hardware import Cluster
    from scheduler.options import SolverOptions

    solver = SolverOptions() if work_limit is None else SolverOptions(work_limit=work_limit)
    if spec.startswith("foreign:"):
        return _run_foreign(spec, baselines=baselines, cost_models=cost_models, solver=solver)
    preset, n_layers, world_size = parse_spec(spec)
    options = capture_options(sac=sac, reshard=reshard)
    label = spec + ("+sac" if sac else "" if options["reshard_after_forward"] else "+keep")
    logger.info("%s: capturing the joint graph (%s)", label, options)
    joint = models.capture_joint_graph(preset, world_size=world_size, n_layers=n_layers, **options)
    n_nodes = len(joint.graph.graph.nodes)
    logger.info("%s: captured %d nodes in %.1f s", label, n_nodes, joint.trace_time_s)
    t0 = time.perf_counter()
    with fake_process_group(world_size):
        comparison = compare(joint.graph, graph=label, baselines=baselines, cost_models=cost_models,
                             cluster=Cluster(n_gpus=world_size, gpus_per_node=min(8, world_size)), solver=solver,
                             on_row=_progress)
    return JointRun(spec=spec, label=label, world_size=world_size, capture_options=options, n_nodes=n_nodes,
                    capture_s=joint.trace_time_s, comparison=comparison, compare_s=time.perf_counter() - t0)


def _run_foreign(spec: str, *, baselines: Sequence[str], cost_models: Sequence[str], solver: Any) -> JointRun:
    """A joint graph of a style of ``tests/foreign_models.py`` (``foreign:style:n_layers:world_size``,
    written without ``models/``, as wide as ``benchmarks/foreign.py`` makes it), compared as
    :func:`run_spec` compares a preset's. One fake world from the capture on, so that the
    style's own groups resolve when graphs are written back."""
    from models.capture import fake_process_group
    from scheduler.costs.hardware import Cluster

    parts = spec.split(":")
    if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
        raise SystemExit(f"model {spec!r}: expected foreign:style:n_layers:world_size, e.g. foreign:tied:8:64")
    style, n_layers, world_size = parts[1], int(parts[2]), int(parts[3])
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import foreign_models

    with fake_process_group(world_size):
        t0 = time.perf_counter()
        captured = foreign_models.capture_joint(style, n_layers=n_layers, world_size=world_size, dim=2048)
        capture_s = time.perf_counter() - t0
        gm = captured.forward  # the joint graph (both fields hold it)
        t0 = time.perf_counter()
        comparison = compare(gm, graph=spec, baselines=baselines, cost_models=cost_models,
                             cluster=Cluster(n_gpus=world_size, gpus_per_node=min(8, world_size)), solver=solver,
                             on_row=_progress)
    return JointRun(spec=spec, label=spec, world_size=world_size, capture_options={"style": style}, n_nodes=len(
        gm.graph.nodes), capture_s=capture_s, comparison=comparison, compare_s=time.perf_counter() - t0)


def _progress(row: Row) -> None:
    logger.info("%s vs %s under %s at %s: %s ms vs %.3f ms (%s)", row.graph, display(row.baseline), row.cost_model,
                fmt_bytes(row.budget_bytes), _ms(row.product_ms), row.baseline_ms, _x(row.speedup))


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**30:.4f}"


def format_table(runs: Sequence[JointRun]) -> str:
    """One line per (graph, baseline, cost model): the budget (B's held peak), B's step, fsdp-
    sched's step and held peak, the speedup and fsdp-sched's solve time (optimize_schedule end
    to end); a line per baseline that could not be made, with the reason."""
    width = max([len("graph"), *(len(r.label) for r in runs)]) + 2
    head = (f"{'graph':<{width}}{'baseline':<20}{'cost':<10}{'budget GiB':>11}{'B ms':>10}{'fsdp-sched ms':>15}"
            f"{'speedup':>9}{'sched GiB':>11}{'solve s':>9}{'bound ms':>10}")
    lines = [head, "-" * len(head)]
    for run in runs:
        for r in run.comparison.rows:
            lines.append(
                f"{r.graph:<{width}}{display(r.baseline):<20}{r.cost_model:<10}{_gib(r.budget_bytes):>11}"
                f"{r.baseline_ms:10.3f}{_ms3(r.product_ms):>15}{_x(r.speedup):>9}{_gib(r.product_peak_bytes):>11}"
                f"{_s(r.compile_s):>9}{_ms3(r.lower_bound_ms):>10}"
                + (f"  {r.note}" if r.note and not r.fits else ""))
        for name, reason in run.comparison.unavailable.items():
            lines.append(f"{run.label:<{width}}{display(name):<20}unavailable: {reason}")
    return "\n".join(lines)


def format_baselines(runs: Sequence[JointRun]) -> str:
    """Per graph and written graph: its pass time and its peaks by each count (the budget holds
    the larger of the re-export and the liveness count; torch's tracker count is reported)."""
    width = max([len("graph"), *(len(r.label) for r in runs)]) + 2
    lines = [f"{'graph':<{width}}{'written graph':<26}{'pass s':>8}{'re-export GiB':>15}{'liveness GiB':>14}"
             f"{'tracker GiB':>13}{'collectives':>13}"]
    for run in runs:
        c = run.comparison
        graphs = [(display(n), j) for n, j in c.baselines.items()]
        graphs += [(f"fsdp-sched @ {_gib(b)}", j) for (b, _), j in sorted(c.products.items(), key=lambda kv: kv[0][0])]
        for name, j in graphs:
            if not j.ok:
                lines.append(f"{run.label:<{width}}{name:<26}{_s(j.compile_s):>8}  no graph: {j.error}")
                continue
            f = j.figures[next(iter(j.figures))]  # the counts are the same under every cost model
            lines.append(f"{run.label:<{width}}{name:<26}{_s(j.compile_s):>8}{_gib(f.peak_bytes):>15}"
                         f"{_gib(f.liveness_peak_bytes):>14}{_gib(f.tracker_peak_bytes):>13}{f.n_collectives:>13}")
    return "\n".join(lines)


def _ms3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="preset:n_layers:world_size, or foreign:style:n_layers:world_size (a joint style of "
                             "tests/foreign_models.py: tied, alternating, sac, tp, fp32)")
    parser.add_argument("--sac", action="store_true",
                        help="selective activation checkpointing per block (matmuls and attention saved)")
    parser.add_argument("--no-reshard", dest="reshard", action="store_false",
                        help="keep gathered parameters from forward to backward (no re-gathers)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="solver work limit per solve, s (default: optimize_schedule's)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every library's progress, not only ours")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    for name in ("benchmarks.joint", "scheduler.compare"):
        logging.getLogger(name).setLevel(logging.INFO)
    t0 = time.perf_counter()
    runs = []
    for spec in args.models:
        runs.append(run_spec(spec, sac=args.sac, reshard=args.reshard, work_limit=args.time_limit))
        if args.json:  # after each spec, so that a long run leaves what it has
            args.json.write_text(json.dumps([r.to_json() for r in runs], indent=1))
    rows = [row for r in runs for row in r.comparison.rows]
    print(f"\n== joint graphs: fsdp-sched at each baseline's peak ==\n{format_table(runs)}")
    print(f"\n== written graphs ==\n{format_baselines(runs)}")
    print(f"\n{headline(rows)}\n({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
