"""torch's overlap scheduler read back as starts of the search (scheduler/torch_overlap.py).

What is asserted: torch's written graph reads back into a valid schedule of the traced graph,
which our write-back turns into a graph that judges as torch's own does; torch's answer is a
start and a baseline, so that where it beats every other start the answer is no slower than it;
a failure of torch's pass drops that start and nothing else; the same graph gives the same
schedule on every rank, although torch writes each rank's own offsets into its graph.

Graphs are traced with make_fx on the fake process group of ``conftest.group_name``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from scheduler import SolverOptions, optimize_schedule  # noqa: E402
from scheduler.api import REPORT_KEY  # noqa: E402
from scheduler.check.written import graph_digest, judge_graph  # noqa: E402
from scheduler.export.dag import export_dag  # noqa: E402
from scheduler.options import AgreementOptions  # noqa: E402
from scheduler.readback import TorchPassError, read_back  # noqa: E402
from scheduler.torch_overlap import (  # noqa: E402
    TORCH,
    TORCH_NO_PREBUCKETING,
    VARIANTS,
    collective_count,
    torch_overlap_schedule,
    torch_starts,
)
from scheduler.writeback import apply_schedule, copy_module  # noqa: E402
from solvers.core import Problem, validate_schedule  # noqa: E402
from solvers.core.order import problem_of  # noqa: E402

from conftest import FAKE_WORLD as WORLD, three_fsdp_layers  # noqa: E402


@pytest.fixture(scope="module")
def traced(group_name):
    return three_fsdp_layers(group_name)


def _long_head(gname: str, n_small: int = 32, n_long: int = 8):
    """One long stretch of compute, then many small layers::

        AG_0 -> wait -> mm x n_long (262144 x 1024 tokens: most of the step) -> slice [:16]
        -> [AG_i -> wait -> mm (16 x 1024)] for i = 1 .. n_small

    Every small layer's all-gather hides behind the long stretch only when issued before it:
    torch's pass issues each as early as its memory and in-flight limits allow, the starts of
    the search prefetch a few buckets ahead (and one bucket of everything waits before the
    first matmul)."""
    ops = torch.ops._c10d_functional

    def gather(w):
        return ops.wait_tensor(ops.all_gather_into_tensor(w, WORLD, gname))

    def f(w0, x, *ws):
        g0 = gather(w0)
        h = x
        for _ in range(n_long):
            h = torch.mm(h, g0)
        h = h[:16]
        for w in ws:
            h = torch.mm(h, gather(w))
        return h

    with FakeTensorMode():
        w0 = torch.randn(1024 // WORLD, 1024, dtype=torch.bfloat16)
        ws = [torch.randn(1024 // WORLD, 1024, dtype=torch.bfloat16) for _ in range(n_small)]
        x = torch.randn(262144, 1024, dtype=torch.bfloat16)
    return make_fx(f, tracing_mode="fake")(w0, x, *ws)


# --------------------------------------------------------------------------------------------
# reading torch's graph back
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_graph_reads_back_into_a_schedule_that_writes_torch_graph(traced, variant):
    """Read back over the traced problem, torch's graph is a valid schedule with one bucket per
    collective of torch's graph; written back by our write-back, it judges under torch's model
    (step and peak of the re-export) as torch's own written graph does."""
    problem = Problem.from_dag(export_dag(traced, cost_model="torch"))
    written = torch_overlap_schedule(traced, **VARIANTS[variant])
    schedule, repairs = read_back(written, problem)

    validate_schedule(problem, schedule)
    assert len(schedule.buckets) == collective_count(written)
    ours = copy_module(traced)
    apply_schedule(ours, problem, schedule)
    mine, theirs = judge_graph(ours, "torch"), judge_graph(written, "torch")
    assert mine.step_ms == pytest.approx(theirs.step_ms, rel=1e-3)
    assert mine.max_peak_bytes == pytest.approx(theirs.max_peak_bytes, rel=1e-3)
    assert mine.n_collectives == theirs.n_collectives


def test_merged_buckets_are_read_from_torch_provenance(traced):
    """With pre-bucketing, torch's one all-gather and one reduce-scatter hold the traced
    collectives named in their provenance; without, every collective keeps its own name."""
    problem = Problem.from_dag(export_dag(traced))
    gathers = sorted(n for n, c in problem.colls.items() if c.coll_type == "all_gather")
    reduces = sorted(n for n, c in problem.colls.items() if c.coll_type == "reduce_scatter")
    merged, _ = read_back(torch_overlap_schedule(traced), problem)
    assert sorted(sorted(b.members) for b in merged.buckets) == [gathers, reduces]
    plain, _ = read_back(torch_overlap_schedule(traced, pre_bucketing_fsdp_collectives=False), problem)
    assert sorted(b.members for b in plain.buckets) == [(n,) for n in sorted(problem.colls)]


def test_a_graph_of_other_collectives_is_refused(traced):
    """A graph whose collectives are not the traced graph's is no start: the message names the
    collective the traced graph does not have."""
    other = copy.deepcopy(traced)
    problem = Problem.from_dag(export_dag(traced))
    for node in other.graph.nodes:  # torch's graph then runs a collective the problem does not know
        if node.name == "all_gather_into_tensor_1":
            node._rename("somebody_elses_gather")
    other.recompile()
    with pytest.raises(TorchPassError, match="somebody_elses_gather"):
        read_back(torch_overlap_schedule(other, pre_bucketing_fsdp_collectives=False), problem)


def test_issues_and_waits_keep_their_place_between_the_nodes_torch_keeps_in_order():
    """torch keeps its matmuls in traced order and lets views run later; our schedules keep every
    node where traced. An issue or wait that torch put after k traced nodes goes to the gap with
    the same matmuls before it (the views moved, the heaviest run in traced order anchoring)::

        traced:  mm0 v1 mm2 v3 mm4          (views v1, v3 free; matmuls 5 ms each)
        torch:   mm0 mm2 v1 mm4 v3
        k:       0   1   2  3   4  5   ->  gaps 0 1 3 3 5 5
    """
    from types import SimpleNamespace

    from scheduler.readback import anchored_gaps

    seq = ["mm0", "v1", "mm2", "v3", "mm4"]
    problem = SimpleNamespace(pos={n: i for i, n in enumerate(seq)}, n=len(seq), compute_ms=[5.0, 0.0, 5.0, 0.0, 5.0])
    assert anchored_gaps(problem, ["mm0", "mm2", "v1", "mm4", "v3"]) == [0, 1, 3, 3, 5, 5]
    assert anchored_gaps(problem, seq) == [0, 1, 2, 3, 4, 5]  # torch's own order: its gaps
    # a node torch folded away (absent from its graph): the others still anchor
    assert anchored_gaps(problem, ["mm0", "mm2", "mm4", "v3"]) == [0, 1, 3, 5, 5]


# --------------------------------------------------------------------------------------------
# starts and baselines
# --------------------------------------------------------------------------------------------
def test_the_answer_is_no_slower_than_torch_where_torch_beats_every_other_start(group_name):
    """On a graph where torch's schedule is faster under torch's model than every start the
    search makes itself (with work for the starts only), the answer's written graph is no
    slower there than torch's own written graphs (without torch's starts it is)."""
    gm = _long_head(group_name)
    quick = SolverOptions(work_limit=1e-6, torch_starts=tuple(VARIANTS))
    theirs = min(judge_graph(torch_overlap_schedule(gm, **options), "torch").step_ms for options in VARIANTS.values())

    def answer(solver: SolverOptions) -> tuple[float, object]:
        written = copy.deepcopy(gm)
        optimize_schedule(written, cost_model="torch", solver=solver, agreement=AgreementOptions(enabled=False))
        return judge_graph(written, "torch").step_ms, written.meta[REPORT_KEY]

    without, _ = answer(SolverOptions(work_limit=1e-6, torch_starts=()))
    assert without > theirs * 1.01  # the premise: torch beats every start of the search's own
    with_torch, report = answer(quick)
    assert with_torch <= theirs * (1 + 1e-6)
    assert report.start in VARIANTS  # the start that won is torch's, and the report says so
    assert {row["name"] for row in report.torch_starts} == set(VARIANTS)
    assert all(row["skipped"] is None and row["step_ms"]["torch"] > 0 for row in report.torch_starts)


def test_a_failing_torch_pass_is_skipped_not_fatal(traced, monkeypatch):
    """When torch's pass raises (as on heterogeneous models), that start is skipped with its
    reason in the report; the call still answers."""
    from torch._inductor.fx_passes import overlap_scheduling

    real = overlap_scheduling.schedule_overlap_bucketing

    def fail_with_prebucketing(gm, **kw):
        if kw.get("pre_bucketing_fsdp_collectives", True):
            raise RuntimeError("detected 2 cyclic extra dep(s)")
        return real(gm, **kw)

    monkeypatch.setattr(overlap_scheduling, "schedule_overlap_bucketing", fail_with_prebucketing)
    problem = Problem.from_dag(export_dag(traced))
    runs = {s.name: s for s in torch_starts(traced, problem, list(VARIANTS))}
    assert runs[TORCH].schedule is None and "cyclic extra dep" in runs[TORCH].skipped
    assert runs[TORCH_NO_PREBUCKETING].schedule is not None and runs[TORCH_NO_PREBUCKETING].skipped is None

    written = copy.deepcopy(traced)
    optimize_schedule(written, solver=SolverOptions(work_limit=0.2, torch_starts=tuple(VARIANTS)),
                      agreement=AgreementOptions(enabled=False))
    report = written.meta[REPORT_KEY]
    rows = {row["name"]: row for row in report.torch_starts}
    assert "cyclic extra dep" in rows[TORCH]["skipped"] and rows[TORCH_NO_PREBUCKETING]["skipped"] is None
    assert any("cyclic extra dep" in note for note in report.notes)
    schedule = written.meta["fsdp_sched_schedule"]
    validate_schedule(problem_of(problem, schedule), schedule)


def test_a_read_back_that_fails_is_skipped_not_fatal(traced, monkeypatch):
    """Whatever fails in reading torch's graph back drops that start only, naming the error."""
    from scheduler import torch_overlap

    def broken(written, problem):
        raise KeyError("a node the read-back did not expect")

    monkeypatch.setattr(torch_overlap, "read_back", broken)
    problem = Problem.from_dag(export_dag(traced))
    (run,) = torch_starts(traced, problem, [TORCH])
    assert run.schedule is None and "KeyError" in run.skipped
    written = copy.deepcopy(traced)
    optimize_schedule(written, solver=SolverOptions(work_limit=0.2), agreement=AgreementOptions(enabled=False))
    assert "KeyError" in written.meta[REPORT_KEY].torch_starts[0]["skipped"]


def test_no_torch_pass_without_a_solver_that_takes_starts(traced, monkeypatch):
    """A heuristic asked for by name takes no starts: torch's pass does not run."""
    from torch._inductor.fx_passes import overlap_scheduling

    def never(gm, **kw):
        raise AssertionError("torch's pass ran")

    monkeypatch.setattr(overlap_scheduling, "schedule_overlap_bucketing", never)
    written = copy.deepcopy(traced)
    optimize_schedule(written, solver=SolverOptions(solver="fsdp2"), agreement=AgreementOptions(enabled=False))
    assert written.meta[REPORT_KEY].torch_starts == []


def test_report_round_trips_with_its_start_and_torch_rows(traced):
    from scheduler.report import ScheduleReport

    written = copy.deepcopy(traced)
    optimize_schedule(written, solver=SolverOptions(work_limit=0.2), agreement=AgreementOptions(enabled=False))
    report = written.meta[REPORT_KEY]
    assert report.start and set(report.start_step_ms) == set(report.search_step_ms) == set(report.cost_models)
    again = ScheduleReport.from_json(report.to_json())
    assert again.to_json() == report.to_json()
    assert again.start_gain_ms() == report.start_gain_ms()
    assert "start: " in str(again)


def test_torch_starts_default_to_torch_own_pass(traced):
    """By default the search starts from torch's pass as torch.compile runs it (pre-bucketing)."""
    written = copy.deepcopy(traced)
    optimize_schedule(written, solver=SolverOptions(work_limit=0.2), agreement=AgreementOptions(enabled=False))
    assert [row["name"] for row in written.meta[REPORT_KEY].torch_starts] == [TORCH]


def test_torch_starts_must_name_known_variants():
    with pytest.raises(ValueError, match="torch_starts"):
        SolverOptions(torch_starts=("torch-overlap", "torch-overlap-deluxe"))
    with pytest.raises(ValueError, match="torch_starts"):
        SolverOptions(torch_starts=["torch-overlap"])


# --------------------------------------------------------------------------------------------
# cost and determinism
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_pass_run_as_a_start_writes_the_same_graph(traced, variant):
    """``reuse=True`` (each merge shape traced once, each roofline once, no unread log) changes
    nothing torch writes: the same nodes, order and arguments."""
    plain = torch_overlap_schedule(traced, **VARIANTS[variant])
    reused = torch_overlap_schedule(traced, reuse=True, **VARIANTS[variant])
    assert graph_digest(reused) == graph_digest(plain)


def test_two_calls_give_the_same_start(traced):
    problem = Problem.from_dag(export_dag(traced))
    first = torch_starts(traced, problem, list(VARIANTS))
    second = torch_starts(traced, problem, list(VARIANTS))
    assert [s.schedule.digest() for s in first] == [s.schedule.digest() for s in second]


_ON_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    sys.path.insert(0, {tests!r})
    from conftest import FAKE_WORLD as WORLD, three_fsdp_layers
    from scheduler.check.written import graph_digest
    from scheduler.export.dag import export_dag
    from scheduler.readback import read_back
    from scheduler.torch_overlap import TORCH, torch_overlap_schedule
    from solvers.core import Problem
    dist.init_process_group("fake", store=FakeStore(), rank={rank}, world_size=WORLD)
    gm = three_fsdp_layers(dist.group.WORLD.group_name)
    written = torch_overlap_schedule(gm, reuse=True)
    print(graph_digest(written), read_back(written, Problem.from_dag(export_dag(gm)))[0].digest())
    """)


@pytest.mark.slow
def test_every_rank_reads_the_same_schedule_from_its_own_torch_graph():
    """Ranks 0 and 3, each in a fresh interpreter: torch's written graphs differ (each rank's
    slice offsets of the merged all-gather), the schedules read back do not."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    out = [subprocess.run([sys.executable, "-c", _ON_RANK.format(tests=tests, rank=rank)], capture_output=True,
                          text=True, check=True, timeout=600).stdout.split() for rank in (0, 3)]
    (graph_0, schedule_0), (graph_3, schedule_3) = out
    assert graph_0 != graph_3  # the premise: torch's graph is rank-dependent
    assert schedule_0 == schedule_3
