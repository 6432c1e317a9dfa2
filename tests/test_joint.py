"""Joint forward + loss + backward graphs (make_fx of a training step, as torchtitan's graph
trainer traces): capture, structure and direction of every collective, the heuristics' plan per
block and per direction, and optimize_schedule under the graph's own peak.

The capture is :func:`models.capture_joint_graph` (llama3-debug, 2 layers, 21 parameters, on a
fake group of 4 ranks); the smallest graphs are traced here by hand with make_fx.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import models
from conftest import FAKE_WORLD as WORLD
from models.capture import ALL_GATHER, REDUCE_SCATTER, WAIT, fake_process_group
from scheduler import SolverOptions, optimize_schedule
from scheduler.api import REPORT_KEY
from scheduler.export.dag import export_dag
from scheduler.check.judge import liveness_peak
from solvers.core.problem import Problem
from solvers.core.simulator import simulate
from solvers.core.validator import validate_schedule
from solvers.heuristics import HEURISTICS, fsdp2_blocks, fsdp2_schedule

DEBUG = "llama3-debug"
N_PARAMS = 21  # llama3-debug, 2 layers: embeddings, 9 per block, final norm, output
c10d = torch.ops._c10d_functional

#: the three ways a graph trainer traces llama3-debug: no recompute, reshard after forward
#: (backward re-gathers), selective activation checkpointing (re-gathers and recomputed
#: pointwise ops, matmuls and attention saved)
VARIANTS = {
    "keep": dict(reshard_after_forward=False),
    "reshard": dict(reshard_after_forward=True),
    "sac": dict(reshard_after_forward=True, activation_checkpointing="selective"),
}


@pytest.fixture(scope="module")
def joints():
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "fake":
        pytest.skip("capture needs a process without a real group")
    return {k: models.capture_joint_graph(DEBUG, world_size=WORLD, **opts) for k, opts in VARIANTS.items()}


def _collectives(gm, target, backward: bool | None = None):
    return [n for n in gm.graph.nodes if n.target is target
            and (backward is None or bool(n.meta.get("autograd_backward")) == backward)]


def _export(gm):
    with fake_process_group(WORLD):
        return export_dag(gm)


def _true_block(fqn: str) -> int | None:
    parts = fqn.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


# --------------------------------------------------------------------------------------------
# a joint graph traced by hand
# --------------------------------------------------------------------------------------------
class _Gather(torch.autograd.Function):
    """SimpleFSDP in two ops: all-gather the shard forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, shard, group_name):
        ctx.group_name = group_name
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, WORLD, group_name))

    @staticmethod
    def backward(ctx, grad):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.contiguous(), "sum", WORLD, ctx.group_name)), None


def _tiny_joint(group_name: str, *, annotate_backward: bool):
    """Two weights of 8 x 8 (shards 2 x 8), traced as one training step::

        primals_1 -> all_gather -> wait -> t -> mm(x) -> relu -> mm -> sum = loss   (forward)
        primals_2 -> all_gather -> wait -> t ------------------^
        ones -> ... -> mm (dW2) -> reduce_scatter -> wait -> output[1]            (backward)
                       mm (dW1) -> reduce_scatter -> wait -> output[2]

    ``annotate_backward``: trace under torch's non-strict tracing hooks, which mark backward
    nodes ``autograd_backward`` (the graph trainer's way); else the graph says nothing and its
    direction is read from what the loss reads.
    """
    from torch._subclasses import FakeTensorMode
    from torch.fx.traceback import preserve_node_meta

    def step(primals):
        w1, w2, x = primals
        h = torch.relu(x @ _Gather.apply(w1, group_name).t())
        loss = (h @ _Gather.apply(w2, group_name).t()).sum()
        return [loss, *torch.autograd.grad(loss, [w1, w2])]

    mode = FakeTensorMode()
    inputs = [mode.from_tensor(torch.empty(2, 8)).requires_grad_(True),
              mode.from_tensor(torch.empty(2, 8)).requires_grad_(True), mode.from_tensor(torch.empty(4, 8))]
    if annotate_backward:
        with (mode, preserve_node_meta(), torch.compiler._non_strict_tracing_context(),
              torch.compiler._patch_engine_backward()):
            return make_fx(step)(inputs)
    with mode:
        return make_fx(step)(inputs)


@pytest.mark.parametrize("annotate_backward", [True, False], ids=["autograd_backward", "data-flow"])
def test_tiny_joint_graph_directions(group_name, annotate_backward):
    """Both gathers run forward and both reduce-scatters backward, whether the graph marks its
    backward nodes or the direction comes from what the loss reads; the graph is 'joint'."""
    gm = _tiny_joint(group_name, annotate_backward=annotate_backward)
    assert annotate_backward == any(n.meta.get("autograd_backward") for n in gm.graph.nodes)
    dag = export_dag(gm)
    assert dag.graph["graph_kind"] == "joint"
    phases = {dag.nodes[n]["coll_type"]: set() for n in dag.nodes if dag.nodes[n]["kind"] == "collective"}
    for n, a in dag.nodes(data=True):
        if a["kind"] == "collective":
            phases[a["coll_type"]].add(a["phase"])
    assert phases == {"all_gather": {"forward"}, "reduce_scatter": {"backward"}}


def test_tiny_joint_graph_with_regathers_schedules_and_keeps_results(group_name):
    """Tagging the gathers for recompute and running torch's remat pass puts a re-gather of
    the weight the backward reads into the backward (phase 'backward': w2, for the gradient
    of h; w1's gradient needs only x and the gradient of its output); every heuristic's schedule is valid and
    keeps each bucket in one direction; optimize_schedule writes the graph back as a joint
    graph that lints."""
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (
        remat_using_tags_for_fwd_loss_bwd_graph,
    )
    from torch.utils.checkpoint import CheckpointPolicy

    gm = _tiny_joint(group_name, annotate_backward=True)
    for ag in gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        (wait,) = ag.users
        for n in (ag, wait, *(u for u in wait.users if u.target is torch.ops.aten.t.default)):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    gm = remat_using_tags_for_fwd_loss_bwd_graph(gm)
    dag = export_dag(gm)
    regathers = [n for n, a in dag.nodes(data=True) if a["kind"] == "collective" and a["coll_type"] == "all_gather"
                 and a["phase"] == "backward"]
    assert regathers == ["all_gather_into_tensor_1_recomputed"]
    problem = Problem.from_dag(dag)
    for name in HEURISTICS:
        schedule = HEURISTICS[name](problem).schedule
        validate_schedule(problem, schedule)
        for bucket in schedule.buckets:
            assert len({problem.colls[m].phase for m in bucket.members}) == 1, (name, bucket.members)
    out = optimize_schedule(copy.deepcopy(gm), solver=SolverOptions(work_limit=2))
    assert out.meta[REPORT_KEY].graph_kind == "joint"
    out.graph.lint()


# --------------------------------------------------------------------------------------------
# the capture of llama3-debug
# --------------------------------------------------------------------------------------------
def test_capture_inputs_outputs_and_collectives(joints):
    """Every input is a primals_* (held by the caller); outputs are the loss and one gradient
    per parameter; one forward gather and one reduce-scatter per parameter, each named after
    its parameter, reduce-scatter i feeding gradient output i."""
    for variant, j in joints.items():
        gm = j.graph
        assert gm.meta["fsdp_graph_kind"] == "joint"
        placeholders = gm.graph.find_nodes(op="placeholder")
        assert all(p.name.startswith("primals_") for p in placeholders)
        assert len(placeholders) == N_PARAMS + len(j.buffer_names) + 2
        outputs = gm.graph.find_nodes(op="output")[0].args[0]
        assert len(outputs) == 1 + N_PARAMS and outputs[0].meta["val"].ndim == 0
        fwd = _collectives(gm, ALL_GATHER, backward=False)
        rs = _collectives(gm, REDUCE_SCATTER)
        assert sorted(n.meta["fsdp_fqn"] for n in fwd) == sorted(j.param_fqns), variant
        assert sorted(n.meta["fsdp_param_index"] for n in rs) == list(range(N_PARAMS))
        assert all(n.meta.get("autograd_backward") for n in rs)
        for i, out in enumerate(outputs[1:]):
            node = out
            while node.target is not WAIT:
                node = node.args[0]
            assert node.args[0].meta["fsdp_param_index"] == i


def test_reshard_and_selective_checkpointing_regather_in_backward(joints):
    """Without recompute no parameter is gathered in backward; reshard after forward gathers
    every parameter again that the backward reads (all but the embedding table), from its own
    shard, as a recomputed copy; selective checkpointing also recomputes pointwise ops but never
    a matmul or the attention."""
    keep, reshard, sac = (joints[k].graph for k in ("keep", "reshard", "sac"))
    assert _collectives(keep, ALL_GATHER, backward=True) == []
    for gm in (reshard, sac):
        again = _collectives(gm, ALL_GATHER, backward=True)
        assert sorted(n.meta["fsdp_fqn"] for n in again) == sorted(f for f in joints["keep"].param_fqns
                                                                  if f != "tok_embeddings.weight")
        assert all(n.name.endswith("_recomputed") for n in again)
        for n in again:
            src = n.args[0]
            while src.op != "placeholder":
                src = src.args[0]
            assert int(src.name.split("_")[1]) - 1 == n.meta["fsdp_param_index"]
    recomputed = {n.target for n in sac.graph.nodes if n.name.endswith("_recomputed")}
    assert torch.ops.aten.mm.default not in recomputed
    assert torch.ops.fsdp_sched.flash_attn.default not in recomputed
    assert len(recomputed - {ALL_GATHER, WAIT}) > 5
    assert sum(n.name.endswith("_recomputed") for n in sac.graph.nodes) > 2 * sum(
        n.name.endswith("_recomputed") for n in reshard.graph.nodes)


def test_64_ranks_regather_every_parameter_of_uneven_shards():
    """llama3-8b widths on 64 ranks: shards of the norm weights (4096 / 64) are even, but the
    padded gathers of uneven shards (the vocabulary tables) are sliced after their wait; the
    slice is recomputed with the gather, so reshard after forward re-gathers every parameter
    the backward reads (a saved slice would keep the full table alive instead)."""
    j = models.capture_joint_graph("llama3-8b", world_size=64, n_layers=1, seq_len=256)
    gm = j.graph
    again = {n.meta["fsdp_fqn"] for n in _collectives(gm, ALL_GATHER, backward=True)}
    assert again == set(j.param_fqns) - {"tok_embeddings.weight"}


# --------------------------------------------------------------------------------------------
# structure and direction
# --------------------------------------------------------------------------------------------
def _strip(gm, *keys):
    for n in gm.graph.nodes:
        for k in keys:
            n.meta.pop(k, None)
    gm.meta.pop("fsdp_graph_kind", None)
    return gm


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_blocks_and_directions_from_every_source(joints, variant):
    """Blocks and directions of every collective equal the truth (the capture's annotations,
    kept aside) when read from fsdp_fqn, from the graph trainer's module_fqn annotations, from
    the graph alone, and from the graph alone without autograd_backward marks."""
    gm = copy.deepcopy(joints[variant].graph)
    truth = {n.name: (_true_block(n.meta["fsdp_fqn"]), "backward" if n.meta.get("autograd_backward") else "forward")
             for n in gm.graph.nodes if n.target in (ALL_GATHER, REDUCE_SCATTER)}
    steps = [("fsdp_fqn", ()), ("module_stack", ("fsdp_fqn", "fsdp_role", "fsdp_param_index")),
             ("graph", ("custom",)), ("graph", ("autograd_backward",))]
    for source, keys in steps:
        dag = _export(_strip(gm, *keys))
        assert dag.graph["graph_kind"] == "joint"
        assert dag.graph["structure"]["source"] == source
        assert dag.graph["structure"]["n_blocks"] == 2
        got = {n: (dag.nodes[n]["block"], dag.nodes[n]["phase"]) for n in truth}
        assert got == truth, (source, {n: (got[n], truth[n]) for n in truth if got[n] != truth[n]})


# --------------------------------------------------------------------------------------------
# heuristics: per block and per direction
# --------------------------------------------------------------------------------------------
def test_fsdp2_plan_is_per_block_and_per_direction(joints):
    """FSDP2-like on the reshard graph: each bucket holds exactly the parameters of one block
    (or of the root) in one direction; the forward gathers of block b and its backward
    re-gathers are separate buckets; prefetch never crosses the forward / backward boundary
    (the first backward bucket is issued where it is needed); no heuristic mixes directions."""
    dag = _export(joints["reshard"].graph)
    problem = Problem.from_dag(dag)
    blocks = fsdp2_blocks(problem)
    schedule = fsdp2_schedule(problem)
    validate_schedule(problem, schedule)
    issue, _ = schedule.positions()
    groups: dict[tuple, set[str]] = {}
    for name, c in problem.colls.items():
        groups.setdefault((c.coll_type, c.phase, blocks[name]), set()).add(name)
    for b, bucket in enumerate(schedule.buckets):
        c0 = problem.colls[bucket.members[0]]
        key = (c0.coll_type, c0.phase, blocks[c0.name])
        if key[2].startswith("block:"):
            assert set(bucket.members) == groups[key], key
        assert {problem.colls[m].phase for m in bucket.members} == {c0.phase}
    gathers = sorted((b for b, bk in enumerate(schedule.buckets) if problem.colls[bk.members[0]].coll_type
                      == "all_gather"), key=lambda b: issue[b])
    first_backward = next(b for b in gathers if problem.colls[schedule.buckets[b].members[0]].phase == "backward")
    members = schedule.buckets[first_backward].members
    assert issue[first_backward] == min(problem.colls[m].needed for m in members)
    for name in HEURISTICS:
        for bucket in HEURISTICS[name](problem).schedule.buckets:
            assert len({problem.colls[m].phase for m in bucket.members}) == 1, (name, bucket.members)


def test_per_block_plan_prefetches_into_the_backward_and_the_search_keeps_up(joints):
    """The per-block plan (heuristic ``perblock``) on the reshard graph: FSDP2-like's buckets,
    but the first backward bucket is issued before it is needed, while the forward still runs
    (before the last forward bucket is needed); so it is faster than FSDP2-like under the
    analytic model at the same peak. The default search (the family of cost models) at the
    per-block plan's peak is then not slower than it under the analytic model nor under
    torch's."""
    from scheduler.costs.family import cost_model_family
    from scheduler.costs.hardware import Cluster
    from scheduler.costs.pricing import export_problems
    from solvers.core.evaluate import evaluate
    from solvers.search import search

    gm = joints["reshard"].graph
    cluster = Cluster(n_gpus=WORLD, gpus_per_node=WORLD)
    with fake_process_group(WORLD):
        problems = export_problems(gm, cost_model_family(cluster), cluster)
    problem = problems["analytic"]
    plan = HEURISTICS["perblock"](problem).schedule
    fsdp2 = fsdp2_schedule(problem)
    validate_schedule(problem, plan)
    assert sorted(b.members for b in plan.buckets) == sorted(b.members for b in fsdp2.buckets)
    issue, _ = plan.positions()
    gathers = sorted((b for b, bk in enumerate(plan.buckets) if problem.colls[bk.members[0]].coll_type
                      == "all_gather"), key=lambda b: issue[b])
    phases = [problem.colls[plan.buckets[b].members[0]].phase for b in gathers]
    first = phases.index("backward")
    last_forward_needed = min(problem.colls[m].needed for m in plan.buckets[gathers[first - 1]].members)
    assert issue[gathers[first]] <= last_forward_needed
    ours, theirs = evaluate(problem, plan), evaluate(problem, fsdp2)
    assert ours.peak_bytes <= theirs.peak_bytes and ours.step_ms < theirs.step_ms
    found = search(problems, ours.peak_bytes).schedule
    validate_schedule(problem, found, mem_budget_bytes=ours.peak_bytes)
    for label in ("analytic", "torch"):
        assert evaluate(problems[label], found).step_ms <= evaluate(problems[label], plan).step_ms * (1 + 1e-9), label


# --------------------------------------------------------------------------------------------
# the graph's own peak as the budget
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["keep", "reshard", "sac"])
def test_budget_equal_to_the_traced_peak_is_met(joints, variant):
    """optimize_schedule with the traced joint graph's own peak (the reference liveness count,
    which the simulator reproduces) as budget: never refused, and the written graph peaks
    within it by the liveness count and the re-export, and is faster."""
    gm = copy.deepcopy(joints[variant].graph)
    dag = _export(gm)
    problem = Problem.from_dag(dag)
    traced = simulate(dag, problem.traced_schedule(), problem=problem)
    budget = liveness_peak(gm)
    assert traced.peak_bytes == budget
    with fake_process_group(WORLD):
        optimize_schedule(gm, mem_budget=budget, solver=SolverOptions(work_limit=5))
    report = gm.meta[REPORT_KEY]
    assert report.graph_kind == "joint"
    assert liveness_peak(gm) <= budget
    assert report.peak_bytes_after <= budget
    assert report.step_ms_after < report.step_ms_before


def test_torch_manual_per_block_plan_buckets_each_block_and_direction(joints):
    """torch's manual scheduler with the per-block plan of structure inference: on the reshard
    graph one all-gather bucket per block and direction plus the root runs (embeddings; final
    norm and output; in backward output and norm), one reduce-scatter bucket per block plus
    the two root runs; the rewritten graph still reads as a joint graph, its merged buckets
    (new nodes, without autograd_backward marks) in the right direction."""
    from scheduler.compare.baselines import manual_bucket_plans, torch_manual_schedule

    gm = joints["reshard"].graph
    plans, _ = manual_bucket_plans(gm)
    assert plans == ["forward.root0", "forward.block0", "forward.block1", "forward.root1",
                     "backward.root0", "backward.block1", "backward.block0", "backward.root1"]
    out = torch_manual_schedule(gm)
    dag = _export(out)
    colls = [(a["coll_type"], a["phase"]) for _, a in dag.nodes(data=True) if a["kind"] == "collective"]
    assert sorted(colls) == sorted([("all_gather", "forward")] * 4 + [("all_gather", "backward")] * 3
                                   + [("reduce_scatter", "backward")] * 4)
    assert dag.graph["graph_kind"] == "joint"


# --------------------------------------------------------------------------------------------
# graphs we did not capture: tests/foreign_models.py traced as joint graphs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["tied", "alternating", "sac", "tp", "fp32"])
def test_foreign_joint_graphs_blocks_directions_and_own_peak(style):
    """Each foreign style traced as one joint graph (make_fx of its training step, written
    without models/): blocks from the graph trainer's module_fqn annotations and, without
    them, from the graph alone, equal the data-flow truth; directions follow the marks; and
    optimize_schedule with the graph's own traced peak as budget is not refused, writes a graph
    within it and is faster (the "sac" style recomputes its gathers in backward)."""
    import foreign_models as fm

    for annotated, source in ((True, "module_stack"), (False, "graph")):
        captured = fm.capture_joint(style, world_size=WORLD, n_layers=4, module_fqns=annotated)
        gm = captured.forward
        truth = gm.meta[fm.TRUTH_KEY]
        with fake_process_group(WORLD):
            if style == "tp":  # the graph's groups by name: the same mesh again
                fm._mesh((WORLD // 2, 2), ("dp", "x"))
            dag = export_dag(gm)
            assert dag.graph["graph_kind"] == "joint" and dag.graph["structure"]["source"] == source
            assert dag.graph["structure"]["n_blocks"] == 4
            for name, param in truth.items():
                assert dag.nodes[name]["block"] == captured.true_blocks[param], (name, param)
                backward = bool(next(n for n in gm.graph.nodes if n.name == name).meta.get("autograd_backward"))
                assert dag.nodes[name]["phase"] == ("backward" if backward else "forward")
            if annotated:
                continue
            problem = Problem.from_dag(dag)
            traced = simulate(dag, problem.traced_schedule(), problem=problem)
            budget = liveness_peak(gm)
            optimize_schedule(gm, mem_budget=budget, solver=SolverOptions(work_limit=3))
        report = gm.meta[REPORT_KEY]
        assert report.step_ms_after < traced.step_ms
        if budget is not None:
            assert liveness_peak(gm) <= budget and report.peak_bytes_after <= budget


def test_ddp_all_reduces_are_placed_and_merged_only_when_allowed():
    """DDP's gradient all-reduces move like reduce-scatters (issued early, waited late: the
    step gains over the traced order) but stay one per gradient unless merges are allowed,
    since a merged ring all-reduce sums in another order; allowed, they are merged too."""
    import models
    import scheduler
    from models.capture import fake_process_group
    from models.fsdp import FSDPOptions, mesh_for
    from scheduler.api import REPORT_KEY

    j = models.capture_joint_graph(DEBUG, world_size=WORLD, n_layers=2, param_dtype=None, dp_mode="replicate")
    with fake_process_group(WORLD):
        mesh_for(WORLD, FSDPOptions(param_dtype=None, dp_mode="replicate"))  # the capture's groups, again
        problem = Problem.from_dag(export_dag(j.graph))
        ars = [c for c in problem.colls.values() if c.coll_type == "all_reduce"]
        assert ars and all(c.movable and not c.mergeable for c in ars)
        assert all(c.mergeable for c in Problem.from_dag(export_dag(j.graph, merge_all_reduces=True)).colls.values())
        reports = {}
        for merge in (False, True):
            gm = copy.deepcopy(j.graph)
            scheduler.optimize_schedule(gm, None, solver=scheduler.SolverOptions(merge_all_reduces=merge),
                                        agreement=scheduler.AgreementOptions(enabled=False))
            reports[merge] = gm.meta[REPORT_KEY]
    placed, merged = reports[False], reports[True]
    assert placed.step_ms_after < placed.step_ms_before
    assert max(len(b) for b in placed.buckets) == 1
    assert max(len(b) for b in merged.buckets) > 1
