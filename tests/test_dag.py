"""Export of make_fx-traced graphs on a fake process group, and the DAG's JSON round-trip."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from scheduler.dag import DagError, dag_from_json, dag_to_json, export_dag, load_dag, save_dag  # noqa: E402
from solvers.core.problem import Problem  # noqa: E402

from conftest import FAKE_WORLD as WORLD  # noqa: E402  (ranks of the group_name fixture)



def _fsdp_like(gname: str):
    """Two FSDP all-gathers (bf16 casts of fp32 shards) and one reduce-scatter::

        primals_1 -> _to_copy -> AG -> wait -> mm(x, .) -> mm_1(., wait_1) <- wait_1 <- AG_1 <- _to_copy_1 <- primals_2
        mm_1 -> relu -> _to_copy_2 (fp32) -> RS(sum) -> wait_2 -> output
    """
    ops = torch.ops._c10d_functional

    def f(primals_1, primals_2, x):
        a1 = ops.wait_tensor(ops.all_gather_into_tensor(primals_1.to(torch.bfloat16), WORLD, gname))
        h = torch.mm(x, a1)
        a2 = ops.wait_tensor(ops.all_gather_into_tensor(primals_2.to(torch.bfloat16), WORLD, gname))
        y = torch.relu(torch.mm(h, a2))
        return ops.wait_tensor(ops.reduce_scatter_tensor(y.float(), "sum", WORLD, gname))

    return f


def _trace(gname: str, mode: str = "fake"):
    def make_args():
        return (torch.randn(16, 64), torch.randn(16, 64), torch.randn(64, 64, dtype=torch.bfloat16))

    if mode == "fake":
        with FakeTensorMode():
            args = make_args()
    else:  # symbolic tracing makes its own fake mode with a shape env from real inputs
        args = make_args()
    return make_fx(_fsdp_like(gname), tracing_mode=mode)(*args)


@pytest.fixture(scope="module")
def traced(group_name):
    gm = _trace(group_name)
    return gm, export_dag(gm)


def _by_target(dag, op: str) -> list[str]:
    return [n for n in dag.graph["order"] if dag.nodes[n]["target"] == op]


def test_export_kinds_and_edges(traced):
    gm, dag = traced
    assert dag.graph["order"] == [n.name for n in gm.graph.nodes]
    kinds = [dag.nodes[n]["kind"] for n in dag.graph["order"]]
    assert kinds.count("input") == 3 and kinds.count("output") == 1
    assert kinds.count("collective") == 3 and kinds.count("wait") == 3
    (mm, mm_1) = _by_target(dag, "aten.mm.default")
    ag, ag_1 = _by_target(dag, "_c10d_functional.all_gather_into_tensor.default")
    assert set(dag.predecessors(mm)) == {"x_1", dag.nodes[ag]["wait"]}
    assert set(dag.predecessors(mm_1)) == {mm, dag.nodes[ag_1]["wait"]}
    assert dag.nodes[dag.nodes[ag]["wait"]]["alias_of"] == ag
    # parameter shards are pinned, other inputs may be freed
    assert [dag.nodes[n]["releasable"] for n in ("primals_1_1", "primals_2_1", "x_1")] == [False, False, True]


def test_export_collective_attributes(traced, group_name):
    _, dag = traced
    ag = dag.nodes[_by_target(dag, "_c10d_functional.all_gather_into_tensor.default")[0]]
    assert ag["coll_type"] == "all_gather" and ag["group_name"] == group_name and ag["group_size"] == WORLD
    assert ag["payload_bytes"] == 16 * 64 * 2  # bf16 shard
    assert ag["size_bytes"] == WORLD * 16 * 64 * 2
    assert ag["movable"] and ag["role"] == "fsdp" and ag["dtype"] == "bfloat16"
    (cast,) = ag["prologue"]
    assert dag.nodes[cast]["target"] == "aten._to_copy.default"
    assert dag.nodes[cast]["moves_with"] == _by_target(dag, "_c10d_functional.all_gather_into_tensor.default")[0]
    rs = dag.nodes[_by_target(dag, "_c10d_functional.reduce_scatter_tensor.default")[0]]
    assert (rs["coll_type"], rs["reduce_op"], rs["group_size"]) == ("reduce_scatter", "sum", WORLD)
    assert rs["payload_bytes"] == 64 * 64 * 4 and rs["size_bytes"] == 64 * 64 * 4 // WORLD
    assert len(rs["prologue"]) == 1 and rs["movable"]
    assert dag.graph["process_groups"][group_name] == {"size": WORLD, "ranks": list(range(WORLD))}
    # the problem view: casts are not schedulable nodes, the AGs can move up to the graph start
    p = Problem.from_dag(dag)
    assert p.seq == tuple(n for n in dag.graph["order"] if dag.nodes[n]["kind"] == "compute" and not dag.nodes[n]["moves_with"])
    assert [c.ready for c in p.colls.values()][:2] == [0, 0]


def test_json_round_trip(traced, tmp_path):
    _, dag = traced
    path = tmp_path / "g.json"
    save_dag(dag, path)
    back = load_dag(path)
    assert dict(back.nodes(data=True)) == json.loads(json.dumps(dict(dag.nodes(data=True))))
    assert set(back.edges) == set(dag.edges)
    assert back.graph == json.loads(json.dumps(dag.graph))
    assert back.graph["order"] == dag.graph["order"]


def _write(tmp_path, text: str):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


def test_corrupt_json_raises(tmp_path):
    with pytest.raises(DagError, match="is not valid JSON"):
        load_dag(_write(tmp_path, "{not json"))


def test_truncated_file_raises(traced, tmp_path):
    text = json.dumps(dag_to_json(traced[1]))
    with pytest.raises(DagError, match="was it truncated"):
        load_dag(_write(tmp_path, text[: len(text) // 2]))


@pytest.mark.parametrize("data", [{"hello": 1}, [1, 2], {"graph": "x"}])
def test_foreign_json_raises(tmp_path, data):
    with pytest.raises(DagError, match="is not an fsdp-sched DAG file"):
        load_dag(_write(tmp_path, json.dumps(data)))


def test_wrong_version_raises(traced):
    data = dag_to_json(traced[1])
    data["graph"]["version"] = 99
    with pytest.raises(DagError, match="schema version 99.*re-export"):
        dag_from_json(data)


def test_inconsistent_file_raises(traced):
    data = dag_to_json(traced[1])
    data["edges"].append(["nope", data["nodes"][0]["name"]])
    with pytest.raises(DagError, match="corrupt"):
        dag_from_json(data)


def test_missing_meta_val_raises(group_name):
    gm = _trace(group_name)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    del mm.meta["val"]
    with pytest.raises(DagError, match=r"has no meta\['val'\]"):
        export_dag(gm)


def test_symbolic_shapes_raise(group_name):
    with pytest.raises(DagError, match="symbolic shape"):
        export_dag(_trace(group_name, mode="symbolic"))
