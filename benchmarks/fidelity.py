"""Fidelity of the execution model: predicted vs measured step time on a real gloo group.

Each rank of a local gloo group builds the same FSDP model (:func:`models.build_model`, fp32),
fits a :class:`scheduler.costs.measure.MeasuredCostModel` on the live group (collective alpha-beta
lines, compute ops timed on this CPU), compiles the model with the fsdp-sched backend
(:func:`scheduler.backend`) once per solver, runs training steps, and compares the wall time of
forward and backward with what the simulator predicted for the rewritten graphs
(``ScheduleReport.step_ms_after``) on the same costs.

This is a check of the execution model (one compute stream, one FIFO stream per group,
alpha-beta collectives, op times that add up), measured on CPU kernels and gloo: it says
nothing about GPU performance. Time that the simulator does not model (autograd engine,
dynamo guards, Python between ops) shows up as measured > predicted.

With ``--profile`` each solver's compiled step is also predicted from a profile of the same
run: the collectives are timed on the same group by ``fsdp-sched measure`` (its CSV, read back
as a :class:`scheduler.costs.models.TableCostModel`), a training step is recorded with
``torch.profiler`` on every rank after each timed step (CPU activity, ``record_shapes=True``;
the profiled steps are not timed), and the rewritten forward and backward graphs that ran
are priced by :class:`scheduler.costs.models.ProfileCostModel` (each node's op on its input
shapes as the profile timed it; unmatched nodes timed on this CPU by the measured model; each
collective by gloo's own time for it in the profiled step on the rank that started it last,
every rank's trace read, else from that table), then simulated in their order, once per
profiled step; the median over the steps of the slowest rank's prediction is compared with the
median of the measured steps (each step's slowest rank), and the means too. Beside it, every
rank's trace of the step at once: each rank priced by its own trace, the ranks run in lockstep
at the collectives (:func:`scheduler.simulate_ranks`: a collective starts when the last rank
reaches it), which a single rank's simulation cannot see.
The same prediction with every collective from the idle group's table is reported beside it
(with more processes than cores, a collective waits for cores that compute holds, which the
idle table cannot see). The share of compute time the trace priced is reported per rank.

Run (a few minutes on 2 cores)::

    python benchmarks/fidelity.py                         # llama3-debug, 4 layers, 2 ranks
    python benchmarks/fidelity.py --world-size 4 --set dim=128 --set seq_len=128
    # predicted from a profile; ops large enough that the profiler's own cost per op is small
    python benchmarks/fidelity.py --profile --world-size 4 --steps 7 --set n_layers=2 --set dim=512 \
        --set ffn_hidden_dim=1536 --set seq_len=256

Prints a table and writes ``benchmarks/out/fidelity.json`` (the profiles and the collective
table under ``benchmarks/out/fidelity/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the multi-process harness lives with the tests

from gloo_harness import run_multiprocess  # noqa: E402

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FidelityConfig:
    """One fidelity run."""

    #: model preset (see models.list_presets())
    model: str = "llama3-debug"
    #: LlamaConfig overrides, e.g. {"n_layers": 4}
    overrides: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"n_layers": 4, "dim": 128, "ffn_hidden_dim": 384, "seq_len": 64}
    )
    #: ranks of the gloo group
    world_size: int = 2
    #: fsdp-sched solvers to compare ("traced" runs the graph as captured)
    solvers: tuple[str, ...] = ("traced", "fsdp2", "cpsat")
    #: timed training steps per solver, after warmup_steps untimed ones
    steps: int = 5
    warmup_steps: int = 2
    #: solver time limit per graph, s
    work_limit: float = 10.0
    #: per-rank payload sizes (bytes) of the collective fit
    collective_sizes: tuple[int, ...] = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
    #: timing cache directory (default: $FSDP_SCHED_CACHE or ~/.cache/fsdp-sched)
    cache_dir: str | None = None
    #: wall-clock limit of the whole multi-process run, s
    timeout_s: float = 900.0
    #: also predict each step from a torch.profiler trace of the same run, with collective
    #: times from ``fsdp-sched measure`` on the same group
    profile: bool = False
    #: directory of the profiles and the measured collective table (``--profile``)
    profile_dir: str = str(REPO / "benchmarks" / "out" / "fidelity")
    #: per-rank input sizes (bytes) of the measured collective table (``--profile``): they
    #: bracket the model's per-parameter and merged collectives
    table_sizes: tuple[int, ...] = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (FSDP), got {self.world_size}")
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("steps must be >= 1 and warmup_steps >= 0")
        if not self.solvers:
            raise ValueError("give at least one solver")


def _rank_main(rank: int, world_size: int, cfg: FidelityConfig) -> list[dict[str, Any]]:
    """On every rank: fit costs, then per solver compile, run and time steps."""
    import torch
    import torch.distributed as dist

    import models
    import scheduler
    from models.fsdp import make_mesh
    from models.llama import get_config
    from scheduler.costs.hardware import Cluster
    from scheduler.costs.measure import MeasuredCostModel

    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    mesh = make_mesh(world_size)
    group = mesh.get_group()
    cluster = Cluster(n_gpus=world_size, gpus_per_node=world_size)  # one "node": the local machine
    cost = MeasuredCostModel.from_live_group(group, sizes=cfg.collective_sizes, cache_dir=cfg.cache_dir,
                                             cluster=cluster)
    table = _measured_table(cfg, group, cluster) if cfg.profile else None
    mcfg = get_config(cfg.model, **cfg.overrides)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, mcfg.vocab_size, (mcfg.batch_size, mcfg.seq_len), generator=gen)
    labels = torch.randint(0, mcfg.vocab_size, (mcfg.batch_size, mcfg.seq_len), generator=gen)

    rows = []
    for solver in cfg.solvers:
        torch._dynamo.reset()
        model = models.build_model(cfg.model, mesh=mesh, seed=0, param_dtype=None, **cfg.overrides)
        graphs: dict[str, Any] = {}
        backend = _recording_backend(
            graphs, cost_model=cost, cluster=cluster,
            solver=scheduler.SolverOptions(solver=solver, work_limit=cfg.work_limit, seed=0,
                                           fallback=False),  # the solver's own schedule, not a better start
            agreement=scheduler.AgreementOptions(broadcast_from=0),
        )
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        start = time.perf_counter()
        compiled(tokens, labels).backward()  # compiles both graphs (measuring + solving)
        compile_s = time.perf_counter() - start
        fw_ms, bw_ms, traces = [], [], []
        for i in range(cfg.warmup_steps + cfg.steps):
            model.zero_grad(set_to_none=True)
            dist.barrier(group)
            t0 = time.perf_counter()
            loss = compiled(tokens, labels)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i >= cfg.warmup_steps:
                fw_ms.append((t1 - t0) * 1e3)
                bw_ms.append((t2 - t1) * 1e3)
                if cfg.profile:  # interleaved, so that profiled and timed steps share the machine's load
                    traces.append(_profile_step(compiled, model, tokens, labels, group))
        trace_paths = []
        for i, trace in enumerate(traces):
            trace_paths.append(Path(cfg.profile_dir) / f"{solver}-rank{rank}-step{i}.json")
            trace_paths[-1].parent.mkdir(parents=True, exist_ok=True)
            trace_paths[-1].write_text(json.dumps(trace))
        # a step is as slow as its slowest rank
        times = torch.tensor([fw_ms, bw_ms], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        reports = {r.graph_name: r for r in backend.reports}
        fw, bw = reports["forward"], reports["backward"]
        steps = [a + b for a, b in zip(times[0].tolist(), times[1].tolist())]
        rows.append({
            "solver": solver,
            "status": f"{fw.status}/{bw.status}",
            "collectives": fw.n_collectives_after + bw.n_collectives_after,
            "predicted_fw_ms": fw.step_ms_after,
            "predicted_bw_ms": bw.step_ms_after,
            "measured_fw_ms": statistics.median(times[0].tolist()),
            "measured_bw_ms": statistics.median(times[1].tolist()),
            "measured_step_ms": statistics.median(steps),
            "measured_step_ms_all": steps,
            "compile_s": compile_s,
        })
        if cfg.profile:
            dist.barrier(group)  # every rank's traces written: each collective is timed on its last rank
            world = dist.get_world_size(group)
            every_rank = [[Path(cfg.profile_dir) / f"{solver}-rank{r}-step{i}.json" for r in range(world)]
                          for i in range(len(trace_paths))]
            per_step = _on_every_rank(group, _predict_from_profile, graphs, every_rank, rank, world, table, cost,
                                      cluster)
            rows[-1].update(_slowest_predictions(per_step, group))
        if rank == 0:
            logger.info("%s: %s", solver, {k: v for k, v in rows[-1].items() if k != "measured_step_ms_all"})
    if rank == 0:
        rows.append({"cost_model_stats": dict(cost.stats), "collective_fit": cost.collective_fits[0]})
    return rows


def _recording_backend(graphs: dict[str, Any], **options: Any) -> Any:
    """``scheduler.backend(**options)`` that also keeps the graphs it compiled (rewritten in
    place by ``optimize_schedule``, as they run) in ``graphs["forward"]`` / ``["backward"]``."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler

    import scheduler
    from scheduler.api import REPORT_KEY

    reports: list[Any] = []

    def compiler(kind: str):
        def compile_graph(gm, example_inputs):
            gm.meta.setdefault("fsdp_graph_kind", kind)
            scheduler.optimize_schedule(gm, None, **options)
            reports.append(gm.meta[REPORT_KEY])
            graphs[kind] = gm
            return gm

        return make_boxed_compiler(compile_graph)

    fn = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                      partition_fn=min_cut_rematerialization_partition)
    fn.reports = reports
    return fn


def _measured_table(cfg: FidelityConfig, group: Any, cluster: Any) -> Any:
    """``fsdp-sched measure`` on this group (every rank runs the command; rank 0 writes the
    CSV), read back as the table cost model every rank uses."""
    import torch.distributed as dist

    from scheduler.cli import main as cli_main
    from scheduler.costs.models import TableCostModel

    out = Path(cfg.profile_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier(group)
    path = out / "collectives.csv"
    status = cli_main(["-q", "measure", "--out", str(path), "--collectives", "all_gather,reduce_scatter",
                       "--sizes", ",".join(f"{b}B" for b in cfg.table_sizes)])
    if status != 0:
        raise RuntimeError(f"fsdp-sched measure exited with {status}")
    dist.barrier(group)
    return TableCostModel.from_file(path, cluster=cluster)


def _profile_step(compiled: Any, model: Any, tokens: Any, labels: Any, group: Any) -> dict[str, Any]:
    """One training step under torch.profiler (CPU, shapes recorded): its Chrome trace."""
    import tempfile

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        compiled(tokens, labels).backward()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/step.json")
        return json.loads(Path(f"{d}/step.json").read_text())


def _on_every_rank(group: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, its failure on any rank raised on every rank (named, through
    :func:`scheduler.integrate.consensus.agree_on_outcome`), so that no rank waits in a later
    collective for one that has failed."""
    from scheduler.integrate.consensus import agree_on_outcome

    try:
        out, error = fn(*args), None
    except Exception as e:  # noqa: BLE001  (told to every rank, then raised)
        out, error = None, e
    failed = agree_on_outcome(error, group=group)
    if failed:
        raise RuntimeError(f"the profile's prediction failed on rank(s) {sorted(failed)}: {failed}")
    return out


def _predict_from_profile(graphs: dict[str, Any], traces: list[list[Path]], rank: int, world: int, table: Any,
                          measured: Any, cluster: Any) -> list[list[float]]:
    """Per profiled step (``traces[i]``: every rank's trace of step i): the graphs that ran,
    simulated in their order under that step's profile of this rank (compute), the measured
    table (collectives) and the measured model (compute the trace did not time, copies), on this
    rank: per step, [forward, backward, step, forward and backward matched shares, step with the
    idle table's collectives, step of every rank in lockstep] (ms). The lockstep step
    (:func:`scheduler.simulate_ranks`: each rank priced by its own trace, each collective
    started when the last rank reaches it) is worked out by one rank per step, in turn (NaN on
    the others)."""
    from scheduler import export_dag, simulate, simulate_ranks
    from scheduler.costs.models import ProfileCostModel, TableCostModel
    from scheduler.costs.profiles import ProfileTrace
    from solvers.core import Problem

    fallback = TableCostModel(collectives=table.collectives, fallback=measured, cluster=cluster)
    kinds = ("forward", "backward")

    def problems_of(trace: Any) -> dict[str, Problem]:
        model = ProfileCostModel(trace, fallback=fallback, cluster=cluster)
        return {kind: Problem.from_dag(export_dag(graphs[kind], cost_model=model, cluster=cluster, name=kind))
                for kind in kinds}

    per_step = []
    for i, paths in enumerate(traces):
        # collectives as the profiled step ran them, each on the rank that started it last; every
        # rank's trace is read once where this rank works out the step in lockstep
        lockstep = i % world == rank
        every_trace = ProfileTrace.of_group(paths) if lockstep else None
        trace = every_trace[rank] if every_trace else ProfileTrace(paths[rank], peer_traces=[p for q, p in enumerate(paths)
                                                                                  if q != rank])
        mine = problems_of(trace)
        # and every collective as the table measured it on the idle group
        idle = ProfileCostModel(trace, fallback=fallback, cluster=cluster, collectives=False)
        pred, shares, pred_idle = [], [], 0.0
        for kind in kinds:
            p = mine[kind]
            pred.append(simulate(p.dag, problem=p).step_ms)
            cov = p.dag.graph["cost_coverage"]
            shares.append(cov["compute_matched_share"])
            assert not cov["fallback_groups"], f"collectives without a measured row: {cov['fallback_groups']}"
            pred_idle += simulate(export_dag(graphs[kind], cost_model=idle, cluster=cluster, name=kind)).step_ms
        together = float("nan")
        if every_trace:
            ranks = [mine if r == rank else problems_of(t) for r, t in enumerate(every_trace)]
            together = sum(max(res.step_ms for res in simulate_ranks([problems[kind] for problems in ranks]))
                           for kind in kinds)
        per_step.append([pred[0], pred[1], pred[0] + pred[1], *shares, pred_idle, together])
    return per_step


def _slowest_predictions(per_step: list[list[float]], group: Any) -> dict[str, Any]:
    """Every rank's per-step predictions (:func:`_predict_from_profile`) gathered: the slowest
    rank's per step, their median, and every rank's matched share (first step)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(per_step, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    # per step, the slowest rank's prediction (as the measured step is its slowest rank's)
    slowest = [max((t[i] for t in every), key=lambda row: float(row[2])) for i in range(len(per_step))]
    return {
        "profile_fw_ms": statistics.median(float(r[0]) for r in slowest),
        "profile_bw_ms": statistics.median(float(r[1]) for r in slowest),
        "profile_step_ms": statistics.median(float(r[2]) for r in slowest),
        "profile_step_ms_all": [float(r[2]) for r in slowest],
        # the same with every collective priced by the idle group's table
        "profile_idle_step_ms": statistics.median(max(float(t[i][5]) for t in every) for i in range(len(per_step))),
        "profile_matched_share": [[float(t[0][3]), float(t[0][4])] for t in every],
        # every rank's trace at once, the ranks in lockstep at the collectives (one rank per step)
        "profile_lockstep_step_ms": statistics.median(float(every[i % len(every)][i][6]) for i in range(len(per_step))),
    }


def format_profile_table(rows: list[dict[str, Any]]) -> str:
    """Predicted from the profile against measured, as markdown (ms)."""
    lines = ["| solver | profile fw | measured fw | profile bw | measured bw | profile step | measured step | "
             "error | mean: profile / measured | every rank in lockstep: step, error | "
             "collectives from the idle table: step, error | compute matched (fw / bw, per rank) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "profile_step_ms" not in r:
            continue
        err = r["profile_step_ms"] / r["measured_step_ms"] - 1
        mean_p = statistics.mean(r["profile_step_ms_all"])
        mean_m = statistics.mean(r["measured_step_ms_all"])
        share = "; ".join(f"{a:.0%} / {b:.0%}" for a, b in r["profile_matched_share"])
        lines.append(f"| {r['solver']} | {r['profile_fw_ms']:.1f} | {r['measured_fw_ms']:.1f} | {r['profile_bw_ms']:.1f} | "
                     f"{r['measured_bw_ms']:.1f} | {r['profile_step_ms']:.1f} | {r['measured_step_ms']:.1f} | "
                     f"{err:+.1%} | {mean_p:.1f} / {mean_m:.1f} ({mean_p / mean_m - 1:+.1%}) | "
                     f"{r['profile_lockstep_step_ms']:.1f}, {r['profile_lockstep_step_ms'] / r['measured_step_ms'] - 1:+.1%} | "
                     f"{r['profile_idle_step_ms']:.1f}, {r['profile_idle_step_ms'] / r['measured_step_ms'] - 1:+.1%} | "
                     f"{share} |")
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a text table (ms)."""
    head = f"{'solver':<12}{'colls':>6}{'pred fw':>10}{'meas fw':>10}{'pred bw':>10}{'meas bw':>10}" \
           f"{'pred step':>11}{'meas step':>11}{'meas/pred':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "solver" not in r:
            continue
        pred = r["predicted_fw_ms"] + r["predicted_bw_ms"]
        meas = r["measured_fw_ms"] + r["measured_bw_ms"]
        lines.append(
            f"{r['solver']:<12}{r['collectives']:>6}{r['predicted_fw_ms']:>10.2f}{r['measured_fw_ms']:>10.2f}"
            f"{r['predicted_bw_ms']:>10.2f}{r['measured_bw_ms']:>10.2f}{pred:>11.2f}{meas:>11.2f}"
            f"{meas / pred if pred > 0 else float('nan'):>10.2f}"
        )
    return "\n".join(lines)


def run(cfg: FidelityConfig) -> list[dict[str, Any]]:
    """Run the fidelity benchmark on a local gloo group; rank 0's rows."""
    return run_multiprocess(_rank_main, cfg.world_size, cfg, timeout_s=cfg.timeout_s)[0]


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=FidelityConfig.model)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="LlamaConfig override (repeatable); replaces the default overrides")
    p.add_argument("--world-size", type=int, default=FidelityConfig.world_size)
    p.add_argument("--solvers", default=",".join(FidelityConfig.solvers))
    p.add_argument("--steps", type=int, default=FidelityConfig.steps)
    p.add_argument("--work-limit", "--time-limit-s", type=float, default=FidelityConfig.work_limit)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--profile", action="store_true",
                   help="also predict each step from a torch.profiler trace of the run and a collective table "
                        "measured by `fsdp-sched measure` on the same group")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "fidelity.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    kwargs: dict[str, Any] = {}
    if args.set:
        kwargs["overrides"] = {k: _parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = FidelityConfig(
        model=args.model, world_size=args.world_size, solvers=tuple(args.solvers.split(",")),
        steps=args.steps, work_limit=args.work_limit, cache_dir=args.cache_dir, profile=args.profile, **kwargs,
    )
    start = time.perf_counter()
    rows = run(cfg)
    print(f"\nfidelity: {cfg.model} {cfg.overrides} on {cfg.world_size} gloo ranks (CPU; ms, median of "
          f"{cfg.steps} steps, slowest rank)")
    print(format_table(rows))
    if cfg.profile:
        print("\npredicted from a profile of the same run (compute) and `fsdp-sched measure` (collectives):")
        print(format_profile_table(rows))
    print(f"({time.perf_counter() - start:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": dataclasses.asdict(cfg), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
