"""torch's overlap scheduler as a baseline, and torch's memory estimator against our simulator."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from scheduler.compare import baselines  # noqa: E402
from scheduler.compare.baselines import (  # noqa: E402
    TorchBaselineError,
    simulate_torch_baseline,
    torch_memory_peak,
    torch_memory_profile,
    torch_overlap_schedule,
)
from scheduler.export.dag import export_dag  # noqa: E402
from solvers.core.simulator import simulate  # noqa: E402
from solvers.core.validator import validate_schedule  # noqa: E402
from solvers.core.problem import Problem  # noqa: E402

from conftest import FAKE_WORLD as WORLD, three_fsdp_layers  # noqa: E402  (ranks of the group_name fixture)
DIM, TOKENS = 256, 512



@pytest.fixture(scope="module")
def traced(group_name):
    return three_fsdp_layers(group_name)


def _collectives(gm) -> Counter:
    """collective op -> total input bytes (merged all-gathers use the ``_out`` variant)."""
    out: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional":
            if n.target is not torch.ops._c10d_functional.wait_tensor.default:
                inp = n.args[0].meta["val"]
                out[n.target._schema.name.removesuffix("_out")] += inp.numel() * inp.element_size()
    return out


def _n_collectives(gm) -> int:
    return baselines.collective_count(gm)


# --------------------------------------------------------------------------------------------
# torch's overlap scheduler
# --------------------------------------------------------------------------------------------
def test_torch_schedule_is_valid_and_keeps_bytes(traced):
    """torch's pass runs on CPU, leaves the input alone, returns a lint-clean graph with no more
    collectives and the same bytes per collective type, and our simulator accepts it."""
    before = traced.print_readable(print_output=False)
    out = torch_overlap_schedule(traced)

    assert traced.print_readable(print_output=False) == before  # worked on a copy
    out.graph.lint()
    assert _n_collectives(traced) == 5
    assert 1 <= _n_collectives(out) <= _n_collectives(traced)
    assert _collectives(out) == _collectives(traced)

    problem = Problem.from_dag(export_dag(out))
    result = validate_schedule(problem, problem.traced_schedule())
    assert result.n_collectives == _n_collectives(out)
    assert result.step_ms > 0


def test_simulate_torch_baseline_matches_validated_run(traced):
    """simulate_torch_baseline = export of torch's rewrite + simulation in graph order."""
    result = simulate_torch_baseline(traced)
    problem = Problem.from_dag(export_dag(torch_overlap_schedule(traced)))
    expected = validate_schedule(problem, problem.traced_schedule())
    assert result.step_ms == pytest.approx(expected.step_ms)
    assert result.peak_bytes == expected.peak_bytes
    assert result.n_collectives <= _n_collectives(traced)


def test_torch_failure_is_reported_as_unavailable_baseline(traced, monkeypatch):
    """A failure inside torch's pass surfaces as TorchBaselineError naming torch's message."""
    from torch._inductor.fx_passes import overlap_scheduling

    def fail(gm, **kw):
        raise RuntimeError("detected 2 cyclic extra dep(s)")

    monkeypatch.setattr(overlap_scheduling, "schedule_overlap_bucketing", fail)
    with pytest.raises(TorchBaselineError, match="cyclic extra dep.*unavailable"):
        torch_overlap_schedule(traced)


def test_gpu_estimators_are_restored_after_the_pass(traced):
    """The CPU patches of torch's GPU queries do not leak out of the call."""
    import torch.utils._runtime_estimation as rte
    from torch._inductor import comm_analysis, config

    saved = (rte.get_gpu_dram_gbps, rte.get_device_tflops, comm_analysis.get_gpu_type, config.intra_node_bw)
    torch_overlap_schedule(traced)
    assert (rte.get_gpu_dram_gbps, rte.get_device_tflops, comm_analysis.get_gpu_type, config.intra_node_bw) == saved


# --------------------------------------------------------------------------------------------
# memory: our simulator vs torch's memory_estimator
# --------------------------------------------------------------------------------------------
def test_peak_memory_agrees_with_torch_estimator(traced):
    """On the traced graph (each wait right after its collective) the two models agree exactly:
    same allocations (CPU tensors counted, _unsafe_view an alias), same frees."""
    ours = simulate(export_dag(traced)).peak_bytes
    assert ours > 0
    assert ours == torch_memory_peak(traced)


def test_torch_raw_estimate_double_counts_at_waits(traced):
    """Without the wait-alias correction torch allocates a collective's output again at its
    wait (fake wait_tensor returns a fresh storage): after each wait's allocation, torch's raw
    profile exceeds the corrected one by exactly that collective's output bytes."""
    corrected = torch_memory_profile(traced)
    raw = torch_memory_profile(traced, wait_aliases_input=False)
    body = [n for n in traced.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    wait = torch.ops._c10d_functional.wait_tensor.default
    waits = 0
    for i, node in enumerate(body):
        after_alloc = 1 + 2 * i
        if node.target is wait:
            out = node.meta["val"]
            assert raw[after_alloc] - corrected[after_alloc] == out.numel() * out.element_size()
            waits += 1
        else:
            assert raw[after_alloc] == corrected[after_alloc]
    assert waits == 5
    assert max(raw) >= max(corrected)


def test_collective_input_held_until_wait_is_the_only_difference(group_name):
    """With compute between a collective and its wait, our model keeps the collective's input
    (the bf16 cast of the shard) until the wait, torch frees it after the collective::

        primals_1 -> _to_copy -> AG ............ wait -> mm_1(y, .)
        x -> mm(x, x) = y   (runs while AG is in flight: the peak)

    so our peak exceeds torch's by exactly the cast's bytes."""
    ops = torch.ops._c10d_functional

    def f(primals_1, x):
        shard = primals_1.to(torch.bfloat16)
        gathered = ops.all_gather_into_tensor(shard, WORLD, group_name)
        y = torch.mm(x, x)
        return torch.mm(y, ops.wait_tensor(gathered))

    with FakeTensorMode():
        args = (torch.randn(DIM // WORLD, DIM), torch.randn(DIM, DIM, dtype=torch.bfloat16))
    gm = make_fx(f, tracing_mode="fake")(*args)
    cast_bytes = (DIM // WORLD) * DIM * 2
    assert simulate(export_dag(gm)).peak_bytes - torch_memory_peak(gm) == cast_bytes
