"""The user-facing API: parse_bytes, optimize_schedule with its option objects, solve_dag, the
compile backend and the inductor pass, the schedule cache.

Graphs are the toy graph of ``test_writeback`` (three all-gathers, two reduce-scatters) traced
on a real single-process gloo group, with fixed collective costs so that scheduling matters.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import scheduler
from scheduler.costs.family import cost_model_label
from scheduler import (
    AgreementOptions,
    InfeasibleBudgetError,
    ScheduleError,
    ScheduleReport,
    SolverOptions,
    WriteBackOptions,
    optimize_schedule,
    parse_bytes,
    solve_dag,
)
from scheduler import api
from scheduler.integrate import cache
from scheduler.integrate import compile as compile_
from scheduler.check.written import graph_digest
from scheduler.export.dag import export_dag
from scheduler.export.dagfile import dag_from_json, dag_to_json
from solvers import Problem, Schedule, SolveStatus
from test_writeback import COSTS, gloo_group, n_collectives, real_inputs, toy_graph

QUICK = SolverOptions(work_limit=1.0)


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def _same_outputs(gm, inputs, ref) -> bool:
    return all(torch.equal(a, b) for a, b in zip(ref, gm(*inputs)))


# --------------------------------------------------------------------------------------------
# parse_bytes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        (None, None),
        (4096, 4096),
        ("40GiB", 40 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 GB", 1_500_000_000),
        ("300 KiB", 300 * 1024),
        ("2mib", 2 * 2**20),
        ("  7 b ", 7),
        ("1024", 1024),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["40 GB/s", "forty GiB", "12 XB", "GiB", "1.2.3 MB", ""])
def test_parse_bytes_rejects_bad_strings_naming_units(text):
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        parse_bytes(text)


@pytest.mark.parametrize("value", [0, -1, "0 GiB", "-3MB"])
def test_parse_bytes_rejects_non_positive(value):
    with pytest.raises(ValueError):
        parse_bytes(value)


# --------------------------------------------------------------------------------------------
# optimize_schedule
# --------------------------------------------------------------------------------------------
def test_optimize_schedule_rewrites_and_reports(pg):
    """The graph is rewritten in place, computes the same, and the report describes the graph
    as written: its figures are those of the chosen candidate, judged on its written graph,
    and its stages are the export, torch's pass (read back as starts), the search's, the judging, then
    the write-back."""
    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    out_gm = optimize_schedule(gm, "1 GiB", cost_model=COSTS, solver=QUICK)
    assert out_gm is gm
    report = gm.meta[api.REPORT_KEY]
    assert isinstance(report, ScheduleReport)
    assert report.n_collectives_before == 5
    assert n_collectives(gm) == report.n_collectives_after == len(report.buckets) < 5
    assert report.step_ms_after < report.step_ms_before  # the traced graph exposes every collective
    assert report.lower_bound_ms <= report.best_bound_ms <= report.step_ms_after + 1e-12
    assert report.peak_bytes_after <= 2**30 and report.mem_budget_bytes == 2**30
    assert len(report.ag_prefetch) == report.bucket_types.count("all_gather")
    assert len(report.digest) == 64 and report.digest == gm.meta[api.SCHEDULE_KEY].digest()
    assert report.verified and report.cost_models == [cost_model_label(COSTS)]
    chosen = next(c for c in report.candidates if c["name"] == report.chosen_candidate)
    assert chosen["dropped"] is None and chosen["digest"] == report.digest
    assert chosen["figures"]["step_ms"] == report.reexported_step_ms
    assert max(report.reexported_peak_bytes, report.liveness_peak_bytes) <= 2**30
    # the written graph, re-exported, is faster than the traced one too
    assert report.reexported_step_ms < report.step_ms_before
    assert [s["name"] for s in report.stages] == ["export", "torch", "starts", "windows", "polish", "judge", "write-back"]
    assert ScheduleReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert _same_outputs(gm, inputs, ref)


def test_installed_schedule_starts_another_solve(pg):
    """``gm.meta[SCHEDULE_KEY]`` is the installed schedule over the traced graph; given to a
    solve of a copy as an extra start, with work for the starts only, the solve is never
    slower than it; a schedule of another graph is refused."""
    gm = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, solver=QUICK)
    start = gm.meta[api.SCHEDULE_KEY]
    first = gm.meta[api.REPORT_KEY]
    assert isinstance(start, Schedule) and start.digest() == first.digest
    again = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS,
                              solver=SolverOptions(work_limit=1e-6, extra_starts=(start,)))
    assert again.meta[api.REPORT_KEY].step_ms_after <= first.step_ms_after + 1e-9
    other = Schedule(start.buckets[:1], start.steps)
    with pytest.raises(ValueError, match="not a schedule of this graph"):
        optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS,
                          solver=SolverOptions(work_limit=0.1, extra_starts=(other,), fallback=False))


def test_schedule_hook_replaces_the_solved_schedule(pg):
    """A hook's schedule is the one installed (here the traced order: nothing is merged)."""
    traced = []

    def hook(problem, schedule):
        traced.append(problem.traced_schedule())
        return traced[0]

    gm = toy_graph(pg, 1)
    optimize_schedule(gm, "1 GiB", cost_model=COSTS, solver=SolverOptions(work_limit=1.0, schedule_hook=hook))
    assert gm.meta[api.SCHEDULE_KEY].digest() == traced[0].digest() == gm.meta[api.REPORT_KEY].digest
    assert n_collectives(gm) == 5


def test_graph_without_collectives_comes_back_unchanged():
    gm = make_fx(lambda x: torch.relu(x @ x), tracing_mode="fake")(torch.randn(8, 8))
    before = str(gm.graph)
    optimize_schedule(gm, "1 GiB")
    assert str(gm.graph) == before
    report = gm.meta[api.REPORT_KEY]
    assert report.status == "unchanged" and report.n_collectives_after == 0
    assert gm.meta[api.SCHEDULE_KEY] is None


def test_infeasible_budget_states_a_smallest_peak_that_works_as_a_budget(pg):
    gm = toy_graph(pg, 1)
    traced_peak = api.simulate(export_dag(gm, cost_model=COSTS)).peak_bytes
    before = graph_digest(gm)
    with pytest.raises(InfeasibleBudgetError, match="at least") as info:
        optimize_schedule(gm, 1000, cost_model=COSTS, solver=QUICK)
    assert 1000 < info.value.min_peak_bytes <= traced_peak
    assert info.value.mem_budget_bytes == 1000
    with pytest.warns(DeprecationWarning, match="mem_budget_bytes"):
        assert info.value.budget_bytes == 1000  # its old name, for one release
    assert graph_digest(gm) == before
    optimize_schedule(gm, info.value.min_peak_bytes, cost_model=COSTS, solver=QUICK)
    report = gm.meta[api.REPORT_KEY]
    assert max(report.reexported_peak_bytes, report.liveness_peak_bytes) <= info.value.min_peak_bytes


def test_bad_budget_string_raises_before_touching_the_graph(pg):
    gm = toy_graph(pg, 1)
    before = graph_digest(gm)
    with pytest.raises(ValueError, match="GiB"):
        optimize_schedule(gm, "lots")
    assert graph_digest(gm) == before


@pytest.mark.parametrize("error", [ScheduleError("model invalid"), TimeoutError("wall clock exceeded")])
def test_solver_failure_falls_back_to_a_valid_schedule(pg, error):
    """A solver that fails is replaced by the best start that fits: status fallback, a faster
    step than traced, the same numerics."""
    def failing(problem, **kw):
        raise error

    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    optimize_schedule(gm, "1 GiB", cost_model=COSTS, solver=SolverOptions(solver=failing))
    report = gm.meta[api.REPORT_KEY]
    assert report.fell_back and report.status == SolveStatus.FALLBACK.value
    assert report.requested_solver == "failing" and report.solver == "fallback"
    assert report.step_ms_after < report.step_ms_before
    assert report.peak_bytes_after <= 2**30
    assert _same_outputs(gm, inputs, ref)


def test_solver_failure_without_fallback_raises(pg):
    def failing(problem, **kw):
        raise ScheduleError("model invalid")

    gm = toy_graph(pg, 1)
    before = graph_digest(gm)
    with pytest.raises(ScheduleError, match="model invalid"):
        optimize_schedule(gm, cost_model=COSTS, solver=SolverOptions(solver=failing, fallback=False))
    assert graph_digest(gm) == before


def test_solve_dag_offline_from_json(pg):
    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    dag = dag_from_json(json.loads(json.dumps(dag_to_json(dag))))
    schedule, report = solve_dag(dag, "64 MiB", solver=SolverOptions(solver="fsdp2"))
    assert report.solver == "fsdp2" and not report.fell_back
    sim = scheduler.validate_schedule(Problem.from_dag(dag), schedule, mem_budget_bytes=64 * 2**20)
    assert sim.step_ms == pytest.approx(report.step_ms_after)
    assert sim.peak_bytes == report.peak_bytes_after
    searched, report = solve_dag(dag, "64 MiB", solver=QUICK)
    assert report.digest == searched.digest() and [s["name"] for s in report.stages][0] == "starts"
    assert report.step_ms_after <= sim.step_ms + 1e-9


def test_broadcast_from_on_a_single_rank_group_is_a_plain_solve(pg, monkeypatch):
    """``broadcast_from=0`` on a one-rank group: nothing to agree with, the same schedule as
    without (multi-rank: tests/test_numerics_gloo.py); a rank outside the world is refused.
    Both are solved (no cache), so that the second is not the first's answer read back."""
    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    plain, broadcast = toy_graph(pg, 1), toy_graph(pg, 1)
    optimize_schedule(plain, None, cost_model=COSTS, solver=QUICK)
    optimize_schedule(broadcast, None, cost_model=COSTS, solver=QUICK, agreement=AgreementOptions(broadcast_from=0))
    assert broadcast.meta[api.REPORT_KEY].digest == plain.meta[api.REPORT_KEY].digest
    with pytest.raises(ValueError, match="broadcast_from"):
        optimize_schedule(toy_graph(pg, 1), None, cost_model=COSTS, agreement=AgreementOptions(broadcast_from=3))


# --------------------------------------------------------------------------------------------
# compiler integration
# --------------------------------------------------------------------------------------------
def test_backend_compiles_forward_and_backward(pg):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_single_autograd as all_gather

    group = dist.group.WORLD

    def f(w1, w2, w3, x):
        h = torch.relu(x @ all_gather(w1.to(torch.bfloat16), 0, group))
        h = torch.relu(h @ all_gather(w2.to(torch.bfloat16), 0, group))
        return (h @ all_gather(w3.to(torch.bfloat16), 0, group)).float().sum()

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(3)]
    x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    ref = f(*ws, x)
    ref.backward()
    ref_grads = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None

    be = scheduler.backend(mem_budget="1 GiB", cost_model=COSTS, solver=QUICK)
    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend=be, fullgraph=True)(*ws, x)
        out.backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, ref)
    for a, w in zip(ref_grads, ws):
        assert torch.equal(a, w.grad)
    assert [r.graph_name for r in be.reports] == ["forward", "backward"]
    fw, bw = be.reports
    assert fw.bucket_types and set(fw.bucket_types) == {"all_gather"}
    assert set(bw.bucket_types) == {"reduce_scatter"}  # gradients of all-gathers
    for r in be.reports:
        assert r.step_ms_after < r.step_ms_before


def test_backend_reports_share_the_compile_id(pg):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_single_autograd as all_gather

    def f(w, x):
        return (x @ all_gather(w, 0, dist.group.WORLD)).sum()

    be = scheduler.backend(cost_model=COSTS, solver=SolverOptions(solver="fsdp2"))
    torch._dynamo.reset()
    try:
        torch.compile(f, backend=be, fullgraph=True)(torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
                                                     ).backward()
    finally:
        torch._dynamo.reset()
    fw, bw = be.reports
    assert (fw.graph_kind, bw.graph_kind) == ("forward", "backward")
    assert fw.compile_id is not None and fw.compile_id == bw.compile_id


def test_backend_refuses_a_bad_budget_when_built():
    with pytest.raises(ValueError, match="GiB"):
        scheduler.backend(fw_mem_budget="lots")


def test_inductor_post_grad_pass_pins_order(pg):
    """The pass writes back with control dependencies by default (inductor reorders by
    itself); FSDP2-like prefetches each all-gather one use ahead, and those overlaps are
    pinned. Its uuid tells differently configured passes apart."""
    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    options = dict(cost_model=COSTS, solver=SolverOptions(solver="fsdp2"))
    post_pass = compile_.inductor_post_grad_pass(mem_budget="1 GiB", **options)
    assert post_pass.uuid() == compile_.inductor_post_grad_pass(mem_budget="1 GiB", **options).uuid()
    assert post_pass.uuid() != compile_.inductor_post_grad_pass(mem_budget="2 GiB", **options).uuid()
    assert post_pass.uuid() != compile_.inductor_post_grad_pass(
        mem_budget="1 GiB", cost_model=COSTS, solver=SolverOptions(solver="simplefsdp")).uuid()
    post_pass(gm.graph)
    (report,) = post_pass.reports
    assert report.n_collectives_before == 5 and max(report.ag_prefetch) > 0
    pinned = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.control_deps]
    assert pinned
    assert _same_outputs(gm, inputs, ref)
    unpinned = toy_graph(pg, 1)
    compile_.inductor_post_grad_pass(mem_budget="1 GiB", writeback=WriteBackOptions(control_deps=False),
                                     **options)(unpinned.graph)
    assert not [n for n in unpinned.graph.nodes if n.target is torch.ops.higher_order.control_deps]


# --------------------------------------------------------------------------------------------
# the schedule cache
# --------------------------------------------------------------------------------------------
def test_cached_schedule_is_the_one_solved(pg, tmp_path, monkeypatch, caplog):
    """With ``$FSDP_SCHED_CACHE`` set, a second call on an identical graph with the same budget
    and options installs the schedule of the first without solving (its only stage is the
    cache); another budget is a miss; a corrupt entry is a miss with a warning."""
    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path))
    entries = tmp_path / cache.SCHEDULES_DIR
    first = toy_graph(pg, 1)
    optimize_schedule(first, None, cost_model=COSTS, solver=QUICK)
    r1 = first.meta[api.REPORT_KEY]
    assert not r1.cache_hit and "starts" in [st["name"] for st in r1.stages]
    assert len(list(entries.glob("*.json"))) == 1

    second = toy_graph(pg, 1)
    optimize_schedule(second, None, cost_model=COSTS, solver=QUICK)
    r2 = second.meta[api.REPORT_KEY]
    assert r2.cache_hit and [st["name"] for st in r2.stages] == ["export", "cache", "write-back"]
    assert r2.digest == r1.digest and graph_digest(second) == graph_digest(first)
    assert second.meta[api.SCHEDULE_KEY].digest() == first.meta[api.SCHEDULE_KEY].digest()

    other_budget = toy_graph(pg, 1)
    optimize_schedule(other_budget, r1.reexported_peak_bytes + 1, cost_model=COSTS, solver=QUICK)
    assert not other_budget.meta[api.REPORT_KEY].cache_hit
    assert len(list(entries.glob("*.json"))) == 2

    for entry in entries.glob("*.json"):
        entry.write_text("{ not json")
    again = toy_graph(pg, 1)
    with caplog.at_level(logging.WARNING, logger="scheduler.integrate.cache"):
        optimize_schedule(again, None, cost_model=COSTS, solver=QUICK)
    assert not again.meta[api.REPORT_KEY].cache_hit and caplog.records
    assert graph_digest(again) == graph_digest(first)


def test_cached_entry_that_does_not_fit_the_graph_is_ignored(pg, tmp_path, monkeypatch, caplog):
    """An entry under the right key whose schedule names collectives this graph lacks (a key
    collision, or a hand-edited file) is a miss with a warning: the graph is solved."""
    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path))
    entries = tmp_path / cache.SCHEDULES_DIR
    gm = toy_graph(pg, 1)
    optimize_schedule(gm, None, cost_model=COSTS, solver=QUICK)
    [entry] = entries.glob("*.json")
    payload = json.loads(entry.read_text())["payload"]
    payload["schedule"]["buckets"][0] = ["no_such_collective"]
    cache.store(entry.stem, payload)
    again = toy_graph(pg, 1)
    with caplog.at_level(logging.WARNING, logger="scheduler.api"):
        optimize_schedule(again, None, cost_model=COSTS, solver=QUICK)
    assert not again.meta[api.REPORT_KEY].cache_hit and caplog.records
    assert again.meta[api.REPORT_KEY].digest == gm.meta[api.REPORT_KEY].digest


def test_the_pass_raises_no_future_warning_of_its_own():
    """A pass on a group of ranks reads no deprecated torch API: the export reads the traced
    sizes from ``backed_var_to_val`` (not ``var_to_val``) and the ranks agree through
    ``all_gather_single`` (not ``all_gather_into_tensor``), either of which warns on every call."""
    import copy
    import warnings

    from conftest import FAKE_WORLD, capture_llama_debug
    from models.capture import fake_process_group

    graphs = capture_llama_debug(n_layers=1)
    with fake_process_group(FAKE_WORLD), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        gm = optimize_schedule(copy.deepcopy(graphs.forward), None, solver=SolverOptions(work_limit=0.2))
    assert gm.meta[api.REPORT_KEY].status != "unchanged"  # the ranks agreed and it was written


def test_the_pass_collects_only_its_own_young_garbage_and_leaves_the_collector_as_found(pg):
    """During a pass the collector leaves alone what the process held before it (frozen: a full
    collection would scan the model and its graphs again and again) and runs no full collection
    (the oldest generation's threshold out of reach), and afterwards it is as it was, a pass
    that raises included: nothing frozen, or, when the caller had frozen objects, their freeze;
    the caller's thresholds."""
    import gc

    from scheduler.costs.models import TableCostModel

    seen: list[int] = []
    thresholds: list[tuple[int, ...]] = []

    def collective_ms(coll_type, payload_bytes, group):
        if not seen:  # counting the frozen objects walks them all: once is enough
            seen.append(gc.get_freeze_count())
        thresholds.append(gc.get_threshold())
        return 0.01 + 1e-9 * payload_bytes

    costs = TableCostModel(collective=collective_ms)
    caller = gc.get_threshold()
    gc.collect()
    assert gc.get_freeze_count() == 0
    try:
        gc.set_threshold(500, 7, 9)
        optimize_schedule(toy_graph(pg, 1), None, cost_model=costs, solver=QUICK)
        assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
        assert thresholds and all(t[:2] == (500, 7) and t[2] > 10**6 for t in thresholds)
        assert gc.get_threshold() == (500, 7, 9)
        with pytest.raises(InfeasibleBudgetError):
            optimize_schedule(toy_graph(pg, 1), 1, cost_model=costs, solver=QUICK)
        assert gc.get_threshold() == (500, 7, 9) and gc.get_freeze_count() == 0
        gc.freeze()
        try:
            optimize_schedule(toy_graph(pg, 1), None, cost_model=costs, solver=QUICK)
            assert gc.get_freeze_count() > 0  # the caller's freeze stands (objects it froze may have died)
        finally:
            gc.unfreeze()
    finally:
        gc.set_threshold(*caller)
