"""Another order of the graph's compute: a schedule in torch's order is one of the same graph.

torch's overlap scheduler runs compute nodes early (a collective's input, to issue it early).
:func:`solvers.core.order.in_order` is a problem over another order of the DAG's nodes and
:func:`solvers.core.order.problem_of` the problem a schedule's own order defines: an order that
runs a node before its input is refused; a schedule in torch's order validates, simulates as
torch's own graph does, writes back and computes the same.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from scheduler import SolverOptions, optimize_schedule  # noqa: E402
from scheduler import api  # noqa: E402
from scheduler.export.dag import export_dag  # noqa: E402
from scheduler.torch_overlap import torch_overlap_schedule, torch_starts  # noqa: E402
from solvers.core import Problem, ScheduleError, simulate, validate_schedule  # noqa: E402
from solvers.core.order import in_order, node_order, problem_of  # noqa: E402
from test_writeback import COSTS, gloo_group, toy_graph  # noqa: E402


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def _llama_backward():
    from conftest import FAKE_WORLD, capture_llama_debug

    return FAKE_WORLD, copy.deepcopy(capture_llama_debug().backward)  # the capture is shared: rewrite a copy


def test_an_order_that_runs_a_node_before_its_input_is_refused(pg):
    problem = Problem.from_dag(export_dag(toy_graph(pg, 1), cost_model=COSTS))
    order = list(problem.dag.graph["order"])
    mm = next(i for i, n in enumerate(order) if problem.dag.nodes[n]["kind"] == "compute"
              and any(problem.dag.nodes[u]["kind"] == "compute" for u in problem.dag.predecessors(n)))
    reader, producer = order[mm], next(u for u in problem.dag.predecessors(order[mm]))
    swapped = list(order)
    i, j = swapped.index(producer), swapped.index(reader)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=reader):
        in_order(problem, swapped)
    with pytest.raises(ScheduleError, match="once"):
        in_order(problem, order[:-1])
    assert in_order(problem, order) is problem
    assert problem_of(problem, problem.traced_schedule()) is problem


def test_torchs_schedule_in_its_own_order_is_torchs_graph():
    """On the llama debug backward, torch runs compute nodes out of their traced order: over the
    traced order its schedule needs repairs, over its own order it is read back exactly (the
    simulator prices it as torch's own written graph)."""
    from models.capture import fake_process_group

    world, gm = _llama_backward()
    with fake_process_group(world):
        problem = Problem.from_dag(export_dag(gm, cost_model="analytic"))
        run = torch_starts(gm, problem, ["torch-overlap"])[0]
        assert run.order is not None and run.schedule_in_order is not None
        own = problem_of(problem, run.schedule_in_order)
        assert own is not problem and own.seq == node_order(run.schedule_in_order) != problem.seq
        read_back = validate_schedule(own, run.schedule_in_order).step_ms
        written = torch_overlap_schedule(copy.deepcopy(gm), inplace=True)
        torchs = Problem.from_dag(export_dag(written, cost_model="analytic"))
        torchs_own = simulate(torchs.dag, torchs.traced_schedule(), problem=torchs).step_ms
        repaired = simulate(problem.dag, run.schedule, problem=problem).step_ms
    assert read_back == pytest.approx(torchs_own, rel=1e-9)
    assert repaired >= read_back - 1e-9


def test_the_search_in_torchs_order_installs_that_order(monkeypatch):
    """With ``compute_order="torch"`` the installed graph runs its compute in the schedule's
    order, torch's (that it computes the same is checked on gloo ranks:
    ``tests/test_numerics_gloo.py``, case ``fp32_reshard_torch_order``)."""
    from models.capture import fake_process_group

    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    world, gm = _llama_backward()
    with fake_process_group(world):
        traced = Problem.from_dag(export_dag(gm, cost_model="analytic"))
        optimize_schedule(gm, None, cost_model="analytic",
                          solver=SolverOptions(work_limit=0.5, compute_order="torch"))
    report, schedule = gm.meta[api.REPORT_KEY], gm.meta[api.SCHEDULE_KEY]
    ran = tuple(n.name for n in gm.graph.nodes if n.name in traced.pos)
    assert ran == node_order(schedule) != traced.seq
    assert report.compute_order == "torch"


def test_a_search_in_torchs_order_that_fails_leaves_the_traced_orders_answer(monkeypatch):
    """torch's order is a second chance: when its search fails (here a schedule hook raises on
    its problems only), the traced order's answer is installed, never an error."""
    from models.capture import fake_process_group

    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    world, gm = _llama_backward()
    with fake_process_group(world):
        traced = Problem.from_dag(export_dag(gm, cost_model="analytic"))

        def hook(problem, schedule):
            if problem.seq != traced.seq:
                raise RuntimeError("no schedule in torch's order")
            return None

        optimize_schedule(gm, None, cost_model="analytic",
                          solver=SolverOptions(work_limit=0.5, compute_order="choose", schedule_hook=hook))
    report, schedule = gm.meta[api.REPORT_KEY], gm.meta[api.SCHEDULE_KEY]
    assert report.compute_order == "traced" and node_order(schedule) == traced.seq


def test_starts_runs_the_later_stages_in_one_order_and_answers_as_that_order_alone(monkeypatch):
    """With ``compute_order="choose"`` the starts run in both orders and the later stages in the
    one whose starts are better: the installed schedule is the one that order's search gives
    alone, it is no slower than torch's own schedule (read back over its own order), and its
    stage table holds one polish."""
    from models.capture import fake_process_group

    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    world, gm = _llama_backward()
    answers = {}
    with fake_process_group(world):
        for order in ("starts", "choose", "traced", "torch"):
            g = copy.deepcopy(gm)
            optimize_schedule(g, None, cost_model="analytic", solver=SolverOptions(work_limit=0.5, compute_order=order))
            answers[order] = (g.meta[api.REPORT_KEY], g.meta[api.SCHEDULE_KEY])
        traced = Problem.from_dag(export_dag(gm, cost_model="analytic"))
        run = torch_starts(gm, traced, ["torch-overlap"])[0]
        own = problem_of(traced, run.schedule_in_order)
        torchs = simulate(own.dag, run.schedule_in_order, problem=own).step_ms
    report, schedule = answers["starts"]
    alone_report, alone = answers[report.compute_order]
    assert schedule.digest() == alone.digest()
    assert report.search_step_ms == alone_report.search_step_ms
    assert report.search_step_ms["analytic"] <= torchs * (1 + 1e-9)
    assert [s["name"] for s in report.stages].count("polish") == 1
    assert [s["name"] for s in report.stages].count("starts") == 2
    chosen_report, chosen = answers["choose"]
    assert chosen.digest() == answers[chosen_report.compute_order][1].digest()
    assert [s["name"] for s in chosen_report.stages].count("polish") == 2


def test_with_no_budget_an_order_whose_starts_trail_stops_at_its_starts(monkeypatch):
    """With ``compute_order="choose"`` and no budget, an order whose best start trails the
    other's by more than ``order_margin`` (0 here: by anything) is searched no further than its
    starts: the installed schedule is the one ``"starts"`` gives, with one polish, and a note
    names the order left. Under a budget, even one no schedule comes near, both orders are
    polished (the polish can close any gap there)."""
    from models.capture import fake_process_group

    from conftest import FAKE_WORLD as world, capture_llama_debug

    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    # parameters kept after the forward: torch's order's best start trails the traced one's a little
    gm = copy.deepcopy(capture_llama_debug(reshard_after_forward=False).backward)
    runs = {}
    with fake_process_group(world):
        for name, order, margin, budget in (("starts", "starts", 0.0, None), ("margin", "choose", 0.0, None),
                                            ("budget", "choose", 0.0, 1 << 50)):
            g = copy.deepcopy(gm)
            optimize_schedule(g, budget, cost_model="analytic",
                              solver=SolverOptions(work_limit=0.5, compute_order=order, order_margin=margin))
            runs[name] = (g.meta[api.REPORT_KEY], g.meta[api.SCHEDULE_KEY])
    (starts_report, starts), (report, schedule) = runs["starts"], runs["margin"]
    assert schedule.digest() == starts.digest()
    assert report.search_step_ms == starts_report.search_step_ms
    assert [s["name"] for s in report.stages].count("polish") == 1
    assert any("searched no further than its starts" in n for n in report.notes)
    assert [s["name"] for s in runs["budget"][0].stages].count("polish") == 2


def test_the_order_is_chosen_on_its_starts_by_the_regret_alone():
    """On the starts, a traced-order start a little slower than torch's own schedule under one
    strict model but of smaller worst-case regret is the order polished (the polish may pass
    torch's schedule; the answer is checked against it when finished), as on autoparallel's
    published DeepSeek-V3 backward, whose traced start loses a little under the analytic model,
    gains much under torch's, and ends faster than torch's schedule under both."""
    from scheduler.orders import better_order
    from solvers.core import SolveResult, SolveStatus

    def result(**steps):
        return SolveResult(None, SolveStatus.FEASIBLE, "search", steps["analytic"], 0.0, 0.0, 0,
                           step_ms_by_model=steps)

    traced = ("traced", {"analytic": None, "torch": None}, [], result(analytic=247.5, torch=191.3))
    torch_order = ("torch", {"analytic": None, "torch": None}, [("torch-overlap", None)],
                   result(analytic=247.3, torch=200.0))
    solver = SolverOptions()
    assert better_order([traced, torch_order], solver, on_starts=True) == (0, [])
    k, notes = better_order([torch_order, traced], solver, on_starts=True)
    assert k == 1 and notes == []
    # the torch order's start of smaller regret is taken, and said so
    faster = ("torch", {"analytic": None, "torch": None}, [("torch-overlap", None)],
              result(analytic=240.0, torch=185.0))
    k, notes = better_order([traced, faster], solver, on_starts=True)
    assert k == 1 and len(notes) == 1


def test_an_order_no_schedule_of_which_fits_is_left_out_by_its_least_peak(monkeypatch):
    """At the traced peak of a llama3-8b forward no schedule fits in torch's order (it runs the
    inputs of all-gathers early): its least peak is over the budget, so its starts are not run;
    the search goes on in the traced order, and the report's stage table holds both orders'
    starts, the one left out with no evaluation. The bound is sound: torch's order's own starts,
    run at that budget, are all refused, the smallest of their peaks no lower than it."""
    from models import capture_fsdp_graphs
    from models.capture import fake_process_group
    from scheduler.check.written import judge_graph
    from scheduler.orders import least_peak_over
    from solvers.core import InfeasibleBudgetError
    from solvers.search import begin

    monkeypatch.setenv("FSDP_SCHED_CACHE", "0")
    with fake_process_group(64):
        gm = capture_fsdp_graphs("llama3-8b", world_size=64, n_layers=2).forward
        budget = judge_graph(gm).max_peak_bytes
        traced = Problem.from_dag(export_dag(gm))
        in_torch = in_order(traced, torch_starts(gm, traced, ["torch-overlap"])[0].order)
        written = copy.deepcopy(gm)
        optimize_schedule(written, budget, solver=SolverOptions(compute_order="choose"))
    least, _ = least_peak_over(in_torch)
    assert least > budget >= least_peak_over(traced)[0]
    with pytest.raises(InfeasibleBudgetError) as refused:
        begin({"analytic": in_torch}, budget)
    assert refused.value.min_peak_bytes >= least
    report = written.meta[api.REPORT_KEY]
    starts = [s for s in report.stages if s["name"] == "starts"]
    assert report.compute_order == "traced" and len(starts) == 2
    assert [(s["step_ms"] is None, s["evaluations"]) for s in starts if s["step_ms"] is None] == [(True, 0)]
    assert judge_graph(written).max_peak_bytes <= budget
