"""Structure inference and export robustness on graphs captured without any helper of models/.

The graphs come from tests/foreign_models.py (plain torch.compile + aot_autograd, an own
SimpleFSDP-style parametrization); each collective's true parameter comes from a data-flow
oracle there, never from what structure inference reads.
"""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
from torch import fx, nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import foreign_models as fm  # noqa: E402
from conftest import FAKE_WORLD as WORLD  # noqa: E402
from scheduler import optimize_schedule, simulate  # noqa: E402
from scheduler.export.dag import DagError, export_dag  # noqa: E402
from scheduler.export.dagfile import dag_from_json, dag_to_json  # noqa: E402
from scheduler.export.repetition import find_repetition  # noqa: E402
from scheduler.export.structure import normalize_path  # noqa: E402
from solvers.core.problem import Problem  # noqa: E402

ops = torch.ops._c10d_functional
_CAPTURED: dict = {}


def _capture(style: str, **kwargs) -> fm.Captured:
    """``fm.capture(style, world_size=WORLD, **kwargs)``, traced once for the module; each call
    gets its own copy (tests strip or add metadata in place)."""
    key = (style, tuple(sorted(kwargs.items())))
    if key not in _CAPTURED:
        _CAPTURED[key] = fm.capture(style, world_size=WORLD, **kwargs)
    return copy.deepcopy(_CAPTURED[key])


def _check_blocks(gm, captured, *, source: str | None) -> dict:
    """Export ``gm``; every parameter collective's block equals its parameter's true block,
    and grouping each chain by block gives one bucket per block holding exactly that block's
    parameters (the FSDP2-like grouping). Returns the structure summary."""
    dag = export_dag(gm)
    truth = gm.meta[fm.TRUTH_KEY]
    structure = dag.graph["structure"]
    if source is not None:
        assert structure["source"] == source
    n_blocks = len({b for b in captured.true_blocks.values() if b is not None})
    assert structure["n_blocks"] == n_blocks
    for name, param in truth.items():
        assert dag.nodes[name]["block"] == captured.true_blocks[param], (name, param)
    problem = Problem.from_dag(dag)
    for chain in problem.chains.values():
        if not set(chain) & truth.keys():
            continue  # a tensor- or expert-parallel collective's: no parameter's
        runs: list[list[str]] = []
        for m in chain:
            if runs and dag.nodes[runs[-1][-1]]["block"] == dag.nodes[m]["block"]:
                runs[-1].append(m)
            else:
                runs.append([m])
        in_blocks = [r for r in runs if dag.nodes[r[0]]["block"] is not None]
        assert len(in_blocks) == n_blocks
        for run in in_blocks:
            b = dag.nodes[run[0]]["block"]
            assert {truth[m] for m in run} == {p for p, tb in captured.true_blocks.items() if tb == b}
    return structure


CASES = [
    ("tied", {}),
    ("alternating", {"n_layers": 6}),
    ("sac", {"partitioner": "min_cut"}),
    ("sac", {"partitioner": "default"}),
    ("tp", {}),
    ("fp32", {}),
    ("moe", {}),
]


@pytest.mark.parametrize("style,kwargs", CASES, ids=[f"{s}-{k.get('partitioner', '')}" for s, k in CASES])
def test_blocks_from_module_stack_then_from_the_graph_alone(group_name, style, kwargs):
    """Named by the aot graph's nn_module_stack; then, with that metadata stripped, found again
    from the repetition of the graph alone, forward and backward."""
    captured = _capture(style, **kwargs)
    for gm in (captured.forward, captured.backward):
        assert gm.meta[fm.TRUTH_KEY]
        assert not any("fsdp_fqn" in n.meta for n in gm.graph.nodes)
        _check_blocks(gm, captured, source="module_stack")
        _check_blocks(fm.strip_names(gm), captured, source="graph")


def test_names_from_module_stack_and_dynamo_sources(group_name):
    captured = fm.capture("tied", world_size=WORLD, dynamo_names=True)
    fw, bw = captured.forward, captured.backward
    dag = export_dag(fw)
    truth = fw.meta[fm.TRUTH_KEY]
    assert all(dag.nodes[c]["fqns"] == [p] for c, p in truth.items())  # e.g. trunk.0.up.weight
    for gm in (fm.strip_names(fw), fm.strip_names(bw)):
        structure = _check_blocks(gm, captured, source="dynamo")
        dag = export_dag(gm)
        truth = gm.meta[fm.TRUTH_KEY]
        assert all(dag.nodes[c]["fqns"] == [p] and dag.nodes[c]["structure_source"] == "dynamo"
                   for c, p in truth.items())
        assert structure["block_names"] == ["trunk.0", "trunk.1", "trunk.2"]


def test_fsdp_fqn_is_the_first_source(group_name):
    captured = _capture("fp32")
    gm = captured.forward
    for name, param in gm.meta[fm.TRUTH_KEY].items():
        next(n for n in gm.graph.nodes if n.name == name).meta["fsdp_fqn"] = param.replace("trunk", "layers")
    dag = export_dag(gm)
    assert dag.graph["structure"]["source"] == "fsdp_fqn"
    assert dag.graph["structure"]["block_names"] == ["layers.0", "layers.1", "layers.2"]


def test_alternating_widths_give_signatures_and_period_and_survive_json(group_name):
    """Widths 2d, 3d alternate and every 3rd block is 2x wider: 4 signatures, period 6."""
    captured = fm.capture("alternating", world_size=WORLD, n_layers=6, wide_every=3)
    for gm in (captured.forward, fm.strip_names(captured.backward)):
        dag = export_dag(gm)
        s = dag.graph["structure"]
        assert s["signatures"] == [0, 1, 2, 1, 0, 3] and s["signature_period"] == 6 and s["n_signatures"] == 4
        back = dag_from_json(json.loads(json.dumps(dag_to_json(dag))))
        assert back.graph["structure"] == s
        assert all(back.nodes[n].get("block") == a.get("block") for n, a in dag.nodes(data=True))


def test_find_repetition_and_paths():
    #            prefix   3 units of (a, b, c)          suffix
    tokens = ["e", "a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "z"]
    assert find_repetition(tokens) == (1, 3, 3)
    assert find_repetition(list("abcdef")) is None
    assert normalize_path("L['self']._modules['layers']._modules['3']._modules['parametrizations']"
                          "._modules['weight']._parameters['original']") == "layers.3.weight"
    assert normalize_path("L['self'].trunk.0.up.parametrizations.weight.0") == "trunk.0.up.weight"
    assert normalize_path("L['tokens']") is None


# --------------------------------------------------------------------------------------------
# export robustness


def test_moe_all_to_all_with_data_dependent_splits_exports_on_its_group(group_name):
    """all_to_all_single with .tolist() split sizes (unbacked symbols) on the expert group:
    exported with finite sizes on the expert group's stream, movable alone within the issue ranges
    their data give them (one whose output's size is read before its wait stays, saying so); the
    all-gathers stay movable and the traced schedule simulates."""
    captured = _capture("moe")
    for gm in (captured.forward, captured.backward):
        a2a = [n.name for n in gm.graph.nodes if n.target is ops.all_to_all_single.default]
        assert a2a and any(
            "u" in str(s) for n in gm.graph.nodes if n.target is ops.all_to_all_single.default
            for s in getattr(n.meta.get("val"), "shape", ()))
        dag = export_dag(gm)
        groups = {dag.nodes[n]["group_name"] for n in a2a}
        dp = {a["group_name"] for _, a in dag.nodes(data=True) if a.get("role") == "fsdp"}
        assert len(groups) == 1 and groups.isdisjoint(dp)
        assert dag.graph["process_groups"][groups.pop()]["size"] == 2
        assert all(dag.nodes[n]["size_bytes"] > 0 for n in a2a)
        problem = Problem.from_dag(dag)
        for n in a2a:
            c = problem.colls[n]
            assert not c.mergeable and c.ready <= c.traced_issue <= c.traced_wait <= c.needed
            assert c.movable or c.fixed_reason  # pinned only for a stated reason
        assert any(c.movable for c in problem.colls.values())
        sim = simulate(dag)
        assert sim.step_ms > 0 and sim.peak_bytes > 0


def test_tp_all_reduces_move_alone_on_the_tp_stream(group_name):
    captured = _capture("tp")
    dag = export_dag(captured.forward)
    ar = [n for n, a in dag.nodes(data=True) if a.get("coll_type") == "all_reduce"]
    assert len(ar) == 3
    assert all(dag.nodes[n]["block"] == b for b, n in enumerate(ar))
    problem = Problem.from_dag(dag)
    assert all(problem.colls[n].movable and not problem.colls[n].mergeable for n in ar)
    tp_group = dag.nodes[ar[0]]["group_name"]
    assert tp_group != next(a["group_name"] for _, a in dag.nodes(data=True) if a.get("role") == "fsdp")
    assert dag.graph["process_groups"][tp_group]["size"] == 2


def _fake(*shapes):
    with FakeTensorMode():
        return tuple(torch.randn(*s) for s in shapes)


def test_backward_that_waits_on_a_placeholder(group_name):
    """The all-gather was issued in forward; backward only waits on it::

        gathered (placeholder) -> wait_tensor -> mm(g, .) -> reduce_scatter -> wait -> out
    """
    def bw(gathered, grad):
        w = ops.wait_tensor(gathered)
        return ops.wait_tensor(ops.reduce_scatter_tensor(torch.mm(grad, w), "sum", WORLD, group_name))

    gm = make_fx(bw, tracing_mode="fake")(*_fake((16, 16), (16, 16)))
    dag = export_dag(gm)
    wait = next(n for n in dag.graph["order"] if dag.nodes[n]["target"].endswith("wait_tensor.default")
                and dag.nodes[n]["kind"] == "view")
    assert dag.nodes[wait]["external_wait"] == "input" and dag.nodes[wait]["runtime_ms"] == 0
    assert dag.nodes[wait]["alias_of"] == "gathered_1"
    problem = Problem.from_dag(dag)
    (rs,) = problem.colls.values()
    assert rs.coll_type == "reduce_scatter" and rs.movable
    assert simulate(dag).step_ms > 0


def test_wait_on_a_wait_and_collective_waited_in_the_other_graph(group_name):
    """Forward: ``wait(wait(all_gather(w)))`` feeds an mm; a second all-gather is prefetched
    for backward (returned unwaited)::

        w -> AG -> wait -> wait_1 -> mm(x, .) -> out
        v -> AG_1 --------------------------------> out
    """
    def fw(w, v, x):
        full = ops.wait_tensor(ops.wait_tensor(ops.all_gather_into_tensor(w, WORLD, group_name)))
        return torch.mm(x, full), ops.all_gather_into_tensor(v, WORLD, group_name)

    gm = make_fx(fw, tracing_mode="fake")(*_fake((4, 16), (4, 16), (8, 16)))
    dag = export_dag(gm)
    ag, ag_1 = [n for n in dag.graph["order"] if dag.nodes[n]["target"].endswith("all_gather_into_tensor.default")]
    first_wait = dag.nodes[ag]["wait"]
    second = next(iter(dag.successors(first_wait)))
    assert dag.nodes[second]["external_wait"] == "wait" and dag.nodes[second]["alias_of"] == ag
    assert dag.nodes[ag_1]["kind"] == "compute" and dag.nodes[ag_1]["unwaited_collective"]
    problem = Problem.from_dag(dag)
    assert list(problem.colls) == [ag]
    assert simulate(dag).step_ms > 0


def test_graph_without_collectives_or_metadata_comes_back_unchanged():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    gm = fx.symbolic_trace(MLP())
    assert not any("val" in n.meta for n in gm.graph.nodes)
    before = str(gm.graph)
    assert optimize_schedule(gm, "1 GiB") is gm and str(gm.graph) == before
    with pytest.raises(DagError, match="no meta\\['val'\\]"):
        export_dag(gm)
