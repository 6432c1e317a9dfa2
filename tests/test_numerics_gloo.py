"""Numerics of the fsdp-sched backend on a real gloo process group (2 and 4 CPU processes).

Each rank builds llama3-debug (1 layer) with the project's FSDP (:func:`models.build_model`)
and runs a few SGD training steps three times:

- ``base``: ``torch.compile`` with aot_autograd and identity compilers (the graphs as traced,
  same min-cut partitioner as the fsdp-sched backend). Its compilers also export each graph,
  solve it *without* a budget (:func:`scheduler.solve_dag`) and run the heuristics, which
  gives the traced peak and the largest peak of a schedule that overlaps more;
- ``sched``: ``torch.compile(backend=scheduler.backend(fw_mem_budget=..., bw_mem_budget=...))``
  with each graph's budget halfway between those two peaks (none where they are equal), so
  that the solver must trade bucketing against memory (the test asserts that the reports show
  at least one merged bucket and one prefetched all-gather);
- ``ref``: the unsharded eager model (:func:`models.build_reference_model`) on the global
  batch (every data-parallel rank's batch concatenated), one process.

Checks: losses, gradients (local shards) and updated parameters of ``sched`` are bitwise equal
(``torch.equal``) to ``base``; both are close to ``ref`` (tolerances in ``_TOL``: fp32
``rtol=1e-4, atol=1e-6`` (losses ``rtol=1e-5``), the bf16 all-gather case absolute ``1e-3``
on losses and gradients and ``5e-4`` on parameters after the updates; see the constants).

Cases: fp32 with reshard-after-forward on and off, mixed precision (bf16 all-gather and
compute, fp32 reduce-scatter) on 2 ranks; fp32 on 4 ranks, and a 2 x 2 (dp x tp) mesh.

Every case of one world size runs in one multi-process run (module-scoped fixture), so that
process start-up and imports are paid once; a hung rank is killed by the harness timeout
(:class:`gloo_harness.MultiprocessTimeout`), and each test checks that no child is left.

Rank determinism, read from the same runs (in this file, so that a worker of a distributed test
run that runs one runs the other from its cache). FSDP ranks must run the same collectives in
the same order, or they hang (or silently mix up buckets); when every rank solves for itself,
the solve must therefore be deterministic:

- every rank's schedule digests (``ScheduleReport.digest`` of each graph the backend compiled,
  from ``backend.reports``) are gathered with ``dist.all_gather_object`` and must all be equal;
- ``optimize_schedule(..., agreement=AgreementOptions(broadcast_from=0))`` (rank 0 solves and
  broadcasts) must give the same schedule (digest) as solving on every rank;
- the same DAG solved in two separate processes (started afresh on the DAGs exported in the
  runs) gives an identical ``Schedule.digest()``, at its budget and without one, and without
  one the same as every rank found inside training.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # gloo_harness, and this module in spawned ranks

from gloo_harness import bitwise_mismatches, run_multiprocess  # noqa: E402

MODEL = "llama3-debug"
#: LlamaConfig overrides: one block keeps tracing fast; the graphs still hold 12 parameters
OVERRIDES = {"n_layers": 1}
STEPS = 2
LR = 0.5
#: work limit of the search per graph (deterministic; see solvers/search.py)
SOLVER_WORK_LIMIT = 2.0
#: wall-clock limit of one multi-process run of all cases of a world size
TIMEOUT_S = {2: 480.0, 4: 900.0}

#: tolerances against the unsharded eager reference.
#: fp32: the sharded model sums gradients over ranks in another order and computes the loss of
#: each rank's batch separately: differences are a few ulps (observed <= 1e-7 absolute).
#: bf16: parameters and activations are rounded to bf16 (8 bits of mantissa, relative 4e-3)
#: while the reference computes in fp32 (observed on 2 ranks: loss 1.5e-4, gradients 2.5e-4,
#: parameters after 2 updates 1.5e-4 absolute; the tolerances leave 3-6x margin).
_TOL = {
    "fp32": {"loss": dict(rtol=1e-5, atol=1e-6), "grad": dict(rtol=1e-4, atol=1e-6),
             "param": dict(rtol=1e-4, atol=1e-6)},
    "bf16": {"loss": dict(rtol=0.0, atol=1e-3), "grad": dict(rtol=0.0, atol=1e-3),
             "param": dict(rtol=0.0, atol=5e-4)},
}

CASES_2 = {
    "fp32_reshard": dict(param_dtype=None, reshard_after_forward=True),
    "fp32_no_reshard": dict(param_dtype=None, reshard_after_forward=False),
    "bf16_ag_fp32_rs": dict(param_dtype="bfloat16", reduce_dtype="float32", reshard_after_forward=True),
    # the backward's all-gathers on a second gloo group of the same ranks (SolverOptions)
    "fp32_reshard_ag_stream": dict(param_dtype=None, reshard_after_forward=True, all_gather_stream="separate"),
    # the compute in the order torch's overlap scheduler runs it (SolverOptions.compute_order)
    "fp32_reshard_torch_order": dict(param_dtype=None, reshard_after_forward=True, compute_order="torch"),
}
CASES_4 = {
    "fp32_reshard": dict(param_dtype=None, reshard_after_forward=True),
    "fp32_2d_tp2": dict(param_dtype=None, reshard_after_forward=True, tp_size=2),
}


# --------------------------------------------------------------------------------------------
# rank bodies (module level, so that spawned ranks unpickle them)
# --------------------------------------------------------------------------------------------
def _fsdp_options(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    opts = dict(case)
    for k in ("param_dtype", "reduce_dtype"):
        if isinstance(opts.get(k), str):
            opts[k] = getattr(torch, opts[k])
    return opts


def _batches(cfg, dp_rank: int, dp_size: int):
    """Per step: this dp rank's (tokens, labels) and the global batch (all dp ranks, in order)."""
    import torch

    out = []
    for step in range(STEPS):
        per_rank = []
        for r in range(dp_size):
            g = torch.Generator().manual_seed(1000 * step + r)
            shape = (cfg.batch_size, cfg.seq_len)
            per_rank.append((torch.randint(0, cfg.vocab_size, shape, generator=g),
                             torch.randint(0, cfg.vocab_size, shape, generator=g)))
        out.append((per_rank[dp_rank],
                    (torch.cat([t for t, _ in per_rank]), torch.cat([lab for _, lab in per_rank]))))
    return out


def _train(model, compiled, batches, dp_size: int) -> dict[str, Any]:
    """STEPS SGD steps; per step the loss and every gradient (local shard), then the params."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for (tokens, labels), _ in batches:
        loss = compiled(tokens, labels)
        (loss / dp_size).backward()  # gradients are summed over dp ranks (models.fsdp)
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _reference(cfg_overrides, batches, dp_size: int) -> dict[str, Any]:
    """The unsharded eager model on the global batch; the loss per dp rank's batch too."""
    import torch

    import models

    ref = models.build_reference_model(MODEL, seed=0, **cfg_overrides)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for _, (tokens, labels) in batches:
        per_rank = [ref(t, lab).detach() for t, lab in zip(tokens.chunk(dp_size), labels.chunk(dp_size))]
        loss = ref(tokens, labels)
        loss.backward()
        losses.append(torch.stack(per_rank))
        grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def _local_part(fqn_sharded: str, full, dp_mesh, tp_rank: int, tp_size: int):
    """This rank's local shard of a reference (unsharded) tensor: the tp slice, then the dp chunk."""
    from models.fsdp import _tp_slice

    fqn = fqn_sharded.replace(".parametrizations.", ".").removesuffix(".original")
    local = _tp_slice(fqn, full, tp_rank, tp_size)
    return local.chunk(dp_mesh.size())[dp_mesh.get_local_rank()], fqn


def _compare_ref(run: dict, ref: dict, dp_mesh, dp_rank: int, tp_rank: int, tp_size: int, tol: dict) -> dict:
    """Max abs differences to the reference and names of tensors outside tolerance."""
    import torch

    out = {"max_abs": {"loss": 0.0, "grad": 0.0, "param": 0.0}, "bad": []}

    def check(kind: str, name: str, x, y) -> None:
        out["max_abs"][kind] = max(out["max_abs"][kind], (x.float() - y.float()).abs().max().item())
        if not torch.allclose(x.float(), y.float(), **tol[kind]):
            out["bad"].append(f"{name} (max abs diff {(x.float() - y.float()).abs().max().item():.3g})")

    for i, (loss, ref_losses) in enumerate(zip(run["losses"], ref["losses"])):
        check("loss", f"loss[{i}]", loss, ref_losses[dp_rank])
    for i, (g, rg) in enumerate(zip(run["grads"], ref["grads"])):
        for n, x in g.items():
            y, fqn = _local_part(n, rg[n.replace(".parametrizations.", ".").removesuffix(".original")],
                                 dp_mesh, tp_rank, tp_size)
            check("grad", f"grad[{i}].{fqn}", x, y)
    for n, x in run["params"].items():
        y, fqn = _local_part(n, ref["params"][n.replace(".parametrizations.", ".").removesuffix(".original")],
                             dp_mesh, tp_rank, tp_size)
        check("param", f"param.{fqn}", x, y)
    return out


def _run_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler

    import models
    import scheduler
    from models.fsdp import make_mesh
    from models.llama import get_config
    from scheduler.api import REPORT_KEY
    from scheduler.export.dagfile import dag_to_json
    from solvers import Problem
    from solvers.core.simulator import simulate
    from solvers.heuristics import HEURISTICS

    opts = _fsdp_options(case)
    all_gather_stream = opts.pop("all_gather_stream", "shared")
    compute_order = opts.pop("compute_order", "choose")
    tp_size = opts.get("tp_size", 1)
    mesh = make_mesh(world_size, tp_size)
    dp_mesh = mesh if tp_size == 1 else mesh["dp"]
    tp_rank = 0 if tp_size == 1 else mesh["tp"].get_local_rank()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    cfg = get_config(MODEL, **OVERRIDES)
    batches = _batches(cfg, dp_rank, dp_size)

    options = scheduler.SolverOptions(solver="cpsat", work_limit=SOLVER_WORK_LIMIT, seed=0,
                                      all_gather_stream=all_gather_stream, compute_order=compute_order)
    # 1. as traced: identity compilers; the peaks of each graph give the budgets
    torch._dynamo.reset()
    base_graphs: dict[str, Any] = {}
    unconstrained: dict[str, Any] = {}
    peaks: dict[str, tuple[int, int]] = {}
    dags: dict[str, Any] = {}

    def recorder(kind: str):
        def compile_graph(gm, example_inputs):
            gm.meta["fsdp_graph_kind"] = kind
            dag = scheduler.export_dag(gm)
            dags[kind] = dag_to_json(dag)
            _, unconstrained[kind] = scheduler.solve_dag(dag, None, solver=options)
            problem = Problem.from_dag(dag)
            overlapping = [simulate(dag, fn(problem).schedule, problem=problem).peak_bytes
                           for fn in HEURISTICS.values()]
            peaks[kind] = (simulate(dag, problem=problem).max_peak_bytes,
                           max(overlapping + [unconstrained[kind].peak_bytes_after]))
            base_graphs[kind] = gm
            return gm

        return make_boxed_compiler(compile_graph)

    base_backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"),
                                partition_fn=min_cut_rematerialization_partition)
    model = models.build_model(MODEL, mesh=mesh, seed=0, **OVERRIDES, **opts)
    base = _train(model, torch.compile(model, backend=base_backend, fullgraph=True), batches, dp_size)

    budgets = {}
    for kind, (lo, hi) in peaks.items():
        budgets[kind] = (lo + hi) // 2 if hi > lo else None

    # 2. the fsdp-sched backend under those budgets; every rank solves by itself
    torch._dynamo.reset()
    sched_backend = scheduler.backend(fw_mem_budget=budgets["forward"], bw_mem_budget=budgets["backward"],
                                      solver=options)
    model = models.build_model(MODEL, mesh=mesh, seed=0, **OVERRIDES, **opts)
    sched = _train(model, torch.compile(model, backend=sched_backend, fullgraph=True), batches, dp_size)
    reports = {r.graph_name: r for r in sched_backend.reports}

    # 3. rank determinism: every rank's digests, and the same graphs solved on rank 0 only
    digests = [None] * world_size
    dist.all_gather_object(digests, {k: r.digest for k, r in reports.items()})
    broadcast = {}
    for kind, gm in base_graphs.items():  # the traced graphs, no longer run: rewrite them now
        scheduler.optimize_schedule(gm, budgets[kind], solver=options,
                                    agreement=scheduler.AgreementOptions(broadcast_from=0))
        broadcast[kind] = gm.meta[REPORT_KEY].digest

    # 4. the eager, unsharded reference on the global batch
    ref = _reference(OVERRIDES, batches, dp_size)
    tol = _TOL["bf16" if opts.get("param_dtype") is not None else "fp32"]
    return {
        "mismatch": bitwise_mismatches(base, sched),
        "sched_vs_ref": _compare_ref(sched, ref, dp_mesh, dp_rank, tp_rank, tp_size, tol),
        "base_vs_ref": _compare_ref(base, ref, dp_mesh, dp_rank, tp_rank, tp_size, tol),
        "budgets": budgets,
        "unconstrained": {k: (*peaks[k], r.digest) for k, r in unconstrained.items()},
        "reports": {k: r.to_json() for k, r in reports.items()},
        "all_digests": digests,
        "broadcast_digests": broadcast,
        "dags": dags if rank == 0 else None,
        "losses": [x.item() for x in sched["losses"]],
    }


def _run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for name, case in cases.items():
        try:
            out[name] = _run_case(rank, world_size, case)
        except Exception:  # one failing case must not hide the others (ranks fail alike)
            import traceback

            out[name] = {"error": traceback.format_exc()}
    return out


# --------------------------------------------------------------------------------------------
# fixtures: one multi-process run per world size, shared by the tests below
# --------------------------------------------------------------------------------------------
_RUNS: dict[int, Any] = {}


def gloo_runs(world_size: int) -> list[dict[str, Any]]:
    """Per rank, the results of every case of ``world_size`` (run once per test session)."""
    if world_size not in _RUNS:
        cases = CASES_2 if world_size == 2 else CASES_4
        try:
            _RUNS[world_size] = run_multiprocess(_run_cases, world_size, cases, timeout_s=TIMEOUT_S[world_size],
                                                 threads_per_process=1)
        except Exception as e:  # a timeout or crash: every test of this world size reports it
            _RUNS[world_size] = e
        assert multiprocessing.active_children() == []
        if not isinstance(_RUNS[world_size], Exception):
            _print_summary(world_size, _RUNS[world_size])
    result = _RUNS[world_size]
    if isinstance(result, Exception):
        raise result
    return result


def _print_summary(world_size: int, per_rank: list[dict[str, Any]]) -> None:
    """One line per case (rank 0), shown with ``pytest -s``: buckets, prefetch, differences."""
    for case, res in per_rank[0].items():
        if "error" in res:
            print(f"[w{world_size} {case}] error")
            continue
        reps = res["reports"]
        shape = {k: ([f"{t}x{len(b)}" for b, t in zip(r["buckets"], r["bucket_types"]) if len(b) > 1],
                     sum(p > 0 for p in r["ag_prefetch"]), r["status"])
                 for k, r in reps.items()}
        print(f"[w{world_size} {case}] budgets {res['budgets']} merged/prefetched/status {shape} "
              f"max|sched-ref| {res['sched_vs_ref']['max_abs']} max|base-ref| {res['base_vs_ref']['max_abs']}")


def case_results(world_size: int, case: str) -> list[dict[str, Any]]:
    per_rank = [r[case] for r in gloo_runs(world_size)]
    errors = [f"rank {i}:\n{r['error']}" for i, r in enumerate(per_rank) if "error" in r]
    if errors:
        pytest.fail(f"case {case} on {world_size} ranks raised:\n" + "\n".join(errors))
    return per_rank


PARAMS = [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4]


def _params():
    return [pytest.param(ws, c, id=f"w{ws}-{c}") for ws, c in PARAMS]


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", _params())
def test_budget_forces_bucketing_and_prefetch(world_size, case):
    res = case_results(world_size, case)[0]
    reports = res["reports"]
    assert set(reports) == {"forward", "backward"}
    for kind, rep in reports.items():
        lo, hi, _ = res["unconstrained"][kind]
        budget = res["budgets"][kind]
        if budget is not None:
            written = max(rep["reexported_peak_bytes"], rep["liveness_peak_bytes"])
            assert rep["peak_bytes_after"] <= budget < hi and written <= budget, (kind, rep, res["budgets"])
    merged = [b for rep in reports.values() for b in rep["buckets"] if len(b) > 1]
    prefetched = [p for rep in reports.values() for p in rep["ag_prefetch"] if p > 0]
    assert merged, f"no merged bucket under budgets {res['budgets']}: {reports}"
    assert prefetched, f"no prefetched all-gather under budgets {res['budgets']}: {reports}"
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", _params())
def test_sched_bitwise_equal_to_traced(world_size, case):
    for rank, res in enumerate(case_results(world_size, case)):
        assert res["mismatch"] == [], f"rank {rank}: not bitwise equal to the traced graphs: {res['mismatch']}"
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", _params())
def test_close_to_unsharded_reference(world_size, case):
    for rank, res in enumerate(case_results(world_size, case)):
        for what in ("sched_vs_ref", "base_vs_ref"):
            assert res[what]["bad"] == [], f"rank {rank} {what}: {res[what]}"
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_all_gathers_on_a_second_group_are_written():
    """The case that puts all-gathers on their own stream did: the backward (which also
    reduce-scatters) split its group on every rank, the forward (all-gathers only) did not; its
    numerics are checked bitwise by the tests above."""
    for rank, res in enumerate(case_results(2, "fp32_reshard_ag_stream")):
        reports = res["reports"]
        assert reports["backward"]["split_groups"], f"rank {rank}: the backward split no group: {reports['backward']}"
        assert reports["forward"]["split_groups"] == [], f"rank {rank}: {reports['forward']['split_groups']}"
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_compute_in_torchs_order_is_written():
    """The case run in torch's order of compute installs schedules in that order (on every rank),
    and the tests above hold for it: bitwise equal to the traced graphs."""
    for rank, res in enumerate(case_results(2, "fp32_reshard_torch_order")):
        orders = {kind: rep["compute_order"] for kind, rep in res["reports"].items()}
        assert orders == {"forward": "torch", "backward": "torch"}, f"rank {rank}: {orders}"
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------------------------
# rank determinism (module docstring)
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", _params())
def test_every_rank_solves_the_same_schedule(world_size, case):
    per_rank = case_results(world_size, case)
    gathered = [r["all_digests"] for r in per_rank]
    own = [{k: rep["digest"] for k, rep in r["reports"].items()} for r in per_rank]
    for rank, g in enumerate(gathered):
        assert len(g) == world_size
        assert all(d == g[0] for d in g), f"rank {rank} gathered different schedules: {g}"
        assert g[rank] == own[rank]
    assert gathered[0][0].keys() == {"forward", "backward"}
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", _params())
def test_broadcast_from_rank0_gives_the_same_schedule(world_size, case):
    for rank, r in enumerate(case_results(world_size, case)):
        own = {k: rep["digest"] for k, rep in r["reports"].items()}
        assert r["broadcast_digests"] == own, f"rank {rank}: broadcast {r['broadcast_digests']} != solved {own}"
    assert multiprocessing.active_children() == []


def _solve_body(rank: int, world_size: int, dags: dict[str, Any], budgets: dict[str, Any]) -> dict[str, str]:
    import os

    from scheduler import SolverOptions, solve_dag
    from scheduler.export.dagfile import dag_from_json

    options = SolverOptions(solver="cpsat", work_limit=SOLVER_WORK_LIMIT, seed=0)
    out = {"pid": str(os.getpid())}
    for kind, data in dags.items():
        for budget, key in ((budgets[kind], kind), (None, f"{kind} unconstrained")):
            schedule, report = solve_dag(dag_from_json(data), budget, solver=options)
            assert report.digest == schedule.digest()
            out[key] = schedule.digest()
    return out


@pytest.mark.slow
def test_same_dag_same_digest_in_two_processes():
    res = case_results(2, "fp32_reshard")[0]
    dags, budgets = res["dags"], res["budgets"]
    assert set(dags) == {"forward", "backward"}
    a, b = run_multiprocess(_solve_body, 2, dags, budgets, timeout_s=300, threads_per_process=1)
    assert multiprocessing.active_children() == []
    assert a["pid"] != b["pid"]
    for kind in dags:
        assert a[kind] == b[kind], f"{kind}: two processes found different schedules"
        assert a[f"{kind} unconstrained"] == b[f"{kind} unconstrained"]
        # and the schedule every rank found for the same DAG while training
        for rank, r in enumerate(case_results(2, "fp32_reshard")):
            assert a[f"{kind} unconstrained"] == r["unconstrained"][kind][2], f"{kind}: rank {rank}"
