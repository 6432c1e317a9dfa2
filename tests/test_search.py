"""The search's stages in solvers/search.py: starts, CP-SAT windows, polish.

What is asserted is what a caller relies on, read from the result's structured records
(:class:`solvers.core.schedule.StageRecord`), never from its notes: which stages ran and how much
work each was charged; that no start, alternative or answer is over the budget; that the answer
is never slower than a heuristic that fits, nor than a start it was given; that with several
cost models the objective is the worst-case regret; that a window's proposal is kept only when
it evaluates better and fits (a stub stands in for the window backend there); determinism; and
that a budget no start reaches is refused with a peak that works as a budget.

Graphs: synthetic FSDP DAGs (scheduler/synthetic.py). The backward graph with
reshard-after-forward (4 layers, 8 ranks, budget = its traced peak) is the one where memory
binds: the heuristics that prefetch are over the budget, and CP-SAT's windows gain over the
starts there.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time

import pytest

from scheduler.costs.hardware import Cluster
from scheduler.whatif.synthetic import make_fsdp_dag
from solvers import InfeasibleBudgetError, Problem, Schedule, ScheduleError, SolveStatus, solve, solve_budgets
from solvers.core.simulator import simulate
from solvers.core.validator import validate_schedule
from solvers.cpsat import CpSatBackend
from solvers.heuristics import HEURISTICS, fsdp2_schedule
from solvers.objective import Ordering
from solvers.search import Objective, SearchConfig, search
from solvers.objective import regret
from solvers.starts import fit_by_delays, starts

#: one window frees every collective of these graphs: one backend call, whatever the work left
ONE_WINDOW = SearchConfig(window_members=1000, window_sweeps=1, window_share=1.0)


def _backward(n_layers: int = 4) -> Problem:
    return Problem.from_dag(make_fsdp_dag(n_layers=n_layers, graph_kind="backward", reshard_after_forward=True,
                                          seed=1))


def _peak(p: Problem, schedule: Schedule) -> int:
    """The execution model's peak: the memory the written graph holds, what a budget bounds."""
    return simulate(p.dag, schedule, problem=p).peak_bytes


def _step(p: Problem, schedule: Schedule) -> float:
    return simulate(p.dag, schedule, problem=p).step_ms


@pytest.fixture(scope="module")
def binding():
    """The backward graph, 1.05x its traced peak as the budget (binding: the fastest starts do
    not fit), and the search's result there."""
    p = _backward()
    budget = int(1.05 * _peak(p, p.traced_schedule()))
    result = search({"analytic": p}, budget, backend=CpSatBackend(), work_limit=2.0)
    return p, budget, result


# --------------------------------------------------------------------------------------------
# the stages as recorded
# --------------------------------------------------------------------------------------------
def test_stages_are_recorded_with_their_work_and_gains(binding):
    """starts, windows, polish in that order, then the last stages where they kept a move; each
    stage's step time is the best after it and its gain what it took off the stage before; the
    starts are a fixed set, charged no work; the windows' work is whole windows of
    ``window_work``; windows and polish share the limit, the last stages work outside it."""
    p, budget, result = binding
    config = SearchConfig()
    assert [s.name for s in result.stages[:3]] == ["starts", "windows", "polish"]
    assert {s.name for s in result.stages[3:]} <= {"links", "ahead"}
    starts_, windows_, polish_ = result.stages[:3]
    assert starts_.gained_ms == 0.0 and starts_.evaluations >= len(HEURISTICS) and starts_.work == 0.0
    for before, stage in zip(result.stages, result.stages[1:]):
        assert stage.step_ms <= before.step_ms
        assert stage.gained_ms == pytest.approx(before.step_ms - stage.step_ms)
        assert stage.wall_s >= 0 and (stage.work > 0) == (stage.name in ("windows", "polish"))
    assert result.stages[-1].step_ms == pytest.approx(result.objective_ms)
    # on this graph CP-SAT's windows gain over the best start (the reason the stage exists)
    assert windows_.gained_ms > 0
    solved = windows_.work / config.window_work
    assert solved == pytest.approx(round(solved)) and windows_.work <= 2.0 * config.window_share + 1e-9
    assert windows_.work + polish_.work <= 2.0 * 1.01
    assert result.status == SolveStatus.FEASIBLE and result.solver == "search"
    assert result.objective_ms == pytest.approx(_step(p, result.schedule))
    assert result.peak_bytes == _peak(p, result.schedule)


def test_a_limit_too_small_for_a_stage_skips_it():
    """The starts always run; without work left (or without a backend, or with no window share)
    the windows do not, and neither does the polish without work."""
    p = _backward(2)
    only_starts = search({"m": p}, None, backend=CpSatBackend(), work_limit=1e-6)
    assert [s.name for s in only_starts.stages] == ["starts"]
    assert only_starts.status == SolveStatus.HEURISTIC
    no_backend = search({"m": p}, None, backend=None, work_limit=1.0)
    assert [s.name for s in no_backend.stages] == ["starts", "polish"]
    no_share = search({"m": p}, None, backend=CpSatBackend(), work_limit=1.0,
                      config=SearchConfig(window_share=0.0))
    assert [s.name for s in no_share.stages] == ["starts", "polish"]


def test_starts_only_runs_the_first_stage_alone():
    """``starts_only`` stops after the starts whatever the limit: the answer is the best start
    that fits, the one a limit too small for any other stage also gives."""
    p = _backward(2)
    only = search({"m": p}, None, backend=CpSatBackend(), work_limit=1.0, starts_only=True)
    assert [s.name for s in only.stages] == ["starts"]
    assert only.status == SolveStatus.HEURISTIC
    tiny = search({"m": p}, None, backend=CpSatBackend(), work_limit=1e-6)
    assert only.schedule.digest() == tiny.schedule.digest()


# --------------------------------------------------------------------------------------------
# the budget and the starts
# --------------------------------------------------------------------------------------------
def test_no_start_alternative_or_answer_is_over_the_budget(binding):
    """At the traced peak the prefetching heuristics are over the budget (the premise); the
    answer and every alternative (the next best starts, the API's fallbacks) fit by both
    counts and are valid schedules."""
    p, budget, result = binding
    over = [name for name, fn in HEURISTICS.items() if _peak(p, fn(p, mem_budget_bytes=None).schedule) > budget]
    assert over, "the budget does not bind on this graph"
    assert result.alternatives
    for schedule in (result.schedule, *result.alternatives):
        validate_schedule(p, schedule, mem_budget_bytes=budget)
        assert _peak(p, schedule) <= budget
    digests = [s.digest() for s in (result.schedule, *result.alternatives)]
    assert len(set(digests)) == len(digests)


def test_starts_are_ranked_and_all_fit(binding):
    """``starts`` returns only schedules that fit, best first, and the smallest peak of every
    start tried (fitting or not)."""
    p, budget, _ = binding
    objective = Objective({"m": p}, budget)
    found, smallest = starts(objective, SearchConfig())
    assert found and all(objective.fits(e) for e in found)
    keys = [objective.key(e) for e in found]
    assert keys == sorted(keys)
    assert smallest <= min(e.peak_bytes for e in found)


@pytest.mark.parametrize("fraction", [1.0, 1.1, None], ids=["traced-peak", "1.1x", "no-budget"])
def test_never_slower_than_a_heuristic_that_fits(fraction):
    """Whatever the budget, every heuristic (run as it is, and under the budget) whose schedule
    fits is at least as slow as the answer."""
    p = _backward()
    budget = None if fraction is None else int(_peak(p, p.traced_schedule()) * fraction)
    result = search({"m": p}, budget, backend=CpSatBackend(), work_limit=1.0)
    compared = 0
    for name, fn in HEURISTICS.items():
        for given in (None, budget):
            try:
                schedule = fn(p, mem_budget_bytes=given).schedule
            except InfeasibleBudgetError:
                continue
            if budget is None or _peak(p, schedule) <= budget:
                compared += 1
                assert result.objective_ms <= _step(p, schedule) + 1e-9, (name, given)
    assert compared >= 2


def test_regular_bucketings_beat_one_bucket_per_block_where_communication_dominates():
    """A forward with large parameters and little compute (64 ranks): a bucket per block pays
    each collective's fixed cost once per block; the starts' regular bucketings of several
    blocks are faster, so the starts stage alone beats FSDP2-like."""
    dag = make_fsdp_dag(n_layers=8, params_per_layer=3, param_bytes=4 << 20, world_size=64,
                        compute_ms_per_node=0.05, graph_kind="forward")
    for _, a in dag.nodes(data=True):  # blocks as the export infers them from the FQNs
        if a["kind"] == "collective":
            parts = a["fqns"][0].split(".")
            a["block"] = int(parts[1]) if parts[0] == "layers" else None
    p = Problem.from_dag(dag)
    result = search({"m": p}, None, work_limit=1e-6)
    assert [s.name for s in result.stages] == ["starts"]
    per_block = fsdp2_schedule(p)
    assert result.objective_ms < _step(p, per_block) - 1e-6
    assert len(result.schedule.buckets) < len(per_block.buckets)


def test_deeper_aheads_only_where_they_fit():
    """Regular bucketings issued four buckets ahead (``start_deep_aheads``) are starts for every
    bucketing without a budget; under a budget only where they fit and the same bucketing two
    ahead fits too; they are never tried under a budget that binds (1.155x the traced peak,
    where the starts moved under the budget are the best ones: without the rule, the deep
    starts just over it crowded them out and the best start was the traced order)."""
    p = _backward()
    traced = _peak(p, p.traced_schedule())

    def regular(budget):
        objective = Objective({"m": p}, budget)
        found, _ = starts(objective, SearchConfig())
        return objective, {e.name: e for e in found if e.name.startswith("regular")}

    _, free = regular(None)
    two = [n for n in free if n.endswith(", 2 ahead")]
    assert two and all(n.replace(", 2 ahead", ", 4 ahead") in free for n in two)
    objective, roomy = regular(int(1.5 * traced))
    deep = [n for n in roomy if n.endswith(", 4 ahead")]
    assert deep and all(objective.fits(roomy[n]) and n.replace(", 4 ahead", ", 2 ahead") in roomy for n in deep)
    objective, tight = regular(int(1.155 * traced))
    assert tight and not any(", 4 ahead" in n for n in tight)
    assert min(objective.key(e) for e in tight.values()) < objective.key(objective.evaluate(p.traced_schedule()))
    with pytest.raises(ValueError, match="deeper than every start_aheads"):
        SearchConfig(start_aheads=(1, 4), start_deep_aheads=(4,))


def test_fit_by_delays_moves_a_start_just_over_the_budget_under_it():
    """FSDP2-like one byte over the budget: a move at its peak brings it under, a valid schedule
    still; far below its peak no few moves can."""
    p = _backward()
    start = fsdp2_schedule(p)
    peak = _peak(p, start)
    fitted = fit_by_delays(p, start, peak - 1)
    assert fitted is not None and fitted.digest() != start.digest()
    validate_schedule(p, fitted)
    assert _peak(p, fitted) <= peak - 1
    assert fit_by_delays(p, start, peak // 4, max_moves=3) is None


def test_extra_starts_bound_the_result(binding):
    """A start given in ``extra_starts`` is a candidate: with work for the starts only, the
    result is never slower than it; one over the budget is never the answer."""
    p, budget, good = binding
    quick = search({"m": p}, budget, work_limit=1e-6)
    assert good.objective_ms < quick.objective_ms  # the premise: the start is better than the starts
    res = search({"m": p}, budget, work_limit=1e-6, extra_starts=[good.schedule])
    assert res.objective_ms <= good.objective_ms + 1e-9
    unbounded = search({"m": p}, None, backend=CpSatBackend(), work_limit=1.0).schedule
    assert _peak(p, unbounded) > budget
    res = search({"m": p}, budget, work_limit=1e-6, extra_starts=[unbounded])
    assert _peak(p, res.schedule) <= budget


def test_registry_extra_starts_are_for_the_search_only(binding):
    p, budget, good = binding
    res = solve(p, solver="cpsat", mem_budget_bytes=budget, work_limit=0.1, extra_starts=[good.schedule])
    assert res.objective_ms <= good.objective_ms + 1e-9
    with pytest.raises(ValueError, match="exact solvers"):
        solve(p, solver="fsdp2", extra_starts=[good.schedule])


def test_a_larger_budget_never_gives_a_slower_step():
    """solve_budgets: budgets given out of order; the best at each smaller budget is a start at
    the larger ones, so the step time never grows with the budget."""
    p = _backward()
    peak = _peak(p, p.traced_schedule())
    budgets = [int(peak * 1.2), peak, None, int(peak * 1.05)]
    out = solve_budgets(p, budgets, work_limit=0.5)
    assert list(out) == budgets
    ordered = [out[b] for b in sorted(budgets, key=lambda b: (b is None, b or 0))]
    for smaller, larger in zip(ordered, ordered[1:]):
        assert larger.objective_ms <= smaller.objective_ms + 1e-9
    for b, r in out.items():
        assert b is None or r.peak_bytes <= b


# --------------------------------------------------------------------------------------------
# several cost models: the worst-case regret
# --------------------------------------------------------------------------------------------
def _two_clusters(kind: str, n_layers: int = 4) -> dict[str, Problem]:
    """One graph priced by two clusters: 400 GB/s between nodes (collectives hide behind
    compute) and 25 GB/s (communication dominates: fewer, larger buckets win)."""
    def priced(inter_node_gbps: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps)
        return Problem.from_dag(make_fsdp_dag(n_layers=n_layers, graph_kind=kind, world_size=64, seed=0,
                                              cluster=cluster))

    return {"fast": priced(400.0), "slow": priced(25.0)}


def test_several_models_minimise_the_worst_case_regret():
    """The objective is ``max_m t_m / R_m - 1`` with ``R_m`` the fastest start under model m:
    the answer regrets no more than any start that fits (each model's fastest included), and
    less than the fastest start under the primary model, which a step-time objective would
    keep."""
    problems = _two_clusters("forward")
    p = problems["fast"]
    budget = int(_peak(p, p.traced_schedule()) * 1.15)
    result = search(problems, budget, backend=CpSatBackend(), work_limit=2.0)
    objective = Objective(problems, budget)
    found, _ = starts(objective, SearchConfig())
    reference = objective.reference_ms
    assert set(reference) == {"fast", "slow"}

    def worst(schedule: Schedule) -> float:
        return max(_step(q, schedule) / reference[label] - 1 for label, q in problems.items())

    answer = worst(result.schedule)
    assert all(answer <= worst(e.schedule) + 1e-12 for e in found)
    fastest_primary = min(found, key=lambda e: e.step_ms("fast"))
    assert answer < worst(fastest_primary.schedule) - 1e-3
    assert result.objective_ms == pytest.approx(_step(p, result.schedule))  # reported under the primary
    for q in problems.values():
        assert _peak(q, result.schedule) <= budget


def test_objective_key_is_the_regret_then_its_sum():
    """Objective.key on hand-made evaluations (reference 10 ms and 20 ms; no strict model, so
    its first term is 0)."""
    problems = _two_clusters("forward", n_layers=1)
    objective = Objective(problems, None)
    objective.reference_ms = {"fast": 10.0, "slow": 20.0}

    def evaluated(fast_ms: float, slow_ms: float):
        sims = {"fast": _FakeSim(fast_ms), "slow": _FakeSim(slow_ms)}
        return dataclasses.replace(_evaluated_template(problems), sims=sims)

    a, b = evaluated(11.0, 20.0), evaluated(10.5, 21.0)  # regrets (10 %, 0) and (5 %, 5 %)
    assert objective.key(a) == pytest.approx((0.0, 0.10, 0.10))
    assert objective.key(b) == pytest.approx((0.0, 0.05, 0.10))
    assert objective.key(b) < objective.key(a)  # the faster under "fast" loses: its worst case is larger
    single = Objective({"fast": problems["fast"]}, None, strict_models=("fast",))
    assert single.key(dataclasses.replace(a, sims={"fast": _FakeSim(11.0)})) == (0.0, 11.0, 11.0)


def test_a_slowdown_under_a_strict_model_comes_before_any_regret():
    """Under a strict model, a schedule slower than the best baseline ranks after every one
    that is not, whatever their regrets; among those that lose, the smaller loss first; the
    other models keep the weighted penalty alone."""
    problems = _two_clusters("forward", n_layers=1)
    objective = Objective(problems, None, baseline_weight=10.0, strict_models=("fast",))
    objective.reference_ms = {"fast": 10.0, "slow": 20.0}
    objective.baseline_ms = {"fast": 10.4, "slow": 20.5}

    def evaluated(fast_ms: float, slow_ms: float):
        sims = {"fast": _FakeSim(fast_ms), "slow": _FakeSim(slow_ms)}
        return dataclasses.replace(_evaluated_template(problems), sims=sims)

    tiny_loss = evaluated(10.401, 20.0)  # 0.01 % slower than the baseline under the strict "fast"
    far = evaluated(10.0, 24.0)  # regret 20 % under "slow" (and 17 % slower than its baseline)
    assert objective.key(far) < objective.key(tiny_loss)
    assert objective.key(tiny_loss)[0] == pytest.approx(10.401 / 10.4 - 1)
    assert objective.key(evaluated(10.401, 20.0)) < objective.key(evaluated(10.45, 20.0))
    lenient = Objective(problems, None, baseline_weight=10.0)  # no strict model: the weight decides
    lenient.reference_ms, lenient.baseline_ms = objective.reference_ms, objective.baseline_ms
    assert lenient.key(tiny_loss) < lenient.key(far)


def test_the_polish_and_the_search_order_schedules_alike():
    """One order for every stage (:class:`Ordering`): the polish's comparison takes a score as
    lower exactly when the search's key ranks it first, with the strict models first or without;
    a difference of float noise is no gain."""
    problems = _two_clusters("forward", n_layers=1)
    objective = Objective(problems, None, baseline_weight=10.0, strict_models=("fast",))
    objective.reference_ms = {"fast": 10.0, "slow": 20.0}
    objective.baseline_ms = {"fast": 10.4, "slow": 20.5}
    steps = [{"fast": f, "slow": s} for f, s in [(10.0, 24.0), (10.401, 20.0), (10.45, 20.0), (10.5, 21.0),
                                                  (11.0, 20.0), (10.2, 20.6)]]
    for strict in (True, False):
        order = objective.ordering(strict)
        for a in steps:
            for b in steps:
                assert Ordering.improves((0, *order.key(a)), (0, *order.key(b))) == (order.key(a) < order.key(b))
    noisy = {"fast": 10.2 * (1 - 1e-15), "slow": 20.6}
    assert not Ordering.improves((0, *objective.ordering().key(noisy)), (0, *objective.ordering().key(steps[-1])))
    assert Ordering.improves((0, 1.0, 1.0, 1.0), (1, 0.0, 0.0, 0.0))  # fewer bytes over the budget first


def test_a_slowdown_against_the_best_baseline_weighs_more_than_regret():
    """With the baselines' steps known, a schedule slower than the best baseline under one model
    ranks after one a little further from the fastest start but no slower than any baseline,
    and a large gain under one model still outweighs a tiny loss under the other."""
    problems = _two_clusters("forward", n_layers=1)
    objective = Objective(problems, None)
    objective.reference_ms = {"fast": 10.0, "slow": 20.0}
    objective.baseline_ms = {"fast": 10.4, "slow": 30.0}
    objective.baseline_weight = 10.0

    def evaluated(fast_ms: float, slow_ms: float):
        sims = {"fast": _FakeSim(fast_ms), "slow": _FakeSim(slow_ms)}
        return dataclasses.replace(_evaluated_template(problems), sims=sims)

    over = evaluated(10.5, 20.0)  # regrets (5 %, 0), but ~1 % slower than the baseline under "fast"
    under = evaluated(10.4, 21.5)  # regrets (4 %, 7.5 %), no slower than any baseline
    assert objective.key(under) < objective.key(over)
    objective.baseline_weight = 0.0  # the regret alone prefers the other
    assert objective.key(over) < objective.key(under)
    objective.baseline_weight = 10.0
    tiny_loss = evaluated(10.401, 20.0)  # 0.01 % slower than the baseline under "fast", 0 regret under "slow"
    assert objective.key(tiny_loss) < objective.key(under)
    assert regret(10.5, 10.0, 10.4, 10.0) == pytest.approx(0.05 + 10 * (10.5 / 10.4 - 1))
    assert regret(10.3, 10.0, 10.4, 10.0) == pytest.approx(0.03)
    assert regret(10.5, 10.0, None, 10.0) == pytest.approx(0.05)


@pytest.mark.parametrize("kind,seed", [("forward", 0), ("backward", 1), ("backward", 2)])
def test_the_search_loses_no_more_to_a_baseline_under_a_strict_model_than_its_best_start(kind, seed):
    """At the traced peak, with both clusters strict: the answer is no slower than the best
    baseline under each, relative to it, by more than the start (baselines included) that loses
    least; so where one start loses nothing (a baseline fastest under both), the answer loses
    nothing either."""
    def priced(inter_node_gbps: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps)
        return Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind=kind, world_size=64, seed=seed,
                                              cluster=cluster))

    problems = {"fast": priced(400.0), "slow": priced(25.0)}
    p = problems["fast"]
    budget = simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes
    config = SearchConfig(strict_models=("fast", "slow"))
    objective = Objective(problems, budget, config.baseline_weight, config.strict_models)
    found, _ = starts(objective, config)
    least = min(objective.strict_loss(e) for e in found)
    result = search(problems, budget, backend=None, work_limit=1.0, config=config)
    answer = objective.evaluate(result.schedule)
    assert objective.strict_loss(answer) <= least + 1e-12
    assert answer.peak_bytes <= budget


def _strict_pair(kind: str, seed: int) -> tuple[dict[str, Problem], int, SearchConfig]:
    """One graph priced by two clusters, both strict, and its traced peak as the budget."""
    def priced(inter_node_gbps: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps)
        return Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind=kind, world_size=64, seed=seed,
                                              cluster=cluster))

    problems = {"fast": priced(400.0), "slow": priced(25.0)}
    p = problems["fast"]
    return problems, simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes, SearchConfig(
        strict_models=("fast", "slow"))


@pytest.mark.parametrize("seed", [1, 5])
def test_with_work_for_the_starts_only_the_answer_loses_no_more_than_its_best_start(seed):
    """Where the start of least regret loses to a baseline under a strict model and another
    start does not, a search with no work for the polish still answers with one that loses
    least: no stage ends worse (``Objective.key``) than a start it could keep."""
    problems, budget, config = _strict_pair("backward", seed)
    objective = Objective(problems, budget, config.baseline_weight, config.strict_models)
    found, _ = starts(objective, config)
    least = min(objective.strict_loss(e) for e in found)
    assert objective.strict_loss(found[0]) > least  # the premise: the first by regret loses
    result = search(problems, budget, work_limit=1e-6, config=config)
    assert objective.strict_loss(objective.evaluate(result.schedule)) <= least + 1e-12
    assert result.start in {e.name for e in found}


def test_given_baselines_are_starts_and_baselines():
    """A named schedule given as a baseline (as torch's pass read back is) is tried as a start
    and sets the best baseline's step under each model where it is the fastest that fits; the
    answer loses no more against those baselines than the start that loses least."""
    problems, budget, config = _strict_pair("backward", 1)
    plain = Objective(problems, budget, config.baseline_weight, config.strict_models)
    found, _ = starts(plain, config)
    good = min(found, key=lambda e: e.step_ms("slow")).schedule  # a regular bucketing, no baseline
    given = Objective(problems, budget, config.baseline_weight, config.strict_models)
    found, _ = starts(given, config, baselines=[("torch-overlap", good)])
    steps = {label: _step(q, good) for label, q in problems.items()}
    assert steps["slow"] < plain.baseline_ms["slow"]  # the premise: faster than every other baseline
    assert given.baseline_ms == {label: min(plain.baseline_ms[label], steps[label]) for label in problems}
    assert "torch-overlap" in {e.name for e in found}
    least = min(given.strict_loss(e) for e in found)
    result = search(problems, budget, work_limit=1e-6, config=config, baselines=[("torch-overlap", good)])
    assert given.strict_loss(given.evaluate(result.schedule)) <= least + 1e-12


@dataclasses.dataclass
class _FakeSim:
    step_ms: float
    max_peak_bytes: int = 0


def _evaluated_template(problems):
    p = next(iter(problems.values()))
    return Objective(problems, None).evaluate(p.traced_schedule())


def test_problems_of_different_graphs_are_refused():
    with pytest.raises(ValueError, match="not the same graph"):
        search({"a": _backward(2), "b": _backward(4)}, None)
    with pytest.raises(ValueError, match="at least one"):
        search({}, None)


# --------------------------------------------------------------------------------------------
# the windows stage, with a stub in place of the window backend
# --------------------------------------------------------------------------------------------
class _Proposes:
    """A window backend that proposes a fixed schedule (or raises) for every window."""

    name = "stub"

    def __init__(self, proposal: Schedule | None = None, error: Exception | None = None):
        self.proposal, self.error, self.calls = proposal, error, 0

    def solve_window(self, problem, mem_budget_bytes, schedule, free, limit_s, seed, num_workers, anchors):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.proposal


def _windows_stage(result):
    (stage,) = [s for s in result.stages if s.name == "windows"]
    return stage


def _stub_search(p, budget, backend):
    return search({"m": p}, budget, backend=backend, work_limit=2.0, config=ONE_WINDOW)


def test_window_stride_sets_how_far_apart_the_windows_start(binding):
    """One sweep solves a window every ``window_stride`` collectives where any is exposed (by
    default half a window, so that windows overlap): windows side by side are fewer, windows
    one collective apart more."""
    p, budget, _ = binding

    def windows_solved(stride):
        backend = _Proposes(None)
        search({"m": p}, budget, backend=backend, work_limit=2.0, config=SearchConfig(
            window_members=8, window_sweeps=1, window_share=1.0, window_work=0.01, window_stride=stride))
        return backend.calls

    halves = windows_solved(None)
    assert halves == windows_solved(4)
    assert windows_solved(1) > halves > windows_solved(8) >= 1


def test_windows_keep_a_proposal_that_is_better_and_fits(binding):
    """The premise of the two tests after it: a better schedule that fits, proposed by the
    stub, is taken (the stage's step time is the proposal's)."""
    p, budget, good = binding
    backend = _Proposes(good.schedule)
    result = _stub_search(p, budget, backend)
    stage = _windows_stage(result)
    assert backend.calls == 1
    assert stage.step_ms == pytest.approx(good.objective_ms) and stage.gained_ms > 0
    assert result.objective_ms <= good.objective_ms + 1e-9


def test_windows_never_take_a_worse_proposal(binding):
    """At 1.1x the traced peak the best start prefetches; the traced order, proposed for every
    window, fits and is slower: it is never taken."""
    p, budget, _ = binding
    budget = int(budget * 1.1)
    backend = _Proposes(p.traced_schedule())
    result = _stub_search(p, budget, backend)
    stage = _windows_stage(result)
    starts_ms = result.stages[0].step_ms
    assert backend.calls == 1 and _step(p, p.traced_schedule()) > starts_ms
    assert stage.gained_ms == 0.0 and stage.step_ms == starts_ms


def test_windows_never_take_a_faster_proposal_over_the_budget(binding):
    p, budget, _ = binding
    unbounded = search({"m": p}, None, backend=CpSatBackend(), work_limit=1.0)
    assert _peak(p, unbounded.schedule) > budget
    assert unbounded.objective_ms < binding[2].stages[0].step_ms  # faster than the best start that fits
    backend = _Proposes(unbounded.schedule)
    result = _stub_search(p, budget, backend)
    stage = _windows_stage(result)
    assert backend.calls >= 1
    assert stage.gained_ms == 0.0 and stage.step_ms == result.stages[0].step_ms
    assert _peak(p, result.schedule) <= budget


@pytest.mark.parametrize("proposal, error", [
    (None, ScheduleError("the window model is invalid")),
    ("malformed", None),
], ids=["raises", "malformed"])
def test_a_failing_window_is_skipped_not_fatal(binding, proposal, error):
    """A window whose backend raises, or proposes a schedule that is not one of the graph, is
    skipped: the search still answers with a schedule that fits."""
    p, budget, _ = binding
    if proposal == "malformed":
        traced = p.traced_schedule()
        proposal = Schedule(traced.buckets[:-1], traced.steps)
    backend = _Proposes(proposal, error)
    result = _stub_search(p, budget, backend)
    assert backend.calls >= 1 and _windows_stage(result).gained_ms == 0.0
    validate_schedule(p, result.schedule, mem_budget_bytes=budget)


def test_windows_are_solved_only_where_communication_is_exposed():
    """Windows holding no exposed bucket are not solved: with windows of a few collectives, the
    backend sees only windows that hold one."""
    p = _backward(6)
    seen: list[set[str]] = []

    class Records(_Proposes):
        def solve_window(self, problem, mem_budget_bytes, schedule, free, *args, **kwargs):
            sim = simulate(problem.dag, schedule, problem=problem)
            bucket_of = schedule.bucket_of()
            seen.append({m for m in free if sim.bucket_exposed_ms.get(bucket_of[m], 0.0) > 0})
            return None

    movable = sum(c.movable for c in p.colls.values())
    n_windows = len(range(0, movable - 8 + 4, 4))  # windows of 8 at a stride of 4
    search({"m": p}, None, backend=Records(), work_limit=100.0,
           config=SearchConfig(window_members=8, window_sweeps=1, window_work=0.01))
    assert seen and all(seen)
    assert len(seen) < n_windows  # some windows were skipped: they exposed nothing


# --------------------------------------------------------------------------------------------
# infeasible budgets
# --------------------------------------------------------------------------------------------
def test_an_unreachable_budget_names_a_peak_that_works_as_a_budget():
    p = _backward()
    traced = _peak(p, p.traced_schedule())
    with pytest.raises(InfeasibleBudgetError) as err:
        search({"m": p}, traced // 2, backend=CpSatBackend(), work_limit=1.0)
    assert err.value.mem_budget_bytes == traced // 2
    assert traced // 2 < err.value.min_peak_bytes <= traced
    result = search({"m": p}, err.value.min_peak_bytes, backend=CpSatBackend(), work_limit=1.0)
    assert _peak(p, result.schedule) <= err.value.min_peak_bytes


# --------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------
def test_same_schedule_again_with_a_clock_running_three_times_fast(binding, monkeypatch):
    """No decision reads the wall clock: the same graph gives the same schedule again, on a
    machine three times slower (a clock running 3x fast), with the same work in every stage."""
    p, budget, first = binding
    real = time.perf_counter
    t0 = real()
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + 3.0 * (real() - t0))
    slow = search({"analytic": p}, budget, backend=CpSatBackend(), work_limit=2.0)
    assert slow.schedule.digest() == first.schedule.digest()
    assert [s.evaluations for s in slow.stages] == [s.evaluations for s in first.stages]


def test_same_schedule_in_two_processes(tmp_path):
    """Two fresh interpreters (other hash seeds) solve the same saved DAG to the same digest."""
    from scheduler.export.dagfile import save_dag

    dag = make_fsdp_dag(n_layers=3, graph_kind="backward", reshard_after_forward=True, seed=1)
    path = tmp_path / "dag.json"
    save_dag(dag, path)
    code = textwrap.dedent(f"""
        from scheduler.export.dagfile import load_dag
        from solvers import Problem, solve
        from solvers.core.simulator import simulate
        p = Problem.from_dag(load_dag({str(path)!r}))
        budget = simulate(p.dag, p.traced_schedule(), problem=p).max_peak_bytes
        print(solve(p, solver="cpsat", mem_budget_bytes=budget, work_limit=1.0).schedule.digest())
        """)
    digests = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=300).stdout.strip() for _ in range(2)]
    assert digests[0] == digests[1] and len(digests[0]) == 64
