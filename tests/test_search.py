"""The search around the model: degenerate starts, more memory never slower, deterministic
limits (no wall clock in any decision), templates over a period of several blocks.

Graphs: foreign captures (tests/foreign_models.py, no helper of models/) exported with the
analytic cost model, and the synthetic FSDP DAG.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import foreign_models as fm  # noqa: E402
from scheduler import export_dag  # noqa: E402
from scheduler.synthetic import make_fsdp_dag  # noqa: E402
from solvers import Problem, solve, solve_budgets  # noqa: E402
from solvers.core.simulator import simulate  # noqa: E402
from solvers.core.validator import validate_schedule  # noqa: E402
from solvers.cpsat import CpSatBackend, CpSatConfig, solve_cpsat  # noqa: E402
from solvers.decompose import CAP_NOTE, WorkBudget, bucket_free, search, window_order, window_search  # noqa: E402
from solvers.heuristics import SimpleFSDPConfig, simplefsdp_schedule  # noqa: E402
from solvers.periodic import detect_periodicity, replicate  # noqa: E402


@pytest.fixture(scope="module")
def tied() -> fm.Captured:
    """A 12-layer foreign model (tied embeddings), 8 ranks."""
    return fm.capture("tied", n_layers=12, world_size=8)


@pytest.fixture(scope="module")
def foreign_forward(tied) -> Problem:
    return Problem.from_dag(export_dag(tied.forward))


def test_backward_blocks_repeat_around_a_common_consumer(tied):
    """In a backward graph every gradient's reduce-scatter is needed by the same output node:
    that gap does not shift from block to block, the ready gaps do; still one repetition."""
    p = Problem.from_dag(export_dag(tied.backward))
    per = detect_periodicity(p, min_blocks=6)
    assert per is not None and per.stride == 1 and per.period < 0 and len(per.blocks) >= 10


def _one_bucket_of_everything(p: Problem):
    return simplefsdp_schedule(p, SimpleFSDPConfig(bucket_cap_bytes=2**62))


def test_degenerate_start_ends_no_worse_than_the_per_block_plan(foreign_forward):
    """Started from one bucket of every all-gather, the decomposition ends at or below the
    FSDP2-like plan (one bucket per block) and splits the bucket before the windows."""
    p = foreign_forward
    budget = simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes * 6 // 5
    start = _one_bucket_of_everything(p)
    assert max(len(b.members) for b in start.buckets) >= 12  # degenerate: spans every block
    per_block = solve(p, solver="fsdp2", mem_budget_bytes=budget)
    cfg = CpSatConfig(template_rounds=0, lns_window_s=0.5)
    sched, sim, notes = search(p, cfg, CpSatBackend(cfg).solve_window, budget, start, WorkBudget(20.0, 600.0), 0, 1,
                               budget)
    validate_schedule(p, sched, mem_budget_bytes=budget)
    assert sim.step_ms <= per_block.objective_ms + 1e-6
    assert max(len(b.members) for b in sched.buckets) < max(len(b.members) for b in start.buckets)


def test_degenerate_hint_is_not_a_trap(foreign_forward):
    """The same start given as the solve's hint: the answer is no worse than the per-block plan."""
    p = foreign_forward
    per_block = solve(p, solver="fsdp2")
    res = solve_cpsat(p, hint=_one_bucket_of_everything(p), time_limit_s=6.0,
                      config=CpSatConfig(full_model_max_members=0))
    validate_schedule(p, res.schedule)
    assert res.objective_ms <= per_block.objective_ms + 1e-6


def test_two_budget_sweep_is_monotone(foreign_forward):
    """More memory never gives a slower step: the smaller budget's best is a start at the larger."""
    p = foreign_forward
    peak = simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes
    budgets = [peak * 6 // 5, peak]  # given out of order on purpose
    out = solve_budgets(p, budgets, time_limit_s=4.0)
    small, large = out[peak], out[peak * 6 // 5]
    assert small.peak_bytes <= peak and large.peak_bytes <= peak * 6 // 5
    assert large.objective_ms <= small.objective_ms + 1e-9


def test_extra_starts_bound_the_result():
    """A start given in ``extra_starts`` is a candidate: the result is never slower than it."""
    p = Problem.from_dag(make_fsdp_dag(n_layers=4, graph_kind="forward", reshard_after_forward=True, seed=2))
    good = solve_cpsat(p, time_limit_s=4.0)
    res = solve(p, time_limit_s=0.5, extra_starts=[good.schedule])
    assert res.objective_ms <= good.objective_ms + 1e-9
    with pytest.raises(ValueError, match="exact solvers"):
        solve(p, solver="fsdp2", extra_starts=[good.schedule])


@pytest.mark.parametrize("full_model", [True, False], ids=["full-model", "windows"])
def test_same_schedule_on_a_slower_machine(monkeypatch, full_model):
    """No limit depends on the wall clock: with a clock running 3x fast (a machine 3x slower)
    the schedule is the same, as long as the safety cap is not hit (and then it says so)."""
    p = Problem.from_dag(make_fsdp_dag(n_layers=8, graph_kind="backward", reshard_after_forward=True))
    budget = simulate(p.dag, p.traced_schedule(), problem=p).max_peak_bytes
    # a generous cap: this test is about the limits, not about the cap on a loaded CI machine
    cfg = CpSatConfig(full_model_max_members=10_000 if full_model else 0, decompose_repeating=not full_model,
                      lns_window_members=10, wall_clock_slack_s=300.0)
    base = solve_cpsat(p, mem_budget_bytes=budget, time_limit_s=3.0, config=cfg)
    real = time.perf_counter
    t0 = real()
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + 3.0 * (real() - t0))
    slow = solve_cpsat(p, mem_budget_bytes=budget, time_limit_s=3.0, config=cfg)
    assert CAP_NOTE not in base.notes and CAP_NOTE not in slow.notes
    assert slow.schedule.digest() == base.schedule.digest()


def test_wall_clock_cap_is_reported(monkeypatch):
    """A clock that jumps past the safety cap stops the windows and the result says so."""
    p = Problem.from_dag(make_fsdp_dag(n_layers=8, graph_kind="backward", reshard_after_forward=True))
    real = time.perf_counter
    t0 = real()
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + 1000.0 * (real() - t0))
    res = solve_cpsat(p, time_limit_s=2.0, config=CpSatConfig(full_model_max_members=0, lns_window_members=10))
    validate_schedule(p, res.schedule)
    assert CAP_NOTE in res.notes


def test_template_over_a_two_block_period():
    """Alternating MLP widths repeat every 2 blocks: the periodicity has stride 2, and copying
    the middle period's decisions puts each block where the block 2 before it is, one period
    later."""
    captured = fm.capture("alternating", n_layers=12, world_size=8, wide_every=1000)
    p = Problem.from_dag(export_dag(captured.forward))
    assert detect_periodicity(p, min_blocks=6, max_stride=1) is None or \
        len(detect_periodicity(p, min_blocks=6, max_stride=1).blocks) < 12
    per = detect_periodicity(p, min_blocks=6, max_stride=4)
    assert per is not None and per.stride == 2 and len(per.blocks) >= 10
    source = solve(p, solver="fsdp2").schedule
    copied = replicate(p, per, source, per.middle(), per.blocks)
    assert copied is not None
    validate_schedule(p, copied)
    issue, _ = copied.positions()
    bucket_of = copied.bucket_of()
    for b in per.blocks[2:]:  # the first blocks' copies are clamped at the graph's start
        if b + 2 not in per.members:
            continue
        for role, name in per.members[b].items():
            nxt = per.members[b + 2][role]
            assert issue[bucket_of[nxt]] - issue[bucket_of[name]] == per.period


def test_windows_exposing_no_communication_are_skipped():
    """An 8-layer backward under the per-block plan exposes communication only at its two ends
    (the first all-gathers, the last reduce-scatter): of the windows of 10 collectives, only
    the two that hold an exposed bucket are solved."""
    p = Problem.from_dag(make_fsdp_dag(n_layers=8, graph_kind="backward", reshard_after_forward=True))
    start = solve(p, solver="fsdp2").schedule
    sim = simulate(p.dag, start, problem=p)
    bucket_of = start.bucket_of()
    exposed = {n for n in window_order(p) if sim.bucket_exposed_ms.get(bucket_of[n], 0.0) > 0}
    assert 0 < len(exposed) < 10  # the premise: most buckets are hidden
    solved: list[set[str]] = []

    def record(problem, mem_budget_bytes, schedule, free, *args, **kwargs):
        solved.append(set(free))
        return None

    cfg = CpSatConfig(lns_window_members=10, lns_max_sweeps=1)
    window_search(p, cfg, record, None, start, sim, 100.0, 0, 1, None)
    assert len(solved) == 2
    assert all(free & exposed for free in solved)


def test_repeating_layers_go_to_the_templates_first(foreign_forward):
    """The 12-layer tied forward has fewer collectives than ``full_model_max_members`` but its
    layers repeat: it goes to the per-layer template and windows, not the whole-graph model
    (which it still gets with ``decompose_repeating=False``)."""
    p = foreign_forward
    assert sum(len(c) for c in p.chains.values()) <= CpSatConfig().full_model_max_members
    templated = solve_cpsat(p, time_limit_s=4.0)
    validate_schedule(p, templated.schedule)
    assert any("rolling-window search" in n for n in templated.notes)
    # the whole-graph model's notes open with "model" (its step, or what it found: UNKNOWN ...)
    assert not any(n.startswith("model ") for n in templated.notes)
    whole = solve_cpsat(p, time_limit_s=4.0, config=CpSatConfig(decompose_repeating=False))
    assert any(n.startswith("model ") for n in whole.notes)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_window_moves_its_collectives_within_the_trust_region(tied, kind):
    """A window decides its collectives only within ``lns_radius_anchors`` of the incumbent's
    positions (issue, and wait for reduce-scatters): every member's window in the model lies
    there, and the window's schedule issues each of them there."""
    from solvers.model import Anchors, ModelData

    p = Problem.from_dag(export_dag(getattr(tied, kind)))
    start = solve(p, solver="fsdp2").schedule
    free = bucket_free(start, window_order(p)[:12])
    anchors = Anchors(p)
    radius = 3
    cfg = CpSatConfig(lns_radius_anchors=radius)
    data = ModelData(p, cfg, None, free=free, reference=start, anchors=anchors)
    wide = ModelData(p, CpSatConfig(lns_radius_anchors=None), None, free=free, reference=start, anchors=anchors)
    issue, wait = start.positions()
    bucket_of = start.bucket_of()
    # the issue anchors of the chain's previous all-gather / next reduce-scatter (merge reach)
    neighbour = {}
    for chain in data.chains:
        for k, x in enumerate(chain):
            at = [anchors.at_or_before(issue[bucket_of[y.name]]) for y in chain]
            neighbour[x.name] = (at[k - 1] if k and x.coll_type == "all_gather" else at[k],
                                 at[k + 1] if k + 1 < len(chain) and x.coll_type == "reduce_scatter" else at[k])
    narrower = 0
    for name, x in data.member.items():
        ti, tw = anchors.at_or_before(issue[bucket_of[name]]), anchors.at_or_before(wait[bucket_of[name]])
        prev, nxt = neighbour.get(name, (ti, ti))
        assert x.lo <= ti and x.lo >= min(ti - radius, prev), name
        if x.coll_type == "reduce_scatter":
            assert x.hi <= max(ti + radius, nxt, x.lo) and x.whi <= max(x.hi, tw + radius), name
        narrower += (x.hi - x.lo) < (wide.member[name].hi - wide.member[name].lo)
    assert narrower, "the trust region restricted nothing: the test does not exercise it"
    cand = CpSatBackend(cfg).solve_window(p, None, start, free, 2.0, 0, 1, anchors)
    assert cand is not None
    c_issue, _ = cand.positions()
    c_bucket = cand.bucket_of()
    for name in free:
        at = anchors.at_or_before(c_issue[c_bucket[name]])
        assert data.member[name].lo <= at <= data.member[name].hi, name


def test_trust_region_is_validated():
    with pytest.raises(ValueError, match="lns_radius_anchors"):
        CpSatConfig(lns_radius_anchors=0)


def test_a_window_result_is_copied_onto_the_other_layers():
    """A window that improves the whole blocks it decides has them copied onto the other blocks
    of the repeating layers (as the template copies its middle period): one window then
    improves the whole graph, not only its own range."""
    p = Problem.from_dag(make_fsdp_dag(params_per_layer=4, n_layers=12, graph_kind="forward"))
    per = detect_periodicity(p)
    assert per is not None
    good = solve(p, solver="fsdp2").schedule  # one bucket per block, prefetched a block ahead
    start = solve(p, solver="traced").schedule  # every all-gather alone, waited where issued
    sim0 = simulate(p.dag, start, problem=p)
    block_of = per.block_of()
    decided: list[set[int]] = []

    def copy_good(problem, mem_budget_bytes, schedule, free, *args, **kwargs):
        """A window 'solver' that gives the blocks it decides whole the per-block plan's decisions."""
        whole = {b for b in per.blocks if set(per.members[b].values()) <= free}
        decided.append(whole)
        return replicate(p, per, good, per.middle(), sorted(whole), onto=schedule) if whole else None

    cfg = CpSatConfig(lns_max_sweeps=1)
    sched, sim, _ = window_search(p, cfg, copy_good, None, start, sim0, cfg.lns_window_s, 0, 1, None)
    assert len(decided) == 1 and decided[0]  # the work budget buys one window, deciding some blocks
    alone = replicate(p, per, good, per.middle(), sorted(decided[0]), onto=start)
    assert sim.step_ms < simulate(p.dag, alone, problem=p).step_ms - 1e-6  # the copies gained more
    validate_schedule(p, sched)
    grouped = {b for b in per.blocks if len({sched.bucket_of()[n] for n in per.members[b].values()}) == 1}
    assert grouped - decided[0]  # blocks outside the window took its decisions



def test_search_restarts_from_the_other_granularity_with_work_left():
    """A comm-bound forward: the fastest start groups several blocks per bucket; when the search
    from it converges with work left it searches again from the fastest one-bucket-per-block
    start (FSDP2-like) and keeps the faster, so it is never slower than without the restart."""
    from solvers.warmstart import GROUPED, other_family, warm_starts

    p = Problem.from_dag(make_fsdp_dag(n_layers=8, params_per_layer=3, param_bytes=4 << 20, world_size=64,
                                       compute_ms_per_node=0.05, graph_kind="forward"))
    starts = warm_starts(p, None, None)
    assert starts[0].solver == GROUPED
    second = other_family(starts)
    assert second is not None and second.solver != GROUPED
    assert other_family([second, starts[0]]) is starts[0]
    again = solve_cpsat(p, time_limit_s=6.5)
    once = solve_cpsat(p, time_limit_s=6.5, config=CpSatConfig(restart_share=2.0))
    assert any(n.startswith(f"searched again from {second.solver}") for n in again.notes)
    assert not any(n.startswith("searched again") for n in once.notes)
    assert again.objective_ms <= once.objective_ms + 1e-9
    validate_schedule(p, again.schedule)


def test_polish_over_torchs_count_holds_it_where_the_start_has_it(monkeypatch):
    """The solve's model holds the budget by the execution model's count only. When the polish
    cannot bring its start under the budget by torch's tracker rules too (made to refuse here),
    the solve does not fail: it polishes again with that count held at the start's peak."""
    from scheduler.costs import Cluster
    from solvers import driver
    from solvers.core import InfeasibleBudgetError

    p = Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind="forward", world_size=64, seed=1,
                                       cluster=Cluster(n_gpus=64, inter_node_gbps=400)))
    budget = int(simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes * 1.15)
    calls = []
    real = driver.polish

    def refusing(problems, start, reference, mem_budget_bytes, config, *, tracker_budget_bytes=None):
        calls.append((start, tracker_budget_bytes))
        if tracker_budget_bytes is None:
            raise InfeasibleBudgetError("refused", budget_bytes=mem_budget_bytes, min_peak_bytes=mem_budget_bytes + 1)
        return real(problems, start, reference, mem_budget_bytes, config, tracker_budget_bytes=tracker_budget_bytes)

    monkeypatch.setattr(driver, "polish", refusing)
    result = solve_cpsat(p, mem_budget_bytes=budget, time_limit_s=2)
    assert [t is None for _, t in calls] == [True, False]
    start = simulate(p.dag, calls[1][0], problem=p)
    assert calls[1][1] == max(budget, start.tracker_peak_bytes)
    assert any(n.startswith("polished on the simulator") for n in result.notes)
    assert simulate(p.dag, result.schedule, problem=p).peak_bytes <= budget


def test_the_solve_ends_with_a_polish_on_the_simulator():
    """A 6-layer synthetic forward (64 ranks, 400 GB/s between nodes, 1.15x the traced peak):
    the windows' schedule leaves merges and issue moves the model prices only approximately;
    the final polish (solvers/minimax.py with the one model) takes them, never losing, within
    the budget. ``polish_share=0`` turns it off."""
    from scheduler.costs import Cluster

    p = Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind="forward", world_size=64, seed=1,
                                       cluster=Cluster(n_gpus=64, inter_node_gbps=400)))
    budget = int(simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes * 1.15)
    plain = solve_cpsat(p, mem_budget_bytes=budget, time_limit_s=2, config=CpSatConfig(polish_share=0))
    polished = solve_cpsat(p, mem_budget_bytes=budget, time_limit_s=2)
    assert not any("polished" in n for n in plain.notes)
    assert any(n.startswith("polished on the simulator") for n in polished.notes)
    assert polished.objective_ms < plain.objective_ms - 1e-6
    # the schedule before the polish goes with the result, for the written-graph check to judge
    assert not plain.alternatives and len(polished.alternatives) == 1
    before = simulate(p.dag, polished.alternatives[0], problem=p)
    assert before.step_ms > polished.objective_ms and before.peak_bytes <= budget
    checked = validate_schedule(p, polished.schedule, mem_budget_bytes=budget)
    assert checked.step_ms == pytest.approx(polished.objective_ms)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="polish_share"):
            CpSatConfig(polish_share=bad)
