"""Topology read from the process groups a graph names, not assumed: the world and each group's
ranks from the (fake) process group, the nodes each group spans from the cluster's GPUs per
node, printed in the report; a given cluster whose n_gpus is not the graph's world is named.

The graph: a world of 64 ranks, 8 per node, as a dp 8 x tp 8 mesh has it. The dp group of rank 0
is ranks 0, 8, ..., 56 (one per node: every byte crosses the network), its tp group ranks 0..7
(one node)::

    w_dp -> all_gather(dp) -> wait --\\
    w_tp -> all_gather(tp) -> wait --> x @ a_dp @ a_tp
"""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from scheduler.costs.hardware import Cluster, GroupInfo, graph_topology, topology_line  # noqa: E402
from scheduler.costs.models import AnalyticCostModel  # noqa: E402

WORLD = 64
DP_RANKS = list(range(0, WORLD, 8))
TP_RANKS = list(range(8))


@pytest.fixture(scope="module")
def groups():
    """dp and tp group names in a fake world of 64 (this process is rank 0 of both)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("another process group is initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield dist.new_group(DP_RANKS).group_name, dist.new_group(TP_RANKS).group_name
    finally:
        dist.destroy_process_group()


def mesh_graph(dp: str, tp: str) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = torch.ops._c10d_functional

    def f(w_dp, w_tp, x):
        a_dp = ops.wait_tensor(ops.all_gather_into_tensor(w_dp, 8, dp))
        a_tp = ops.wait_tensor(ops.all_gather_into_tensor(w_tp, 8, tp))
        return (x @ a_dp) @ a_tp

    with FakeTensorMode():
        args = (torch.randn(32, 256), torch.randn(32, 256), torch.randn(4, 256))
    return make_fx(f, tracing_mode="fake")(*args)


def test_world_and_ranks_come_from_the_process_groups(groups):
    """The export records the world of 64 and each group's ranks; the strided dp group spans 8
    nodes and is priced so, the tp group one node; without a cluster the export's is the
    graph's world."""
    from scheduler.export.dag import export_dag

    dp, tp = groups
    dag = export_dag(mesh_graph(dp, tp))
    assert dag.graph["world_size"] == WORLD
    assert dag.graph["process_groups"][dp]["ranks"] == DP_RANKS
    assert dag.graph["cluster"]["n_gpus"] == WORLD
    topo = graph_topology(dag)
    assert {g["group_name"]: (g["size"], g["nodes"], g["ranks_known"]) for g in topo["groups"]} == {
        dp: (8, 8, True), tp: (8, 1, True)}
    ag = {a["group_name"]: a for _, a in dag.nodes(data=True) if a["kind"] == "collective"}
    strided = AnalyticCostModel(Cluster(gpus_per_node=1)).collective_ms("all_gather", ag[dp]["payload_bytes"],
                                                                        GroupInfo(dp, 8, None))
    assert ag[dp]["runtime_ms"] == pytest.approx(strided) and ag[dp]["runtime_ms"] > 2 * ag[tp]["runtime_ms"]


def test_the_report_prints_the_topology_used(groups):
    from scheduler import SolverOptions, optimize_schedule
    from scheduler.api import REPORT_KEY

    dp, tp = groups
    gm = mesh_graph(dp, tp)
    optimize_schedule(gm, None, solver=SolverOptions(work_limit=1))
    report = gm.meta[REPORT_KEY]
    first, second = sorted([(dp, "8 nodes"), (tp, "1 node")])
    line = (f"64 ranks, 8 per node; group {first[0]!r}: 8 ranks on {first[1]}; "
            f"group {second[0]!r}: 8 ranks on {second[1]}")
    assert topology_line(report.topology) == line
    assert f"topology: {line}" in str(report)
    assert not any("n_gpus" in n for n in report.notes)


def test_a_cluster_of_another_world_is_named_not_obeyed(groups, caplog):
    """Cluster(n_gpus=16) on a graph of 64 ranks: a warning and a note say so; the groups are
    still priced by their own ranks (the step equals that of the cluster of the right size)."""
    from scheduler import SolverOptions, optimize_schedule
    from scheduler.api import REPORT_KEY

    dp, tp = groups
    gm0 = mesh_graph(dp, tp)
    steps = {}
    for n_gpus in (16, WORLD):
        gm = copy.deepcopy(gm0)
        with caplog.at_level(logging.WARNING, logger="scheduler.api"):
            caplog.clear()
            optimize_schedule(gm, None, cost_model="analytic", cluster=Cluster(n_gpus=n_gpus),
                              solver=SolverOptions(work_limit=1))
        report = gm.meta[REPORT_KEY]
        named = [n for n in report.notes if "n_gpus=16" in n and "64 ranks" in n]
        assert bool(named) == (n_gpus == 16)
        assert any("n_gpus=16" in r.getMessage() for r in caplog.records) == (n_gpus == 16)
        steps[n_gpus] = report.step_ms_before
    assert steps[16] == steps[WORLD]


def test_a_group_whose_ranks_are_unknown_is_said_to_be_taken_as_consecutive():
    """A DAG without a process group behind it (ranks None, world unknown): 16 ranks taken as
    consecutive span 2 nodes, and the line says it is a guess."""
    import networkx as nx

    dag = nx.DiGraph(process_groups={"dp": {"size": 16, "ranks": None}}, cluster=Cluster().to_json())
    topo = graph_topology(dag)
    assert topo["groups"] == [{"group_name": "dp", "size": 16, "ranks_known": False, "nodes": 2}]
    assert topology_line(topo) == ("world size unknown, 8 per node; group 'dp': 16 ranks on 2 nodes "
                                   "(ranks unknown: taken as consecutive)")
