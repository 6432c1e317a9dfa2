"""Robust to the cost model (scheduler/robust.py): the criterion on hand-made tables, the family
of cost models, and robust_schedule on llama3-debug judged on the rewritten graph."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler.costs import Cluster, GroupInfo
from scheduler.robust import (
    choice_key,
    cost_model_family,
    regrets,
    robust_key,
    single_model_pick,
    worst_regret,
)

#: a table where each model alone picks a schedule that the other model punishes:
#:            m1     m2
#:   fast1   100    140    (regret 0 / 40 %)
#:   hedge   103    104    (regret 3 % / 4 %)
#:   fast2   130    100    (regret 30 % / 0)
TABLE = {"m1": {"fast1": 100.0, "hedge": 103.0, "fast2": 130.0},
         "m2": {"fast1": 140.0, "hedge": 104.0, "fast2": 100.0}}


def test_robust_pick_differs_from_each_single_model_pick():
    assert single_model_pick(TABLE, "m1") == "fast1"
    assert single_model_pick(TABLE, "m2") == "fast2"
    assert robust_key(TABLE) == "hedge"
    worst = worst_regret(TABLE)
    assert worst["hedge"] == pytest.approx(0.04)
    assert worst["fast1"] == pytest.approx(0.40) and worst["fast2"] == pytest.approx(0.30)
    assert regrets(TABLE)["fast1"]["m1"] == 0.0


def test_robust_key_breaks_ties_by_name_whatever_the_order():
    table = {"m": {"b": 10.0, "a": 10.0, "c": 11.0}}
    assert robust_key(table) == "a"
    assert robust_key({"m": dict(reversed(list(table["m"].items())))}) == "a"


@pytest.mark.parametrize("bad", [{}, {"m": {}}, {"m1": {"a": 1.0}, "m2": {"b": 1.0}}, {"m": {"a": 0.0}}])
def test_robust_key_refuses_malformed_tables(bad):
    with pytest.raises(ValueError):
        robust_key(bad)


def test_choice_key_takes_regrets_among_the_candidates_that_fit():
    """The over-budget candidate is the best under m2; counted, it would make fast2's m2
    regret positive and change the choice. Among the fitting ones, hedge is robust."""
    def cand(name, m1, m2, peak):
        return SimpleNamespace(name=name, figures=SimpleNamespace(step_ms={"m1": m1, "m2": m2}, max_peak_bytes=peak))

    cands = [cand(n, TABLE["m1"][n], TABLE["m2"][n], 10) for n in TABLE["m1"]]
    cands.append(cand("huge", 150.0, 50.0, 99))
    unjudged = SimpleNamespace(name="broken", figures=None)
    key = choice_key(cands + [unjudged], mem_budget_bytes=20)
    assert min(cands + [unjudged], key=key).name == "hedge"
    assert key(cands[-1])[0] == float("inf") and key(unjudged)[0] == float("inf")
    # without a budget, "huge" sets m2's best: every m2 regret is at least 100 %
    assert min(cands, key=choice_key(cands)).name == "huge"


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


# --------------------------------------------------------------------------------------------
# robust_schedule on a traced model, judged on the rewritten graph
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_graphs():
    from conftest import capture_llama_debug

    return capture_llama_debug(n_layers=2)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_robust_schedule_fits_and_has_the_least_regret(llama_graphs, kind):
    from models.capture import fake_process_group
    from scheduler.judge import liveness_peak, torch_tracker_peak
    from scheduler.rewritten import rewrite_baseline, robust_schedule
    from scheduler.verify import judge_graph

    gm = getattr(llama_graphs, kind)
    n_nodes = len(gm.graph.nodes)
    with fake_process_group(4):
        budget = judge_graph(rewrite_baseline(gm, "fsdp2")).max_peak_bytes
        result = robust_schedule(gm, budget, time_limit_s=3.0)
    assert len(gm.graph.nodes) == n_nodes  # the input graph is not modified
    assert liveness_peak(result.gm) <= budget and torch_tracker_peak(result.gm) <= budget
    assert result.chosen in result.fitting and "fsdp2" in result.fitting
    # one solve under each base model and three blends of them (compromises), and the best of
    # them polished on the worst case across the family (solvers/minimax.py) when a move gains
    solved = set(result.solved_under.values())
    assert {"analytic", "torch", "blend 25%", "blend 50%", "blend 75%"} <= solved
    assert solved <= {"analytic", "torch", "blend 25%", "blend 50%", "blend 75%", "minimax"}
    worst = result.worst_regret()
    # the models disagree on this tiny graph (torch's estimator is latency-bound): the solve
    # under one model regrets 40 % or more under the other's; the robust pick regrets no more
    # than either single-model solve
    assert max(worst["fsdp-sched[analytic]"], worst["fsdp-sched[torch]"]) > 0.4
    assert worst[result.chosen] <= min(worst["fsdp-sched[analytic]"], worst["fsdp-sched[torch]"])
    table = result.step_ms_by_model()
    assert len(table) == 6
    for label in table:  # the robust pick regrets no more than what any one model would pick
        assert worst[result.chosen] <= worst[single_model_pick(table, label)] + 1e-12
    assert result.chosen in result.table()


def test_solvers_own_schedules_join_when_no_candidate_has_them(llama_graphs):
    """robust_schedule's candidates ``<product>:solved`` / ``<product>:unpolished``: the schedules
    a product's solver returned (``SOLVED_KEY`` of its graph) that no candidate has, judged under
    every model given; one equal to a candidate's is not repeated."""
    from models.capture import fake_process_group
    from scheduler.api import SOLVED_KEY
    from scheduler.dag import export_dag
    from scheduler.rewritten import solver_candidates
    from scheduler.verify import Candidate
    from solvers import Problem, solve

    gm = llama_graphs.backward
    models = {"analytic": "analytic", "torch": "torch"}
    with fake_process_group(4):
        problem = Problem.from_dag(export_dag(gm))
        installed = solve(problem, solver="fsdp2").schedule
        other = solve(problem, solver="simplefsdp").schedule
        assert installed.digest() != other.digest()
        product = Candidate(name="fsdp-sched[analytic]", schedule=installed,
                            graph=SimpleNamespace(meta={SOLVED_KEY: (installed, other)}))
        out = solver_candidates(gm, problem, [product], models)
    assert [(p.name, c.name) for p, c in out] == [("fsdp-sched[analytic]", "fsdp-sched[analytic]:unpolished")]
    own = out[0][1]
    assert own.schedule.digest() == other.digest()
    assert own.figures is not None and set(own.figures.step_ms) == set(models)


def test_regrouped_start_joins_the_written_candidates(llama_graphs):
    """``minimax_candidates`` with ``regroup_starts``: a regular bucketing of the best start
    (here the traced order, the only candidate, so every regret is measured against it) is
    polished, written back and judged under every model, and joins as ``<name>-regrouped``:
    it fits the FSDP2-like peak by all three counts and is faster than the traced order under
    both models. Without ``regroup_starts`` and with no candidate start nothing is polished."""
    from models.capture import fake_process_group
    from scheduler.dag import export_dag
    from scheduler.rewritten import rewrite_baseline
    from scheduler.verify import judge_candidates, judge_graph, minimax_candidates, schedule_candidate
    from solvers import Problem
    from solvers.minimax import MinimaxConfig

    gm = llama_graphs.forward
    models = {"analytic": "analytic", "torch": "torch"}
    with fake_process_group(4):
        budget = judge_graph(rewrite_baseline(gm, "fsdp2")).max_peak_bytes
        problem = Problem.from_dag(export_dag(gm))
        traced = schedule_candidate(problem, "traced", problem.traced_schedule())
        judge_candidates(gm, problem, [traced], cost_model="analytic", other_cost_models={"torch": "torch"},
                         label="analytic")
        assert minimax_candidates(gm, problem, [traced], budget, models, config=MinimaxConfig(), starts=0) == []
        out = minimax_candidates(gm, problem, [traced], budget, models, name="mm", starts=0,
                                 config=MinimaxConfig(max_simulations=2000, regroup_starts=1))
    assert [c.name for c in out][:1] == ["mm-regrouped"]
    f = out[0].figures
    assert f.max_peak_bytes <= budget
    assert all(f.step_ms[label] < traced.figures.step_ms[label] for label in models)


def test_refined_start_is_polished_longer(llama_graphs, monkeypatch):
    """With ``regroup_refine``, the best bucketing refined to single collectives is polished
    after the one in blocks, with ``regroup_work`` times the simulations of every other start."""
    from models.capture import fake_process_group
    from scheduler import verify
    from scheduler.dag import export_dag
    from scheduler.rewritten import rewrite_baseline
    from solvers import Problem
    from solvers.minimax import MinimaxConfig

    limits = []

    def recording(problems, start, reference, budget, config, **kw):
        limits.append(config.max_simulations)
        return polish(problems, start, reference, budget, config, **kw)

    polish = verify.polish
    monkeypatch.setattr(verify, "polish", recording)
    gm = llama_graphs.forward
    models = {"analytic": "analytic", "torch": "torch"}
    with fake_process_group(4):
        budget = verify.judge_graph(rewrite_baseline(gm, "fsdp2")).max_peak_bytes
        problem = Problem.from_dag(export_dag(gm))
        traced = verify.schedule_candidate(problem, "traced", problem.traced_schedule())
        verify.judge_candidates(gm, problem, [traced], cost_model="analytic", other_cost_models={"torch": "torch"},
                                label="analytic")
        verify.minimax_candidates(gm, problem, [traced], budget, models, name="mm", starts=0,
                                  config=MinimaxConfig(max_simulations=300, regroup_starts=1, regroup_refine=1,
                                                       regroup_work=3))
    assert limits[0] == 300 and 900 in limits[1:]


def test_polished_graph_over_by_a_written_count_is_polished_again(llama_graphs, monkeypatch):
    """``minimax_candidates``' tightened rounds: torch's tracker made to count 16 KiB above the
    liveness count on any graph with a merged all-gather, the first polished graph (from
    the traced order, no merges, so no margin) is over the budget by it; the polish runs again
    under the budget less that excess, and that round (``-tightened``) fits by all three
    counts."""
    from models.capture import fake_process_group
    from scheduler import verify
    from scheduler.dag import export_dag
    from scheduler.judge import liveness_peak
    from scheduler.rewritten import rewrite_baseline
    from scheduler.verify import judge_candidates, judge_graph, minimax_candidates, schedule_candidate
    from solvers import Problem
    from solvers.minimax import MinimaxConfig

    def merged(gm):
        return sum(1 for n in gm.graph.nodes if "all_gather_into_tensor_out" in str(n.target))

    gm = llama_graphs.backward
    models = {"analytic": "analytic", "torch": "torch"}
    with fake_process_group(4):
        budget = judge_graph(rewrite_baseline(gm, "fsdp2")).max_peak_bytes
        monkeypatch.setattr(verify, "torch_tracker_peak", lambda gm: liveness_peak(gm) + (16 << 10) * bool(merged(gm)))
        problem = Problem.from_dag(export_dag(gm))
        traced = schedule_candidate(problem, "traced", problem.traced_schedule())
        judge_candidates(gm, problem, [traced], cost_model="analytic", other_cost_models={"torch": "torch"},
                         label="analytic")
        out = minimax_candidates(gm, problem, [traced], budget, models, name="mm", starts=0,
                                 config=MinimaxConfig(max_simulations=2000, regroup_starts=1))
    names = [c.name for c in out]
    assert names[:2] == ["mm-regrouped", "mm-regrouped-tightened"], names
    assert out[0].figures.max_peak_bytes > budget >= out[0].predicted_peak_bytes
    assert out[1].figures.max_peak_bytes <= budget


# --------------------------------------------------------------------------------------------
# optimize_schedule(robust=True): the criterion inside the closed loop
# --------------------------------------------------------------------------------------------
def test_optimize_schedule_robust_fits_and_regrets_no_more_than_the_fastest(llama_graphs):
    """llama3-debug backward at the FSDP2-like peak: the robust pick's written graph holds the
    budget by the liveness count and torch's tracker, the report names the criterion and each
    candidate's worst regret over the family, and the pick regrets no more over the family
    than the graph robust=False writes (judged under the family here, against the same pool)."""
    import copy

    from models.capture import fake_process_group
    from scheduler import optimize_schedule
    from scheduler.api import REPORT_KEY
    from scheduler.judge import liveness_peak, torch_tracker_peak
    from scheduler.rewritten import rewrite_baseline
    from scheduler.verify import judge_graph

    gm = llama_graphs.backward
    family = cost_model_family()
    with fake_process_group(4):
        budget = judge_graph(rewrite_baseline(gm, "fsdp2")).max_peak_bytes
        fastest, robust = copy.deepcopy(gm), copy.deepcopy(gm)
        optimize_schedule(fastest, budget, time_limit_s=3, agree=False)
        optimize_schedule(robust, budget, time_limit_s=3, agree=False, robust=True)
        fastest_steps = judge_graph(fastest, "analytic", other_cost_models=family).step_ms
    report = robust.meta[REPORT_KEY]
    assert liveness_peak(robust) <= budget and torch_tracker_peak(robust) <= budget
    assert report.criterion.startswith("robust") and "chosen by: robust" in str(report)
    rows = {c["name"]: c for c in report.candidates}
    # solved under blends of the two base models too (compromises), each judged like the others,
    # and the best polished on the worst case across the family
    assert {f"cpsat[blend {w}%]" for w in (25, 50, 75)} & set(rows)
    # the polish counts torch's tracker rules too (a merged all-gather's out= result beside its
    # buffer), so its first graph fits by all three counts, within 32 B of the budget here (it
    # used to be 16 KiB over by the tracker and needed a tightened round), and regrets less than
    # the solve under the analytic model
    polished = rows["cpsat[minimax]"]
    assert max(polished["peak_bytes"], polished["liveness_peak_bytes"], polished["tracker_peak_bytes"]) <= budget
    assert polished["tracker_peak_bytes"] > polished["liveness_peak_bytes"]
    assert not any("-tightened" in name for name in rows)
    assert polished["worst_regret"] < rows["cpsat"]["worst_regret"]
    pool = {n: c["step_ms"] for n, c in rows.items() if c["worst_regret"] is not None}
    assert set(pool[report.chosen_candidate]) == set(family)
    assert rows[report.chosen_candidate]["worst_regret"] == min(c["worst_regret"] for c in rows.values()
                                                                if c["worst_regret"] is not None)
    best = {label: min([t[label] for t in pool.values()] + [fastest_steps[label]]) for label in family}

    def worst(steps):
        return max(steps[label] / best[label] - 1 for label in family)

    assert worst(pool[report.chosen_candidate]) <= worst(fastest_steps) + 1e-9
    assert fastest.meta[REPORT_KEY].criterion.startswith("fastest")


def test_robust_needs_verify(llama_graphs):
    from scheduler import optimize_schedule

    n_nodes = len(llama_graphs.forward.graph.nodes)
    with pytest.raises(ValueError, match="needs verify=True"):
        optimize_schedule(llama_graphs.forward, robust=True, verify=False)
    assert len(llama_graphs.forward.graph.nodes) == n_nodes


def test_inductor_pass_forwards_robust_as_an_option():
    """The pass forwards its options to optimize_schedule; robust enters its cache key."""
    pytest.importorskip("torch._inductor.custom_graph_pass")
    from scheduler.compile import inductor_post_grad_pass

    assert inductor_post_grad_pass(robust=True).uuid() != inductor_post_grad_pass().uuid()
    assert '"robust": true' in inductor_post_grad_pass(robust=True).uuid()


def test_blend_cost_model_is_the_mean_of_its_models():
    from scheduler.costs import AnalyticCostModel, BlendCostModel, Cluster, GroupInfo

    slow, fast = AnalyticCostModel(Cluster(intra_node_gbps=100)), AnalyticCostModel(Cluster(intra_node_gbps=400))
    blend = BlendCostModel([slow, fast])
    group = GroupInfo(name="0", size=8, ranks=tuple(range(8)))
    for b in (1 << 20, 1 << 26):
        expect = (slow.collective_ms("all_gather", b, group) + fast.collective_ms("all_gather", b, group)) / 2
        assert blend.collective_ms("all_gather", b, group) == pytest.approx(expect)
        assert fast.collective_ms("all_gather", b, group) < expect < slow.collective_ms("all_gather", b, group)
    attrs = {"flops": 1e12, "bytes_accessed": 1e9, "dtype": "bfloat16"}
    assert blend.compute_ms(attrs) == pytest.approx(slow.compute_ms(attrs))  # same GPU: same compute
    leaning = BlendCostModel([slow, fast], (3, 1))
    big = 1 << 26
    expect = 0.75 * slow.collective_ms("all_gather", big, group) + 0.25 * fast.collective_ms("all_gather", big, group)
    assert leaning.collective_ms("all_gather", 1 << 26, group) == pytest.approx(expect)
    with pytest.raises(ValueError, match="at least one"):
        BlendCostModel([])
    with pytest.raises(ValueError, match="one non-negative weight per model"):
        BlendCostModel([slow, fast], (1.0,))
