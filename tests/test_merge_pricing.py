"""Merges priced as torch emits them: the prediction on the original DAG equals the re-export of
the written-back graph (step time within 1 %, peak exactly), and the solver model charges the
same copies as the Problem.

Hand-checked pricing (:func:`test_folded_casts_priced_once`)::

    w1[200 B fp32] -> cast1[0.05 ms] -> AG1(100 B bf16) -> wait -┐
    w2[200 B fp32] -> cast2[0.05 ms] -> AG2(100 B bf16) -> wait -+-> mm -> output
    x ---------------------------------------------------------- ┘
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import foreign_models as fm  # noqa: E402
from conftest import FAKE_WORLD as WORLD  # noqa: E402
from scheduler import apply_schedule, export_dag, simulate  # noqa: E402
from scheduler.check.judge import liveness_peak  # noqa: E402
from scheduler.whatif.synthetic import DagBuilder  # noqa: E402
from solvers import Problem, solve  # noqa: E402
from solvers.config import ModelConfig  # noqa: E402
from solvers.core.schedule import Bucket, Schedule  # noqa: E402
from solvers.model import ModelData, us  # noqa: E402

F_MS, C_MS = 0.1, 0.001  # copy: fixed ms, ms per byte


def _cast_pair():
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    for k in (1, 2):
        b.add_input(f"primals_{k}", size_bytes=200, releasable=False)
    w1 = b.add_collective("ag1", "primals_1", payload_bytes=100, size_bytes=400, cast_ms=0.05, runtime_ms=1.0)
    w2 = b.add_collective("ag2", "primals_2", payload_bytes=100, size_bytes=400, cast_ms=0.05, runtime_ms=1.0)
    b.add_compute("mm", "x", w1, w2, runtime_ms=1.0, size_bytes=100)
    b.add_output("mm")
    dag = b.build(comm_model={"all_gather|0": (1.0, 0.01)}, copy_ms_per_byte=C_MS, copy_ms_fixed=F_MS)
    return Problem.from_dag(dag)


def test_folded_casts_priced_once():
    """Merged, the casts fold into the copy-in: Q = 400 B read, P = 200 B payload;
    copy-in 0.1 (casts) - 0.1 (folded) + (0.1 + 0.4) + (0.1 + 0.001 * 600 / 2) = 0.9 ms;
    copy-out one copy per member: 2 * (0.1 + 0.001 * 400) = 1.0 ms. Alone: the cast only."""
    p = _cast_pair()
    assert [p.colls[m].merge_read_bytes for m in ("ag1", "ag2")] == [200, 200]
    assert p.copy_in_ms(["ag1"]) == pytest.approx(0.05) and p.copy_out_ms(["ag1"]) == 0.0
    assert p.copy_in_ms(["ag1", "ag2"]) == pytest.approx(0.9)
    assert p.copy_out_ms(["ag1", "ag2"]) == pytest.approx(1.0)
    merged = Schedule.from_positions(p.seq, [Bucket(("ag1", "ag2"))], [0], [0])
    # copy-in 0.9, comm 1 + 0.01 * 200 = 3 (ends 3.9), copy-out 1.0, mm 1.0
    assert simulate(p.dag, merged, problem=p).step_ms == pytest.approx(5.9)


def _model_copies(data: ModelData, p: Problem, members: list[str]) -> int:
    """What the solver model charges the compute stream for ``members`` merged (us)."""
    xs = [data.member[m] for m in members]
    return sum(x.copy_us + x.prologue_us + x.epilogue_us for x in xs) + xs[0].copy_fixed_us


def _problem_copies(p: Problem, members: list[str]) -> int:
    return us(p.copy_in_ms(members) + p.copy_out_ms(members))


def test_model_copies_equal_the_problems_on_the_cast_pair():
    p = _cast_pair()
    data = ModelData(p, ModelConfig(), None)
    assert _model_copies(data, p, ["ag1", "ag2"]) == _problem_copies(p, ["ag1", "ag2"]) == us(0.9 + 1.0)


# --------------------------------------------------------------------------------------------
# captured graphs: prediction vs re-export of the written-back graph
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graphs(group_name):
    """llama3-debug (1 layer) and two foreign styles, forward and backward, on one fake group."""
    from conftest import capture_llama_debug

    llama = capture_llama_debug(n_layers=1)
    out = {("llama3-debug", "forward"): llama.forward, ("llama3-debug", "backward"): llama.backward}
    for style in ("tied", "fp32"):
        captured = fm.capture(style, world_size=WORLD)
        out[(style, "forward")], out[(style, "backward")] = captured.forward, captured.backward
    return out


SOLVERS = ("fsdp2", "simplefsdp", "autoparallel", "cpsat")


def _agreement(gm, solver: str, cost_model: str):
    """(prediction, re-export simulated as traced, reference liveness peak, schedule)."""
    gm = copy.deepcopy(gm)
    problem = Problem.from_dag(export_dag(gm, cost_model=cost_model))
    schedule = solve(problem, solver=solver, work_limit=2.0).schedule
    predicted = simulate(problem.dag, schedule, problem=problem)
    apply_schedule(gm, problem, schedule)
    again = Problem.from_dag(export_dag(gm, cost_model=cost_model))
    return predicted, simulate(again.dag, problem=again), liveness_peak(gm), problem, schedule


@pytest.mark.parametrize("cost_model", ["analytic", "torch"])
@pytest.mark.parametrize("model", ["llama3-debug", "tied", "fp32"])
def test_prediction_equals_reexport(graphs, model, cost_model):
    """Every solver, forward and backward: step time within 1 %, peak exactly equal to the
    re-export's and to the reference liveness count; the solver model charges each merged
    bucket the Problem's copies."""
    merged = 0
    for kind in ("forward", "backward"):
        for solver in SOLVERS:
            predicted, again, reference, problem, schedule = _agreement(graphs[(model, kind)], solver, cost_model)
            case = f"{model} {kind} {solver} {cost_model}"
            assert again.step_ms == pytest.approx(predicted.step_ms, rel=0.01), case
            assert predicted.peak_bytes == again.peak_bytes == reference, case
            data = ModelData(problem, ModelConfig(), None)
            for bucket in schedule.buckets:
                members = list(bucket.members)
                if len(members) > 1 and all(m in data.member for m in members):
                    merged += 1
                    assert abs(_model_copies(data, problem, members) - _problem_copies(problem, members)) <= len(
                        members), case  # rounding to us, per member
    assert merged, "no merged bucket: the check saw nothing"


def test_merged_collective_priced_at_the_cost_models_time():
    """torch's NCCL estimate is concave in the payload: a merged bucket is priced at the cost
    model's own time for its total payload (the export's table, interpolated), not on the line
    through the smallest and the summed payload, which under-prices block-sized buckets."""
    from scheduler.costs.annotate import group_info
    from scheduler.costs.hardware import Cluster
    from scheduler.costs.spec import resolve_cost_model

    captured = fm.capture("tied", n_layers=2, world_size=WORLD, dim=512)
    for name in ("torch", "analytic"):
        dag = export_dag(captured.forward, cost_model=name)
        p = Problem.from_dag(dag)
        model = resolve_cost_model(name, Cluster.from_json(dag.graph["cluster"]))
        for chain in p.chains.values():
            for k in (2, len(chain) // 2, len(chain)):
                members = chain[:k]
                if len(members) < 2:
                    continue
                c0 = p.colls[members[0]]
                total = sum(p.colls[m].payload_bytes for m in members)
                want = model.collective_ms(c0.coll_type, total, group_info(dag, c0.group_name))
                assert p.bucket_comm_ms(members) == pytest.approx(want, rel=5e-3), (name, k)
