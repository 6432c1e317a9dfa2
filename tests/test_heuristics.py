"""Baseline heuristics on synthetic FSDP graphs: valid schedules, the bucketing and prefetch
each one promises, and memory budgets either met or refused with InfeasibleBudgetError."""

from __future__ import annotations

import pytest

from solvers.core.validator import validate_schedule
from solvers import InfeasibleBudgetError, Problem, SolveStatus, solve
from solvers.heuristics import (
    TORCH_GREEDY_BUCKET_CAP_BYTES,
    AutoParallelConfig,
    BlockGroups,
    FSDP2Config,
    SimpleFSDPConfig,
    autoparallel_schedule,
    compute_gaps,
    fsdp2_blocks,
    fsdp2_schedule,
    heuristic_result,
    simplefsdp_schedule,
)
from scheduler.whatif.synthetic import DagBuilder, make_fsdp_dag

HEURISTICS = ["traced", "fsdp2", "perblock", "simplefsdp", "autoparallel"]
MiB = 1 << 20


def _problem(**kw) -> Problem:
    base = dict(n_layers=3, params_per_layer=3, param_bytes=64 * MiB, world_size=16, compute_ms_per_node=0.3)
    base.update(kw)
    return Problem.from_dag(make_fsdp_dag(**base))


GRAPHS = {
    "fw": dict(graph_kind="forward"),
    "fw-2groups-seeded": dict(graph_kind="forward", n_groups=2, seed=7),
    "bw": dict(graph_kind="backward"),
    "bw-reshard": dict(graph_kind="backward", reshard_after_forward=True, seed=3),
    "bw-fp32-noembed": dict(graph_kind="backward", param_dtype="float32", with_embeddings=False),
}


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("name", HEURISTICS)
def test_heuristic_schedules_are_valid(name, graph):
    p = _problem(**GRAPHS[graph])
    res = solve(p, solver=name)
    sim = validate_schedule(p, res.schedule)
    assert res.status is SolveStatus.HEURISTIC and res.solver == name
    assert res.objective_ms == pytest.approx(sim.step_ms)
    assert res.peak_bytes == sim.peak_bytes
    assert res.best_bound_ms == pytest.approx(p.lower_bound_ms())
    assert res.best_bound_ms <= res.objective_ms + 1e-9


def test_overlap_heuristics_beat_traced():
    """Comm-heavy forward (inter-node group): prefetching must hide some communication."""
    p = _problem(graph_kind="forward")
    traced = solve(p, solver="traced").objective_ms
    assert solve(p, solver="fsdp2").objective_ms < traced
    assert solve(p, solver="autoparallel").objective_ms < traced


def test_fsdp2_buckets_equal_blocks():
    """Forward params: tok_embeddings | layers.0.* | layers.1.* | layers.2.* | norm, output."""
    p = _problem(graph_kind="forward")
    blocks = fsdp2_blocks(p)
    buckets = [[p.colls[m].fqns[0] for m in b.members] for b in fsdp2_schedule(p).buckets]
    assert buckets[0] == ["tok_embeddings.weight"]
    for layer in range(3):
        assert buckets[1 + layer] == [f"layers.{layer}.{n}" for n in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")]
    assert buckets[4] == ["norm.weight", "output.weight"]
    assert {blocks[m] for m in p.colls} == {"root", "layers.0", "layers.1", "layers.2"}


def test_fsdp2_prefetches_one_block_ahead():
    """Bucket k+1 is issued at the gap where bucket k is needed; the first is issued at its
    own need (exposed). Reduce-scatters: issued after the block's last gradient, waited when
    the next one is issued."""
    p = _problem(graph_kind="backward", reshard_after_forward=True)
    s = fsdp2_schedule(p)
    issue, wait = s.positions()
    ags = [i for i, b in enumerate(s.buckets) if p.colls[b.members[0]].coll_type == "all_gather"]
    rss = [i for i, b in enumerate(s.buckets) if p.colls[b.members[0]].coll_type == "reduce_scatter"]
    needed = {i: min(p.colls[m].needed for m in s.buckets[i].members) for i in ags}
    ags.sort(key=lambda i: needed[i])
    assert issue[ags[0]] == needed[ags[0]]
    for prev, nxt in zip(ags, ags[1:]):
        assert issue[nxt] == needed[prev]
        assert wait[nxt] == needed[nxt]
    rss.sort(key=lambda i: issue[i])
    for i in rss:
        assert issue[i] == max(p.colls[m].ready for m in s.buckets[i].members)
    for prev, nxt in zip(rss, rss[1:]):
        assert wait[prev] == issue[nxt]
    assert wait[rss[-1]] == p.n
    # "waited just before the next is issued": the wait step precedes the issue step
    steps = list(s.steps)
    for prev, nxt in zip(rss, rss[1:]):
        assert steps.index(_step("wait", prev)) < steps.index(_step("issue", nxt))


def _step(kind, ref):
    from solvers.core.schedule import Step

    return Step(kind, ref)


def test_simplefsdp_buckets_by_cap_at_earliest_traced_issue():
    """Cap of 2.5 parameters: buckets of two consecutive chain members; each issued where its
    first member was traced and waited right before its first use."""
    p = _problem(graph_kind="forward", with_embeddings=False)
    member_bytes = max(max(c.payload_bytes, c.out_bytes) for c in p.colls.values())
    s = simplefsdp_schedule(p, SimpleFSDPConfig(bucket_cap_bytes=int(2.5 * member_bytes)))
    chain = next(iter(p.chains.values()))
    assert [b.members for b in s.buckets] == [tuple(chain[i : i + 2]) for i in range(0, len(chain), 2)]
    issue, wait = s.positions()
    for b, i, w in zip(s.buckets, issue, wait):
        assert i == min(p.colls[m].traced_issue for m in b.members)
        assert w == min(p.colls[m].needed for m in b.members)
    assert TORCH_GREEDY_BUCKET_CAP_BYTES == 2000 * MiB


def test_autoparallel_prefetch_and_reduce_scatter_distances():
    """Every all-gather is issued min(50, available) compute nodes before its need (here with
    a limit of 4 to see it bind); every reduce-scatter waits at most 2 compute nodes after its
    issue (the end of the graph caps it)."""
    cfg = AutoParallelConfig(max_prefetch_compute_nodes=4, max_rs_compute_nodes=2, bucket_cap_bytes=0)
    fw = _problem(graph_kind="forward")
    s = autoparallel_schedule(fw, cfg)
    cnt = compute_gaps(fw)
    issue, wait = s.positions()
    for b, i, w in zip(s.buckets, issue, wait):
        (m,) = b.members
        need = fw.colls[m].needed
        assert w == need
        assert cnt[need] - cnt[i] == min(4, cnt[need])
    bw = _problem(graph_kind="backward")
    s = autoparallel_schedule(bw, cfg)
    cnt = compute_gaps(bw)
    issue, wait = s.positions()
    for b, i, w in zip(s.buckets, issue, wait):
        assert i == bw.colls[b.members[0]].ready
        assert cnt[w] - cnt[i] == min(2, cnt[bw.n] - cnt[i])


def test_autoparallel_default_prefetch_is_50_compute_nodes():
    """A long graph (73 compute nodes): the last all-gathers are issued 50 compute nodes early."""
    p = _problem(graph_kind="forward", n_layers=8, params_per_layer=9, param_bytes=4 * MiB)
    s = autoparallel_schedule(p, AutoParallelConfig(bucket_cap_bytes=0))
    cnt = compute_gaps(p)
    issue, wait = s.positions()
    dist = [cnt[w] - cnt[i] for i, w in zip(issue, wait)]
    assert max(dist) == 50 and dist[0] == 0


def test_autoparallel_buckets_only_primary_group():
    """Two groups with twice the bytes on group "0" (every even parameter is larger): only
    group "0" collectives are merged."""
    b = DagBuilder(group_sizes={"0": 8, "1": 8})
    b.add_input("x", size_bytes=64)
    h = "x"
    for k in range(4):
        b.add_input(f"primals_{k}", size_bytes=400 if k % 2 == 0 else 100, releasable=False)
        w = b.add_collective(f"ag{k}", f"primals_{k}", group=str(k % 2), runtime_ms=1.0)
        h = b.add_compute(f"mm{k}", h, w, runtime_ms=1.0, size_bytes=64)
    b.add_output(h)
    p = Problem.from_dag(b.build())
    s = autoparallel_schedule(p)
    assert sorted(b.members for b in s.buckets) == [("ag0", "ag2"), ("ag1",), ("ag3",)]
    validate_schedule(p, s)


@pytest.mark.parametrize("name", ["fsdp2", "perblock", "simplefsdp", "autoparallel"])
def test_budget_is_respected_by_shrinking(name):
    """A budget between the smallest reachable peak and the unconstrained one is met."""
    p = _problem(graph_kind="backward", reshard_after_forward=True)
    free = solve(p, solver=name)
    traced = solve(p, solver="traced")
    assert traced.peak_bytes < free.peak_bytes  # the budget below binds
    budget = (traced.peak_bytes + free.peak_bytes) // 2
    res = solve(p, solver=name, mem_budget_bytes=budget)
    assert res.peak_bytes <= budget
    assert res.schedule.digest() != free.schedule.digest()  # another schedule of the heuristic: shrunk
    validate_schedule(p, res.schedule, mem_budget_bytes=budget)


@pytest.mark.parametrize("name", HEURISTICS)
def test_impossible_budget_raises(name):
    p = _problem(graph_kind="forward")
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(p, solver=name, mem_budget_bytes=1 << 20)
    assert e.value.mem_budget_bytes == 1 << 20
    assert e.value.min_peak_bytes is not None and e.value.min_peak_bytes > 1 << 20
    # min_peak_bytes is reachable: asking for it succeeds
    assert solve(p, solver=name, mem_budget_bytes=e.value.min_peak_bytes).peak_bytes <= e.value.min_peak_bytes


def test_fixed_collectives_stay_where_traced():
    """x --> mm0 <-- AG0 ; mm0 --> AR (fixed all-reduce) --> mm1 <-- AG1
    The all-reduce is not movable: every heuristic keeps it alone at its traced gaps."""
    b = DagBuilder()
    b.add_input("x", size_bytes=64)
    for k in range(2):
        b.add_input(f"primals_{k}", size_bytes=16, releasable=False)
    w0 = b.add_collective("ag0", "primals_0", runtime_ms=1.0)
    h = b.add_compute("mm0", "x", w0, runtime_ms=1.0, size_bytes=64)
    r = b.add_collective("ar", h, coll_type="all_reduce", runtime_ms=0.5, movable=False)
    w1 = b.add_collective("ag1", "primals_1", runtime_ms=1.0)
    h = b.add_compute("mm1", r, w1, runtime_ms=1.0, size_bytes=64)
    b.add_output(h)
    p = Problem.from_dag(b.build())
    for name in HEURISTICS:
        s = solve(p, solver=name).schedule
        validate_schedule(p, s)
        idx = s.bucket_of()["ar"]
        assert s.buckets[idx].members == ("ar",)
        issue, wait = s.positions()
        assert (issue[idx], wait[idx]) == (p.colls["ar"].traced_issue, p.colls["ar"].traced_wait)


def test_heuristic_result_reports_simulation():
    import time

    p = _problem(graph_kind="forward")
    res = heuristic_result(p, p.traced_schedule(), "mine", SolveStatus.FEASIBLE, time.perf_counter(), notes=("x",))
    assert (res.solver, res.status, res.notes) == ("mine", SolveStatus.FEASIBLE, ("x",))
    assert res.objective_ms == pytest.approx(solve(p, solver="traced").objective_ms)
    assert res.solve_time_s >= 0


def test_block_groups_merge_consecutive_blocks_from_start():
    """Two blocks per all-gather bucket from the second block on: emb | L0 | L1+L2 | L3+L4 |
    norm, output; the root's buckets never merge with a block's. Reduce-scatters untouched."""
    p = _problem(graph_kind="forward", n_layers=5)
    cfg = FSDP2Config(gather_groups=BlockGroups(size=2, start=1))
    s = fsdp2_schedule(p, cfg)
    validate_schedule(p, s)
    layers = [sorted({p.colls[m].fqns[0].split(".")[1] if p.colls[m].fqns[0].startswith("layers.") else "root"
                      for m in b.members}) for b in s.buckets]
    assert layers == [["root"], ["0"], ["1", "2"], ["3", "4"], ["root"]]
    assert BlockGroups(size=3).apply([("a",), ("b",), ("r",), ("c",)], lambda r: r != ("r",)) == [
        ("a", "b"), ("r",), ("c",)]
    with pytest.raises(ValueError, match="size >= 1"):
        BlockGroups(size=0)


def test_plan_waits_first_orders_its_gap():
    """One plan, two orders of a gap: reduce-scatter ``a`` waited in the gap where ``b`` (the
    next of its chain) is issued. Listed in ``waits_first`` (FSDP2 frees the previous
    gradient bucket before issuing the next) its wait runs before that issue; otherwise after.
    Every other collective stays where traced."""
    from solvers.core.plan import PlannedBucket
    from solvers.core.schedule import Bucket
    from solvers.heuristics import schedule_from_plan

    p = _problem(graph_kind="backward")
    chain = next(names for key, names in p.chains.items() if key[0] == "reduce_scatter")
    a, b = p.colls[chain[0]], p.colls[chain[1]]
    gap = b.ready
    assert a.ready <= gap <= a.needed  # ``a`` can be waited where ``b`` is issued
    issue, wait = p.traced_schedule().positions()
    plan = [PlannedBucket(bk, issue[k], wait[k]) for k, bk in enumerate(p.traced_schedule().buckets)
            if bk.members[0] not in (a.name, b.name)]
    plan += [PlannedBucket(Bucket((a.name,)), a.ready, gap), PlannedBucket(Bucket((b.name,)), gap, b.needed)]

    def order(schedule):
        index = {bk.members: k for k, bk in enumerate(schedule.buckets)}
        steps = [(s.kind, s.ref) for s in schedule.steps]
        return steps.index(("wait", index[(a.name,)])) < steps.index(("issue", index[(b.name,)]))

    first = schedule_from_plan(p, plan, waits_first={Bucket((a.name,))})
    last = schedule_from_plan(p, plan)
    assert order(first) and not order(last)
    for schedule in (first, last):
        validate_schedule(p, schedule)
