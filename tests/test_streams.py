"""Two streams on one link (solvers.core.streams): what a second all-gather stream buys and
costs, and that the simulator, the fast evaluator and the written graph price it alike."""

from __future__ import annotations

import itertools
import random

import pytest

from solvers.core.evaluate import Evaluator
from solvers.core.problem import Problem
from solvers.core.simulator import ScheduleInvalidError, simulate
from solvers.core.streams import Link
from solvers.core.timeline import Clock
from solvers.core.schedule import Schedule
from solvers.heuristics import HEURISTICS


def test_alone_on_a_link_is_fifo():
    """Three buckets issued back to back (no compute between them), two on stream g: the second
    waits for the first, the one on h starts at once."""
    clock = Clock([], [(0.0, 0.0, 10.0, "g"), (1.0, 0.0, 2.0, "g"), (0.0, 0.0, 3.0, "h")], record=True)
    clock.advance([(True, 0, 0), (True, 1, 0), (True, 2, 0), (False, 0, 0), (False, 1, 0), (False, 2, 0)])
    assert [clock.bucket_times[b][1:3] for b in range(3)] == [(0.0, 10.0), (10.0, 12.0), (1.0, 4.0)]


def _shared(*issues):
    """A link of streams a and b (or g and g+ag): each ``(bucket, stream, issue ms, ms alone)``."""
    link = Link()
    for b, stream, t, d in issues:
        link.add(b, stream, t, d)
    return link


def test_shared_link_is_processor_sharing():
    # a long reduce-scatter, then a short all-gather on the second stream: both move at half
    # speed while both run; the short one ends far sooner than behind the long one, the long
    # one later, and the link is busy exactly as long as for the two in a row
    s = _shared((0, "g", 0.0, 10.0), (1, "g+ag", 1.0, 2.0), (2, "g+ag", 1.5, 1.0))
    assert s.span(1)[1] == pytest.approx(5.0)  # 1 ms at half speed from 1 to 5
    assert s.span(2) == pytest.approx((5.0, 7.0))
    assert s.span(0)[1] == pytest.approx(13.0)  # total work 13 ms: the link never ran faster than one stream


def test_shared_link_never_beats_total_work():
    rng = random.Random(0)
    for _ in range(200):
        s = Link()
        jobs = []
        t = 0.0
        for b in range(8):
            t += rng.random()
            d = rng.uniform(0.1, 3.0)
            s.add(b, rng.choice("ab"), t, d)
            jobs.append((t, d))
        ends = [s.span(b)[1] for b in range(8)]
        first = min(t for t, _ in jobs)
        assert max(ends) >= first + sum(d for _, d in jobs) - 1e-9 or max(ends) >= max(
            t + d for t, d in jobs) - 1e-9
        for b, (t, d) in enumerate(jobs):
            assert ends[b] >= t + d - 1e-9  # no collective runs faster than alone


@pytest.fixture(scope="module")
def llama_debug_graphs():
    from conftest import capture_llama_debug

    return capture_llama_debug()


@pytest.fixture(scope="module")
def backward_problem(llama_debug_graphs):
    from scheduler import export_dag

    return Problem.from_dag(export_dag(llama_debug_graphs.backward))


def test_split_schedules_evaluate_as_simulated(backward_problem):
    p = backward_problem
    groups = p.splittable_groups()
    assert groups, "a backward with reshard-after-forward re-gathers and reduce-scatters on one group"
    ev = Evaluator(p)
    for name, fn in HEURISTICS.items():
        schedule = fn(p).schedule.with_split(groups)
        sim = simulate(p.dag, schedule, problem=p)
        e = ev.evaluate(schedule)
        assert (e.step_ms, e.peak_bytes, e.tracker_peak_bytes) == (sim.step_ms, sim.peak_bytes,
                                                                   sim.tracker_peak_bytes), name
        one = simulate(p.dag, schedule.with_split(()), problem=p)
        assert sim.peak_bytes == one.peak_bytes  # streams move time, never memory
        assert "+ag" not in one.comm_ms and any(k.endswith("+ag") for k in sim.comm_ms)


def test_split_of_a_group_without_reductions_is_refused(llama_debug_graphs):
    from scheduler import export_dag

    p = Problem.from_dag(export_dag(llama_debug_graphs.forward))
    assert p.splittable_groups() == ()
    group = next(iter(p.colls.values())).group_name
    with pytest.raises(ScheduleInvalidError, match="splits groups"):
        simulate(p.dag, p.traced_schedule().with_split((group,)), problem=p)


def test_schedule_json_keeps_split(backward_problem):
    s = backward_problem.traced_schedule()
    split = s.with_split(backward_problem.splittable_groups())
    assert Schedule.from_json(split.to_json()) == split
    assert split.digest() != s.digest()
    assert "split_groups" not in s.to_json()  # schedules that split nothing hash as before


def test_written_graph_runs_all_gathers_on_a_second_group(llama_debug_graphs):
    """The write-back moves the split group's all-gathers to a second group of the same ranks
    (made once, then reused); re-exported, the written graph has two groups on one link and
    simulates as the split schedule did."""
    import copy

    from models.capture import fake_process_group
    from scheduler import export_dag
    from scheduler.writeback import apply_schedule, second_group

    with fake_process_group(4):
        gm = copy.deepcopy(llama_debug_graphs.backward)  # the capture is shared (conftest)
        p = Problem.from_dag(export_dag(gm))
        (group,) = p.splittable_groups()
        schedule = HEURISTICS["fsdp2"](p).schedule.with_split((group,))
        predicted = simulate(p.dag, schedule, problem=p)
        apply_schedule(gm, p, schedule)
        second = second_group(group)
        assert second != group and second_group(group) == second  # made once, reused
        again = Problem.from_dag(export_dag(gm))
        kinds = {(c.coll_type, c.group_name) for c in again.colls.values()}
        assert {t for t, g in kinds if g == second} == {"all_gather"}
        assert ("all_gather", group) not in kinds and ("reduce_scatter", group) in kinds
        assert again.shares_links and again.group_links[second] == again.group_links[group]
        sim = simulate(again.dag, problem=again)
        assert sum(sim.comm_ms.values()) == pytest.approx(sum(predicted.comm_ms.values()), rel=1e-9)
        assert sim.step_ms == pytest.approx(predicted.step_ms, rel=0.05)


def test_written_split_without_merges_simulates_exactly(llama_debug_graphs):
    import copy

    from models.capture import fake_process_group
    from scheduler import export_dag
    from scheduler.writeback import apply_schedule

    with fake_process_group(4):
        gm = copy.deepcopy(llama_debug_graphs.backward)
        p = Problem.from_dag(export_dag(gm))
        schedule = HEURISTICS["fsdp2"](p).schedule
        # every bucket alone, issued and waited where fsdp2 puts its first member
        issue, wait = schedule.positions()
        bucket_of = schedule.bucket_of()
        names = list(p.colls)
        alone = p.schedule_at([type(schedule.buckets[0])((m,)) for m in names],
                              [issue[bucket_of[m]] for m in names], [wait[bucket_of[m]] for m in names])
        split = alone.with_split(p.splittable_groups())
        predicted = simulate(p.dag, split, problem=p)
        assert predicted.step_ms != simulate(p.dag, alone, problem=p).step_ms  # the streams change the step
        apply_schedule(gm, p, split)
        again = Problem.from_dag(export_dag(gm))
        assert simulate(again.dag, problem=again).step_ms == pytest.approx(predicted.step_ms, rel=1e-9)


def test_judging_a_split_candidate_makes_no_group(llama_debug_graphs):
    """Choosing among candidates writes copies with the all-gathers on their own group and
    prices the split there: no process group is made until the chosen schedule is installed,
    which every rank does for the same schedule (a group made on one rank alone would leave it
    waiting for the others)."""
    import copy

    import torch.distributed as dist

    from models.capture import fake_process_group
    from scheduler import export_dag
    from scheduler.check.written import choose
    from scheduler.writeback import apply_schedule

    with fake_process_group(4):
        gm = copy.deepcopy(llama_debug_graphs.backward)
        p = Problem.from_dag(export_dag(gm))
        schedule = HEURISTICS["fsdp2"](p).schedule.with_split(p.splittable_groups())
        predicted = simulate(p.dag, schedule, problem=p)
        groups_before = set(dist.distributed_c10d._world.pg_names.values())
        chosen, _ = choose(gm, p, [("split", schedule)], None, cost_model=None, cluster=None,
                           payload_order="registration", control_deps=False)
        assert chosen.name == "split"
        assert set(dist.distributed_c10d._world.pg_names.values()) == groups_before
        assert chosen.figures.step_ms == pytest.approx(predicted.step_ms, rel=0.05)
        apply_schedule(gm, p, chosen.schedule)
        made = set(dist.distributed_c10d._world.pg_names.values()) - groups_before
        again = Problem.from_dag(export_dag(gm))
        assert made and {c.group_name for c in again.colls.values() if c.coll_type == "all_gather"} <= made
