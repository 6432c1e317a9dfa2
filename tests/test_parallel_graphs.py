"""FSDP beside tensor- and expert-parallel collectives: small graphs of each structure of the
DeepSeek-V3-style MoE and the LLaMA FSDP x TP graphs (``tests/parallel_graphs.py``), traced
with make_fx on a fake process group of 4 ranks as a 2 x 2 (dp, tp) or (dp, ep) mesh.

- FSDP all-gathers interleaved with sequence-parallel all-gathers and reduce-scatters on tp
  (forward and backward): fsdp-sched buckets the FSDP all-gathers across the tp collectives,
  the written step is no slower than traced, and nothing is left in place unexplained;
- a reduce-scatter of a tp all-reduce's result, and a forward returning a gathered weight:
  the schedule written back validates and runs;
- a MoE block whose tokens travel by ``all_to_all_single`` with split sizes read by
  ``.tolist()``: exports, schedules, writes back, every all-to-all inside its issue range;
- activation all-gathers whose issue ranges do not meet: every schedule the search returns
  validates and writes back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import parallel_graphs as pg
from scheduler import apply_schedule, export_dag, optimize_schedule
from scheduler.api import REPORT_KEY, SCHEDULE_KEY
from scheduler.check.written import judge_graph
from scheduler.options import AgreementOptions, SolverOptions
from solvers.core.order import problem_of
from solvers import Problem
from solvers.core import validate_schedule
from solvers.registry import solve_problems

_c10d = torch.ops._c10d_functional
#: deterministic work of each search (s): enough for these graphs
SOLVER = SolverOptions(work_limit=2.0)
ALONE = AgreementOptions(enabled=False)


@pytest.fixture(scope="module")
def meshes(group_name):
    """(dp, tp) and (dp, ep) meshes of the fake world's 4 ranks, as :class:`parallel_graphs.Groups`."""
    from torch.distributed.device_mesh import init_device_mesh

    assert dist.get_world_size() == 4
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    return pg.mesh_groups(tp, "tp"), pg.mesh_groups(ep, "ep")


def _collectives(gm, group: str, kinds=("all_gather_into_tensor", "all_gather_into_tensor_out")) -> int:
    """Collectives of ``kinds`` (op names) on ``group`` in ``gm``."""
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "_opname", None) in kinds and n.args[-1] == group)


def _optimize(gm, budget, cost_model="analytic"):
    """optimize_schedule on a copy of ``gm`` (one rank, no agreement); the copy and its report."""
    written = copy.deepcopy(gm)
    optimize_schedule(written, budget, cost_model=cost_model, solver=SOLVER, agreement=ALONE)
    return written, written.meta[REPORT_KEY]


def _runs(gm, inputs) -> list:
    """``gm`` run on real ``inputs`` under the fake group (it moves no data): its outputs."""
    out = gm(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


# --------------------------------------------------------------------------------------------
# (a) FSDP all-gathers across tensor-parallel collectives
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_fsdp_all_gathers_bucket_across_tp_collectives(meshes, kind):
    """Sequence-parallel blocks (``parallel_graphs.sp_forward`` / ``sp_backward``)::

        forward, per block:  AG_dp(w1) . AG_tp(x_sp) -> mm -> AG_dp(w2) . mm -> RS_tp -> add
        backward, per block: AG_tp(g_sp) . AG_tp(saved x) . AG_dp(w1) . AG_dp(w2) -> mm ...
                             RS_dp(gw2) . RS_dp(gw1) . RS_tp(gx)

    At the traced peak, fsdp-sched writes fewer FSDP all-gathers (dp) than traced (in the
    forward, a bucket spans a tp collective of the traced order); the written step is no slower
    than traced under the analytic model; and no collective is left where traced (report
    notes)."""
    g, _ = meshes
    if kind == "forward":
        gm = pg.trace(pg.sp_forward(g), pg.sp_inputs(g))
    else:
        gm = pg.trace(pg.sp_backward(g), pg.sp_backward_inputs(g))
    traced = judge_graph(gm, "analytic")
    written, report = _optimize(gm, traced.max_peak_bytes)
    after = judge_graph(written, "analytic")
    assert _collectives(written, g.dp) < _collectives(gm, g.dp)
    if kind == "forward":  # some bucket holds FSDP all-gathers a tp collective separates when traced
        order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        tp_at = [order[n.name] for n in gm.graph.nodes if n.op == "call_function" and n.args
                 and n.args[-1] == g.other
                 and getattr(n.target, "_opname", "") in ("all_gather_into_tensor", "reduce_scatter_tensor")]
        spans = [(min(order[m] for m in b.members), max(order[m] for m in b.members))
                 for b in written.meta[SCHEDULE_KEY].buckets if len(b.members) > 1]
        assert any(lo < t < hi for lo, hi in spans for t in tp_at), spans
    assert after.step_ms <= traced.step_ms
    assert after.max_peak_bytes <= traced.max_peak_bytes
    assert not [n for n in report.notes if "left in place" in n], report.notes
    # the tp collectives are all still there, unmerged
    tp_kinds = ("all_gather_into_tensor", "reduce_scatter_tensor")
    assert _collectives(written, g.other, tp_kinds) == _collectives(gm, g.other, tp_kinds)


# --------------------------------------------------------------------------------------------
# (b) collectives that read or return another's result: the write-back holds
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["norm_grads", "saving_forward"])
def test_written_schedule_validates_and_runs(meshes, case):
    """``norm_grads``: per norm, ``RS_dp(AR_tp(gw))`` (a reduce-scatter of a tensor-parallel
    all-reduce's result) beside FSDP re-gathers; ``saving_forward``: a forward that returns
    every gathered weight (``AG_dp -> wait -> mm``, the wait also an output). Without a budget
    the search merges or moves collectives; its schedule is the one installed (no fallback to
    the traced graph), it validates on the traced graph's problem in its own order of compute, every collective that keeps
    its traced place is named in a report note with its reason, and the written graph lints and
    runs, returning what the traced graph returns (shapes and dtypes)."""
    g, _ = meshes
    fn, inputs = {"norm_grads": (pg.norm_grads_backward, pg.norm_grads_inputs),
                  "saving_forward": (pg.saving_forward, pg.saving_inputs)}[case]
    gm = pg.trace(fn(g), inputs(g, make=torch.zeros))
    written, report = _optimize(gm, None)
    assert report.chosen_candidate == "search", report.notes
    schedule = written.meta[SCHEDULE_KEY]
    problem = Problem.from_dag(export_dag(gm, cost_model="analytic"))
    assert schedule.digest() != problem.traced_schedule().digest()
    validate_schedule(problem_of(problem, schedule), schedule)  # in its own order of compute
    # what keeps its traced place (the chains of norm_grads) is named in a note with its reason
    for c in problem.colls.values():
        if not c.movable:
            assert c.fixed_reason and any(c.fixed_reason in n for n in report.notes if "left in place" in n), c
    written.graph.lint()
    real = inputs(g)
    assert [(t.shape, t.dtype) for t in _runs(written, real)] == [(t.shape, t.dtype) for t in _runs(gm, real)]


# --------------------------------------------------------------------------------------------
# (c) expert parallelism: all-to-alls with data-dependent splits beside FSDP all-gathers
# --------------------------------------------------------------------------------------------
def _moe_graph(meshes):
    _, e = meshes
    return e, pg.trace(pg.moe_forward(e), pg.moe_inputs(e), symbolic=True)


def test_moe_all_to_alls_stay_in_their_issue_ranges(meshes):
    """``parallel_graphs.moe_forward``, per block::

        AG_dp(router) -> argmax -> A2A_ep(counts) -> .tolist() -> A2A_ep(tokens, recv, send)
        AG_dp(w) -> mm -> A2A_ep(back, send, recv) -> index_copy -> add

    The graph exports (split sizes are unbacked symbols), fsdp-sched schedules it at its
    traced peak and writes it back, and in the schedule installed every all-to-all is issued
    and waited inside its issue range [ready, needed] of the traced graph's problem; the
    written graph keeps every all-to-all."""
    e, gm = _moe_graph(meshes)
    problem = Problem.from_dag(export_dag(gm, cost_model="analytic"))
    a2a = [c for c in problem.colls.values() if c.coll_type == "all_to_all_single"]
    assert len(a2a) == 6 and all(c.group_name == e.other for c in a2a)
    traced = judge_graph(gm, "analytic")
    written, report = _optimize(gm, traced.max_peak_bytes)
    schedule = written.meta[SCHEDULE_KEY]
    validate_schedule(problem, schedule, mem_budget_bytes=traced.max_peak_bytes)
    issue, wait = schedule.positions()
    for b, bucket in enumerate(schedule.buckets):
        for m in bucket.members:
            c = problem.colls[m]
            if c.coll_type == "all_to_all_single":
                assert bucket.members == (m,)
                assert c.ready <= issue[b] <= wait[b] <= c.needed, (m, issue[b], wait[b], c.ready, c.needed)
    assert _collectives(written, e.other, ("all_to_all_single",)) == 6
    written.graph.lint()


def test_moe_graph_is_solved_by_the_search_not_a_fallback(meshes):
    """The MoE graph above, at its traced peak: every stage of the search runs (the solve's
    status is not a fallback to the best start after a failure)."""
    _, gm = _moe_graph(meshes)
    traced = judge_graph(gm, "analytic")
    _, report = _optimize(gm, traced.max_peak_bytes)
    assert report.status != "fallback", report.notes


def test_moe_graph_with_dynamic_batch_exports(meshes):
    """The MoE graph traced with dynamic input sizes (a recompile for a new batch size) beside
    the unbacked split sizes: it exports, the all-to-alls' sizes estimated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _, e = meshes
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t) for t in pg.moe_inputs(e)]  # sizes dynamic
    with mode:
        gm = make_fx(pg.moe_forward(e), tracing_mode="fake")(*fakes)
    dag = export_dag(gm, cost_model="analytic")
    a2a = [n for n, a in dag.nodes(data=True) if a["kind"] == "collective" and a["coll_type"] == "all_to_all_single"]
    assert len(a2a) == 6


# --------------------------------------------------------------------------------------------
# (d) issue ranges that do not meet: nothing buckets them
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", ["none", "traced peak"])
def test_every_schedule_of_the_search_validates_and_writes_back(meshes, budget):
    """``parallel_graphs.tp_chain_forward``: per block ``x_sp = relu(AG_tp(x_sp) @ AG_dp(w))[rows]``;
    each activation all-gather is ready where its reader runs (its issue range is one gap, none
    meets another). The search's schedule and each of its alternatives (the next best starts;
    without a budget there are some) validate on the graph's problem and write back on a copy,
    which lints; no bucket holds two activation all-gathers."""
    g, _ = meshes
    gm = pg.trace(pg.tp_chain_forward(g), pg.tp_chain_inputs(g))
    problem = Problem.from_dag(export_dag(gm, cost_model="analytic"))
    tp_gathers = [c for c in problem.colls.values() if c.group_name == g.other]
    assert len(tp_gathers) == 4 and all(c.ready == c.needed for c in tp_gathers)
    mem = None if budget == "none" else judge_graph(gm, "analytic").max_peak_bytes
    result = solve_problems({"analytic": problem}, mem_budget_bytes=mem, work_limit=SOLVER.work_limit)
    schedules = [result.schedule, *result.alternatives]
    if mem is None:  # every start fits: the alternatives are there to check
        assert len(schedules) > 1
    for schedule in schedules:
        validate_schedule(problem, schedule, mem_budget_bytes=mem)
        assert all(sum(m in {c.name for c in tp_gathers} for m in b.members) <= 1 for b in schedule.buckets)
        written = copy.deepcopy(gm)
        apply_schedule(written, problem, schedule)
        written.graph.lint()


# --------------------------------------------------------------------------------------------
# (e) a chain issued in the order of need queues a ready collective behind a late one
# --------------------------------------------------------------------------------------------
def test_the_ahead_pass_issues_a_ready_collective_before_a_late_one_of_its_chain(meshes):
    """``parallel_graphs.sp_backward``: the tp all-gathers of the saved activations are ready at
    the start, those of the output gradients only once the block before has reduce-scattered;
    in the order of need (:func:`solvers.core.plan.chain_ordered`, every other stage's rule) a
    saved activation's all-gather is issued with the gradient's needed before it and queues
    behind it. From such a schedule (the traced one with the tp all-gathers issued at their
    readiness, clamped to that order) the ahead pass issues some bucket before a bucket of its
    chain needed earlier; its schedule validates under both models, no model is slower and one
    is faster by more than 1 %, and it writes back to a graph that lints and is judged as fast."""
    from solvers.core.plan import PlannedBucket, build_schedule, chain_ordered
    from solvers.polish import ahead_pass

    g, _ = meshes
    gm = pg.trace(pg.wgrad_backward(g), pg.wgrad_inputs(g))
    problems = {m: Problem.from_dag(export_dag(gm, cost_model=m)) for m in ("analytic", "torch")}
    p = problems["analytic"]
    traced = p.traced_schedule()
    issue, wait = traced.positions()

    def tp_gather(b) -> bool:
        c = p.colls[b.members[0]]
        return c.group_name == g.other and c.coll_type == "all_gather"

    plan = chain_ordered(p, [PlannedBucket(b, p.colls[b.members[0]].ready if tp_gather(b) else issue[k], wait[k])
                             for k, b in enumerate(traced.buckets)])
    start = build_schedule(p, plan)
    before = {label: validate_schedule(q, start).step_ms for label, q in problems.items()}
    found = ahead_pass(problems, start, before)
    assert found is not None
    for label, q in problems.items():
        assert validate_schedule(q, found.schedule).step_ms == pytest.approx(found.step_ms[label])
        assert found.step_ms[label] <= before[label] * (1 + 1e-9)
    assert any(found.step_ms[label] < before[label] * 0.99 for label in problems), (found.step_ms, before)
    # some bucket is issued before one of its chain that is needed earlier
    first_issue, _ = found.schedule.positions()
    at = {m: first_issue[k] for k, b in enumerate(found.schedule.buckets) for m in b.members}
    assert any(at[later] < at[earlier] for names in p.chains.values()
               for earlier, later in zip(names, names[1:])), "no bucket issued ahead of its chain's order"
    written = copy.deepcopy(gm)
    apply_schedule(written, p, found.schedule)
    written.graph.lint()
    assert judge_graph(written, "analytic").step_ms == pytest.approx(found.step_ms["analytic"], rel=1e-6)


def test_the_search_s_last_stages_run_on_its_answer_later_give_the_same_schedule(meshes):
    """``parallel_graphs.wgrad_backward`` at a size whose search ends with the ahead stage
    gaining: the search without its last stages, then :func:`solvers.search.finish` on its
    answer (what ``optimize_schedule`` does with two orders of compute: the last stages on the
    answer kept alone) gives the schedule the whole search gives, faster than the answer before
    them under one model and slower under none."""
    from solvers.search import begin, finish, search

    g, _ = meshes
    shapes = pg.SPShapes(n_blocks=6, seq=2048, dim=1024, hidden=4096)
    gm = pg.trace(pg.wgrad_backward(g, shapes), pg.wgrad_inputs(g, shapes))
    problems = {m: Problem.from_dag(export_dag(gm, cost_model=m)) for m in ("analytic", "torch")}
    whole = search(problems, None, started=begin(problems, None))
    started = begin(problems, None)
    before = search(problems, None, started=started, finish=False)
    after = finish(started, before, None)
    assert after.schedule.digest() == whole.schedule.digest()
    assert all(after.step_ms_by_model[m] <= before.step_ms_by_model[m] * (1 + 1e-9) for m in problems)
    assert any(after.step_ms_by_model[m] < before.step_ms_by_model[m] * 0.999 for m in problems), \
        (after.step_ms_by_model, before.step_ms_by_model)
