"""Cost models: the NCCL ring formula worked by hand, the roofline, torch's estimators on a
CPU-only machine, user tables, and the checks annotate_costs applies to every cost."""

from __future__ import annotations

import math

import pytest

from scheduler.costs.annotate import annotate_costs
from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.models import AnalyticCostModel, TableCostModel, ring_collective_ms
from scheduler.whatif.synthetic import DagBuilder

MiB = 1 << 20
H100 = Cluster()  # 8 GPUs per node, NVLink 450 GB/s, IB 50 GB/s, latencies 8.4 / 3.4 / 14 us


def test_ring_all_gather_intra_node_by_hand():
    """8 ranks in one node, 1 MiB per rank: S = 8 MiB crosses 7 of 8 ring steps over NVLink.

    t = 8.4 us + 7 * 3.4 us + 8 MiB * 7/8 / 450 GB/s
    """
    t = ring_collective_ms("all_gather", MiB, GroupInfo("g", 8), H100)
    expected_us = 8.4 + 7 * 3.4 + (8 * MiB) * 7 / 8 / 450e3
    assert t == pytest.approx(expected_us / 1e3, rel=1e-12)
    assert t == pytest.approx(0.0485109, rel=1e-5)


def test_ring_reduce_scatter_inter_node_by_hand():
    """16 consecutive ranks = 2 nodes; 64 MiB full-size input per rank: 15 steps, of which
    1 crosses the network; bus bandwidth is the IB figure.

    t = 8.4 + 14 * 3.4 + 1 * 14 + 64 MiB * 15/16 / 50 GB/s   (us)
    """
    t = ring_collective_ms("reduce_scatter", 64 * MiB, GroupInfo("g", 16), H100)
    expected_us = 8.4 + 14 * 3.4 + 14.0 + 64 * MiB * 15 / 16 / 50e3
    assert t == pytest.approx(expected_us / 1e3, rel=1e-12)


def test_ring_group_with_strided_ranks_spans_nodes():
    """8 ranks with stride 8 (the dp dimension of a (dp, tp=8) mesh): 8 nodes, every hop is
    inter-node: t = 8.4 + 7 * 14 + S * 7/8 / 50 GB/s."""
    g = GroupInfo("dp", 8, ranks=tuple(range(0, 64, 8)))
    t = ring_collective_ms("all_gather", MiB, g, H100)
    assert t == pytest.approx((8.4 + 7 * 14.0 + 8 * MiB * 7 / 8 / 50e3) / 1e3)
    assert t > ring_collective_ms("all_gather", MiB, GroupInfo("tp", 8), H100)


@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "all_reduce"])
def test_ring_time_increases_with_bytes(coll):
    times = [ring_collective_ms(coll, n, GroupInfo("g", 16), H100) for n in (1, MiB, 16 * MiB, 256 * MiB)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert ring_collective_ms(coll, MiB, GroupInfo("solo", 1), H100) == 0.0


def test_roofline_picks_the_larger_bound():
    """bf16 peak 989 TFLOP/s at 70 %, HBM 3.35 TB/s at 80 %, + 3 us per kernel."""
    m = AnalyticCostModel(H100)
    flops_us = 1e12 / (989 * 0.7 * 1e6)
    mem_us = 1e9 / (3350 * 0.8 * 1e3)
    compute_bound = m.compute_ms({"flops": 1e12, "bytes_accessed": 1e6, "dtype": "bfloat16"})
    memory_bound = m.compute_ms({"flops": 1e6, "bytes_accessed": 1e9, "dtype": "bfloat16"})
    assert compute_bound == pytest.approx((flops_us + 3.0) / 1e3)
    assert memory_bound == pytest.approx((mem_us + 3.0) / 1e3)
    # fp32 uses the TF32 peak, half the bf16 one
    fp32 = m.compute_ms({"flops": 1e12, "bytes_accessed": 0, "dtype": "float32"})
    assert fp32 == pytest.approx((2 * flops_us + 3.0) / 1e3)
    assert m.compute_ms({"flops": 0, "bytes_accessed": 0}) == 0.0


# --- models on traced graphs ------------------------------------------------------------------
torch = pytest.importorskip("torch")



def _mm_graph(m: int, k: int, n: int, gname: str | None = None):
    """a[m, k] @ b[k, n] (bf16); with ``gname``, b is all-gathered first and the result
    reduce-scattered."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = torch.ops._c10d_functional

    def f(a, b):
        if gname is not None:
            b = ops.wait_tensor(ops.all_gather_into_tensor(b, 4, gname))
        y = torch.mm(a, b)
        if gname is not None:
            y = ops.wait_tensor(ops.reduce_scatter_tensor(y, "sum", 4, gname))
        return y

    with FakeTensorMode():
        a = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(k // 4 if gname else k, n, dtype=torch.bfloat16)
    return make_fx(f, tracing_mode="fake")(a, b)


def _node(dag, target):
    return next(a for _, a in dag.nodes(data=True) if a["target"] == target)


def test_analytic_matmul_flops_exact():
    """Exported mm of (256 x 512) @ (512 x 1024): flops = 2 m n k, bytes = inputs + output."""
    from scheduler.export.dag import export_dag

    m, k, n = 256, 512, 1024
    dag = export_dag(_mm_graph(m, k, n))
    mm = _node(dag, "aten.mm.default")
    assert mm["flops"] == 2 * m * n * k
    assert mm["bytes_accessed"] == 2 * (m * k + k * n + m * n)
    flops_us = 2 * m * n * k / (989 * 0.7 * 1e6)
    mem_us = mm["bytes_accessed"] / (3350 * 0.8 * 1e3)
    assert mm["runtime_ms"] == pytest.approx((max(flops_us, mem_us) + 3.0) / 1e3)


def test_torch_cost_model_without_gpu(group_name):
    """torch's roofline and NCCL estimators run on CPU (peaks patched to the cluster's GPU) and
    give positive finite times; a bigger matmul costs more."""
    from scheduler.costs.torch_model import TorchCostModel
    from scheduler.export.dag import export_dag

    model = TorchCostModel(H100)
    small = export_dag(_mm_graph(256, 512, 1024, group_name), cost_model=model)
    big = export_dag(_mm_graph(2048, 4096, 4096, group_name), cost_model=model)
    for dag in (small, big):
        for _, a in dag.nodes(data=True):
            if a["kind"] in ("compute", "collective"):
                assert math.isfinite(a["runtime_ms"]) and a["runtime_ms"] > 0, a
        assert dag.graph["cost_model"] == "torch"
    t = lambda d: _node(d, "aten.mm.default")["runtime_ms"]  # noqa: E731
    assert t(big) > t(small)


def _small_dag(**runtimes):
    """x --> mm[? ms] --> relu[? ms] --> RS --> output"""
    b = DagBuilder()
    b.add_input("x", size_bytes=1 << 16)
    b.add_compute("mm", "x", size_bytes=1 << 16, flops=10**9)
    b.add_compute("relu", "mm", size_bytes=1 << 16, target="aten.relu.default")
    r = b.add_collective("rs", "relu", coll_type="reduce_scatter")
    b.add_output(r)
    return b.build()


def test_table_cost_model_overrides():
    """By node name first, then by target; a callable may decline (None); the rest falls back."""
    dag = _small_dag()
    analytic = {n: a["runtime_ms"] for n, a in dag.nodes(data=True)}
    annotate_costs(dag, TableCostModel({"mm": 5.0, "aten.relu.default": 2.0}), H100)
    assert (dag.nodes["mm"]["runtime_ms"], dag.nodes["relu"]["runtime_ms"]) == (5.0, 2.0)
    assert dag.nodes["rs"]["runtime_ms"] == pytest.approx(analytic["rs"])
    pick = lambda a: 7.0 if a["name"] == "relu" else None  # noqa: E731
    annotate_costs(dag, TableCostModel(pick, collective=lambda *_: 1.5), H100)
    assert dag.nodes["relu"]["runtime_ms"] == 7.0
    assert dag.nodes["mm"]["runtime_ms"] == pytest.approx(analytic["mm"])
    assert dag.nodes["rs"]["runtime_ms"] == 1.5
    # the merged-bucket line is fitted from the same model: constant time -> beta 0
    line = dict(dag.graph["comm_model"]["reduce_scatter|0"])
    table = line.pop("table")
    assert line == {"alpha_ms": 1.5, "beta_ms_per_byte": 0.0}
    assert {ms for _, ms in table} == {1.5} and len(table) > 2


class _Broken:
    name = "broken"

    def __init__(self, value):
        self.value = value

    def compute_ms(self, attrs, fx_node=None):
        return self.value if attrs["name"] == "relu" else 1.0

    def collective_ms(self, coll_type, payload_bytes, group):
        return 1.0

    def copy_ms(self, nbytes):
        return 0.0


@pytest.mark.parametrize("bad", [float("nan"), -1.0, None, float("inf")])
def test_annotate_costs_rejects_bad_times(bad):
    dag = _small_dag()
    with pytest.raises(ValueError, match=r"cost model returned .* for node 'relu'.*finite time"):
        annotate_costs(dag, _Broken(bad), H100)


# --- naming a cost model ----------------------------------------------------------------------
def test_resolve_cost_model_by_name_object_or_none():
    from scheduler.costs.spec import COST_MODELS, resolve_cost_model
    from scheduler.costs.torch_model import TorchCostModel

    small = Cluster(n_gpus=8)
    assert sorted(COST_MODELS) == ["analytic", "torch"]
    default = resolve_cost_model(None, small)
    assert isinstance(default, AnalyticCostModel) and default.cluster is small
    torch_model = resolve_cost_model(" Torch ", small)
    assert isinstance(torch_model, TorchCostModel) and torch_model.cluster is small
    table = TableCostModel({"mm": 1.0})
    assert resolve_cost_model(table) is table


@pytest.mark.parametrize("bad", ["roofline", "", 3, object()])
def test_resolve_cost_model_rejects_what_is_not_one(bad):
    from scheduler.costs.spec import resolve_cost_model

    with pytest.raises(ValueError, match=r"\['analytic', 'torch'\]"):
        resolve_cost_model(bad)


def test_export_dag_takes_a_cost_model_name(group_name):
    from scheduler.costs.torch_model import TorchCostModel
    from scheduler.export.dag import export_dag

    gm = _mm_graph(256, 512, 1024, group_name)
    by_name = export_dag(gm, cost_model="torch")
    assert by_name.graph["cost_model"] == "torch"
    by_object = export_dag(gm, cost_model=TorchCostModel(H100))
    assert _node(by_name, "aten.mm.default")["runtime_ms"] == _node(by_object, "aten.mm.default")["runtime_ms"]
    assert export_dag(gm, cost_model="analytic").graph["cost_model"] == "analytic"
    with pytest.raises(ValueError, match="unknown cost model 'fast'"):
        export_dag(gm, cost_model="fast")


# --- torch's roofline on ops that move no data --------------------------------------------------
def _bucket_split_graph():
    """cat(a, b) -> split into 2 -> getitem 0 / 1 -> _unsafe_view / clone; and
    empty(n) -> slot.copy_(cat): the shapes torch's merge functions emit (fp32, 1024 x 64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        cat = torch.cat([a, b])
        buf = torch.empty(cat.numel())
        buf.copy_(cat.reshape(-1))
        x, y = torch.split(cat, [1024, 1024])
        return torch.ops.aten._unsafe_view(x.clone(), [-1]), y.t().clone(), buf

    with FakeTensorMode():
        a, b = torch.randn(1024, 64), torch.randn(1024, 64)
    return make_fx(f, tracing_mode="fake")(a, b)


def test_torch_cost_model_charges_nothing_for_getitem_views_and_empty():
    """torch's roofline prices getitem at the bytes of the whole tuple it indexes (the trap in
    TORCH_NOTES): each member of a split bucket would pay for the bucket. TorchCostModel gives
    0 to getitem, views, _unsafe_view and empty, and the real copies still cost."""
    import operator
    from unittest import mock

    import torch.utils._runtime_estimation as rte
    from torch._inductor.fx_passes.overlap_scheduling import estimate_roofline_runtime_ms

    from scheduler.costs.torch_model import TorchCostModel
    from scheduler.export.ops import moves_no_data

    gm = _bucket_split_graph()
    model = TorchCostModel(H100)
    nodes = {n.name: n for n in gm.graph.nodes}
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 2
    with mock.patch.object(rte, "get_gpu_dram_gbps", lambda: 3350.0), mock.patch.object(
        rte, "get_device_tflops", lambda dtype=None: 494.5
    ):
        assert all(estimate_roofline_runtime_ms(g) > 0 for g in getitems)  # torch's own charge
    free = [*getitems, nodes["_unsafe_view"], nodes["empty"], nodes["split_with_sizes"], nodes["t"]]
    for n in free:
        assert moves_no_data(n), n.name
        assert model.compute_ms({"kind": "compute"}, n) == 0.0, n.name
    mb = 1024 * 64 * 4  # bytes of one 1024 x 64 fp32 tensor
    # clone reads and writes one member at 3.35 TB/s; cat reads and writes both
    assert model.compute_ms({"kind": "compute"}, nodes["clone"]) == pytest.approx(2 * mb / 3350e6)
    assert model.compute_ms({"kind": "compute"}, nodes["cat"]) == pytest.approx(4 * mb / 3350e6)
    # copy_ reads its source and writes its destination (torch also charges reading the latter)
    assert model.compute_ms({"kind": "compute"}, nodes["copy_"]) == pytest.approx(4 * mb / 3350e6)
    # bucket copies are priced as the roofline prices those kernels
    assert model.copy_ms(mb) == pytest.approx(2 * mb / 3350e6)


def test_all_to_all_analytic_by_hand():
    """2 ranks in one node, 4 MiB input each: half of it goes to the other rank over NVLink.

    t = 8.4 us + 3.4 us + 4 MiB * 1/2 / 450 GB/s; across nodes the IB hop and bandwidth.
    """
    t = AnalyticCostModel(H100).collective_ms("all_to_all_single", 4 * MiB, GroupInfo("ep", 2))
    assert t == pytest.approx((8.4 + 3.4 + 4 * MiB / 2 / 450e3) / 1e3)
    spread = GroupInfo("ep", 2, ranks=(0, 8))
    assert ring_collective_ms("all_to_all", 4 * MiB, spread, H100) == pytest.approx(
        (8.4 + 14 + 4 * MiB / 2 / 50e3) / 1e3)


def test_all_to_all_is_priced_on_its_group_by_both_models(group_name):
    """The MoE style's all_to_all_single (expert group of 2, data-dependent splits) gets a
    positive stream time under the analytic and torch's cost models, which the simulator
    charges to the expert group's stream."""
    pytest.importorskip("torch")
    import foreign_models as fm
    from conftest import FAKE_WORLD
    from scheduler.export.dag import export_dag

    captured = fm.capture("moe", world_size=FAKE_WORLD)
    for cost_model in ("analytic", "torch"):
        dag = export_dag(captured.forward, cost_model=cost_model)
        a2a = [n for n, a in dag.nodes(data=True) if a.get("coll_type") == "all_to_all_single"]
        assert a2a and all(dag.nodes[n]["runtime_ms"] > 0 for n in a2a)
        dp = {a["group_name"] for _, a in dag.nodes(data=True) if a.get("role") == "fsdp"}
        assert {dag.nodes[n]["group_name"] for n in a2a}.isdisjoint(dp)
