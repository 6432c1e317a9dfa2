"""The fast evaluator (solvers/core/evaluate.py) gives the simulator's numbers.

Every schedule here is valid (``validate_schedule`` accepts it, and returns the simulation the
evaluator is compared with): step time within 1e-9 relative (in practice the same float), both
peak counts to the byte, on

- every heuristic's schedule and random valid schedules (random merges of consecutive chain
  members, random issue and wait gaps inside the issue ranges, random payload order) of synthetic
  FSDP DAGs (hypothesis), llama3-debug's forward and backward (llama3-8b's, slow), the foreign
  styles of ``tests/foreign_models.py``, graphs re-exported after a write-back (merged
  all-gathers already in the graph: ``all_gather_into_tensor_out``), ops of several results
  (topk, sort, batch norm, a flash attention's ``(out, lse)``, a value read by nothing),
  collectives waited several times and chains of collectives (``tests/test_wait_chains.py``),
  random programs of ``tests/random_programs.py`` (waits on graph inputs among them) and joint
  graphs (``models/joint.py``, the foreign styles' joint captures);
- the neighbours the polish generates, read from their plans without building them;
- one schedule under two cost models of one graph (memory counted once).

The fast path must be the one taken on those graphs (``Evaluator.fast``, ``ReadSchedule.fast``): a
fallback to the simulator would make the equality trivial. Where the evaluator cannot place a
storage, or the simulator's static data disagree with its rules, it falls back and the numbers
are still the simulator's. The minimax polish gives the same result with the evaluator as with
every evaluation forced through the simulator.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_wait_chains
from random_programs import random_program, trace_program
from scheduler import export_dag
from scheduler.whatif.synthetic import DagBuilder, make_fsdp_dag
from solvers import solve
from solvers.core import memory, simulator
from solvers.core.evaluate import Evaluator, ModelEvaluator
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule
from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.validator import validate_schedule
from solvers.core.plan import PlannedBucket, build_schedule, chain_ordered
from solvers.heuristics import fixed_buckets, schedule_from_plan, split_feasible, issue_range
from solvers.polish import PolishConfig, _neighbours, _plan_of, polish
from solvers.starts import regroup, regroupings
from test_writeback import gloo_group

HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")
REL = 1e-9


def assert_same(sim, ev) -> None:
    """The evaluation ``ev`` carries the simulation ``sim``'s numbers."""
    scale = max(1.0, abs(sim.step_ms))
    assert abs(ev.step_ms - sim.step_ms) <= REL * scale
    assert abs(ev.exposed_comm_ms - sim.exposed_comm_ms) <= REL * scale
    assert abs(ev.compute_ms - sim.compute_ms) <= REL * scale
    assert ev.comm_ms.keys() == sim.comm_ms.keys()
    assert all(abs(ev.comm_ms[g] - sim.comm_ms[g]) <= REL * scale for g in sim.comm_ms)
    assert ev.peak_bytes == sim.peak_bytes
    assert ev.tracker_peak_bytes == sim.tracker_peak_bytes
    assert ev.max_peak_bytes == sim.max_peak_bytes
    assert ev.n_collectives == sim.n_collectives


def check(ev: Evaluator, schedule: Schedule) -> None:
    """``schedule`` is valid, evaluated on the fast path, with the simulator's numbers."""
    sim = validate_schedule(ev.problem, schedule)
    read = ev.read(schedule)
    assert read.fast
    assert_same(sim, ev.evaluate(read))


def heuristic_schedules(problem: Problem) -> list[Schedule]:
    return [solve(problem, solver=h).schedule for h in HEURISTICS]


def random_schedule(problem: Problem, rng: random.Random) -> Schedule:
    """A random valid schedule: chains cut into random runs (split where issue ranges do not
    meet), members in random payload order now and then, issue and wait gaps anywhere in the range
    (often at its ends), waits first or last in their gap."""
    plan = list(fixed_buckets(problem))
    waits_first = set()
    keep = rng.random()
    for chain in problem.chains.values():
        runs: list[list[str]] = [[]]
        for m in chain:
            if runs[-1] and rng.random() > keep:
                runs.append([])
            runs[-1].append(m)
        for run in runs:
            for piece in split_feasible(problem, run):
                lo, hi = issue_range(problem, piece)
                issue = rng.choice([lo, hi, rng.randint(lo, hi)])
                wait = rng.choice([issue, hi, rng.randint(issue, hi)])
                members = list(piece)
                if rng.random() < 0.2:
                    rng.shuffle(members)
                plan.append(PlannedBucket(Bucket(tuple(members)), issue, wait))
                if rng.random() < 0.5:
                    waits_first.add(plan[-1].bucket)
    return schedule_from_plan(problem, plan, waits_first=waits_first)


@st.composite
def schedules(draw, problem: Problem) -> Schedule:
    """The hypothesis form of :func:`random_schedule`: every cut, gap and order drawn."""
    plan = list(fixed_buckets(problem))
    waits_first = set()
    for chain in problem.chains.values():
        runs: list[list[str]] = [[]]
        for m in chain:
            if runs[-1] and draw(st.booleans()):
                runs.append([])
            runs[-1].append(m)
        for run in runs:
            for piece in split_feasible(problem, run):
                lo, hi = issue_range(problem, piece)
                issue = draw(st.integers(lo, hi))
                wait = draw(st.integers(issue, hi))
                members = tuple(draw(st.permutations(piece))) if len(piece) > 1 else tuple(piece)
                plan.append(PlannedBucket(Bucket(members), issue, wait))
                if draw(st.booleans()):
                    waits_first.add(plan[-1].bucket)
    return schedule_from_plan(problem, plan, waits_first=waits_first)


SYNTHETIC = [
    dict(graph_kind="forward"),
    dict(graph_kind="backward"),
    dict(graph_kind="forward", reshard_after_forward=True, seed=1),
    dict(graph_kind="backward", reshard_after_forward=True, seed=2),
    dict(graph_kind="backward", n_groups=2, seed=3),
    dict(graph_kind="forward", param_dtype="float32", n_groups=2),
    dict(graph_kind="backward", with_embeddings=False, params_per_layer=2, seed=4),
]


# --------------------------------------------------------------------------------------------
# synthetic DAGs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", SYNTHETIC, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_heuristics_and_random_schedules_of_synthetic_dags(kw):
    problem = Problem.from_dag(make_fsdp_dag(n_layers=4, **kw))
    ev = Evaluator(problem)
    assert ev.fast
    rng = random.Random(0)
    for schedule in heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(30)]:
        check(ev, schedule)
    assert ev.fallbacks == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_random_schedules(data):
    dag = make_fsdp_dag(
        n_layers=data.draw(st.integers(1, 4)),
        params_per_layer=data.draw(st.integers(1, 4)),
        param_bytes=data.draw(st.sampled_from([1 << 16, 1 << 20, 16 << 20])),
        compute_ms_per_node=data.draw(st.sampled_from([0.05, 0.5, 2.0])),
        graph_kind=data.draw(st.sampled_from(["forward", "backward"])),
        reshard_after_forward=data.draw(st.booleans()),
        n_groups=data.draw(st.integers(1, 2)),
        seed=data.draw(st.integers(0, 10_000)),
        param_dtype=data.draw(st.sampled_from(["bfloat16", "float32"])),
    )
    problem = Problem.from_dag(dag)
    check(Evaluator(problem), data.draw(schedules(problem)))


def neighbour_checks(problem: Problem, start: Schedule, limit: int, rng: random.Random) -> int:
    """The polish's neighbours of ``start``, read from their plans: the same steps as the schedule
    ``build_schedule`` builds, and its simulation's numbers. Returns how many were checked."""
    ev = Evaluator(problem)
    moves = list(_neighbours(problem, _plan_of(start), PolishConfig()))
    rng.shuffle(moves)
    checked = 0
    for entries in moves[:limit]:
        ordered = chain_ordered(problem, entries)
        if ordered is None:
            continue
        built = build_schedule(problem, ordered)
        planned = ev.read_plan(ordered)
        read = ev.read(built)
        assert (planned.members, planned.steps, planned.fast) == (read.members, read.steps, read.fast)
        assert planned.to_schedule(problem).digest() == built.digest()
        assert_same(simulate(problem.dag, built, problem=problem), ev.evaluate(planned))
        checked += 1
    return checked


def _consumed_results_dag(n: int = 5):
    """Reduce-scatter results read by compute nodes, not the output: freed at a fixed node,
    or (torch's tracker, merged bucket) at the last reader of any member's result. Each
    gradient is also read by the next compute node, inside its reduce-scatter's issue range: freed by
    whichever of the two runs later.

        x -> grad_i (4 MiB) -> act_i -> ... ;  grad_i -> rs_i -> wait_i -> use_i (after every act)
    """
    b = DagBuilder("consumed", graph_kind="backward")
    prev = b.add_input("x", size_bytes=1 << 20)
    waits = []
    for i in range(n):
        grad = b.add_compute(f"grad_{i}", prev, size_bytes=4 << 20, runtime_ms=0.5)
        prev = b.add_compute(f"act_{i}", grad, size_bytes=1 << 20, runtime_ms=0.3)
        waits.append(b.add_collective(f"rs_{i}", grad, coll_type="reduce_scatter", fqn=f"layers.{i}.w.weight",
                                      param_index=i))
    uses = [b.add_compute(f"use_{i}", w, size_bytes=1 << 18, runtime_ms=0.2) for i, w in enumerate(waits)]
    b.add_output(prev, *uses)
    return b.build()


def test_results_freed_at_compute_nodes():
    problem = Problem.from_dag(_consumed_results_dag())
    ev = Evaluator(problem)
    assert ev.fast
    rng = random.Random(8)
    for schedule in heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(60)]:
        check(ev, schedule)
    # the frees at fixed nodes that depend on the bucketing, and those at whichever of a node
    # and a step runs later, were met
    assert any(t.node for t in ev.memory.templates.values())
    assert ev.memory.floating
    assert neighbour_checks(problem, solve(problem, solver="fsdp2").schedule, 60, rng) > 0


def _random_program(rng: random.Random):
    """A random program of compute nodes, views, all-gathers of pinned shards (with or without
    a cast) and reduce-scatters of computed values, each value read by zero to three later
    nodes or collectives; some results reach the output, others are read by compute nodes.
    Collectives that read another's result are kept where traced."""
    b = DagBuilder("random", graph_kind="backward")
    live = [b.add_input("x", size_bytes=rng.choice([1 << 16, 1 << 20]))]
    k = 0
    for i in range(rng.randint(6, 18)):
        r = rng.random()
        if r < 0.25:
            shard = b.add_input(f"w{i}", size_bytes=rng.choice([1 << 12, 1 << 16]), releasable=False)
            live.append(b.add_collective(f"ag{i}", shard, fqn=f"layers.{k}.w{i}.weight", param_index=i,
                                         cast=rng.random() < 0.5))
            k += rng.random() < 0.4
        elif r < 0.45:
            src = rng.choice(live)
            live.append(b.add_collective(f"rs{i}", src, coll_type="reduce_scatter", fqn=f"layers.{k}.g{i}.weight",
                                         param_index=100 + i))
        elif r < 0.55:
            live.append(b.add_view(f"v{i}", rng.choice(live)))
        else:
            ins = rng.sample(live, min(len(live), rng.randint(1, 2)))
            live.append(b.add_compute(f"op{i}", *ins, size_bytes=rng.choice([0, 1 << 14, 1 << 18, 1 << 20]),
                                      runtime_ms=rng.choice([0.01, 0.2, 1.0])))
        if len(live) > 4 and rng.random() < 0.3:
            live.pop(rng.randrange(len(live) - 1))  # no longer read (by what follows)
    b.add_compute("last", *live[-2:], size_bytes=1 << 10, runtime_ms=0.1)
    b.add_output("last", *rng.sample(live, min(len(live), 2)))
    return b.build()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_programs(seed):
    """Random programs: where the evaluator takes the fast path its numbers are the simulator's
    on random valid schedules; where it falls back, they are too. The polish's neighbours too,
    read from entries, valid or not (a fixed collective issued in the gap of the wait it reads,
    before that wait, is no valid schedule: the checks send it to the simulator)."""
    rng = random.Random(seed)
    problem = Problem.from_dag(_random_program(rng))
    ev = Evaluator(problem)
    schedules = [problem.traced_schedule()] + [random_schedule(problem, rng) for _ in range(8)]
    for schedule in schedules:
        assert_same(validate_schedule(problem, schedule), ev.evaluate(schedule))
    for entries in _neighbours(problem, _plan_of(schedules[-1]), PolishConfig())[:15]:
        ordered = chain_ordered(problem, entries)
        if ordered is not None:
            built = build_schedule(problem, ordered)
            assert_same(simulate(problem.dag, built, problem=problem), ev.evaluate(ev.read_plan(ordered)))


def test_random_programs_take_the_fast_path():
    """The fast path covers these random programs (the property above is not vacuous)."""
    fast = sum(Evaluator(Problem.from_dag(_random_program(random.Random(s)))).fast for s in range(40))
    assert fast == 40


def test_polish_neighbours_read_from_plans():
    rng = random.Random(1)
    for kw in SYNTHETIC:
        problem = Problem.from_dag(make_fsdp_dag(n_layers=3, **kw))
        starts = (solve(problem, solver="fsdp2").schedule, random_schedule(problem, rng))
        assert sum(neighbour_checks(problem, start, 40, rng) for start in starts) > 0


def test_two_cost_models_share_one_memory_count():
    """One graph priced twice: the memory of a schedule is counted once for both, each
    timeline is its own model's, and both equal the simulator under that model."""
    slow, fast = (Problem.from_dag(make_fsdp_dag(n_layers=4, graph_kind="backward", seed=5, world_size=64,
                                                 cluster=_cluster(gbps))) for gbps in (25.0, 400.0))
    both = ModelEvaluator({"slow": slow, "fast": fast})
    assert both.memory_of == {"slow": "slow", "fast": "slow"}
    rng = random.Random(2)
    differ = 0
    for schedule in heuristic_schedules(slow) + [random_schedule(slow, rng) for _ in range(10)]:
        evals = both.evaluate(schedule)
        for label, p in (("slow", slow), ("fast", fast)):
            assert_same(simulate(p.dag, schedule, problem=p), evals[label])
        differ += evals["slow"].step_ms != evals["fast"].step_ms
    assert differ > 0


def _cluster(inter_node_gbps: float):
    from scheduler.costs.hardware import Cluster

    return Cluster(n_gpus=64, inter_node_gbps=inter_node_gbps)


def test_model_evaluator_refuses_problems_of_other_graphs():
    a = Problem.from_dag(make_fsdp_dag(n_layers=2, graph_kind="forward"))
    b = Problem.from_dag(make_fsdp_dag(n_layers=3, graph_kind="forward"))
    with pytest.raises(ValueError, match="same graph"):
        ModelEvaluator({"a": a, "b": b})
    with pytest.raises(ValueError):
        ModelEvaluator({})


# --------------------------------------------------------------------------------------------
# schedules the fast path does not take, graphs it does not cover: still the simulator's numbers
# --------------------------------------------------------------------------------------------
def test_schedule_outside_its_issue_range_is_refused_by_both():
    """A reduce-scatter issued before its gradient exists is no valid schedule: the simulator
    refuses it (no clock of a node run before its input means anything), and so does the
    evaluator, so no stage of the search can rank it."""
    problem = Problem.from_dag(make_fsdp_dag(n_layers=3, graph_kind="backward"))
    rs = next(c for c in problem.colls.values() if c.coll_type == "reduce_scatter" and c.ready > 0)
    entries = [(b, i, w) for b, i, w in _plan_of(problem.traced_schedule()) if b.members != (rs.name,)]
    early = build_schedule(problem, entries + [(Bucket((rs.name,)), 0, rs.ready)])
    with pytest.raises(ScheduleInvalidError, match="outside the issue range"):
        simulate(problem.dag, early, problem=problem)
    with pytest.raises(ScheduleInvalidError, match="outside the issue range"):
        Evaluator(problem).evaluate(early)


def test_wait_before_issue_is_refused_as_by_the_simulator():
    problem = Problem.from_dag(make_fsdp_dag(n_layers=2, graph_kind="forward"))
    traced = problem.traced_schedule()
    steps = list(traced.steps)
    k = next(i for i, s in enumerate(steps) if s.kind == "issue")
    w = next(i for i, s in enumerate(steps) if s.kind == "wait" and s.ref == steps[k].ref)
    steps[k], steps[w] = steps[w], steps[k]
    bad = Schedule(traced.buckets, tuple(steps))
    with pytest.raises(ScheduleInvalidError):
        simulate(problem.dag, bad, problem=problem)
    with pytest.raises(ScheduleInvalidError):
        Evaluator(problem).evaluate(bad)


def _shared_input_dag():
    """One cast read by two all-gathers: whichever of them runs last frees it.

        x (releasable) -> y = cast(x) -> ag_a(y), ag_b(y) -> mm_a, mm_b -> output
    """
    b = DagBuilder("shared", graph_kind="forward")
    b.add_input("x", size_bytes=1 << 20)
    b.add_input("h", size_bytes=1 << 16, releasable=False)
    y = b.add_compute("y", "x", size_bytes=1 << 20, runtime_ms=0.1)
    b.add_compute("pad", "h", size_bytes=1 << 16, runtime_ms=0.5)
    wa = b.add_collective("ag_a", y, fqn="layers.0.a.weight", param_index=0)
    wb = b.add_collective("ag_b", y, fqn="layers.0.b.weight", param_index=1)
    ma = b.add_compute("mm_a", "pad", wa, size_bytes=1 << 16, runtime_ms=1.0)
    mb = b.add_compute("mm_b", ma, wb, size_bytes=1 << 16, runtime_ms=1.0)
    b.add_output(mb)
    return b.build()


def test_storage_read_by_two_collectives():
    problem = Problem.from_dag(_shared_input_dag())
    ev = Evaluator(problem)
    assert ev.fast and ev.memory.floating
    rng = random.Random(3)
    for schedule in heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(30)]:
        check(ev, schedule)


def _result_read_by_a_collective_dag():
    """A reduce-scatter's result, through a view, reduce-scattered again: torch's tracker
    counts the first result under its bucket's wait result when it is merged, which the second
    collective's release would have to follow.

        g0, g1 -> rs0, rs1 ; view(wait(rs0)) -> rs2 -> output
    """
    b = DagBuilder("chained", graph_kind="backward")
    x = b.add_input("x", size_bytes=1 << 20)
    g0 = b.add_compute("g0", x, size_bytes=1 << 20, runtime_ms=0.5)
    g1 = b.add_compute("g1", g0, size_bytes=1 << 20, runtime_ms=0.5)
    w0 = b.add_collective("rs0", g0, coll_type="reduce_scatter", fqn="layers.0.a.weight", param_index=0)
    w1 = b.add_collective("rs1", g1, coll_type="reduce_scatter", fqn="layers.0.b.weight", param_index=1)
    v = b.add_view("v", w0)
    w2 = b.add_collective("rs2", v, coll_type="reduce_scatter", fqn="layers.1.c.weight", param_index=2)
    b.add_compute("tail", g1, size_bytes=1 << 10, runtime_ms=0.3)
    b.add_output("tail", w1, w2)
    return b.build()


def test_result_read_by_another_collective():
    """The first result is freed by whichever of its readers runs last, alone or as the merged
    bucket's result: placed per schedule read, the simulator's numbers without simulating."""
    problem = Problem.from_dag(_result_read_by_a_collective_dag())
    schedules = check_graph(problem, random.Random(3), n_random=30)
    assert _views_merged(problem, schedules)


def test_rules_out_of_step_with_the_static_data_fall_back():
    """Where the simulator's uses of a storage are not the releases the evaluator's rules make
    (the simulator's rules changed under it), the evaluator does not guess."""
    problem = Problem.from_dag(make_fsdp_dag(n_layers=2, graph_kind="backward"))
    st = memory.static_memory(problem)
    key = next(k for k, n in st.mem_uses.items() if n and k not in st.mem_never_free)
    memory._STATIC[problem] = dataclasses.replace(st, mem_uses={**st.mem_uses, key: st.mem_uses[key] + 1})
    ev = Evaluator(problem)
    assert not ev.fast
    for schedule in heuristic_schedules(problem):
        assert_same(simulate(problem.dag, schedule, problem=problem), ev.evaluate(schedule))


def merged_pairs_schedule(problem: Problem) -> Schedule | None:
    """Consecutive pairs of each chain merged where their issue ranges meet, issued at the range's
    start and waited at its end; everything else alone where traced (None: nothing to merge)."""
    buckets, issue, wait = [], [], []
    paired: set[str] = set()
    colls = problem.colls
    for chain in problem.chains.values():
        for a, b in zip(chain[::2], chain[1::2]):
            lo, hi = max(colls[a].ready, colls[b].ready), min(colls[a].needed, colls[b].needed)
            if lo <= hi:
                buckets.append(Bucket((a, b)))
                issue.append(lo)
                wait.append(hi)
                paired.update((a, b))
    if not paired:
        return None
    for m, c in colls.items():
        if m not in paired:
            buckets.append(Bucket((m,)))
            issue.append(c.traced_issue)
            wait.append(c.traced_wait)
    return Schedule.from_positions(problem.seq, buckets, issue, wait)


def canary(problem: Problem) -> dict[str, tuple]:
    """The evaluator's peaks and the simulator's on the traced schedule and on one with merged
    buckets (:func:`merged_pairs_schedule`; left out where it is invalid or fails the
    evaluator's cheap checks): name -> (evaluator's, simulator's). They differ where the
    simulator follows a rule that the evaluator's analysis does not see."""
    ev = Evaluator(problem)
    out = {}
    for name, schedule in (("traced", problem.traced_schedule()), ("merged", merged_pairs_schedule(problem))):
        try:
            read = None if schedule is None else ev.read(schedule)
        except ScheduleInvalidError:
            continue
        found = None if read is None else ev.peaks(read)
        if found is not None:
            sim = simulate(problem.dag, schedule, problem=problem)
            out[name] = (found, (sim.peak_bytes, sim.tracker_peak_bytes))
    return out


def assert_canary(problem: Problem) -> None:
    compared = canary(problem)
    assert "traced" in compared
    assert all(found == simulated for found, simulated in compared.values()), compared


@pytest.mark.parametrize("kw", SYNTHETIC, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_canary_on_synthetic_dags(kw):
    """The traced and a merged schedule of each synthetic DAG: the evaluator's peaks are the
    simulator's (the same check runs on every captured graph below, :func:`check_graph`)."""
    problem = Problem.from_dag(make_fsdp_dag(n_layers=4, **kw))
    assert "merged" in canary(problem)
    assert_canary(problem)


def test_canary_sees_a_rule_change_the_static_data_do_not_show(monkeypatch):
    """A simulator whose compute nodes also allocate a scratch storage that is never freed (its
    uses unchanged, so the evaluator's build-time guard passes): the canary names the
    difference, so a change made to one side only fails the tests."""
    original = simulator.Simulator._run_node

    def with_scratch(self, k, name):
        original(self, k, name)
        self.mem.alloc(f"scratch:{name}", 4096)

    monkeypatch.setattr(simulator.Simulator, "_run_node", with_scratch)
    problem = Problem.from_dag(make_fsdp_dag(n_layers=3, params_per_layer=3, graph_kind="backward", seed=77))
    assert Evaluator(problem).fast
    compared = canary(problem)
    assert len(compared) == 2 and all(found != simulated for found, simulated in compared.values())


# --------------------------------------------------------------------------------------------
# captured graphs: llama3-debug, the foreign styles, written graphs re-exported
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_debug():
    from conftest import capture_llama_debug

    return capture_llama_debug(n_layers=2)


def _export(gm, **kw):
    from models.capture import fake_process_group

    with fake_process_group(4):
        return export_dag(gm, **kw)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_llama_debug(llama_debug, kind):
    problem = Problem.from_dag(_export(getattr(llama_debug, kind)))
    ev = Evaluator(problem)
    assert ev.fast
    assert_canary(problem)
    rng = random.Random(4)
    for schedule in heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(40)]:
        check(ev, schedule)
    assert neighbour_checks(problem, solve(problem, solver="fsdp2").schedule, 60, rng) > 0
    assert neighbour_checks(problem, random_schedule(problem, rng), 60, rng) > 0


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_llama_debug_under_two_cost_models(llama_debug, kind):
    """The same graph exported with the analytic model and torch's estimators."""
    gm = getattr(llama_debug, kind)
    problems = {cm: Problem.from_dag(_export(gm, cost_model=cm)) for cm in ("analytic", "torch")}
    both = ModelEvaluator(problems)
    assert both.memory_of == {"analytic": "analytic", "torch": "analytic"}
    rng = random.Random(5)
    p0 = problems["analytic"]
    for schedule in heuristic_schedules(p0) + [random_schedule(p0, rng) for _ in range(15)]:
        evals = both.evaluate(schedule)
        for label, p in problems.items():
            assert_same(simulate(p.dag, schedule, problem=p), evals[label])
    assert all(e.fallbacks == 0 for e in both.evaluators.values())


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("heuristic", ["fsdp2", "simplefsdp"])
def test_written_graphs_reexported(llama_debug, kind, heuristic):
    """A graph written back with merged buckets: its all-gathers write into bucket buffers
    (``all_gather_into_tensor_out``, no bytes of their own)."""
    from models.capture import fake_process_group
    from scheduler.writeback import apply_schedule

    gm = copy.deepcopy(getattr(llama_debug, kind))
    with fake_process_group(4):
        problem = Problem.from_dag(export_dag(gm))
        apply_schedule(gm, problem, solve(problem, solver=heuristic).schedule)
        again = Problem.from_dag(export_dag(gm))
    if kind == "forward":
        assert any(str(a["target"]).endswith("all_gather_into_tensor_out.default")
                   for _, a in again.dag.nodes(data=True))
    ev = Evaluator(again)
    assert ev.fast
    rng = random.Random(6)
    for schedule in heuristic_schedules(again) + [random_schedule(again, rng) for _ in range(20)]:
        check(ev, schedule)


def _foreign_styles():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import foreign_models as fm

    return fm


@pytest.mark.parametrize("style", ["tied", "alternating", "sac", "tp", "fp32", "moe"])
def test_foreign_styles(style):
    fm = _foreign_styles()
    captured = fm.capture(style, n_layers=2)
    rng = random.Random(7)
    for kind in ("forward", "backward"):
        problem = Problem.from_dag(_export(getattr(captured, kind)))
        ev = Evaluator(problem)
        assert ev.fast
        for schedule in heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(15)]:
            check(ev, schedule)


# --------------------------------------------------------------------------------------------
# memory counted result by result, collectives waited several times, chains of collectives,
# waits on graph inputs, joint graphs: the fast path, with the simulator's numbers
# --------------------------------------------------------------------------------------------
def check_graph(problem: Problem, rng: random.Random, n_random: int = 20, neighbours: int = 30) -> list[Schedule]:
    """The evaluator takes its fast path on ``problem`` and gives the simulator's numbers on
    every heuristic's schedule, random valid schedules and the polish's neighbours of FSDP2's
    schedule, none simulated instead. Returns the schedules checked (the neighbours aside)."""
    ev = Evaluator(problem)
    assert ev.fast, ev.reason
    assert_canary(problem)
    schedules = heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(n_random)]
    for schedule in schedules:
        check(ev, schedule)
    neighbour_checks(problem, schedules[1], neighbours, rng)
    assert ev.fallbacks == 0
    return schedules


def _views_merged(problem: Problem, schedules: list[Schedule]) -> bool:
    """Whether a schedule merges a bucket whose members are views of its result (a
    reduce-scatter, an all-gather on one rank)."""
    return any(len(b.members) > 1 and not memory.copied_out(problem.colls, b.members)
               for s in schedules for b in s.buckets)


_c10d = torch.ops._c10d_functional
N = 64  #: rows and columns of the square values of the traced programs below


def _multi_output_step(group_name: str):
    """An FSDP-like step whose compute returns several results, some read by nothing::

        a_i = wait(all_gather(w_i.to(bf16))).float()             i = 1, 2 (4 ranks)
        h = x @ a_1
        _, idx = topk(h, 8)                       # the values nobody reads but their getitem
        srt, _ = sort(h)                          # the indices likewise
        out, mean, invstd = batch_norm(h)         # the statistics returned
        att, _ = flash_attn(q, k, v)              # the log-sum-exp likewise
        exp(h)                                    # read by nothing at all
        z = (relu(out) + srt + att) @ a_2
        return wait(reduce_scatter(z.t() @ h)), idx, mean, invstd
    """
    import models.attention  # noqa: F401  (registers fsdp_sched::flash_attn)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from conftest import FAKE_WORLD

    heads, dim = 4, 16

    def f(primals_1, primals_2, x, q, k, v, rm, rv, gamma, beta):
        def gather(w):
            return _c10d.wait_tensor(_c10d.all_gather_into_tensor(w.to(torch.bfloat16), FAKE_WORLD, group_name)).float()

        h = x @ gather(primals_1)
        _, idx = torch.topk(h, 8)
        srt, _ = torch.sort(h, dim=1)
        out, mean, invstd = torch.ops.aten.native_batch_norm.default(h, gamma, beta, rm, rv, True, 0.1, 1e-5)
        att, _ = torch.ops.fsdp_sched.flash_attn(q, k, v, True, dim**-0.5)
        torch.exp(h)
        z = (torch.relu(out) + srt + att.reshape(N, N).float()) @ gather(primals_2)
        g = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(z.t() @ h, "sum", FAKE_WORLD, group_name))
        return g, idx, mean, invstd

    shapes = [((N // FAKE_WORLD, N), torch.float32)] * 2 + [((N, N), torch.float32)]
    shapes += [((1, N, heads, dim), torch.bfloat16)] * 3 + [((N,), torch.float32)] * 4
    with FakeTensorMode():
        args = [torch.randn(*shape, dtype=dtype) for shape, dtype in shapes]
    gm = make_fx(f, tracing_mode="fake")(*args)
    for i, n in enumerate(n for n in gm.graph.nodes if n.target is _c10d.all_gather_into_tensor.default):
        n.meta.update(fsdp_fqn=f"layers.{i}.w", fsdp_param_index=i)
    for n in gm.graph.nodes:
        if n.target is _c10d.reduce_scatter_tensor.default:
            n.meta.update(fsdp_param_index=0)
    return gm


def test_multi_output_ops(group_name):
    """topk and sort with a result only their getitem reads, batch norm with its statistics
    returned, a flash attention whose log-sum-exp only its getitem reads: each result a storage
    of its own, freed after its last reader while its siblings live on; a value read by nothing
    is freed at once by the execution model's count and never by torch's."""
    problem = Problem.from_dag(export_dag(_multi_output_step(group_name)))
    steps = memory.static_memory(problem).steps
    assert sum(len(steps[n][1]) > 1 for n in problem.seq) >= 4  # topk, sort, batch norm, attention
    assert any(steps[n][3] for n in problem.seq)  # the exp, read by nothing
    check_graph(problem, random.Random(9), n_random=40)


@pytest.mark.parametrize("program", ["several_waits", "chain"])
def test_collectives_waited_several_times_and_chains(program):
    """A reduce-scatter waited three times, and all_gather -> wait -> all_reduce chains (the
    graphs of ``tests/test_wait_chains.py``, on a gloo group of one rank: the first graph's
    all-gathers merge into views of one result)."""
    with gloo_group() as name:
        problem = Problem.from_dag(export_dag(test_wait_chains.traced(test_wait_chains.PROGRAMS[program](name))))
    schedules = check_graph(problem, random.Random(10), n_random=40)
    if program == "several_waits":
        assert any(len(c.result_readers) == 2 for c in problem.colls.values())
        assert _views_merged(problem, schedules)
    else:
        assert sum(bool(problem.issue_after[m]) for m in problem.colls) == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_random_programs_of_functional_collectives(seed):
    """Random programs of ``tests/random_programs.py`` (collectives waited several times and
    read far apart, all-reduces of gathered results, zero-size collectives, waits on graph
    inputs, topk / var_mean / layer norm with results nobody reads) traced on a gloo group of
    one rank: the fast path on every one, with the simulator's numbers."""
    with gloo_group() as name:
        problem = Problem.from_dag(export_dag(trace_program(random_program(seed), name)))
    check_graph(problem, random.Random(seed), n_random=10, neighbours=15)


def test_random_programs_of_functional_collectives_hold_every_rule():
    """The programs drawn above do hold what they are drawn with: together, seeds 0 to 39
    wait on graph inputs, wait on collectives several times, chain collectives, merge buckets
    whose members are views of one result and run ops of several results (the property above is
    not vacuous), and the evaluator takes its fast path on each."""
    seen: set[str] = set()
    with gloo_group() as name:
        for seed in range(40):
            problem = Problem.from_dag(export_dag(trace_program(random_program(seed), name)))
            dag, steps = problem.dag, memory.static_memory(problem).steps
            if any(a.get("external_wait") == "input" for _, a in dag.nodes(data=True)):
                seen.add("input wait")
            if any(c.result_readers for c in problem.colls.values()):
                seen.add("several waits")
            if any(problem.issue_after[m] for m in problem.colls):
                seen.add("chain")
            if any(len(steps[n][1]) > 1 for n in problem.seq):
                seen.add("several results")
            if _views_merged(problem, heuristic_schedules(problem)):
                seen.add("views merged")
            assert Evaluator(problem).fast
    assert seen == {"input wait", "several waits", "chain", "several results", "views merged"}


@pytest.fixture(scope="module")
def llama_joints():
    models = pytest.importorskip("models")
    variants = {"keep": dict(reshard_after_forward=False), "reshard": dict(reshard_after_forward=True),
                "sac": dict(reshard_after_forward=True, activation_checkpointing="selective")}
    return {k: models.capture_joint_graph("llama3-debug", world_size=4, **opts).graph for k, opts in variants.items()}


@pytest.mark.parametrize("joint", [False, True], ids=["partitioned", "joint"])
def test_hsdp_graphs(joint):
    """HSDP (2 x 2 mesh): each reduce-scatter's result all-reduced on the replicate group; both
    move, the all-reduce after the reduce-scatter's wait, merged reduce-scatters' results freed
    after the last all-reduce that reads them."""
    import models

    opts = dict(world_size=4, n_layers=2, dp_mode="hybrid_shard", replicate_size=2)
    gm = models.capture_joint_graph("llama3-debug", **opts).graph if joint else \
        models.capture_fsdp_graphs("llama3-debug", **opts).backward
    problem = Problem.from_dag(_export(gm))
    chained = [c for c in problem.colls if problem.issue_after[c]]
    assert chained and all(problem.colls[c].movable and problem.colls[c].coll_type == "all_reduce" for c in chained)
    schedules = check_graph(problem, random.Random(13), n_random=20)
    assert _views_merged(problem, schedules)


@pytest.mark.parametrize("variant", ["keep", "reshard", "sac"])
def test_joint_graphs(llama_joints, variant):
    """llama3-debug's joint forward + loss + backward graph (models/joint.py): as traced,
    resharded after forward (backward re-gathers), with selective activation checkpointing."""
    problem = Problem.from_dag(_export(llama_joints[variant]))
    check_graph(problem, random.Random(11), n_random=15)


@pytest.mark.parametrize("style", ["tied", "alternating", "sac", "tp", "fp32"])
def test_foreign_joint_graphs(style):
    fm = _foreign_styles()
    captured = fm.capture_joint(style, n_layers=2)
    check_graph(Problem.from_dag(_export(captured.forward)), random.Random(12), n_random=15)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_llama3_8b(kind):
    """llama3-8b at full width (2 layers, 64 fake ranks)."""
    import models
    from models.capture import fake_process_group
    from scheduler import Cluster

    graphs = models.capture_fsdp_graphs("llama3-8b", world_size=64, n_layers=2)
    with fake_process_group(64):
        problem = Problem.from_dag(export_dag(getattr(graphs, kind), cluster=Cluster(n_gpus=64)))
    check_graph(problem, random.Random(13), n_random=20)


# --------------------------------------------------------------------------------------------
# the polish: the same result as with every evaluation simulated
# --------------------------------------------------------------------------------------------
def _simulated_only(monkeypatch):
    """Every evaluation of every evaluator goes to the simulator."""
    monkeypatch.setattr(Evaluator, "peaks", lambda self, read: None)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_polish_and_regular_starts_as_with_the_simulator(llama_debug, kind, monkeypatch):
    gm = getattr(llama_debug, kind)
    problems = {cm: Problem.from_dag(_export(gm, cost_model=cm)) for cm in ("analytic", "torch")}
    p0 = problems["analytic"]
    traced = simulate(p0.dag, p0.traced_schedule(), problem=p0)
    budget = int(traced.peak_bytes * 1.3)
    starts = [p0.traced_schedule(), solve(p0, solver="fsdp2").schedule]
    reference = {label: min(simulate(p.dag, s, problem=p).step_ms for s in starts) for label, p in problems.items()}
    config = PolishConfig(max_evaluations=400)

    def run():
        out = []
        for start in starts:
            r = polish(problems, start, reference, budget, config)
            out.append((r.schedule.digest(), r.evaluations, r.moves, r.stopped, r.regret))
        regular = [regroup(p0, starts[1], r) for r in regroupings(p0, (1, 2, 3), (1, 2))]
        out.append([(s.digest(), {label: ModelEvaluator(problems).evaluate(s)[label].step_ms for label in problems})
                    for s in regular if s is not None])
        return out

    fast = run()
    _simulated_only(monkeypatch)
    assert run() == fast
    assert any(moves > 0 for _, _, moves, _, _ in fast[:2])


# --------------------------------------------------------------------------------------------
# the least peak of an order of compute
# --------------------------------------------------------------------------------------------
def _least_peak_holds(problem: Problem, schedules: list[Schedule]) -> int:
    """Every schedule of ``schedules`` peaks (by the simulator) at or above the problem's least
    peak; returns the smallest peak among them."""
    from solvers.core.peaks import memory_model

    model = memory_model(problem)
    assert model.reason is None
    least, at = model.least_peak()
    assert 0 <= at < problem.n
    peaks = [validate_schedule(problem, s).peak_bytes for s in schedules]
    assert min(peaks) >= least
    return min(peaks)


@pytest.mark.parametrize("kw", SYNTHETIC, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_no_schedule_of_a_synthetic_dag_peaks_below_its_least_peak(kw):
    """The least peak is a bound: no heuristic, random or polished-neighbour schedule goes under
    it; and it is not vacuous: the schedule of least memory the tries find is within a fifth."""
    from solvers.core.peaks import memory_model

    problem = Problem.from_dag(make_fsdp_dag(n_layers=4, **kw))
    rng = random.Random(4)
    schedules = heuristic_schedules(problem) + [random_schedule(problem, rng) for _ in range(40)]
    for entries in list(_neighbours(problem, _plan_of(schedules[1]), PolishConfig()))[:40]:
        ordered = chain_ordered(problem, entries)
        if ordered is not None:
            schedules.append(build_schedule(problem, ordered))
    smallest = _least_peak_holds(problem, schedules)
    assert memory_model(problem).least_peak()[0] > 0.8 * smallest


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_no_schedule_of_a_random_program_peaks_below_its_least_peak(seed):
    """Random programs (collectives read twice, chains, frees placed per schedule, waits on
    graph inputs): no valid schedule peaks below the least peak."""
    from hypothesis import assume
    from solvers.core.peaks import memory_model

    rng = random.Random(seed)
    problem = Problem.from_dag(_random_program(rng))
    # no bound where the evaluator leaves the graph's memory to the simulator (the search then
    # leaves no order out by it): the few such programs are not what this property is about
    assume(memory_model(problem).reason is None)
    schedules = [problem.traced_schedule()] + [random_schedule(problem, rng) for _ in range(12)]
    _least_peak_holds(problem, schedules)


def test_the_cost_models_of_one_export_and_of_another_order_share_one_memory_analysis():
    """Pricing one export under every model of the default family gives problems of one memory
    analysis, as does rebasing them all onto another order of compute: the evaluator counts a
    schedule's memory once per order, not once per model."""
    from conftest import FAKE_WORLD, capture_llama_debug
    from models.capture import fake_process_group
    from scheduler.costs.family import cost_models
    from scheduler.costs.pricing import export_problems
    from solvers.core.order import in_order
    from solvers.core.peaks import memory_model

    from scheduler.torch_overlap import torch_starts

    with fake_process_group(FAKE_WORLD):
        gm = capture_llama_debug().backward
        problems = export_problems(gm, cost_models(None, None, (0.7, 1.3)), None)
        traced = [problems[label] for label in problems]
        order = torch_starts(gm, traced[0], ["torch-overlap"])[0].order  # torch moves compute
    assert len(traced) == 6 and len({id(memory_model(p)) for p in traced}) == 1
    rebased = [in_order(p, order) for p in traced]
    assert rebased[0].seq != traced[0].seq
    assert len({id(memory_model(p)) for p in rebased}) == 1


def test_no_bound_where_the_evaluator_leaves_memory_to_the_simulator():
    """A program whose reduce-scatter result other collectives read, not made at its wait: the
    evaluator cannot place it, so no order is left out by a bound there."""
    from scheduler.orders import least_peak_over
    from solvers.core.peaks import memory_model

    problem = Problem.from_dag(_random_program(random.Random(387917)))
    assert memory_model(problem).reason is not None
    assert least_peak_over(problem) is None
