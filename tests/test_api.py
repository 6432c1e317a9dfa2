"""The user-facing API: parse_bytes, solve_dag, optimize_schedule, the compile backend.

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
from scheduler import InfeasibleBudgetError, ScheduleError, ScheduleReport, optimize_schedule, parse_bytes, solve_dag
from scheduler import api
from scheduler import compile as compile_
from scheduler.dag import dag_from_json, dag_to_json, export_dag
from scheduler.verify import TORCH_CANDIDATES, Candidate
from solvers import Problem, SolveResult, SolveStatus
from solvers.heuristics import HEURISTICS
from test_writeback import COSTS, gloo_group, n_collectives, real_inputs, toy_graph


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


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
    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    out_gm = optimize_schedule(gm, "1 GiB", cost_model=COSTS, time_limit_s=5)
    assert out_gm is gm
    report = gm.meta["fsdp_sched_report"]
    assert isinstance(report, ScheduleReport)
    assert report.n_collectives_before == 5
    assert n_collectives(gm) == report.n_collectives_after == len(report.buckets)
    assert report.step_ms_after <= report.step_ms_before + 1e-12
    assert report.step_ms_after < report.step_ms_before  # the traced graph exposes every collective
    assert report.lower_bound_ms <= report.best_bound_ms <= report.step_ms_after + 1e-12
    assert report.peak_bytes_after <= 2**30 and report.mem_budget_bytes == 2**30
    assert len(report.ag_prefetch) == report.bucket_types.count("all_gather")
    assert len(report.digest) == 64
    assert "step time" in str(report) and "peak memory" in str(report)
    assert ScheduleReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    for a, b in zip(ref, gm(*inputs)):
        assert torch.equal(a, b)


def test_installed_schedule_starts_another_solve(pg):
    """``gm.meta[SCHEDULE_KEY]`` is the installed schedule over the traced graph (None when
    torch's graph is installed; here the solver's, without the closed loop); given to a
    solve of a copy as ``extra_starts`` (a robust solve under a blend gets its single-model
    solves' this way) the solve is never slower than it; a schedule of another graph is refused."""
    from solvers.core.schedule import Schedule

    from scheduler.api import SCHEDULE_KEY

    gm = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, time_limit_s=5, verify=False)
    start = gm.meta[SCHEDULE_KEY]
    first = gm.meta["fsdp_sched_report"]
    assert isinstance(start, Schedule) and start.digest() == first.digest
    again = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, time_limit_s=0.1, extra_starts=[start],
                              verify=False)
    assert again.meta["fsdp_sched_report"].step_ms_after <= first.step_ms_after + 1e-9
    other = Schedule(start.buckets[:1], start.steps)
    with pytest.raises(ValueError, match="not a schedule of this graph"):
        optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, time_limit_s=0.1, extra_starts=[other],
                          fallback=False, verify=False)


def test_solvers_own_schedules_are_kept_beside_the_installed_one(pg):
    """``gm.meta[SOLVED_KEY]``: the schedules the solver returned itself (its result first), which
    the closed loop may not install (robust_schedule judges and polishes them too); empty when
    a hook imposed another schedule."""
    from solvers.core.schedule import Schedule

    from scheduler.api import SCHEDULE_KEY, SOLVED_KEY

    gm = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, time_limit_s=5, verify=False)
    own = gm.meta[SOLVED_KEY]
    assert own and all(isinstance(s, Schedule) for s in own)
    assert own[0].digest() == gm.meta[SCHEDULE_KEY].digest() == gm.meta["fsdp_sched_report"].digest
    traced = []

    def hook(problem, schedule):
        traced.append(problem.traced_schedule())
        return traced[0]

    hooked = optimize_schedule(toy_graph(pg, 1), "1 GiB", cost_model=COSTS, time_limit_s=5, verify=False,
                               schedule_hook=hook)
    assert traced[0].digest() != own[0].digest()  # else the hook imposed nothing
    assert hooked.meta[SOLVED_KEY] == () and hooked.meta[SCHEDULE_KEY].digest() == traced[0].digest()


def test_graph_without_collectives_comes_back_unchanged():
    gm = make_fx(lambda x: torch.relu(x @ x), tracing_mode="fake")(torch.randn(8, 8))
    before = str(gm.graph)
    optimize_schedule(gm, "1 GiB")
    assert str(gm.graph) == before
    report = gm.meta["fsdp_sched_report"]
    assert report.status == "unchanged" and report.n_collectives_after == 0
    assert any("no collectives" in n for n in report.notes)


def test_infeasible_budget_states_smallest_peak(pg):
    gm = toy_graph(pg, 1)
    traced_peak = api.simulate(export_dag(gm, cost_model=COSTS)).peak_bytes
    before = str(gm.graph)
    with pytest.raises(InfeasibleBudgetError, match="at least") as info:
        optimize_schedule(gm, 1000, cost_model=COSTS, time_limit_s=5)
    assert 1000 < info.value.min_peak_bytes <= traced_peak
    assert info.value.budget_bytes == 1000
    assert str(gm.graph) == before


def test_bad_budget_string_raises_before_touching_the_graph(pg):
    gm = toy_graph(pg, 1)
    before = str(gm.graph)
    with pytest.raises(ValueError, match="GiB"):
        optimize_schedule(gm, "lots")
    assert str(gm.graph) == before


@pytest.mark.parametrize("error", [ScheduleError("model invalid"), TimeoutError("wall clock exceeded")])
def test_solver_failure_falls_back_to_a_valid_schedule(pg, caplog, error):
    def failing(problem, **kw):
        raise error

    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    with caplog.at_level(logging.WARNING, logger="scheduler.api"):
        optimize_schedule(gm, "1 GiB", cost_model=COSTS, solver=failing)
    report = gm.meta["fsdp_sched_report"]
    assert report.fell_back and report.status == SolveStatus.FALLBACK.value
    # the fallback heuristic, or another candidate whose written graph was faster (scheduler.verify)
    assert report.requested_solver == "failing" and report.solver in {*HEURISTICS, *TORCH_CANDIDATES}
    assert any(str(error) in n for n in report.notes)
    assert any("falling back" in r.getMessage() for r in caplog.records)
    assert report.step_ms_after <= report.step_ms_before
    for a, b in zip(ref, gm(*inputs)):
        assert torch.equal(a, b)


def test_solver_failure_without_fallback_raises(pg):
    def failing(problem, **kw):
        raise ScheduleError("model invalid")

    gm = toy_graph(pg, 1)
    with pytest.raises(ScheduleError, match="model invalid"):
        optimize_schedule(gm, cost_model=COSTS, fallback=False, solver=failing)


def test_timed_out_incumbent_worse_than_heuristic_is_replaced(pg):
    """A solver stopping at its limit with a poor incumbent (the traced order) does not make
    the result worse than the heuristics."""

    def poor_incumbent(problem: Problem, **kw) -> SolveResult:
        s = problem.traced_schedule()
        sim = api.simulate(problem.dag, s, problem=problem)
        return SolveResult(s, SolveStatus.FEASIBLE, "cpsat", sim.step_ms, 0.0, 0.1, sim.peak_bytes)

    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    schedule, report = solve_dag(dag, solver=poor_incumbent)
    fastest = min(HEURISTICS, key=lambda h: HEURISTICS[h](Problem.from_dag(dag)).objective_ms)
    assert report.fell_back and report.solver == fastest
    assert report.step_ms_after < report.step_ms_before
    assert any("simulates better" in n for n in report.notes)
    assert schedule.digest() == report.digest


def test_solve_dag_offline_from_json(pg):
    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    dag = dag_from_json(json.loads(json.dumps(dag_to_json(dag))))
    schedule, report = solve_dag(dag, "64 MiB", solver="fsdp2")
    assert report.solver == "fsdp2" and not report.fell_back
    sim = scheduler.validate_schedule(Problem.from_dag(dag), schedule, mem_budget_bytes=64 * 2**20)
    assert sim.step_ms == pytest.approx(report.step_ms_after)
    assert sim.peak_bytes == report.peak_bytes_after


def test_broadcast_sends_the_schedule_and_errors(pg):
    """Single-rank gloo group: the broadcast path runs end to end (multi-rank is tested with
    the gloo harness)."""
    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    problem = Problem.from_dag(dag)
    expected = solve_dag(dag, solver="fsdp2")

    chosen = Candidate(name="fsdp2", schedule=expected[0])
    received, report = api._solve_and_broadcast(lambda: (chosen, expected[1]), problem, None, 0)
    assert received.schedule.digest() == received.digest() == expected[0].digest() == report.digest

    def infeasible():
        raise InfeasibleBudgetError("too small", budget_bytes=10, min_peak_bytes=1234)

    with pytest.raises(InfeasibleBudgetError) as info:
        api._solve_and_broadcast(infeasible, problem, 10, 0)
    assert info.value.min_peak_bytes == 1234


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

    be = scheduler.backend(mem_budget="1 GiB", cost_model=COSTS, time_limit_s=5)
    torch._dynamo.reset()
    out = torch.compile(f, backend=be, fullgraph=True)(*ws, x)
    out.backward()
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    for a, w in zip(ref_grads, ws):
        assert torch.equal(a, w.grad)
    kinds = [r.graph_name for r in be.reports]
    assert kinds == ["forward", "backward"]
    fw, bw = be.reports
    assert fw.bucket_types and set(fw.bucket_types) == {"all_gather"}
    assert set(bw.bucket_types) == {"reduce_scatter"}  # gradients of all-gathers
    for r in be.reports:
        assert r.step_ms_after < r.step_ms_before


def test_inductor_post_grad_pass_pins_order(pg):
    gm = toy_graph(pg, 1)
    inputs = real_inputs()
    ref = gm(*inputs)
    # fsdp2 prefetches each all-gather one use ahead: those overlaps get pinned (control_deps is
    # the pass's default; given here to make the test's point explicit)
    # verify=False: fsdp2's schedule itself is written back (with verify, torch's scheduler is
    # faster on this graph; its installed graph is pinned too, see tests/test_verify.py)
    options = dict(cost_model=COSTS, solver="fsdp2", control_deps=True, verify=False)
    post_pass = compile_.inductor_post_grad_pass(mem_budget="1 GiB", **options)
    assert post_pass.uuid() == compile_.inductor_post_grad_pass(mem_budget="1 GiB", **options).uuid()
    assert post_pass.uuid() != compile_.inductor_post_grad_pass(mem_budget="2 GiB", **options).uuid()
    post_pass(gm.graph)
    (report,) = post_pass.reports
    assert report.n_collectives_before == 5 and max(report.ag_prefetch) > 0
    pinned = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.control_deps]
    assert pinned
    for a, b in zip(ref, gm(*inputs)):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# the schedule cache
# --------------------------------------------------------------------------------------------
def test_cached_schedule_is_the_one_solved(pg, tmp_path, monkeypatch, caplog):
    """With ``$FSDP_SCHED_CACHE`` set, a second call on an identical graph with the same budget
    and options installs the schedule of the first without solving (the report says it came
    from the cache and records no solve stage); another budget is a miss; a corrupt entry is a
    miss with a warning, and the solve overwrites it."""
    from scheduler.verify import graph_digest

    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path))
    first = toy_graph(pg, 1)
    optimize_schedule(first, None, cost_model=COSTS, time_limit_s=2)
    r1 = first.meta[api.REPORT_KEY]
    assert not r1.cache_hit and "search" in [st["name"] for st in r1.stages]
    assert len(list(tmp_path.glob("*.json"))) == 1

    second = toy_graph(pg, 1)
    optimize_schedule(second, None, cost_model=COSTS, time_limit_s=2)
    r2 = second.meta[api.REPORT_KEY]
    assert r2.cache_hit and [st["name"] for st in r2.stages] == ["cache"]
    assert r2.digest == r1.digest and graph_digest(second) == graph_digest(first)
    assert second.meta[api.SOLVED_KEY] == first.meta[api.SOLVED_KEY]

    other_budget = toy_graph(pg, 1)
    optimize_schedule(other_budget, r1.reexported_peak_bytes + 1, cost_model=COSTS, time_limit_s=2)
    assert not other_budget.meta[api.REPORT_KEY].cache_hit
    assert len(list(tmp_path.glob("*.json"))) == 2

    for entry in tmp_path.glob("*.json"):
        entry.write_text("{ not json")
    again = toy_graph(pg, 1)
    with caplog.at_level(logging.WARNING, logger="scheduler.cache"):
        optimize_schedule(again, None, cost_model=COSTS, time_limit_s=2)
    assert not again.meta[api.REPORT_KEY].cache_hit and caplog.records
    assert graph_digest(again) == graph_digest(first)


def test_cached_entry_that_does_not_fit_the_graph_is_ignored(pg, tmp_path, monkeypatch, caplog):
    """An entry under the right key whose schedule names collectives this graph lacks (a key
    collision, or a hand-edited file) is a miss with a warning: the graph is solved."""
    from scheduler import cache

    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path))
    gm = toy_graph(pg, 1)
    optimize_schedule(gm, None, cost_model=COSTS, time_limit_s=2)
    [entry] = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    payload = data["payload"]
    payload["own"][0]["buckets"][0] = ["no_such_collective"]
    cache.store(entry.stem, payload)
    again = toy_graph(pg, 1)
    with caplog.at_level(logging.WARNING, logger="scheduler.api"):
        optimize_schedule(again, None, cost_model=COSTS, time_limit_s=2)
    assert not again.meta[api.REPORT_KEY].cache_hit
    assert any("does not fit this graph" in r.getMessage() for r in caplog.records)
