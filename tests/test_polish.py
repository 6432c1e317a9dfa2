"""The polish (solvers/polish.py): a local search on the worst-case regret across cost
models, on synthetic FSDP graphs priced by two clusters (fast and slow inter-node links).

    fast: 400 GB/s between nodes: collectives hide behind compute, small buckets are fine;
    slow:  25 GB/s between nodes: communication dominates, fewer and larger buckets win.

A schedule solved for one cluster regrets 5 to 26 % on the other; the polish, started from it,
must find one that regrets less under both.
"""

from __future__ import annotations

import pytest

from scheduler.costs.hardware import Cluster
from scheduler.whatif.synthetic import make_fsdp_dag
from solvers.core import InfeasibleBudgetError, Problem, simulate, validate_schedule
from solvers.polish import PolishConfig, polish
from solvers.registry import solve
from solvers.search import SearchConfig
from solvers.starts import Regrouping, regroup, regroupings
from solvers.core.plan import chain_units


def reference_times(problems, schedules, budget):
    """Model label -> the least step time under that model among ``schedules`` that fit."""
    best = {}
    for schedule in schedules:
        sims = {label: simulate(p.dag, schedule, problem=p) for label, p in problems.items()}
        if max(sim.peak_bytes for sim in sims.values()) > budget:
            continue
        for label, sim in sims.items():
            best[label] = min(best.get(label, float("inf")), sim.step_ms)
    if len(best) != len(problems):
        raise ValueError("no schedule fits the budget")
    return best


def _problems(kind: str, seed: int = 0) -> dict[str, Problem]:
    def priced(inter_node_gbps: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps)
        return Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind=kind, world_size=64, seed=seed, cluster=cluster))

    return {"fast": priced(400.0), "slow": priced(25.0)}


@pytest.fixture(scope="module")
def forward_case():
    """Problems, budget (1.15x the traced peak), each cluster's own solve, the references."""
    problems = _problems("forward")
    p = problems["fast"]
    budget = int(simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes * 1.15)
    solved = {label: solve(q, solver="cpsat", mem_budget_bytes=budget, work_limit=2).schedule
              for label, q in problems.items()}
    return problems, budget, solved, reference_times(problems, list(solved.values()), budget)


def _worst(problems, schedule, reference):
    return max(simulate(p.dag, schedule, problem=p).step_ms / reference[label] - 1 for label, p in problems.items())


def test_polish_lowers_the_worst_case_below_every_single_model_solve(forward_case):
    problems, budget, solved, reference = forward_case
    start_worst = {label: _worst(problems, s, reference) for label, s in solved.items()}
    assert start_worst["fast"] > 0.10  # the fast cluster's schedule is slow on the slow one
    result = polish(problems, solved["fast"], reference, budget)
    assert result.moves > 0
    assert result.worst_regret < min(start_worst.values())
    assert result.worst_regret == pytest.approx(_worst(problems, result.schedule, reference))
    for p in problems.values():  # a valid schedule of the graph, within the budget under every model
        sim = validate_schedule(p, result.schedule, mem_budget_bytes=budget)
        assert sim.peak_bytes <= budget
    assert result.evaluations <= PolishConfig().max_evaluations


def test_polish_is_deterministic_and_counts_work_in_evaluations(forward_case):
    problems, budget, solved, reference = forward_case
    a = polish(problems, solved["fast"], reference, budget, PolishConfig(max_evaluations=60))
    b = polish(problems, solved["fast"], reference, budget, PolishConfig(max_evaluations=60))
    assert a.schedule.digest() == b.schedule.digest() and a.regret == b.regret
    # the moves stop at the limit; the pass of splits after them tries each bucket once
    n_colls = len(problems["fast"].colls)
    assert a.stopped.startswith("work limit") and a.evaluations <= 60 + len(problems) + (len(problems) + 1) * n_colls
    moves_only = polish(problems, solved["fast"], reference, budget, PolishConfig(max_evaluations=60, splits=False))
    assert moves_only.evaluations <= 60 + len(problems)
    longer = polish(problems, solved["fast"], reference, budget)
    assert longer.worst_regret <= a.worst_regret


def test_with_no_budget_the_polish_ends_as_under_a_budget_nothing_reaches(forward_case):
    """With no budget a neighbour is ruled out on its step times alone (its memory is counted
    once it improves); the walk is the one a budget every schedule fits gives, which counts
    every neighbour's memory: the same moves, evaluations, schedule and figures."""
    problems, _, solved, reference = forward_case
    free = polish(problems, solved["slow"], reference, None)
    roomy = polish(problems, solved["slow"], reference, 10**18)
    assert free.moves > 0
    assert (free.moves, free.evaluations, free.stopped) == (roomy.moves, roomy.evaluations, roomy.stopped)
    assert free.schedule.digest() == roomy.schedule.digest()
    assert free.step_ms == roomy.step_ms and free.peak_bytes == roomy.peak_bytes
    assert free.peak_bytes == max(simulate(p.dag, free.schedule, problem=p).peak_bytes for p in problems.values())


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_the_pass_of_splits_ends_buckets_that_no_move_can_and_slows_no_model(kind):
    """On clusters whose collectives have no latency, a bucket saves nothing and its copies into
    and out of its buffer cost compute: no merge, boundary move or shift ends a bucket, the pass
    of splits after them does, and the polish ends faster under every model with it (a split
    that would slow one model is not kept)."""
    def priced(inter_node_gbps: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps, base_latency_us=0.0,
                          intra_hop_latency_us=0.0, inter_hop_latency_us=0.0)
        return Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind=kind, world_size=64, seed=0, cluster=cluster))

    problems = {"fast": priced(400.0), "slow": priced(50.0)}
    start = solve(problems["fast"], solver="fsdp2").schedule
    reference = {label: simulate(p.dag, start, problem=p).step_ms for label, p in problems.items()}
    without = polish(problems, start, reference, None, PolishConfig(splits=False))
    split = polish(problems, start, reference, None)
    assert len(without.schedule.buckets) <= len(start.buckets) < len(split.schedule.buckets)
    for label, p in problems.items():
        assert split.step_ms[label] < without.step_ms[label]
        assert validate_schedule(p, split.schedule).step_ms == pytest.approx(split.step_ms[label])


def test_the_pass_of_splits_slows_no_model():
    """Two models that disagree on latency (none, and NCCL's), the one without latency furthest
    from its reference: a split that lowers its regret and slows the other lowers the
    worst-case regret, and a pass that kept it would slow that model (on this graph it would:
    one bucket of the backward). The pass keeps only splits that slow no model."""
    def priced(latency_us: float) -> Problem:
        cluster = Cluster(n_gpus=64, inter_node_gbps=400.0, base_latency_us=latency_us,
                          intra_hop_latency_us=latency_us / 2, inter_hop_latency_us=latency_us)
        return Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind="backward", world_size=64, seed=0,
                                              cluster=cluster))

    problems = {"no latency": priced(0.0), "latency": priced(8.4)}
    start = solve(problems["no latency"], solver="fsdp2").schedule
    reference = {label: simulate(p.dag, start, problem=p).step_ms for label, p in problems.items()}
    reference["no latency"] *= 0.97
    without = polish(problems, start, reference, None, PolishConfig(splits=False))
    split = polish(problems, start, reference, None)
    assert all(split.step_ms[label] <= without.step_ms[label] for label in problems)
    assert split.worst_regret <= without.worst_regret


def test_polish_holds_a_tight_budget():
    """At the traced peak itself no move may add memory: every accepted schedule fits."""
    problems = _problems("backward", seed=1)
    p = problems["fast"]
    traced = p.traced_schedule()
    budget = simulate(p.dag, traced, problem=p).peak_bytes
    start = solve(p, solver="fsdp2", mem_budget_bytes=budget).schedule
    reference = reference_times(problems, [start, traced], budget)
    result = polish(problems, start, reference, budget)
    for q in problems.values():
        assert simulate(q.dag, result.schedule, problem=q).peak_bytes <= budget


def test_polish_refuses_bad_input(forward_case):
    problems, budget, solved, reference = forward_case
    with pytest.raises(InfeasibleBudgetError, match="could not bring its start under the budget"):
        polish(problems, solved["fast"], reference, 1)
    with pytest.raises(ValueError, match="reference step times must be > 0"):
        polish(problems, solved["fast"], {"fast": 1.0}, budget)
    with pytest.raises(ValueError, match="not the same graph"):
        polish({"fast": problems["fast"], "other": _problems("backward")["slow"]}, solved["fast"],
               {"fast": 1.0, "other": 1.0}, budget)
    with pytest.raises(ValueError, match="at least one"):
        polish({}, solved["fast"], reference, budget)
    for bad in ({"max_evaluations": 0}, {"steps": ()}, {"steps": (0,)}, {"max_bucket_bytes": 0}):
        with pytest.raises(ValueError):
            PolishConfig(**bad)


def test_the_old_name_of_the_polish_limit_still_works_and_warns():
    """``PolishConfig.max_simulations`` was renamed ``max_evaluations`` (it counts evaluations):
    for one release the old name sets and reads the field, with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="max_evaluations"):
        old = PolishConfig(max_simulations=60)
    assert old == PolishConfig(max_evaluations=60)
    with pytest.warns(DeprecationWarning, match="max_evaluations"):
        assert old.max_simulations == 60


def test_polish_keeps_merged_buckets_under_the_cap(forward_case):
    problems, budget, solved, reference = forward_case
    p = problems["fast"]

    def payload(bucket):
        return sum(p.colls[m].payload_bytes for m in bucket.members)

    cap = max(payload(b) for b in solved["fast"].buckets)  # the start is within the cap
    result = polish(problems, solved["fast"], reference, budget, PolishConfig(max_bucket_bytes=cap))
    free = polish(problems, solved["fast"], reference, budget)
    assert all(payload(b) <= cap for b in result.schedule.buckets)
    assert max(payload(b) for b in free.schedule.buckets) > cap  # without the cap the polish merges past it


# --------------------------------------------------------------------------------------------
# regular bucketings of a chain, the search's starts (solvers/starts.py)
# --------------------------------------------------------------------------------------------
def _with_blocks(kind: str, n_layers: int = 6) -> dict[str, Problem]:
    """The two-cluster problems with each collective's ``block`` set from its FQN, as the export
    infers it (``layers.L.*`` -> L; the embedding, norm and output in no block)."""
    out = {}
    for inter_node_gbps, label in ((400.0, "fast"), (25.0, "slow")):
        dag = make_fsdp_dag(n_layers=n_layers, graph_kind=kind, world_size=64, seed=0,
                            cluster=Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps))
        for _, a in dag.nodes(data=True):
            if a["kind"] == "collective":
                parts = a["fqns"][0].split(".")
                a["block"] = int(parts[1]) if parts[0] == "layers" else None
        out[label] = Problem.from_dag(dag)
    return out


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_regroup_buckets_a_chain_by_blocks_and_issues_ahead(kind):
    """6 layers of 4 parameters, the embedding first and norm, output last (forward; backward in
    reverse): head 2 units, 2 per bucket, tail 1, 1 ahead. Forward: all-gathers waited where
    their first member is needed, issued at the previous bucket's wait. Backward:
    reduce-scatters issued when their last gradient is ready, waited at the next one's issue."""

    p = _with_blocks(kind)["fast"]
    (key, names), = p.chains.items()
    units = chain_units(p, names)
    assert [len(u) for u in units] == ([1] + [4] * 6 + [1, 1] if kind == "forward" else [1, 1] + [4] * 6 + [1])
    r = Regrouping(key, size=2, head=2, tail=1, ahead=1)
    schedule = regroup(p, p.traced_schedule(), r)
    validate_schedule(p, schedule)
    issue, wait = schedule.positions()
    rows = sorted(zip(schedule.buckets, issue, wait), key=lambda x: names.index(x[0].members[0]))
    # 9 units: 2 | 2 | 2 | 2 | 1
    assert [bk.members for bk, _, _ in rows] == [sum(units[a:b], ()) for a, b in ((0, 2), (2, 4), (4, 6), (6, 8), (8, 9))]
    for k, (bk, i, w) in enumerate(rows):
        ready = max(p.colls[m].ready for m in bk.members)
        needed = min(p.colls[m].needed for m in bk.members)
        if kind == "forward":
            assert w == needed
            assert i == (rows[k - 1][2] if k else min(p.traced_schedule().positions()[0]))
        else:
            assert i == ready
            assert w == (rows[k + 1][1] if k + 1 < len(rows) else w)


def test_regroupings_and_their_config_are_checked():
    """Every regular bucketing tried as a start is a valid schedule of the graph; bad sizes are
    refused when the config or the regrouping is built."""

    p = _with_blocks("forward")["fast"]
    found = regroupings(p, SearchConfig().start_sizes, SearchConfig().start_aheads)
    assert found
    for r in found:
        s = regroup(p, p.traced_schedule(), r)
        if s is not None:
            validate_schedule(p, s)
    for bad in ({"start_sizes": ()}, {"start_sizes": (0,)}, {"start_aheads": (0,)}):
        with pytest.raises(ValueError):
            SearchConfig(**bad)
    with pytest.raises(ValueError, match="size, head, tail and ahead >= 1"):
        Regrouping(next(iter(p.chains)), size=0, head=1, tail=1, ahead=1)


def test_the_budget_bounds_the_memory_the_graph_holds_not_torchs_tracker_rules():
    """The traced forward: within the budget by the execution model's count (the memory the
    written graph holds), over it by torch's tracker rules (each wait's result counted beside
    the collective's, though a wait returns its input). The polish holds the budget by the
    first, never above it, and gains on the traced order although the second stays over."""
    p = Problem.from_dag(make_fsdp_dag(n_layers=6, graph_kind="forward", world_size=64, seed=0, cluster=Cluster()))
    traced = simulate(p.dag, problem=p)
    budget = traced.peak_bytes
    assert traced.tracker_peak_bytes > budget
    result = polish({"m": p}, p.traced_schedule(), {"m": traced.step_ms}, budget, PolishConfig(max_evaluations=2000))
    sim = simulate(p.dag, result.schedule, problem=p)
    assert sim.peak_bytes <= budget
    assert result.step_ms["m"] < traced.step_ms


def test_polish_never_trades_a_strict_models_baseline_for_regret_elsewhere(forward_case):
    """Started from the slow cluster's own solve, with a baseline 3 % slower than the fast
    cluster's solve under "fast": left to the minimax, the polish stays slower than that
    baseline on the fast cluster (its worst case is elsewhere); with "fast" strict, it first
    gets as fast as the baseline there, and pays for it in regret."""
    problems, budget, solved, reference = forward_case
    start = solved["slow"]
    own = {label: simulate(p.dag, s, problem=p).step_ms for (label, p), s in
           zip(problems.items(), (solved["fast"], start))}
    baseline = {"fast": own["fast"] * 1.03, "slow": own["slow"]}
    assert simulate(problems["fast"].dag, start, problem=problems["fast"]).step_ms > baseline["fast"]
    free = polish(problems, start, reference, budget, baseline_ms=baseline)
    assert free.step_ms["fast"] > baseline["fast"]
    strict = polish(problems, start, reference, budget, baseline_ms=baseline, strict_models=("fast",))
    assert strict.step_ms["fast"] <= baseline["fast"]
    assert strict.worst_regret >= free.worst_regret - 1e-12
    for p in problems.values():
        assert simulate(p.dag, strict.schedule, problem=p).peak_bytes <= budget


def _two_groups_one_link(share: bool) -> dict[str, Problem]:
    """The 6-layer forward with its parameters alternating between two process groups, of the
    same ranks (``share``: one link, :mod:`solvers.core.streams`) or of other ranks, under two
    bandwidths."""
    def priced(inter_node_gbps: float) -> Problem:
        dag = make_fsdp_dag(n_layers=6, graph_kind="forward", world_size=64, n_groups=2, seed=0,
                            cluster=Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps))
        dag.graph["process_groups"] = {g: {"ranks": list(range(64)) if share or g == "0" else list(range(64, 128))}
                                       for g in ("0", "1")}
        return Problem.from_dag(dag)

    return {"fast": priced(400.0), "slow": priced(100.0)}


def _prefetched(p: Problem, group: str):
    """The traced schedule (every all-gather issued where it is needed: exposed) with the
    all-gathers of ``group`` issued at the start instead: they queue on their stream and run
    beside the exposed ones of the other group."""
    from solvers.core.plan import PlannedBucket, build_schedule

    traced = p.traced_schedule()
    issue, wait = traced.positions()
    return build_schedule(p, [PlannedBucket(b, p.colls[b.members[0]].ready if p.colls[b.members[0]].group_name == group
                                            else issue[k], wait[k]) for k, b in enumerate(traced.buckets)])


def test_the_link_pass_moves_transfers_out_of_exposed_ones_on_their_link_and_slows_no_model():
    """Two groups on one link: group 1's all-gathers all issued at the start run beside group
    0's, which the compute stream waits for, and slow them (processor sharing). The link pass
    moves group 1's issues out of those flights: its schedule is valid, no model is slower, and
    some is faster by more than float noise (with no pass to do it, the test fails)."""
    from solvers.polish import link_pass

    problems = _two_groups_one_link(share=True)
    start = _prefetched(problems["fast"], "1")
    reference = {label: simulate(p.dag, start, problem=p).step_ms for label, p in problems.items()}
    found = link_pass(problems, start, reference)
    assert found is not None
    for label, p in problems.items():
        assert validate_schedule(p, found.schedule).step_ms == pytest.approx(found.step_ms[label])
        assert found.step_ms[label] <= reference[label] * (1 + 1e-9)
    assert any(found.step_ms[label] < reference[label] * 0.999 for label in problems), (found.step_ms, reference)


def test_the_link_pass_costs_nothing_where_no_streams_share_a_link():
    """The same graph with its groups on other ranks: no link is shared, the all-gathers of one
    group slow no other's, and the pass returns nothing, evaluating nothing."""
    from solvers.polish import link_pass

    problems = _two_groups_one_link(share=False)
    assert not problems["fast"].shares_links
    start = _prefetched(problems["fast"], "1")
    reference = {label: simulate(p.dag, start, problem=p).step_ms for label, p in problems.items()}
    assert link_pass(problems, start, reference) is None


@pytest.mark.parametrize("bad", [{"link_rounds": -1}, {"link_trials": 0}])
def test_the_links_stage_config_is_checked(bad):
    with pytest.raises(ValueError, match="link_rounds must be >= 0 and link_trials >= 1"):
        SearchConfig(**bad)


def test_the_ahead_stage_config_is_checked():
    with pytest.raises(ValueError, match="ahead_trials must be >= 0"):
        SearchConfig(ahead_trials=-1)
