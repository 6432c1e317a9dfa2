"""Write-back: schedules applied to FX graphs keep what the program computes.

Numerics run on a real single-process gloo group (world size 1: collectives are identities,
so the rewritten graph must reproduce the original bitwise; member order and split offsets
of merged buckets are exercised). Simulator consistency uses a 4-rank graph, traced only.

The toy graph (W = group size; w1, w2, w3 fp32 shards cast to bf16 and all-gathered)::

    ag0(w1) ag1(w2) ag2(w3)          <- all issued and waited at the top, as traced
    mm(x, ag0) -> mm_1(., t(ag1)) -> relu -> mm_2(., ag2) = y
    t_1(relu) -> mm_3(., gy) -> rs0 ;  t_2(x) -> mm_4(., relu) -> rs1   (reduce-scatters, fp32)
"""

from __future__ import annotations

import contextlib
import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

from scheduler import export_dag, simulate, validate_schedule
from scheduler.costs.models import TableCostModel
from scheduler.writeback import apply_schedule
from solvers import Bucket, Problem, Schedule, ScheduleError

AG = ["all_gather_into_tensor", "all_gather_into_tensor_1", "all_gather_into_tensor_2"]
RS = ["reduce_scatter_tensor", "reduce_scatter_tensor_1"]
#: fixed costs: collectives 10 us + 1 ns/byte; compute from the analytic model
COSTS = TableCostModel(collective=lambda coll_type, payload_bytes, group: 0.01 + 1e-6 * payload_bytes / 1e3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group():
    """A real single-process gloo group for the block; a fake group found in place (another
    test module's) is restored afterwards, so no real group outlives the test."""
    previous = None
    if dist.is_initialized():
        if dist.get_backend() == "gloo" and dist.get_world_size() == 1:
            yield dist.group.WORLD.group_name
            return
        if dist.get_backend() != "fake":
            pytest.skip(f"a real {dist.get_backend()} group is initialised in this process")
        previous = (dist.get_world_size(), dist.get_rank())
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
        if previous is not None:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=previous[1], world_size=previous[0])


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def toy_graph(group_name: str, world_size: int, *, d: int = 16, param_index=(0, 1, 2)) -> torch.fx.GraphModule:
    """Trace the toy graph (module docstring) with fake tensors; w2 and w3 are half the size of
    w1 so that payload order shows in the split sizes. ``param_index`` per all-gather (registration
    order); the reduce-scatters get (1, 0)."""
    ops = torch.ops._c10d_functional
    W = world_size

    def f(w1, w2, w3, x, gy):
        a1 = ops.wait_tensor(ops.all_gather_into_tensor(w1.to(torch.bfloat16), W, group_name))
        a2 = ops.wait_tensor(ops.all_gather_into_tensor(w2.to(torch.bfloat16), W, group_name))
        a3 = ops.wait_tensor(ops.all_gather_into_tensor(w3.to(torch.bfloat16), W, group_name))
        h = torch.mm(x, a1)
        h = torch.relu(torch.mm(h, a2.t()))
        y = torch.mm(h, a3)
        g1 = ops.wait_tensor(ops.reduce_scatter_tensor((h.t() @ gy).float(), "sum", W, group_name))
        g2 = ops.wait_tensor(ops.reduce_scatter_tensor((x.t() @ h).float(), "sum", W, group_name))
        return y, g1, g2

    with FakeTensorMode():
        args = _inputs(d, W, torch.randn)
    gm = make_fx(f, tracing_mode="fake")(*args)
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, idx in zip(AG, param_index):
        by_name[name].meta["fsdp_param_index"] = idx
        by_name[name].meta["fsdp_fqn"] = f"w{idx}"
    for name, idx in zip(RS, (1, 0)):
        by_name[name].meta["fsdp_param_index"] = idx
    return gm


def _inputs(d: int, W: int, randn):
    return (
        randn(d // W, d),
        randn(d // (2 * W), d),
        randn(d // (2 * W), d),
        randn(8, d, dtype=torch.bfloat16),
        randn(8, d, dtype=torch.bfloat16),
    )


def real_inputs(d: int = 16):
    g = torch.Generator().manual_seed(0)
    return _inputs(d, 1, lambda *s, dtype=torch.float32: torch.randn(*s, generator=g, dtype=dtype))


def bucketed_schedule(problem: Problem) -> Schedule:
    """ag0+ag1 merged (issued at the top), ag2 prefetched alone, rs0+rs1 merged at the end."""
    buckets = [Bucket((AG[0], AG[1])), Bucket((AG[2],)), Bucket((RS[0], RS[1]))]
    n = problem.n
    needed_ag2 = problem.colls[AG[2]].needed
    return Schedule.from_positions(problem.seq, buckets, [0, 0, n], [0, needed_ag2, n])


def reorder_schedule(problem: Problem) -> Schedule:
    """Nothing merged; ag2 waited just before its use, rs0 issued after its gradient and waited
    at the end (the traced graph waits every collective right after issuing it)."""
    c = problem.colls
    buckets = [Bucket((m,)) for m in AG + RS]
    issue = [0, 0, 0, c[RS[0]].ready, c[RS[1]].ready]
    wait = [0, c[AG[1]].needed, c[AG[2]].needed, problem.n, problem.n]
    return Schedule.from_positions(problem.seq, buckets, issue, wait)


def n_collectives(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "_c10d_functional" in str(n.target)
               and "wait_tensor" not in str(n.target))


def assert_at_scheduled_gaps(gm, problem: Problem, schedule: Schedule) -> None:
    """Every (merged) collective and its wait sit in the gaps the schedule chose: gap = number
    of the problem's compute/view nodes before it in the rewritten graph."""
    seq = set(problem.seq)
    gap, seen = {}, 0
    for n in gm.graph.nodes:
        seen += n.name in seq
        gap[n.name] = seen
    issue, wait = schedule.positions()
    bucket_of = schedule.bucket_of()
    found = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait_tensor" not in str(n.target):
            b = bucket_of[n.meta.get("fsdp_sched_members", [n.name])[0]]
            (w,) = n.users
            assert (gap[n.name], gap[w.name]) == (issue[b], wait[b]), n.name
            found += 1
    assert found == len(schedule.buckets)


def _problem(gm, cost_model=None) -> Problem:
    return Problem.from_dag(export_dag(gm, cost_model=cost_model))


def _assert_same(ref, out):
    assert len(ref) == len(out)
    for a, b in zip(ref, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
def test_reorder_only_moves_nodes_and_keeps_results(pg):
    gm = toy_graph(pg, 1)
    problem = _problem(gm)
    schedule = reorder_schedule(problem)
    validate_schedule(problem, schedule)
    inputs = real_inputs()
    ref = gm(*inputs)
    apply_schedule(gm, problem, schedule)
    assert_at_scheduled_gaps(gm, problem, schedule)
    order = [n.name for n in gm.graph.nodes]
    wait2 = problem.colls[AG[2]].wait
    # ag2's wait moved from the top to just before its first use
    assert order.index(wait2) > order.index("relu")
    assert order.index(wait2) == order.index("mm_2") - 1
    assert n_collectives(gm) == 5
    _assert_same(ref, gm(*inputs))


def test_merged_buckets_bitwise_equal_on_gloo(pg):
    gm = toy_graph(pg, 1)
    problem = _problem(gm)
    schedule = bucketed_schedule(problem)
    validate_schedule(problem, schedule)
    inputs = real_inputs()
    ref = gm(*inputs)
    apply_schedule(gm, problem, schedule)
    gm.graph.lint()
    assert n_collectives(gm) == 3  # ag0+ag1, ag2, rs0+rs1
    assert_at_scheduled_gaps(gm, problem, schedule)
    targets = [str(n.target) for n in gm.graph.nodes]
    assert any("all_gather_into_tensor_out" in t for t in targets)
    # the fp32 -> bf16 casts of the merged all-gathers were folded into the bucket copy
    assert "_to_copy" not in [n.name for n in gm.graph.nodes] and "_to_copy_1" not in [n.name for n in gm.graph.nodes]
    _assert_same(ref, gm(*inputs))


def _cat_sources(gm) -> list[str]:
    """Placeholders feeding the all-gather bucket's cat, in buffer order."""
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    out = []
    for v in cat.args[0]:
        while v.op != "placeholder":
            v = v.args[0]
        out.append(v.name)
    return out


@pytest.mark.parametrize(
    "payload_order, expected", [("registration", ["w2_1", "w1_1"]), ("execution", ["w1_1", "w2_1"])]
)
def test_payload_order(pg, payload_order, expected):
    # w2's all-gather was registered first (param_index 0) but runs second
    gm = toy_graph(pg, 1, param_index=(1, 0, 2))
    problem = _problem(gm)
    inputs = real_inputs()
    ref = gm(*inputs)
    apply_schedule(gm, problem, bucketed_schedule(problem), payload_order=payload_order)
    assert _cat_sources(gm) == expected
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default)
    sizes = {"w1_1": 256, "w2_1": 128}
    assert list(split.args[1]) == [sizes[s] for s in expected]
    _assert_same(ref, gm(*inputs))


def test_control_deps_pin_both_sides_of_every_window(pg):
    """The bucketed schedule, written back and pinned (inductor's extern compute: the mms)::

        ag01 ag2 wait(ag01) | mm mm_1 relu wait(ag2) mm_2 mm_3 mm_4 | rs01 wait(rs01)

    The anchors are chained, each after the one before it where no data edge does so already:
    ag2 after ag01, wait(ag01) after ag2, mm after wait(ag01), wait(ag2) after mm_1 (not
    relu: inductor realises every dependency, and a pointwise one would no longer be inlined
    into its consumer), mm_3 after mm_2, mm_4 after mm_3, rs01 after mm_4. mm_1 reads mm,
    mm_2 reads wait(ag2), wait(rs01) reads rs01: data edges, no pins."""
    gm = toy_graph(pg, 1)
    problem = _problem(gm)
    inputs = real_inputs()
    ref = gm(*inputs)
    apply_schedule(gm, problem, bucketed_schedule(problem), control_deps=True)
    merged = {frozenset(n.meta["fsdp_sched_members"]): n for n in gm.graph.nodes if "fsdp_sched_members" in n.meta}
    ag01, rs01 = merged[frozenset(AG[:2])], merged[frozenset(RS)]
    pinned = {n.name: [d.name for d in n.args[0]] for n in gm.graph.nodes
              if n.target is torch.ops.higher_order.control_deps}
    wait_ag01 = next(n.name for n in gm.graph.nodes if n.name in pinned and n.args[2] is ag01)
    assert pinned == {
        AG[2]: [ag01.name],
        wait_ag01: [AG[2]],
        "mm": [wait_ag01],
        problem.colls[AG[2]].wait: ["mm_1"],
        "mm_3": ["mm_2"],
        "mm_4": ["mm_3"],
        rs01.name: ["mm_4"],
    }
    _assert_same(ref, gm(*inputs))


def test_invalid_schedule_raises_and_leaves_graph_untouched(pg):
    gm = toy_graph(pg, 1)
    problem = _problem(gm)
    buckets = [Bucket((m,)) for m in AG + RS]
    # ag0 waited after mm, its consumer
    bad = Schedule.from_positions(problem.seq, buckets, [0] * 3 + [problem.n] * 2, [1, 0, 0] + [problem.n] * 2)
    before = str(gm.graph)
    with pytest.raises(ScheduleError, match="before its input"):
        apply_schedule(gm, problem, bad)
    assert str(gm.graph) == before


def test_merge_without_process_group_is_refused():
    if dist.is_initialized():
        pytest.skip("a process group is initialised by another test")
    with gloo_group() as name:
        gm = toy_graph(name, 1)
        problem = _problem(gm)
    before = str(gm.graph)
    with pytest.raises(ScheduleError, match="process group"):
        apply_schedule(gm, problem, bucketed_schedule(problem))
    assert str(gm.graph) == before


# --------------------------------------------------------------------------------------------
# write-back vs. simulator
# --------------------------------------------------------------------------------------------
def test_reexport_matches_simulation_for_reorder(pg):
    gm = toy_graph(pg, 4, d=256)
    problem = _problem(gm, COSTS)
    schedule = reorder_schedule(problem)
    predicted = validate_schedule(problem, schedule)
    apply_schedule(gm, problem, schedule)
    again = simulate(export_dag(gm, cost_model=COSTS))
    assert again.step_ms == pytest.approx(predicted.step_ms, rel=1e-9)
    assert again.exposed_comm_ms == pytest.approx(predicted.exposed_comm_ms, rel=1e-9, abs=1e-12)
    assert again.peak_bytes == predicted.peak_bytes
    assert again.n_collectives == predicted.n_collectives


def test_reexport_of_merged_buckets_matches_communication(pg):
    """Merged buckets: the communication and the collective count agree exactly; step time and
    peak differ by what torch's merge emits that the simulator prices as one copy (see
    apply_schedule docs): separate empty / cat / copy_ / per-member copy-out kernels, the
    bucket buffer counted again as the collective's ``out=`` output, and casts that become
    ordinary compute nodes."""
    gm = toy_graph(pg, 4, d=256)
    problem = _problem(gm, COSTS)
    schedule = bucketed_schedule(problem)
    predicted = validate_schedule(problem, schedule)
    apply_schedule(gm, problem, schedule)
    again = simulate(export_dag(gm, cost_model=COSTS))
    assert again.n_collectives == predicted.n_collectives == 3
    assert again.comm_ms == pytest.approx(predicted.comm_ms, rel=1e-9)
    assert again.step_ms == pytest.approx(predicted.step_ms, rel=0.25)
    assert again.peak_bytes == pytest.approx(predicted.peak_bytes, rel=0.5)


# --------------------------------------------------------------------------------------------
# a real model
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_graphs():
    from conftest import capture_llama_debug

    return capture_llama_debug()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_llama3_debug_fsdp2_buckets_written_back(llama_graphs, kind):
    from models.capture import fake_process_group
    from solvers import solve

    gm = copy.deepcopy(getattr(llama_graphs, kind))  # the capture is shared (conftest)
    with fake_process_group(4):
        problem = Problem.from_dag(export_dag(gm))
        result = solve(problem, solver="fsdp2")
        predicted = validate_schedule(problem, result.schedule)
        assert any(len(b.members) > 1 for b in result.schedule.buckets)
        apply_schedule(gm, problem, result.schedule)
        gm.graph.lint()
        assert_at_scheduled_gaps(gm, problem, result.schedule)
        again = simulate(export_dag(gm))
    assert n_collectives(gm) == len(result.schedule.buckets) == again.n_collectives
    assert again.comm_ms == pytest.approx(predicted.comm_ms, rel=1e-6)
    assert again.step_ms == pytest.approx(predicted.step_ms, rel=0.25)
