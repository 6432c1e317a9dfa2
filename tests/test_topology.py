"""Topology from the real ranks: a process group is priced by the nodes its ranks span, never by
its size alone, in the analytic model and in torch's NCCL estimator (TorchCostModel).

The 2-D case: a dp x tp mesh (foreign_models style "tp", mesh (W/2, 2)) traced on a fake group
of 16 ranks, on a cluster of 2 GPUs per node: the tp group (ranks {0, 1}) sits in one node, the
dp group (ranks {0, 2, ..., 14}) has one rank on each of 8 nodes, so every dp byte crosses the
network. torch's estimator, given the group size alone, would see 8 ranks in one node.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from scheduler.costs.hardware import Cluster, GroupInfo  # noqa: E402
from scheduler.costs.models import AnalyticCostModel  # noqa: E402
from scheduler.costs.torch_model import TorchCostModel, torch_nccl_topology  # noqa: E402

MiB = 1 << 20
H100 = Cluster()  # 8 GPUs per node
STRIDED = GroupInfo("dp", 8, tuple(range(0, 64, 8)))  # dp of dp 8 x tp 8: 8 nodes
CONSECUTIVE = GroupInfo("dp", 8, tuple(range(8)))  # one node
COLLS = ("all_gather", "reduce_scatter", "all_reduce")


@contextlib.contextmanager
def _torch_on_a_machine_with(gpus_per_node: int):
    """torch's NCCL model as it runs on a machine with ``gpus_per_node`` CUDA devices per node
    (torch.cuda itself answering), H100s, the cluster's bandwidths: the reference the model is
    checked against."""
    from torch._inductor import comm_analysis, config

    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: gpus_per_node), \
            mock.patch.object(comm_analysis, "get_gpu_type", lambda: comm_analysis.NVIDIA_GPU_TYPE.HOPPER), \
            mock.patch.object(comm_analysis, "_has_nvlink", lambda: True), \
            mock.patch.object(config, "intra_node_bw", H100.intra_node_gbps), \
            mock.patch.object(config, "inter_node_bw", H100.inter_node_gbps):
        yield


def _torch_reference(coll: str, payload: int, size: int, gpus_per_node: int) -> float:
    from torch._inductor import comm_analysis

    nbytes = {"all_gather": payload * (1 + size), "reduce_scatter": payload + payload // size}.get(coll, 2 * payload)
    with _torch_on_a_machine_with(gpus_per_node):
        return comm_analysis.estimate_nccl_collective_runtime_impl(
            nbytes, size, getattr(comm_analysis.NCCL_COLL, coll.upper()))


@pytest.mark.parametrize("coll", COLLS)
def test_torch_model_prices_a_strided_group_as_torch_does_across_nodes(coll):
    """8 ranks strided over 8 nodes cost what torch's own estimator gives on a machine with one
    GPU per node (every hop on the network), more than the same 8 ranks inside one node, which
    cost what torch gives for one node of 8."""
    model = TorchCostModel(H100)
    strided = model.collective_ms(coll, 64 * MiB, STRIDED)
    one_node = model.collective_ms(coll, 64 * MiB, CONSECUTIVE)
    assert strided == pytest.approx(_torch_reference(coll, 64 * MiB, 8, gpus_per_node=1), rel=1e-12)
    assert one_node == pytest.approx(_torch_reference(coll, 64 * MiB, 8, gpus_per_node=8), rel=1e-12)
    assert strided > 2 * one_node


def test_torch_model_keeps_torchs_count_for_consecutive_ranks():
    """16 consecutive ranks on 8-GPU nodes span 2 nodes, as torch counts by itself; with ranks
    unknown the size decides, on the cluster's GPUs per node."""
    model = TorchCostModel(H100)
    for group in (GroupInfo("g", 16, tuple(range(16))), GroupInfo("g", 16, None)):
        assert model.collective_ms("all_gather", 4 * MiB, group) == pytest.approx(
            _torch_reference("all_gather", 4 * MiB, 16, gpus_per_node=8), rel=1e-12)
    # a cluster of 16 GPUs per node: the same 16 ranks are one node
    big_nodes = TorchCostModel(Cluster(gpus_per_node=16, n_gpus=64))
    assert big_nodes.collective_ms("all_gather", 4 * MiB, GroupInfo("g", 16, None)) == pytest.approx(
        _torch_reference("all_gather", 4 * MiB, 16, gpus_per_node=16), rel=1e-12)


def test_the_patch_leaves_torch_as_it_was():
    from torch._inductor import comm_analysis, config

    before = (comm_analysis.torch, comm_analysis.get_gpu_type, comm_analysis._has_nvlink, config.intra_node_bw,
              config.inter_node_bw, torch.cuda.is_available(), torch.cuda.device_count())
    with torch_nccl_topology(H100, STRIDED):
        assert comm_analysis.torch.cuda.device_count() == 1 and comm_analysis.torch.cuda.is_available()
        assert torch.cuda.device_count() == before[-1]  # the real module is untouched
    after = (comm_analysis.torch, comm_analysis.get_gpu_type, comm_analysis._has_nvlink, config.intra_node_bw,
             config.inter_node_bw, torch.cuda.is_available(), torch.cuda.device_count())
    assert after == before


@pytest.mark.parametrize("coll", COLLS)
def test_analytic_model_prices_a_strided_group_by_its_nodes(coll):
    model = AnalyticCostModel(H100)
    assert model.collective_ms(coll, 64 * MiB, STRIDED) == pytest.approx(
        AnalyticCostModel(Cluster(gpus_per_node=1)).collective_ms(coll, 64 * MiB, GroupInfo("x", 8, None)))
    assert model.collective_ms(coll, 64 * MiB, STRIDED) > 2 * model.collective_ms(coll, 64 * MiB, CONSECUTIVE)


# --- a dp x tp mesh traced on a fake group --------------------------------------------------------
WORLD = 16
#: 2 GPUs per node: the tp pairs are the nodes
TWO_PER_NODE = Cluster(n_gpus=WORLD, gpus_per_node=2)


@pytest.fixture(scope="module")
def mesh_graphs():
    """Forward and backward of the "tp" style on dp 8 x tp 2, traced on a fake group of 16
    that stays up while the graphs are exported (their groups' ranks come from it)."""
    import foreign_models as fm
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("another process group is initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield fm.capture("tp", n_layers=2, world_size=WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_cls", [TorchCostModel, AnalyticCostModel])
def test_exported_mesh_groups_are_priced_by_the_nodes_their_ranks_span(mesh_graphs, model_cls):
    """Every dp collective is priced as 8 ranks over 8 nodes and every tp all-reduce as 2 ranks
    in one node, from the ranks the process group reports at export; the dp group priced by its
    size alone (8 ranks, one 16-GPU node) would be cheaper."""
    from scheduler.export.dag import export_dag

    model = model_cls(TWO_PER_NODE)
    one_node = model_cls(Cluster(n_gpus=WORLD, gpus_per_node=WORLD))
    seen = set()
    for gm in (mesh_graphs.forward, mesh_graphs.backward):
        dag = export_dag(gm, cost_model=model, cluster=TWO_PER_NODE)
        groups = dag.graph["process_groups"]
        for _, a in dag.nodes(data=True):
            if a["kind"] != "collective":
                continue
            ranks = groups[a["group_name"]]["ranks"]
            group = GroupInfo(a["group_name"], a["group_size"], tuple(ranks))
            nodes = group.n_nodes(TWO_PER_NODE)
            seen.add((a["coll_type"], a["group_size"], nodes))
            assert a["runtime_ms"] == pytest.approx(model.collective_ms(a["coll_type"], a["payload_bytes"], group))
            if a["group_size"] == 8:
                assert ranks == list(range(0, WORLD, 2)) and nodes == 8
                assert a["runtime_ms"] > one_node.collective_ms(a["coll_type"], a["payload_bytes"],
                                                                GroupInfo("dp", 8, None))
            else:
                assert a["group_size"] == 2 and nodes == 1
    assert {("all_gather", 8, 8), ("reduce_scatter", 8, 8), ("all_reduce", 2, 1)} <= seen
