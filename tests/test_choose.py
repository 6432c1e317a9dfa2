"""The choice on the written graph (scheduler/choose.py) and the robust default.

What is written back is what counts: a candidate is written back on a copy and judged there by
three memory counts (the re-export's simulation, the liveness count, torch's MemoryTracker);
the first whose written graph holds the budget is installed. With no cost model given the
search judges under a family of models and minimises the worst-case regret.

Graphs: llama3-debug (1 and 2 blocks) on 4 fake ranks.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from conftest import capture_llama_debug  # noqa: E402
from scheduler import AgreementOptions, SolverOptions, optimize_schedule  # noqa: E402
from scheduler.api import REPORT_KEY  # noqa: E402
from scheduler.check.written import choose, graph_digest, judge_graph, write_and_judge, written_and_judged  # noqa: E402
from scheduler.writeback import apply_schedule, copy_graph, copy_module, install_schedule, refill_graph  # noqa: E402
from scheduler.costs.family import cost_model_family, cost_models  # noqa: E402
from scheduler.costs.pricing import export_problems  # noqa: E402
from scheduler.costs.hardware import Cluster, GroupInfo  # noqa: E402
from scheduler.export.dag import export_dag  # noqa: E402
from scheduler.check.judge import liveness_peak, torch_tracker_peak  # noqa: E402
from solvers import InfeasibleBudgetError, Problem  # noqa: E402
from solvers.core.simulator import simulate  # noqa: E402
from solvers.heuristics import fsdp2_schedule  # noqa: E402

#: a fake group moves no data: the ranks have nothing to agree with
ALONE = AgreementOptions(enabled=False)
WRITE = dict(cost_model=None, cluster=None, payload_order="registration", control_deps=False)


@pytest.fixture(scope="module")
def llama(group_name):
    return capture_llama_debug(n_layers=1)


@pytest.fixture(scope="module")
def backward(llama):
    """The 1-block backward, its problem, FSDP2-like and the traced order judged as written."""
    gm = llama.backward
    problem = Problem.from_dag(export_dag(gm))
    fsdp2 = fsdp2_schedule(problem)
    return gm, problem, fsdp2, write_and_judge(gm, problem, fsdp2, **WRITE), \
        write_and_judge(gm, problem, problem.traced_schedule(), **WRITE)


# --------------------------------------------------------------------------------------------
# judging a written graph
# --------------------------------------------------------------------------------------------
def test_judge_graph_takes_three_counts_of_the_graph_as_written(backward):
    gm, problem, _, _, traced = backward
    sim = simulate(problem.dag, problem.traced_schedule(), problem=problem)
    assert traced.step_ms == pytest.approx(sim.step_ms) and traced.peak_bytes == sim.peak_bytes
    assert traced.liveness_peak_bytes == liveness_peak(gm)
    assert traced.tracker_peak_bytes == torch_tracker_peak(gm)
    assert traced.max_peak_bytes == max(traced.peak_bytes, traced.liveness_peak_bytes)


def test_write_and_judge_leaves_the_graph_alone(backward):
    gm, problem, fsdp2, judged, traced = backward
    before = graph_digest(gm)
    again = write_and_judge(gm, problem, fsdp2, **WRITE)
    assert graph_digest(gm) == before
    assert again == judged
    # FSDP2-like merges and prefetches: another graph, faster and larger than the traced one
    assert judged.n_collectives < traced.n_collectives
    assert judged.step_ms < traced.step_ms and judged.max_peak_bytes > traced.max_peak_bytes


@pytest.mark.parametrize("split,control_deps", [(False, False), (True, False), (True, True)])
def test_the_judged_copy_installs_as_the_graph_a_write_back_gives(backward, split, control_deps):
    """The copy a candidate was judged on, installed (its all-gathers moved to a second group,
    its order pinned), is the graph apply_schedule writes on the traced graph: the same nodes,
    names and order, in the graph object the pass was given."""
    gm, problem, fsdp2, _, _ = backward
    schedule = fsdp2.with_split(problem.splittable_groups()) if split else fsdp2
    assert not split or schedule.split_groups
    _, written = written_and_judged(gm, problem, schedule, **WRITE)
    fresh = copy_module(gm)
    apply_schedule(fresh, problem, schedule, control_deps=control_deps)
    target = copy_module(gm)
    graph = target.graph
    install_schedule(target, problem, schedule, written=written, control_deps=control_deps)
    assert target.graph is graph
    assert graph_digest(target) == graph_digest(fresh) != graph_digest(gm)
    assert [n.name for n in target.graph.nodes] == [n.name for n in fresh.graph.nodes]
    assert target.code == fresh.code
    # a copy makes its code when it is read, and that code is its written graph's, not its first
    assert fresh.code == fresh.graph.python_code("self").src != gm.code


def test_a_refilled_graph_is_the_same_object_holding_the_source(backward):
    """Restoring a graph (a failed install rolled back) refills the graph object it had: an
    inductor pass's caller keeps reading that object."""
    gm, problem, fsdp2, _, _ = backward
    target = copy_module(gm)
    graph = target.graph
    backup = copy_graph(graph)
    apply_schedule(target, problem, fsdp2)
    assert graph_digest(target) != graph_digest(gm)
    refill_graph(target.graph, backup)
    target.recompile()
    assert target.graph is graph
    assert graph_digest(target) == graph_digest(gm)
    assert [n.name for n in target.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert all(a.meta.get("val") is b.meta.get("val") for a, b in zip(target.graph.nodes, gm.graph.nodes))


def test_graph_digest_ignores_names_not_structure(llama):
    gm = copy.deepcopy(llama.forward)
    assert graph_digest(gm) == graph_digest(copy.deepcopy(gm))
    renamed = copy.deepcopy(gm)
    for i, n in enumerate(renamed.graph.nodes):
        if n.op == "call_function":
            n.name = f"node_{i}"
    assert graph_digest(renamed) == graph_digest(gm)
    optimize_schedule(gm, None, agreement=ALONE, solver=SolverOptions(solver="fsdp2"))
    assert graph_digest(gm) != graph_digest(renamed)


# --------------------------------------------------------------------------------------------
# the choice
# --------------------------------------------------------------------------------------------
def test_choose_installs_the_first_written_graph_that_holds_the_budget(backward):
    """At the traced graph's peak FSDP2-like's written graph is over: it is dropped (judged,
    with its figures) and the traced order is chosen; without a budget FSDP2-like is."""
    gm, problem, fsdp2, judged, traced = backward
    budget = traced.max_peak_bytes
    chosen, candidates = choose(gm, problem, [("fsdp2", fsdp2)], budget, **WRITE)
    assert chosen.name == "traced" and chosen.dropped is None
    assert [c.name for c in candidates] == ["fsdp2", "traced"]
    assert candidates[0].dropped is not None and candidates[0].figures.max_peak_bytes > budget
    assert chosen.figures.max_peak_bytes <= budget
    free, candidates = choose(gm, problem, [("fsdp2", fsdp2)], None, **WRITE)
    assert free.name == "fsdp2" and [c.name for c in candidates] == ["fsdp2"]


def test_no_written_graph_that_fits_raises_with_a_peak_that_works_as_a_budget(backward):
    gm, problem, fsdp2, judged, traced = backward
    with pytest.raises(InfeasibleBudgetError) as err:
        choose(gm, problem, [("fsdp2", fsdp2)], 1, **WRITE)
    least = min(judged.max_peak_bytes, traced.max_peak_bytes)
    assert err.value.min_peak_bytes == least and err.value.mem_budget_bytes == 1
    chosen, _ = choose(gm, problem, [("fsdp2", fsdp2)], err.value.min_peak_bytes, **WRITE)
    assert chosen.figures.max_peak_bytes <= err.value.min_peak_bytes


def test_returned_graph_is_the_judged_one(llama):
    """The report's written-graph figures are those of the graph returned, which holds the
    budget (FSDP2-like's written peak) by the counts it bounds, and reports torch's tracker count."""
    gm0 = llama.backward
    problem = Problem.from_dag(export_dag(gm0))
    budget = write_and_judge(gm0, problem, fsdp2_schedule(problem), **WRITE).max_peak_bytes
    gm = copy.deepcopy(gm0)
    optimize_schedule(gm, budget, cost_model="analytic", agreement=ALONE, solver=SolverOptions(work_limit=1.0))
    report = gm.meta[REPORT_KEY]
    figures = judge_graph(gm, "analytic")
    assert report.verified and report.reexported_step_ms == pytest.approx(figures.step_ms)
    assert (report.reexported_peak_bytes, report.liveness_peak_bytes, report.tracker_peak_bytes) == (
        figures.peak_bytes, figures.liveness_peak_bytes, figures.tracker_peak_bytes)
    assert figures.max_peak_bytes <= budget
    assert [c["name"] for c in report.candidates][-1] == report.chosen_candidate
    assert all(c["dropped"] is not None for c in report.candidates[:-1])



def test_the_traced_candidate_is_the_graph_itself_judged_as_it_is(backward, monkeypatch):
    """Every written copy of the graph counts a little more memory than the graph (the count
    disagreement that refused a budget equal to a torchtitan backward's own peak): a budget equal
    to the graph's own peak by the counts that judge candidates still chooses the traced order,
    which is the graph itself, judged as it is."""
    import scheduler.check.written as written

    gm, problem, fsdp2, _, traced = backward
    real = written.judge_graph

    def judge(graph, *args):
        figures = real(graph, *args)
        return figures if graph is gm else dataclasses.replace(
            figures, liveness_peak_bytes=figures.liveness_peak_bytes + (16 << 20))

    monkeypatch.setattr(written, "judge_graph", judge)
    chosen, candidates = choose(gm, problem, [("fsdp2", fsdp2)], traced.max_peak_bytes, **WRITE)
    assert chosen.name == "traced" and chosen.figures.max_peak_bytes == traced.max_peak_bytes
    assert candidates[0].dropped is not None


def test_a_budget_the_traced_graph_holds_is_never_refused_when_the_search_finds_none(llama, monkeypatch):
    """The search's count says no schedule fits (its export counts 16 MiB more than the graph
    holds, as a count disagreement would) while the traced graph holds the budget by the
    counts that judge every candidate: the graph as traced is the answer, installed unchanged
    with a note and status "fallback", never an error. Below the traced graph's own peak the
    refusal stands."""
    import scheduler.costs.pricing as pricing  # the search's export, not the judge's

    gm0 = llama.backward
    own = judge_graph(gm0).max_peak_bytes
    real = pricing.export_dag

    def over_counting(graph, **kw):
        dag = real(graph, **kw)
        first_input = next(n for n, a in dag.nodes(data=True) if a["kind"] == "input" and not a["releasable"])
        dag.nodes[first_input]["size_bytes"] += 16 << 20
        return dag

    monkeypatch.setattr(pricing, "export_dag", over_counting)
    gm = copy.deepcopy(gm0)
    optimize_schedule(gm, own, cost_model="analytic", agreement=ALONE, solver=SolverOptions(work_limit=1.0))
    report = gm.meta[REPORT_KEY]
    assert graph_digest(gm) == graph_digest(gm0) and judge_graph(gm).max_peak_bytes <= own
    assert report.status == "fallback" and report.fell_back and report.chosen_candidate == "traced"
    assert any("left unchanged" in n for n in report.notes)
    with pytest.raises(InfeasibleBudgetError):
        optimize_schedule(copy.deepcopy(gm0), own - 1, cost_model="analytic", agreement=ALONE,
                          solver=SolverOptions(work_limit=1.0))

# --------------------------------------------------------------------------------------------
# the cost models
# --------------------------------------------------------------------------------------------
def test_family_has_both_models_and_scaled_bandwidths():
    family = cost_model_family(Cluster())
    assert list(family) == ["analytic", "analytic bw-30%", "analytic bw+30%", "torch", "torch bw-30%", "torch bw+30%"]
    group = GroupInfo(name="0", size=64)  # spans 8 nodes: priced at the inter-node bandwidth
    for base in ("analytic", "torch"):
        t = {label: family[label].collective_ms("all_gather", 64 << 20, group) for label in family if
             label.startswith(base)}
        assert t[f"{base} bw-30%"] > t[base] > t[f"{base} bw+30%"], t
    assert family["analytic"].cluster.inter_node_gbps == 50.0
    assert family["analytic bw-30%"].cluster.inter_node_gbps == pytest.approx(35.0)
    assert family["torch bw+30%"].cluster.intra_node_gbps == pytest.approx(585.0)
    assert list(cost_model_family(bandwidth_scales=())) == ["analytic", "torch"]
    assert list(cost_models("torch", None, (0.7, 1.3))) == ["torch"]
    assert list(cost_models(None, None, (0.7, 1.3))) == list(family)


def test_export_problems_prices_one_export_under_each_model(llama):
    problems = export_problems(llama.forward, cost_model_family(), None)
    first = next(iter(problems.values()))
    steps = {label: simulate(p.dag, problem=p).step_ms for label, p in problems.items()}
    assert all(p.seq == first.seq and p.colls.keys() == first.colls.keys() for p in problems.values())
    assert len(set(steps.values())) > 1  # the models disagree
    assert steps["analytic bw-30%"] >= steps["analytic"] >= steps["analytic bw+30%"]


def test_default_judges_under_the_family(llama):
    gm = copy.deepcopy(llama.forward)
    optimize_schedule(gm, None, agreement=ALONE, solver=SolverOptions(work_limit=1.0))
    assert gm.meta[REPORT_KEY].cost_models == list(cost_model_family())
    one = copy.deepcopy(llama.forward)
    optimize_schedule(one, None, cost_model="torch", agreement=ALONE, solver=SolverOptions(work_limit=1.0))
    assert one.meta[REPORT_KEY].cost_models == ["torch"]


@pytest.fixture(scope="module")
def two_blocks(group_name):
    return capture_llama_debug(n_layers=2)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_robust_default_regrets_no_more_than_a_single_model_solve(two_blocks, kind):
    """llama3-debug (2 blocks) at FSDP2-like's written peak: the written graph of the default
    (judged under the family, least worst-case regret) regrets no more over the family than
    the graph written by a solve under the analytic model alone, or under torch's alone; the
    regret of each model is against the fastest of the three written graphs under it."""
    gm0 = getattr(two_blocks, kind)
    problem = Problem.from_dag(export_dag(gm0))
    budget = write_and_judge(gm0, problem, fsdp2_schedule(problem), **WRITE).max_peak_bytes
    family = cost_model_family()
    steps = {}
    for given in (None, "analytic", "torch"):
        gm = copy.deepcopy(gm0)
        optimize_schedule(gm, budget, cost_model=given, agreement=ALONE, solver=SolverOptions(work_limit=2.0))
        assert liveness_peak(gm) <= budget
        written = export_problems(gm, family, None)
        steps[given] = {label: simulate(p.dag, problem=p).step_ms for label, p in written.items()}
    best = {label: min(s[label] for s in steps.values()) for label in family}
    worst = {given: max(s[label] / best[label] - 1 for label in family) for given, s in steps.items()}
    assert worst[None] <= worst["analytic"] + 1e-9, worst
    assert worst[None] <= worst["torch"] + 1e-9, worst
