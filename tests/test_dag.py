"""Export of make_fx-traced graphs on a fake process group, the DAG's JSON round-trip, and the
loader's schema check: field-level corruptions of a saved DAG and random mutations of one."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from scheduler.export.dag import DagError, export_dag  # noqa: E402
from scheduler.export.dagfile import dag_from_json, dag_to_json, load_dag, save_dag  # noqa: E402
from scheduler.whatif.synthetic import make_fsdp_dag  # noqa: E402
from solvers.core.problem import Problem  # noqa: E402
from solvers.core.simulator import simulate  # noqa: E402

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


def test_symbolic_shapes_are_priced_at_the_sizes_traced(group_name):
    """A graph traced with dynamic sizes (as a recompile for a new batch size gives) exports
    with every node's bytes at the sizes it was traced with: the same as a static trace."""
    dynamic = export_dag(_trace(group_name, mode="symbolic"))
    static = export_dag(_trace(group_name, mode="fake"))
    assert [dynamic.nodes[n]["size_bytes"] for n in dynamic.graph["order"]] == [
        static.nodes[n]["size_bytes"] for n in static.graph["order"]]


# --------------------------------------------------------------------------------------------
# the loader's schema check (scheduler.export.schema)
# --------------------------------------------------------------------------------------------
def _every_kind(gname: str):
    """A node of every kind, a prologue cast on each collective, an epilogue view::

        primals_1 -> _to_copy (bf16) -> AG -> wait_tensor -> t (view) -> mm(x, .) -> relu
        relu -> _to_copy_1 (fp32) -> RS(sum) -> wait_tensor_1 -> view (epilogue) -> output
    """
    ops = torch.ops._c10d_functional

    def f(primals_1, x):
        w = ops.wait_tensor(ops.all_gather_into_tensor(primals_1.to(torch.bfloat16), WORLD, gname))
        h = torch.relu(torch.mm(x, w.t()))
        return ops.wait_tensor(ops.reduce_scatter_tensor(h.float(), "sum", WORLD, gname)).view(-1)

    with FakeTensorMode():
        args = (torch.randn(16, 64), torch.randn(64, 64, dtype=torch.bfloat16))
    return make_fx(f, tracing_mode="fake")(*args)


EVERY_KIND_ORDER = ["primals_1_1", "x_1", "_to_copy", "all_gather_into_tensor", "wait_tensor", "t", "mm", "relu",
                    "_to_copy_1", "reduce_scatter_tensor", "wait_tensor_1", "view", "output"]
#: the node of each kind whose attributes the corruptions delete
NODE_OF_KIND = {"input": "x_1", "output": "output", "compute": "mm", "view": "t",
                "collective": "all_gather_into_tensor", "wait": "wait_tensor"}
AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"


@pytest.fixture(scope="module")
def saved(group_name):
    """Decoded files of valid DAGs: ``every_kind`` (:func:`_every_kind`, exported) and a
    synthetic backward graph with re-gathers."""
    dag = export_dag(_every_kind(group_name))
    assert dag.graph["order"] == EVERY_KIND_ORDER
    assert dag.nodes[AG]["prologue"] == ["_to_copy"] and dag.nodes[RS]["epilogue"] == ["view"]
    synthetic = make_fsdp_dag(n_layers=1, params_per_layer=2, graph_kind="backward", reshard_after_forward=True,
                              seed=0)
    return {"every_kind": json.loads(json.dumps(dag_to_json(dag))),
            "synthetic": json.loads(json.dumps(dag_to_json(synthetic)))}


def _node(data: dict, name: str) -> dict:
    return next(n for n in data["nodes"] if n["name"] == name)


def _set(name: str, attr: str, value):
    def corrupt(data):
        _node(data, name)[attr] = value
    return corrupt


def _drop(name: str, attr: str):
    def corrupt(data):
        del _node(data, name)[attr]
    return corrupt


def _graph(attr: str, value):
    def corrupt(data):
        data["graph"][attr] = value
    return corrupt


def _comm(key: str, attr: str, value):
    def corrupt(data):
        data["graph"]["comm_model"][f"{key}|{_group(data)}"][attr] = value
    return corrupt


def _group(data: dict) -> str:
    return _node(data, AG)["group_name"]


def _edges(change):
    def corrupt(data):
        change(data["edges"])
    return corrupt


COMMON_REQUIRED = ("kind", "index", "target", "runtime_ms", "size_bytes", "alias_of", "releasable", "flops",
                   "bytes_accessed", "dtype", "moves_with")
COLLECTIVE_REQUIRED = ("coll_type", "group_name", "group_size", "reduce_op", "payload_bytes", "fqns", "param_index",
                       "role", "wait", "prologue", "movable")
#: values a finite number >= 0 must not take
NOT_A_SIZE_OR_TIME = {"null": None, "string": "1", "negative": -1, "nan": math.nan, "inf": math.inf}



def _generated_corruptions() -> list[tuple[str, object, str]]:
    """Every required attribute of every node kind deleted; every size and time, and the copy
    cost, set to each value in :data:`NOT_A_SIZE_OR_TIME`."""
    out = []
    for kind, name in NODE_OF_KIND.items():
        required = COMMON_REQUIRED + {"collective": COLLECTIVE_REQUIRED, "wait": ("collective",)}.get(kind, ())
        out += [(f"{kind}-without-{a}", _drop(name, a), a) for a in required]
    for name, attr in [("mm", "runtime_ms"), (AG, "runtime_ms"), ("x_1", "size_bytes"), (AG, "payload_bytes"),
                       ("mm", "flops"), ("mm", "bytes_accessed"), (AG, "group_size"), ("mm", "index")]:
        out += [(f"{name}-{attr}-{label}", _set(name, attr, v), attr) for label, v in NOT_A_SIZE_OR_TIME.items()]
    out += [(f"copy_ms_per_byte-{label}", _graph("copy_ms_per_byte", v), "copy_ms_per_byte")
            for label, v in NOT_A_SIZE_OR_TIME.items()]
    return out


#: (id, corruption of the decoded file, the field its error must name)
CORRUPTIONS: list[tuple[str, object, str]] = _generated_corruptions() + [
    # numbers of the wrong type or range
    ("size_bytes-fraction", _set("x_1", "size_bytes", 1.5), "size_bytes"),
    ("size_bytes-past-int64", _set("x_1", "size_bytes", 2**64), "size_bytes"),
    ("runtime_ms-bool", _set("mm", "runtime_ms", True), "runtime_ms"),
    ("copy_ms_fixed-negative", _graph("copy_ms_fixed", -1.0), "copy_ms_fixed"),
    # enums and types
    ("unknown-kind", _set("mm", "kind", "banana"), "kind"),
    ("kind-not-a-string", _set("mm", "kind", ["compute"]), "kind"),
    ("unknown-coll_type", _set(AG, "coll_type", "all_scatter"), "coll_type"),
    ("unknown-role", _set(AG, "role", "boss"), "role"),
    ("unknown-external_wait", _set("t", "external_wait", "sometimes"), "external_wait"),
    ("unknown-structure_source", _set(AG, "structure_source", "oracle"), "structure_source"),
    ("dtype-not-a-string", _set("mm", "dtype", 5), "dtype"),
    ("releasable-string", _set("x_1", "releasable", "yes"), "releasable"),
    ("movable-string", _set(AG, "movable", "yes"), "movable"),
    ("fqns-string", _set(AG, "fqns", "w"), "fqns"),
    ("prologue-string", _set(AG, "prologue", "_to_copy"), "prologue"),
    ("epilogue-of-numbers", _set(RS, "epilogue", [1]), "epilogue"),
    ("block-negative", _set(AG, "block", -1), "block"),
    ("unknown-node-attribute", _set("mm", "colour", "red"), "colour"),
    ("unwaited_collective-on-a-view", _set("t", "unwaited_collective", True), "unwaited_collective"),
    ("collective-attribute-on-compute", _set("mm", "coll_type", "all_gather"), "unwaited_collective"),
    # references
    ("wait-unknown", _set(AG, "wait", "nope"), "wait"),
    ("wait-names-a-compute-node", _set(AG, "wait", "mm"), "wait"),
    ("wait-of-another-collective", _set(AG, "wait", "wait_tensor_1"), "wait"),
    ("collective-unknown", _set("wait_tensor", "collective", "nope"), "collective='nope'"),
    ("collective-of-another-wait", _set("wait_tensor", "collective", RS), "collective"),
    ("alias_of-unknown", _set("t", "alias_of", "nope"), "alias_of"),
    ("alias_of-itself", _set("t", "alias_of", "t"), "alias_of"),
    ("alias_of-a-later-node", _set("t", "alias_of", "relu"), "alias_of"),
    ("alias_of-an-alias", _set("view", "alias_of", "wait_tensor_1"), "alias_of"),
    ("alias_of-on-an-input", _set("x_1", "alias_of", "primals_1_1"), "alias_of"),
    ("wait-not-aliasing-its-collective", _set("wait_tensor", "alias_of", None), "alias_of"),
    ("moves_with-unknown", _set("_to_copy", "moves_with", "nope"), "moves_with"),
    ("moves_with-a-compute-node", _set("_to_copy", "moves_with", "mm"), "moves_with"),
    ("moves_with-unlisted", _set("mm", "moves_with", AG), "moves_with"),
    ("moves_with-on-an-input", _set("x_1", "moves_with", AG), "moves_with"),
    ("epilogue-member-without-moves_with", _set("view", "moves_with", None), "epilogue"),
    ("prologue-unknown", _set(AG, "prologue", ["nope"]), "prologue"),
    ("prologue-not-the-cast", _set(AG, "prologue", ["mm"]), "prologue"),
    ("prologue-emptied", _set(AG, "prologue", []), "prologue"),
    ("epilogue-unknown", _set(RS, "epilogue", ["nope"]), "epilogue"),
    ("group_name-unknown", _set(AG, "group_name", "nope"), "group_name"),
    ("process_groups-emptied", _graph("process_groups", {}), "process_groups"),
    # order
    ("order-reversed", lambda d: d["graph"]["order"].reverse(), "order"),
    ("order-duplicated-entry", lambda d: d["graph"]["order"].__setitem__(1, d["graph"]["order"][0]), "order"),
    ("order-missing-entry", lambda d: d["graph"]["order"].pop(), "order"),
    ("order-unknown-entry", lambda d: d["graph"]["order"].append("nope"), "order"),
    ("order-two-inputs-swapped", lambda d: d["graph"]["order"].__setitem__(slice(0, 2), ["x_1", "primals_1_1"]),
     "order"),
    ("order-not-a-list", _graph("order", "primals_1_1"), "order"),
    # edges
    ("edge-to-unknown-node", _edges(lambda e: e.append(["mm", "nope"])), "edges"),
    ("edge-self-loop", _edges(lambda e: e.append(["mm", "mm"])), "edges"),
    ("edge-repeated", _edges(lambda e: e.append(list(e[0]))), "edges"),
    ("edge-malformed", _edges(lambda e: e.append(["mm"])), "edges"),
    ("edges-cycle", _edges(lambda e: e.append(["relu", "mm"])), "cycle"),
    ("edge-reversed", _edges(lambda e: e.__setitem__(e.index(["t", "mm"]), ["mm", "t"])), "order"),
    ("edge-into-an-input", _edges(lambda e: e.append(["primals_1_1", "x_1"])), "edges"),
    ("edge-into-a-prologue-chain", _edges(lambda e: e.append(["x_1", AG])), "prologue"),
    ("edge-around-an-epilogue", _edges(lambda e: e.append(["wait_tensor_1", "output"])), "epilogue"),
    ("edge-collective-to-wait-removed", _edges(lambda e: e.remove([AG, "wait_tensor"])), "collective"),
    ("edge-epilogue-to-output-removed", _edges(lambda e: e.remove(["view", "output"])), "epilogue"),
    ("edges-not-a-list", lambda d: d.__setitem__("edges", {"mm": "relu"}), "edges"),
    ("edges-missing", lambda d: d.pop("edges"), "edges"),
    # comm_model
    ("comm_model-garbage", _graph("comm_model", "garbage"), "comm_model"),
    ("comm_model-list", _graph("comm_model", []), "comm_model"),
    ("comm_model-missing", lambda d: d["graph"].pop("comm_model"), "comm_model"),
    ("comm_model-entry-not-a-record", lambda d: d["graph"]["comm_model"].update({f"all_gather|{_group(d)}": 1}),
     "comm_model"),
    ("comm_model-unknown-coll_type", lambda d: d["graph"]["comm_model"].update({"scatter|0": {}}), "comm_model"),
    ("comm_model-alpha_ms-negative", _comm("all_gather", "alpha_ms", -1.0), "alpha_ms"),
    ("comm_model-beta_ms_per_byte-negative", _comm("all_gather", "beta_ms_per_byte", -1e-9), "beta_ms_per_byte"),
    ("comm_model-beta_ms_per_byte-missing",
     lambda d: d["graph"]["comm_model"][f"all_gather|{_group(d)}"].pop("beta_ms_per_byte"), "beta_ms_per_byte"),
    ("comm_model-table-decreasing", lambda d: d["graph"]["comm_model"][f"all_gather|{_group(d)}"]["table"].reverse(),
     "table"),
    ("comm_model-table-negative-time", _comm("reduce_scatter", "table", [[1, 0.5], [2, -0.5]]), "table"),
    ("comm_model-unknown-entry-attribute", _comm("all_gather", "gamma_ms", 1.0), "gamma_ms"),
    # other graph attributes
    ("process_groups-size-negative", lambda d: d["graph"]["process_groups"][_group(d)].update(size=-1), "size"),
    ("process_groups-size-zero", lambda d: d["graph"]["process_groups"][_group(d)].update(size=0), "size"),
    ("group_size-zero", _set(AG, "group_size", 0), "group_size"),
    ("group_size-not-its-groups", lambda d: _node(d, AG).update(group_size=_node(d, AG)["group_size"] + 1),
     "group_size"),
    ("process_groups-ranks-not-size", lambda d: d["graph"]["process_groups"][_group(d)].update(ranks=[0]), "ranks"),
    ("process_groups-ranks-string", lambda d: d["graph"]["process_groups"][_group(d)].update(ranks="0-3"), "ranks"),
    ("cluster-missing", lambda d: d["graph"].pop("cluster"), "cluster"),
    ("cluster-n_gpus-string", lambda d: d["graph"]["cluster"].update(n_gpus="64"), "n_gpus"),
    ("cluster-n_gpus-zero", lambda d: d["graph"]["cluster"].update(n_gpus=0), "n_gpus"),
    ("cluster-unknown-gpu", lambda d: d["graph"]["cluster"].update(gpu="tpu"), "gpu"),
    ("cluster-gpu-spec-incomplete", lambda d: d["graph"]["cluster"].update(gpu={"name": "x"}), "gpu"),
    ("cluster-unknown-attribute", lambda d: d["graph"]["cluster"].update(colour="red"), "colour"),
    ("name-not-a-string", _graph("name", 5), "name"),
    ("graph_kind-null", _graph("graph_kind", None), "graph_kind"),
    ("cost_model-missing", lambda d: d["graph"].pop("cost_model"), "cost_model"),
    ("unknown-graph-attribute", _graph("budget_bytes", 1 << 30), "budget_bytes"),
    ("structure-unknown-source", lambda d: d["graph"]["structure"].update(source="banana"), "source"),
    ("structure-n_blocks-negative", lambda d: d["graph"]["structure"].update(n_blocks=-1), "n_blocks"),
    ("schema-missing", lambda d: d["graph"].pop("schema"), "schema"),
    ("version-string", _graph("version", "1"), "version"),
    # the file's layout
    ("nodes-missing", lambda d: d.pop("nodes"), "nodes"),
    ("nodes-not-a-list", lambda d: d.__setitem__("nodes", {}), "nodes"),
    ("node-without-name", lambda d: _node(d, "mm").pop("name"), "name"),
    ("node-name-repeated", lambda d: d["nodes"].append(dict(_node(d, "mm"))), "name"),
    ("unknown-top-level-key", lambda d: d.__setitem__("comment", "hi"), "comment"),
]


@pytest.mark.parametrize("raw, message", [
    pytest.param(b"\xff\xfe{}", "is not valid JSON", id="not-utf8"),
    pytest.param(b"[" * 100_000, "nested too deeply", id="nested-too-deeply"),
    pytest.param(b'{"graph": ' + b"9" * 5000 + b"}", "is not valid JSON", id="integer-past-the-digit-limit"),
])
def test_unreadable_file_raises_dag_error(tmp_path, raw, message):
    path = tmp_path / "bad.dag.json"
    path.write_bytes(raw)
    with pytest.raises(DagError, match=message):
        load_dag(path)


def test_corruptions_cover_every_required_attribute_of_every_kind():
    ids = [c[0] for c in CORRUPTIONS]
    assert len(ids) == len(set(ids)) and len(ids) >= 48
    assert {f"{k}-without-kind" for k in NODE_OF_KIND} <= set(ids)


@pytest.mark.parametrize("corrupt, field", [pytest.param(c, f, id=i) for i, c, f in CORRUPTIONS])
def test_corrupt_field_raises_dag_error_naming_it(saved, tmp_path, corrupt, field):
    data = copy.deepcopy(saved["every_kind"])
    corrupt(data)
    path = tmp_path / "bad.dag.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    with pytest.raises(DagError) as err:
        load_dag(path)
    assert field in str(err.value) and str(path) in str(err.value), str(err.value)


@pytest.mark.parametrize("source", ["every_kind", "synthetic"])
def test_valid_file_round_trips_unchanged(saved, tmp_path, source):
    path, again = tmp_path / "g.dag.json", tmp_path / "again.dag.json"
    path.write_text(json.dumps(saved[source]))
    dag = load_dag(path)
    save_dag(dag, again)
    assert json.loads(again.read_text()) == saved[source]
    p = Problem.from_dag(dag)
    assert simulate(dag, p.traced_schedule(), problem=p).step_ms > 0


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda d: d["graph"].pop("structure"), id="structure"),
    pytest.param(lambda d: [_node(d, c).pop(a) for c in (AG, RS) for a in ("epilogue", "block", "structure_source")
                            if c != RS or a != "epilogue"], id="epilogue-block-structure_source"),
    pytest.param(lambda d: [m.pop("table") for m in d["graph"]["comm_model"].values()], id="comm_model-table"),
])
def test_optional_attributes_may_be_left_out(saved, corrupt):
    """What older files and DagBuilder graphs leave out loads, and simulates as before."""
    data = copy.deepcopy(saved["every_kind"])
    corrupt(data)
    dag, full = dag_from_json(data), dag_from_json(copy.deepcopy(saved["every_kind"]))
    assert simulate(dag).step_ms == simulate(full).step_ms


# --------------------------------------------------------------------------------------------
# fuzz: random mutations load into a DAG that simulates, or raise DagError
# --------------------------------------------------------------------------------------------
def _containers(data, path=()) -> list[tuple]:
    """Paths of every non-empty dict and list in ``data``, except the points of comm tables
    (a third of the file, and all alike)."""
    out = [path] if data else []
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        if isinstance(value, (dict, list)) and not (path and path[-1] == "table"):
            out += _containers(value, (*path, key))
    return out


def _at(data, path):
    for key in path:
        data = data[key]
    return data


_SCALARS = (st.none() | st.booleans() | st.integers(-2, 20) | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4))
_JSON = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_mutation_loads_and_simulates_or_raises_dag_error(saved, data):
    source = data.draw(st.sampled_from(sorted(saved)))
    doc = copy.deepcopy(saved[source])
    names = [n["name"] for n in doc["nodes"]]
    box = _at(doc, data.draw(st.sampled_from(_containers(doc))))
    keys = list(box) if isinstance(box, dict) else list(range(len(box)))
    key = data.draw(st.sampled_from(keys))
    op = data.draw(st.sampled_from(["delete", "replace", "swap"]))
    if op == "delete":
        del box[key]
    elif op == "replace":
        box[key] = data.draw(_JSON | st.sampled_from(names) | st.lists(st.sampled_from(names), max_size=3))
    else:
        other = data.draw(st.sampled_from(keys))
        box[key], box[other] = box[other], box[key]
    try:
        dag = dag_from_json(json.loads(json.dumps(doc)), source="mutated")
    except DagError:
        return
    problem = Problem.from_dag(dag)
    sim = simulate(dag, problem.traced_schedule(), problem=problem)
    assert not math.isnan(sim.step_ms)


# --------------------------------------------------------------------------------------------
# multi-output nodes: a storage per result
# --------------------------------------------------------------------------------------------
def _multi_output():
    """``topk`` written into given tensors (``out=(v, i)``), and a plain ``topk`` whose values
    nobody reads::

        empty, empty_1 -> topk(x, out=) -> getitem (of empty), getitem_1 (of empty_1)
        topk_1(x) -> getitem_2 (values, unread), getitem_3 (indices) -> output
    """

    def f(x):
        v, i = torch.empty(8, 4), torch.empty(8, 4, dtype=torch.long)
        torch.topk(x, 4, out=(v, i))
        return torch.topk(x, 4)[1], v, i

    with FakeTensorMode():
        args = (torch.randn(8, 16),)
    return make_fx(f, tracing_mode="fake")(*args)


@pytest.fixture(scope="module")
def multi_output():
    return json.loads(json.dumps(dag_to_json(export_dag(_multi_output()))))


def test_multi_output_nodes_count_each_result(multi_output):
    """A result is a storage of its own (``output_bytes``, a getitem's ``output_index``); one
    written into a given tensor is that tensor's storage (``output_alias``, the getitem a view of
    it)."""
    dag = dag_from_json(multi_output)
    assert dag.nodes["topk_1"]["output_bytes"] == [8 * 4 * 4, 8 * 4 * 8]
    assert dag.nodes["topk_1"]["size_bytes"] == 8 * 4 * 12
    assert (dag.nodes["getitem_3"]["alias_of"], dag.nodes["getitem_3"]["output_index"]) == ("topk_1", 1)
    assert dag.nodes["topk"]["output_alias"] == ["empty", "empty_1"]
    assert dag.nodes["topk"]["output_bytes"] == [0, 0] and dag.nodes["topk"]["size_bytes"] == 0
    assert dag.nodes["getitem"]["alias_of"] == "empty" and "output_index" not in dag.nodes["getitem"]
    assert dag.nodes["getitem_1"]["alias_of"] == "empty_1"


@pytest.mark.parametrize("corrupt, field", [
    pytest.param(_set("topk_1", "output_bytes", [128, 1]), "size_bytes", id="results-do-not-add-up"),
    pytest.param(_set("topk_1", "output_bytes", [128, -1]), "output_bytes", id="negative-result"),
    pytest.param(_set("getitem_3", "output_index", 2), "output_index", id="index-past-the-results"),
    pytest.param(_set("x_1", "output_index", 0), "output_index", id="index-on-an-input"),
    pytest.param(_set("topk_1", "output_index", 0), "output_index", id="index-without-alias"),
    pytest.param(_set("topk", "output_alias", ["empty"]), "output_alias", id="alias-list-too-short"),
    pytest.param(_set("topk", "output_alias", ["getitem_3", "empty_1"]), "output_alias", id="alias-to-a-later-node"),
    pytest.param(_set("topk_1", "output_alias", ["x_1", None]), "output_alias", id="written-result-with-bytes"),
    pytest.param(_drop("topk_1", "output_bytes"), "output_index", id="index-into-no-results"),
    pytest.param(_set("getitem", "output_index", 0), "output_index", id="index-of-a-written-result"),
])
def test_corrupt_multi_output_field_raises_dag_error_naming_it(multi_output, corrupt, field):
    data = copy.deepcopy(multi_output)
    corrupt(data)
    with pytest.raises(DagError) as err:
        dag_from_json(data)
    assert field in str(err.value), str(err.value)


def test_multi_output_file_round_trips_unchanged(multi_output, tmp_path):
    path, again = tmp_path / "g.dag.json", tmp_path / "again.dag.json"
    path.write_text(json.dumps(multi_output))
    save_dag(load_dag(path), again)
    assert json.loads(again.read_text()) == multi_output


def test_submodules_and_unread_inputs_export_without_meta_val(group_name):
    """A graph may hold code as data (flex attention's score and mask functions are get_attr
    nodes of submodules) and, traced by make_fx with int arguments, placeholders that carry no
    meta['val'] and are never read. Neither holds memory the step uses: both export as inputs
    of 0 bytes, while a read placeholder without meta['val'] is still refused."""
    gm = _trace(group_name)
    graph = gm.graph
    gm.add_submodule("score_mod", torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        unread = graph.placeholder("arg0_1")
    with graph.inserting_after(first):
        code = graph.get_attr("score_mod")
    gm.recompile()
    dag = export_dag(gm)
    assert dag.nodes[unread.name]["kind"] == dag.nodes[code.name]["kind"] == "input"
    assert dag.nodes[unread.name]["size_bytes"] == dag.nodes[code.name]["size_bytes"] == 0
    assert simulate(dag, Problem.from_dag(dag).traced_schedule()).peak_bytes == \
        simulate(export_dag(_trace(group_name)), Problem.from_dag(export_dag(_trace(group_name))).traced_schedule()).peak_bytes

    read = next(n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))
    del read.meta["val"]
    with pytest.raises(DagError, match=read.name):
        export_dag(gm)
