"""The simulator on tiny hand-built DAGs: step time, exposed communication and peak memory
equal the values worked out by hand from the execution model (solvers/core/simulator.py).

Conventions of the drawings: ``name[size B, t ms]``; ``-->`` is a data edge; ``AG``/``RS`` are
an all-gather / reduce-scatter with their wait; ``||`` separates schedule gaps.
"""

from __future__ import annotations

import json

import pytest

from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule
from scheduler.whatif.synthetic import DagBuilder


def _sim(dag, schedule=None):
    p = Problem.from_dag(dag)
    return p, simulate(dag, schedule, problem=p)


def test_compute_only_chain():
    """x[100 B] --> a[200 B, 1 ms] --> b[300 B, 2 ms] --> output

    step = 1 + 2; peak when b runs: a (200) + b (300), x freed after a.
    """
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_compute("a", "x", runtime_ms=1.0, size_bytes=200)
    b.add_compute("b", "a", runtime_ms=2.0, size_bytes=300)
    b.add_output("b")
    _, sim = _sim(b.build())
    assert sim.step_ms == pytest.approx(3.0)
    assert sim.exposed_comm_ms == 0.0
    assert sim.peak_bytes == 500
    assert sim.node_times == {"a": (0.0, 1.0), "b": (1.0, 3.0)}


def _one_ag(compute_before: float | None):
    """primals_w[25 B, pinned] --> AG[2 ms, out 100 B] --> mm[1 ms, 100 B] <-- (c1 or x)"""
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_input("primals_w", size_bytes=25, releasable=False)
    h = "x"
    if compute_before is not None:
        h = b.add_compute("c1", "x", runtime_ms=compute_before, size_bytes=100)
    w = b.add_collective("ag", "primals_w", runtime_ms=2.0, payload_bytes=25, size_bytes=100)
    b.add_compute("mm", h, w, runtime_ms=1.0, size_bytes=100)
    b.add_output("mm")
    return b.build()


def test_one_exposed_all_gather():
    """AG issued and waited right before mm (as traced): fully exposed.

    step = 2 (AG) + 1 (mm); memory: x 100 + w 25 + AG out 100 + mm 100 = 325 while mm runs.
    """
    _, sim = _sim(_one_ag(None))
    assert sim.step_ms == pytest.approx(3.0)
    assert sim.exposed_comm_ms == pytest.approx(2.0)
    assert sim.peak_bytes == 325
    assert sim.bucket_times[0][1:3] == (0.0, 2.0)


def test_prefetched_all_gather_is_hidden():
    """x --> c1[3 ms] --> mm[1 ms] <-- AG[2 ms]

    traced:     c1 || AG, wait || mm             -> 3 + 2 + 1 = 6, exposed 2
    prefetched: AG || c1 || wait || mm           -> 3 + 1 = 4, exposed 0
    """
    dag = _one_ag(3.0)
    p, traced = _sim(dag)
    assert traced.step_ms == pytest.approx(6.0)
    assert traced.exposed_comm_ms == pytest.approx(2.0)
    pre = Schedule.from_positions(p.seq, [Bucket(("ag",))], [0], [1])
    sim = simulate(dag, pre, problem=p)
    assert sim.step_ms == pytest.approx(4.0)
    assert sim.exposed_comm_ms == pytest.approx(0.0)
    # prefetched, the gathered weight is alive while c1 runs: x + w + AG out + c1 = 325, the
    # same peak as traced (c1 + w + AG out + mm, x freed after c1)
    assert sim.peak_bytes == traced.peak_bytes == 325


def _two_ags(group2: str):
    """x --> c1[1 ms] --> mm[1 ms] <-- AG1[2 ms], AG2[2 ms] (group "0" and ``group2``)"""
    b = DagBuilder(group_sizes={"0": 4, "1": 4})
    b.add_input("x", size_bytes=100)
    b.add_input("primals_1", size_bytes=25, releasable=False)
    b.add_input("primals_2", size_bytes=25, releasable=False)
    c1 = b.add_compute("c1", "x", runtime_ms=1.0, size_bytes=100)
    w1 = b.add_collective("ag1", "primals_1", runtime_ms=2.0, size_bytes=100)
    w2 = b.add_collective("ag2", "primals_2", group=group2, runtime_ms=2.0, size_bytes=100)
    b.add_compute("mm", c1, w1, w2, runtime_ms=1.0, size_bytes=100)
    b.add_output("mm")
    dag = b.build()
    p = Problem.from_dag(dag)
    sched = Schedule.from_positions(p.seq, [Bucket(("ag1",)), Bucket(("ag2",))], [0, 0], [1, 1])
    return dag, p, sched


def test_two_collectives_on_one_stream_serialise():
    """Both AGs issued before c1 on one FIFO stream: AG2 runs 2..4, so mm waits until 4.

    step = 4 + 1 = 5; exposed = 4 - 1 = 3.
    """
    dag, p, sched = _two_ags("0")
    sim = simulate(dag, sched, problem=p)
    assert [sim.bucket_times[i][1:3] for i in (0, 1)] == [(0.0, 2.0), (2.0, 4.0)]
    assert sim.step_ms == pytest.approx(5.0)
    assert sim.exposed_comm_ms == pytest.approx(3.0)
    assert sim.comm_ms == {"0": pytest.approx(4.0)}


def test_two_process_groups_overlap():
    """Same graph with AG2 on group "1": both streams run 0..2; step = 2 + 1, exposed 1."""
    dag, p, sched = _two_ags("1")
    sim = simulate(dag, sched, problem=p)
    assert sim.bucket_times[1][1:3] == (0.0, 2.0)
    assert sim.step_ms == pytest.approx(3.0)
    assert sim.exposed_comm_ms == pytest.approx(1.0)


def test_merged_bucket_charges_copies_and_alpha_once():
    """x, AG1(w1), AG2(w2) --> mm[1 ms]; comm line alpha 1 ms + 0.01 ms/B, copy 0.1 ms +
    0.001 ms/B; each AG moves 25 B (1.25 ms alone) and outputs 100 B.

    traced (alone, one after the other): 1.25 + 1.25 + 1 = 3.5
    merged, issued and waited before mm (as torch's merge emits it; no casts, so the copy-in
    reads Q = P = 50 B):
        copy-in (0.1 + 0.001 * 50) + (0.1 + 0.001 * (50 + 50) / 2) = 0.3
        || comm 1 + 0.01 * 50 = 1.5 (ends at 1.8)
        || copy-out, one per member: 2 * (0.1 + 0.001 * 100) = 0.4 || mm 1  -> 3.2, exposed 1.5
    """
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_input("primals_1", size_bytes=25, releasable=False)
    b.add_input("primals_2", size_bytes=25, releasable=False)
    w1 = b.add_collective("ag1", "primals_1", runtime_ms=1.25, size_bytes=100)
    w2 = b.add_collective("ag2", "primals_2", runtime_ms=1.25, size_bytes=100)
    b.add_compute("mm", "x", w1, w2, runtime_ms=1.0, size_bytes=100)
    b.add_output("mm")
    dag = b.build(comm_model={"all_gather|0": (1.0, 0.01)}, copy_ms_per_byte=0.001, copy_ms_fixed=0.1)
    p, traced = _sim(dag)
    assert traced.step_ms == pytest.approx(3.5)
    merged = Schedule.from_positions(p.seq, [Bucket(("ag1", "ag2"))], [0], [0])
    sim = simulate(dag, merged, problem=p)
    assert sim.bucket_times[0][1:3] == (pytest.approx(0.3), pytest.approx(1.8))
    assert sim.exposed_comm_ms == pytest.approx(1.5)
    assert sim.step_ms == pytest.approx(3.2)
    assert sim.compute_ms == pytest.approx(0.3 + 0.4 + 1.0)


def _two_rs():
    """x[100 B] --> c1[1 ms, g1 200 B] --> RS1[1 ms, out 50 B] --> output
       x        --> c2[1 ms, g2 200 B] --> RS2[1 ms, out 50 B] --> output
       x        --> c3[1 ms, 100 B]    --> output
    RSs issued after c2, waited after c3 (end)."""
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    g1 = b.add_compute("c1", "x", runtime_ms=1.0, size_bytes=200)
    g2 = b.add_compute("c2", "x", runtime_ms=1.0, size_bytes=200)
    r1 = b.add_collective("rs1", g1, coll_type="reduce_scatter", runtime_ms=1.0, size_bytes=50)
    r2 = b.add_collective("rs2", g2, coll_type="reduce_scatter", runtime_ms=1.0, size_bytes=50)
    b.add_compute("c3", "x", runtime_ms=1.0, size_bytes=100)
    b.add_output(r1, r2, "c3")
    dag = b.build(copy_ms_per_byte=0.0, copy_ms_fixed=0.0)
    return dag, Problem.from_dag(dag)


def test_reduce_scatter_input_alive_until_wait():
    """Unmerged: g1 and g2 (400 B) stay alive until the waits, through c3.

    live after: c1 300, c2 500 (x, g1, g2), issues +50 each, c3 600 (x freed, c3 added),
    wait1 400, wait2 200 (outs and c3). Peak 700 while c3 runs (x not yet released).
    """
    dag, p = _two_rs()
    sched = Schedule.from_positions(p.seq, [Bucket(("rs1",)), Bucket(("rs2",))], [2, 2], [3, 3])
    sim = simulate(dag, sched, problem=p)
    live = [m for _, m in sim.memory]
    # steps: c1, c2, issue, issue, c3, wait, wait
    assert live == [100, 300, 500, 550, 600, 600, 400, 200]
    assert sim.peak_bytes == 700  # c3 allocated before x is released


def test_merged_reduce_scatter_frees_inputs_at_copy_in():
    """Merged, as torch's merge emits it: the cat into the bucket buffer (400 B) runs while
    g1, g2 are still alive (peak 500 + 400 = 900), then g1, g2 are freed and the outputs
    allocated (900 - 400 + 100 = 600): live 600 through c3, and the buffer goes at the wait."""
    dag, p = _two_rs()
    sched = Schedule.from_positions(p.seq, [Bucket(("rs1", "rs2"))], [2], [3])
    sim = simulate(dag, sched, problem=p)
    live = [m for _, m in sim.memory]
    assert live == [100, 300, 500, 600, 600, 200]
    assert sim.peak_bytes == 900


def test_never_waited_bucket_is_rejected():
    """A schedule that issues AG but never waits on it cannot be simulated."""
    dag = _one_ag(None)
    p = Problem.from_dag(dag)
    bad = Schedule(p.traced_schedule().buckets, tuple(s for s in p.traced_schedule().steps if s.kind != "wait"))
    with pytest.raises(ScheduleInvalidError, match="never waited"):
        simulate(dag, bad, problem=p)


def test_chrome_trace_is_valid_json(tmp_path):
    """The trace has one complete event per node and per bucket, and memory counters."""
    dag = _one_ag(3.0)
    p, sim = _sim(dag)
    path = sim.write_chrome_trace(tmp_path / "trace.json", p)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"c1", "mm", "all_gather x1"} <= names
    assert any(e["ph"] == "C" for e in events)
    ag = next(e for e in events if e["name"] == "all_gather x1")
    assert ag["tid"] == "comm 0" and ag["dur"] == pytest.approx(2000.0)


def test_bucket_exposure_adds_up_to_exposed_comm():
    """Per-bucket waiting time (used to order the solver's windows) accounts for all of it."""
    from solvers import solve
    from scheduler.whatif.synthetic import make_fsdp_dag

    dag = make_fsdp_dag(n_layers=3, graph_kind="backward", reshard_after_forward=True, seed=2)
    problem = Problem.from_dag(dag)
    for name in ("traced", "fsdp2"):
        sim = simulate(dag, solve(problem, solver=name).schedule, problem=problem)
        assert sim.exposed_comm_ms > 0
        assert sum(sim.bucket_exposed_ms.values()) == pytest.approx(sim.exposed_comm_ms)
        assert all(v > 0 for v in sim.bucket_exposed_ms.values())


def _two_phases(c1_ms: float, c2_ms: float):
    """x --> c1 --> m1[1 ms] <-- AG1[2 ms]; m1 --> c2 --> m2[1 ms] <-- AG2[2 ms], as traced
    (each all-gather issued right before it is needed); one rank's costs."""
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_input("primals_1", size_bytes=25, releasable=False)
    b.add_input("primals_2", size_bytes=25, releasable=False)
    c1 = b.add_compute("c1", "x", runtime_ms=c1_ms, size_bytes=100)
    w1 = b.add_collective("ag1", "primals_1", runtime_ms=2.0, size_bytes=100)
    m1 = b.add_compute("m1", c1, w1, runtime_ms=1.0, size_bytes=100)
    c2 = b.add_compute("c2", m1, runtime_ms=c2_ms, size_bytes=100)
    w2 = b.add_collective("ag2", "primals_2", runtime_ms=2.0, size_bytes=100)
    b.add_compute("m2", c2, w2, runtime_ms=1.0, size_bytes=100)
    b.add_output("m2")
    return Problem.from_dag(b.build())


def test_ranks_wait_for_the_last_one_at_each_collective():
    """Rank 0 is slow before the first all-gather, rank 1 before the second. Alone each takes
    3 + 2 + 1 + 1 + 2 + 1 = 10 ms. In lockstep AG1 starts when rank 0 issues it (3) and ends at
    5, AG2 when rank 1 issues it (5 + 1 + 3 = 9) and ends at 11: both ranks take 12 ms."""
    from solvers.core.simulator import simulate_ranks

    ranks = [_two_phases(3.0, 1.0), _two_phases(1.0, 3.0)]
    alone = [simulate(p.dag, problem=p).step_ms for p in ranks]
    assert alone == [pytest.approx(10.0), pytest.approx(10.0)]
    together = simulate_ranks(ranks)
    assert [r.step_ms for r in together] == [pytest.approx(12.0), pytest.approx(12.0)]
    assert [r.bucket_times[1][1:3] for r in together] == [(9.0, 11.0), (9.0, 11.0)]
    # the rank that came early waited: its exposed time grew by what it waited
    assert together[0].exposed_comm_ms == pytest.approx(2.0 + 4.0)


def test_ranks_with_equal_costs_run_as_one():
    from solvers.core.simulator import simulate_ranks

    dag, p, sched = _two_ags("1")
    one = simulate(dag, sched, problem=p)
    for r in simulate_ranks([p, Problem.from_dag(dag)], sched):
        assert (r.step_ms, r.peak_bytes, r.bucket_times) == (one.step_ms, one.peak_bytes, one.bucket_times)


def test_ranks_must_run_the_same_graph():
    from solvers.core.simulator import simulate_ranks

    with pytest.raises(ValueError, match="not the graph of rank 0"):
        simulate_ranks([_two_phases(1.0, 1.0), Problem.from_dag(_one_ag(1.0))])
    with pytest.raises(ValueError, match="at least one rank"):
        simulate_ranks([])
    # a split schedule's two streams (all-gathers beside reduce-scatters) share the group's link:
    # not synchronised across ranks
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_input("primals_1", size_bytes=25, releasable=False)
    g = b.add_compute("g", "x", runtime_ms=1.0, size_bytes=100)
    rs = b.add_collective("rs", g, coll_type="reduce_scatter", runtime_ms=2.0, payload_bytes=100, size_bytes=25)
    w = b.add_collective("ag", "primals_1", runtime_ms=2.0, size_bytes=100)
    b.add_compute("mm", rs, w, runtime_ms=1.0, size_bytes=100)
    b.add_output("mm")
    dag = b.build()
    p = Problem.from_dag(dag)
    split = p.traced_schedule().with_split(["0"])
    assert simulate(dag, split, problem=p).step_ms > 0  # one rank alone is simulated
    with pytest.raises(ValueError, match="share a network link"):
        simulate_ranks([p, p], split)
