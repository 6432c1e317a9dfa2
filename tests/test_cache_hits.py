"""A schedule cache hit is taken as a fresh candidate of this graph: its schedule validated on
this graph's problem, budget and options, written and judged, and its report made on this graph;
an entry that does not hold (stale, edited by hand, of another graph) is a miss with a warning,
and reading one never raises.

Graphs are traced on a real single-process gloo group (merges need one). The layer graph
(d = width; three fp32 weights cast to bf16 and all-gathered, all at the top as traced, then
one reduce-scatter per layer of a small gradient)::

    ag0(w1) ag1(w2) ag2(w3)                       <- issued and waited at the top, as traced
    mm(x, ag0) -> relu -> mm(., ag1) -> relu -> mm(., ag2) -> relu = h
    rs_k(2 h.sum(0)) for k = 0, 1, 2              <- gradients, small

The weights are ``primals*`` (the graph cannot free them), so gathering a weight only where its
layer needs it lowers the peak: a budget below the traced graph's own peak needs a rewrite.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from scheduler import SolverOptions, export_dag, optimize_schedule, simulate
from scheduler import api
from scheduler.check.judge import liveness_peak
from scheduler.integrate import cache
from solvers import Problem
from test_writeback import COSTS, gloo_group

QUICK = SolverOptions(work_limit=1.0)


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The directory of this test's schedule entries."""
    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path))
    return tmp_path / cache.SCHEDULES_DIR


def layers(group_name: str, d: int = 64) -> torch.fx.GraphModule:
    """The layer graph of the module docstring on a group of one rank."""
    ops = torch.ops._c10d_functional

    def f(primals_1, primals_2, primals_3, x):
        gathered = [ops.wait_tensor(ops.all_gather_into_tensor(w.to(torch.bfloat16), 1, group_name))
                    for w in (primals_1, primals_2, primals_3)]
        h = x
        for a in gathered:
            h = torch.relu(torch.mm(h, a))
        grads = [ops.wait_tensor(ops.reduce_scatter_tensor((h.sum(0) * 2.0).float(), "sum", 1, group_name))
                 for _ in gathered]
        return h, *grads

    with FakeTensorMode():
        args = [torch.randn(d, d) for _ in range(3)] + [torch.randn(8, d, dtype=torch.bfloat16)]
    return make_fx(f, tracing_mode="fake")(*args)


def binding_budget(group_name: str) -> int:
    """A budget below the traced graph's own peak that a rewrite holds."""
    return liveness_peak(layers(group_name)) * 7 // 8


def solve_into_cache(cache_dir, gm, budget, solver=QUICK):
    """Optimise ``gm`` (a miss) and return the key and the payload of the entry it wrote."""
    before = set(cache_dir.glob("*.json"))
    optimize_schedule(gm, budget, cost_model=COSTS, solver=solver)
    assert not gm.meta[api.REPORT_KEY].cache_hit
    [entry] = set(cache_dir.glob("*.json")) - before
    return entry.stem, json.loads(entry.read_text())["payload"]


def test_the_layer_graph_needs_a_rewrite_to_hold_the_budget(pg):
    budget = binding_budget(pg)
    assert liveness_peak(layers(pg)) > budget
    gm = optimize_schedule(layers(pg), budget, cost_model=COSTS, solver=QUICK)
    assert liveness_peak(gm) <= budget


def test_an_entry_without_a_schedule_is_a_miss_and_the_budget_holds(pg, cache_dir, caplog):
    """An entry whose schedule is null, for a graph with collectives, would leave the graph as
    traced, over its budget, under a report saying "feasible": it is a miss with a warning
    naming the entry, and the graph is solved."""
    budget = binding_budget(pg)
    key, payload = solve_into_cache(cache_dir, layers(pg), budget)
    payload["schedule"] = None
    cache.store(key, payload)
    gm = layers(pg)
    with caplog.at_level(logging.WARNING, logger="scheduler.api"):
        optimize_schedule(gm, budget, cost_model=COSTS, solver=QUICK)
    report = gm.meta[api.REPORT_KEY]
    assert not report.cache_hit and liveness_peak(gm) <= budget
    assert report.peak_bytes_after == liveness_peak(gm)
    assert any(key in r.getMessage() for r in caplog.records)


def test_a_cached_split_schedule_is_a_miss_where_all_gathers_share_their_group(pg, cache_dir):
    """A schedule solved with the all-gathers on a second group, found under the key of a solve
    that keeps them on theirs (``all_gather_stream="shared"``), must not make that group."""
    separate = SolverOptions(work_limit=1.0, all_gather_stream="separate")
    _, split = solve_into_cache(cache_dir, layers(pg), None, separate)
    assert split["schedule"]["split_groups"]
    key, _ = solve_into_cache(cache_dir, layers(pg), None)
    cache.store(key, split)
    gm = optimize_schedule(layers(pg), None, cost_model=COSTS, solver=QUICK)
    assert not gm.meta[api.REPORT_KEY].cache_hit
    assert gm.meta[api.SCHEDULE_KEY].split_groups == () and gm.meta[api.REPORT_KEY].split_groups == []


@pytest.mark.parametrize("field, value, hit", [("gap", "x", True), ("peak_bytes_after", None, True),
                                                ("notes", 5, False), ("status", "splendid", False),
                                                ("best_bound_ms", float("nan"), False)])
def test_report_fields_of_the_wrong_type_never_raise(pg, cache_dir, field, value, hit):
    """A figure of the stored report is not read (it is computed again on this graph); a field
    that says how the schedule was found is checked, and a bad one makes the entry a miss.
    optimize_schedule never raises on an entry, and its report's figures are numbers."""
    budget = binding_budget(pg)
    key, payload = solve_into_cache(cache_dir, layers(pg), budget)
    payload["report"][field] = value
    cache.store(key, payload)
    gm = optimize_schedule(layers(pg), budget, cost_model=COSTS, solver=QUICK)
    report = gm.meta[api.REPORT_KEY]
    assert report.cache_hit == hit and liveness_peak(gm) <= budget
    assert isinstance(report.gap, float) and all(isinstance(n, str) for n in report.notes)
    assert report.summary_line()  # formats every figure


def test_the_entry_of_another_graph_gets_a_report_of_this_one(pg, cache_dir):
    """The entry of a narrower graph with the same node names, renamed to this graph's key: its
    schedule is one of this graph, so it may be installed, but the report describes the graph
    it is attached to, every figure computed on it."""
    wide_key, _ = solve_into_cache(cache_dir, layers(pg, d=128), None)
    _, narrow = solve_into_cache(cache_dir, layers(pg, d=32), None)
    cache.store(wide_key, narrow)
    gm = layers(pg, d=128)
    problem = Problem.from_dag(export_dag(gm, cost_model=COSTS))
    optimize_schedule(gm, None, cost_model=COSTS, solver=QUICK)
    report, installed = gm.meta[api.REPORT_KEY], gm.meta[api.SCHEDULE_KEY]
    assert report.cache_hit and installed.digest() == report.digest
    sim = simulate(problem.dag, installed, problem=problem)
    assert report.peak_bytes_after == sim.peak_bytes == liveness_peak(gm) == report.liveness_peak_bytes
    assert report.step_ms_after == pytest.approx(sim.step_ms)
    assert report.peak_bytes_before == simulate(problem.dag, problem=problem).peak_bytes


@pytest.mark.parametrize("edited", [False, True], ids=["as-stored", "figures-edited"])
def test_a_hit_reads_the_judged_figures_only_where_sealed_for_this_graph(pg, cache_dir, edited):
    """An entry keeps the figures of its written graph, with the graph and schedule they were
    judged on and a seal over the three: a hit on that graph takes them (it is not written and
    judged a second time, and says so); an entry whose figures were changed afterwards is
    written and judged again, and the report shows this graph's own figures."""
    budget = binding_budget(pg)
    key, payload = solve_into_cache(cache_dir, layers(pg), budget)
    if edited:
        payload["judged"]["figures"]["liveness_peak_bytes"] -= 4096
        cache.store(key, payload)
    gm = optimize_schedule(layers(pg), budget, cost_model=COSTS, solver=QUICK)
    report = gm.meta[api.REPORT_KEY]
    assert report.cache_hit and report.liveness_peak_bytes == liveness_peak(gm) <= budget
    taken = any("judged on this graph when it was stored" in n for n in report.notes)
    assert taken == (not edited)


def _steps_swapped(schedule: dict, first: str, second: str) -> dict:
    """``schedule`` (JSON) with the node steps ``first`` and ``second`` swapped."""
    steps = [list(s) for s in schedule["steps"]]
    i = steps.index(["node", first])
    j = steps.index(["node", second])
    steps[i], steps[j] = steps[j], steps[i]
    return {**schedule, "steps": steps}


def test_an_entry_in_another_order_of_compute_is_installed_in_that_order_or_refused(pg, cache_dir):
    """A schedule may run the compute in another order than traced (torch's: its pass runs a
    collective's input early): an entry whose order runs every node after its inputs is
    installed in that order; one whose order runs a node before its input is a miss."""
    key, payload = solve_into_cache(cache_dir, layers(pg), None)
    problem = Problem.from_dag(export_dag(layers(pg), cost_model=COSTS))
    # two nodes that follow each other in the schedule, neither reading the other
    steps = payload["schedule"]["steps"]
    a, b = next((x[1], y[1]) for x, y in zip(steps, steps[1:]) if x[0] == y[0] == "node"
                and not _depends(problem, y[1], x[1]))
    payload["schedule"] = _steps_swapped(payload["schedule"], a, b)
    cache.store(key, payload)
    gm = optimize_schedule(layers(pg), None, cost_model=COSTS, solver=QUICK)
    ran = [n.name for n in gm.graph.nodes if n.name in problem.pos]
    assert gm.meta[api.REPORT_KEY].cache_hit and ran.index(b) < ran.index(a)
    assert gm.meta[api.REPORT_KEY].compute_order == "torch"

    reader, producer = next((v, u) for u, v in problem.dag.edges if u in problem.pos and v in problem.pos)
    payload["schedule"] = _steps_swapped(payload["schedule"], producer, reader)
    cache.store(key, payload)
    gm = optimize_schedule(layers(pg), None, cost_model=COSTS, solver=QUICK)
    ran = [n.name for n in gm.graph.nodes if n.name in problem.pos]
    assert not gm.meta[api.REPORT_KEY].cache_hit and ran.index(producer) < ran.index(reader)


def _depends(problem: Problem, node: str, on: str) -> bool:
    import networkx as nx

    return nx.has_path(problem.dag, on, node)
