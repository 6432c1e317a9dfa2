"""Bad inputs and faults: each ends in a clear error, or in a documented, reported fallback.

One test per row of docs/RELIABILITY.md. Traced graphs are small make_fx graphs on a real
single-process gloo group (``test_writeback.gloo_group``); DAGs come from
``scheduler.whatif.synthetic.make_fsdp_dag``.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from scheduler import (
    DagError,
    SolverOptions,
    export_dag,
    optimize_schedule,
    parse_bytes,
    solve_dag,
    validate_schedule,
)
from scheduler import cli
from scheduler.cli import sweep
from scheduler.costs.models import AnalyticCostModel, TableCostModel
from scheduler.export.dagfile import dag_to_json, load_dag, save_dag
from solvers.core.simulator import ScheduleInvalidError
from solvers import Bucket, Problem, Schedule, SolveStatus, Step, solve
from scheduler.whatif.synthetic import make_fsdp_dag
from test_writeback import COSTS, gloo_group, toy_graph

ops = torch.ops._c10d_functional


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def small_dag(**kw):
    return make_fsdp_dag(**{"n_layers": 1, "params_per_layer": 3, "graph_kind": "backward", "seed": 0, **kw})


# --------------------------------------------------------------------------------------------
# graphs that cannot be exported
# --------------------------------------------------------------------------------------------
def test_graph_without_meta_val_is_refused(pg):
    gm = toy_graph(pg, 1)
    mm = next(n for n in gm.graph.nodes if n.name == "mm")
    del mm.meta["val"]
    with pytest.raises(DagError, match=r"'mm' .*has no meta\['val'\]; trace with fake tensors"):
        export_dag(gm)
    before = str(gm.graph)
    with pytest.raises(DagError, match="no meta"):
        optimize_schedule(gm)
    assert str(gm.graph) == before


def test_symbolic_shapes_are_priced_at_the_sizes_traced():
    """Dynamic sizes are priced at the sizes traced (a recompile for a new batch size used to
    fail torch.compile); a size with no traced value is still refused, naming the remedy."""
    gm = make_fx(lambda x: torch.relu(x) @ x, tracing_mode="symbolic")(torch.randn(8, 8))
    dag = export_dag(gm)
    assert max(dag.nodes[n]["size_bytes"] for n in dag.nodes) == 8 * 8 * 4
    from scheduler.export.dag import _tensor_bytes

    with pytest.raises(DagError, match="symbolic shape .*static shapes: compile with dynamic=False"):
        _tensor_bytes(next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"], "x")


def test_collective_without_wait_is_refused(pg):
    def f(w, x):
        return torch.mm(x, ops.all_gather_into_tensor(w, 1, pg))  # no wait_tensor

    gm = make_fx(f, tracing_mode="fake")(torch.randn(16, 16), torch.randn(8, 16))
    with pytest.raises(DagError, match="'all_gather_into_tensor' .*has no wait_tensor"):
        export_dag(gm)


def test_expert_and_tensor_parallel_collectives_move_alone_within_their_issue_ranges(pg):
    """::

        w -> cast -> all_gather -> wait -> mm(x, .) -> all_to_all_single -> wait -> add -> out
                                                                  \\-> sum -> all_reduce -> wait -> out
    The all-to-all and the all-reduce (not a gradient's) move within the issue ranges their data
    give them, each alone (an all-to-all cannot be merged; a merged all-reduce would sum in
    another order), and the rewritten graph computes what the traced one does."""

    def f(w, x):
        a = ops.wait_tensor(ops.all_gather_into_tensor(w.to(torch.bfloat16), 1, pg))
        h = ops.wait_tensor(ops.all_to_all_single(torch.mm(x, a), [8], [8], pg))
        s = ops.wait_tensor(ops.all_reduce(h.sum(0), "sum", pg))
        return h + 1, s

    args = (torch.randn(16, 16), torch.randn(8, 16, dtype=torch.bfloat16))
    gm = make_fx(f, tracing_mode="fake")(*args)
    problem = Problem.from_dag(export_dag(gm, cost_model=COSTS))
    for name in ("all_to_all_single", "all_reduce"):
        c = problem.colls[name]
        assert c.movable and not c.mergeable
        assert c.ready <= c.traced_issue <= c.traced_wait <= c.needed
    ref = gm(*args)
    optimize_schedule(gm, cost_model=COSTS, solver=SolverOptions(work_limit=2.0))
    after = [n.name for n in gm.graph.nodes]
    assert after.index("mm") < after.index("all_to_all_single") < after.index("wait_tensor_1") < after.index("all_reduce")
    for a, b in zip(ref, gm(*args)):
        assert torch.equal(a, b)


def test_moving_a_fixed_collective_is_refused():
    dag = small_dag()
    name = next(n for n, a in dag.nodes(data=True) if a["kind"] == "collective" and a["coll_type"] == "reduce_scatter")
    dag.nodes[name]["movable"] = False
    problem = Problem.from_dag(dag)
    c = problem.colls[name]
    assert not c.movable and c.traced_wait < problem.n
    traced = problem.traced_schedule()
    issue, wait = traced.positions()
    wait[traced.bucket_of()[name]] = problem.n
    moved = Schedule.from_positions(problem.seq, traced.buckets, issue, wait)
    with pytest.raises(ScheduleInvalidError, match=f"fixed collective '{name}' moved"):
        validate_schedule(problem, moved)


# --------------------------------------------------------------------------------------------
# budgets
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["40GiBs", "40 gigs", "40 GiB GiB", "GiB", "forty GiB", "-"])
def test_misspelled_budget_units_name_the_units(text):
    with pytest.raises(ValueError, match="cannot parse memory size .*KiB, MiB, GiB, TiB"):
        parse_bytes(text)
    with pytest.raises(ValueError, match="cannot parse memory size"):
        solve_dag(small_dag(), text)


@pytest.mark.parametrize("budget", [0, -1, "0GiB", "-5 MiB", 0.4, float("nan"), float("inf")])
def test_zero_negative_or_non_finite_budget_is_refused(budget):
    with pytest.raises(ValueError, match="memory size must be|cannot parse memory size"):
        solve_dag(small_dag(), budget)


def test_zero_budget_in_solver_dispatch_is_refused():
    with pytest.raises(ValueError, match="mem_budget_bytes must be > 0"):
        solve(Problem.from_dag(small_dag()), solver="fsdp2", mem_budget_bytes=0)


def test_bad_budget_leaves_the_graph_untouched(pg):
    gm = toy_graph(pg, 1)
    before = str(gm.graph)
    with pytest.raises(ValueError, match="cannot parse"):
        optimize_schedule(gm, "40 gigs")
    assert str(gm.graph) == before and "fsdp_sched_report" not in gm.meta


# --------------------------------------------------------------------------------------------
# DAG files
# --------------------------------------------------------------------------------------------
def _corrupt(data: dict, how: str) -> object:
    if how == "not a dict":
        return [1, 2]
    if how == "no schema":
        data["graph"].pop("schema")
    elif how == "version 2":
        data["graph"]["version"] = 2
    elif how == "edge to unknown node":
        data["edges"].append(["nope", data["nodes"][0]["name"]])
    elif how == "node without kind":
        data["nodes"][3].pop("kind")
    elif how == "unknown kind":
        data["nodes"][3]["kind"] = "banana"
    elif how == "NaN runtime":
        data["nodes"][3]["runtime_ms"] = "nan"
    elif how == "negative runtime":
        data["nodes"][3]["runtime_ms"] = -1.0
    elif how == "order incomplete":
        data["graph"]["order"] = data["graph"]["order"][:-1]
    elif how == "nodes missing":
        data.pop("nodes")
    return data


@pytest.mark.parametrize(
    "how, message",
    [
        ("not a dict", "not an fsdp-sched DAG file"),
        ("no schema", "not an fsdp-sched DAG file"),
        ("version 2", "schema version 2; this fsdp-sched reads version 1: re-export"),
        ("edge to unknown node", "is corrupt: .*unknown node"),
        ("node without kind", "lacks attribute 'kind'"),
        ("unknown kind", "unknown kind 'banana'"),
        ("NaN runtime", "runtime_ms='nan'.*finite time >= 0"),
        ("negative runtime", "runtime_ms=-1.0.*finite time >= 0"),
        ("order incomplete", "'order' must list every node"),
        ("nodes missing", "is corrupt"),
    ],
)
def test_corrupt_or_wrong_version_dag_json(tmp_path, how, message):
    path = tmp_path / "g.dag.json"
    path.write_text(json.dumps(_corrupt(dag_to_json(small_dag()), how)))
    with pytest.raises(DagError, match=message):
        load_dag(path)


def test_truncated_dag_file(tmp_path):
    path = tmp_path / "g.dag.json"
    save_dag(small_dag(), path)
    path.write_text(path.read_text()[:-100])
    with pytest.raises(DagError, match="not valid JSON .*truncated"):
        load_dag(path)
    with pytest.raises(FileNotFoundError):
        load_dag(tmp_path / "missing.json")


# --------------------------------------------------------------------------------------------
# cost models
# --------------------------------------------------------------------------------------------
class _BadCompute(AnalyticCostModel):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def compute_ms(self, attrs, fx_node=None):
        return self.value


class _BadCollective(AnalyticCostModel):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def collective_ms(self, coll_type, payload_bytes, group):
        return self.value


@pytest.mark.parametrize("value", [float("nan"), -1.0, None, float("inf"), "fast"])
@pytest.mark.parametrize("model", [_BadCompute, _BadCollective])
def test_cost_model_returning_nan_negative_or_missing_times(pg, model, value):
    gm = toy_graph(pg, 1)
    with pytest.raises(ValueError, match=r"cost model returned .* it must return a finite time in ms >= 0"):
        export_dag(gm, cost_model=model(value))


def test_table_cost_model_none_falls_back_to_its_default(pg):
    """A TableCostModel callable returning None means "not covered": the fallback prices it."""
    gm = toy_graph(pg, 1)
    dag = export_dag(gm, cost_model=TableCostModel(compute=lambda attrs: None))
    ref = export_dag(gm)
    assert all(dag.nodes[n]["runtime_ms"] == ref.nodes[n]["runtime_ms"] for n in dag)
    with pytest.raises(ValueError, match="cost model returned nan"):
        export_dag(gm, cost_model=TableCostModel(compute=lambda attrs: math.nan))


# --------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------
def merged_schedule(problem: Problem, members: list[str]) -> Schedule:
    """``members`` in one bucket issued at the top of its issue range, waited at its end; every
    other collective alone where traced."""
    others = [c for c in problem.colls if c not in members]
    buckets = [Bucket(tuple(members))] + [Bucket((c,)) for c in others]
    issue = [max(problem.colls[m].ready for m in members)] + [problem.colls[c].traced_issue for c in others]
    wait = [min(problem.colls[m].needed for m in members)] + [problem.colls[c].traced_wait for c in others]
    return Schedule.from_positions(problem.seq, buckets, issue, wait)


def _two_groups() -> tuple[Problem, list[str]]:
    problem = Problem.from_dag(small_dag(graph_kind="forward", n_groups=2))
    first = list(problem.colls)[:2]
    assert problem.colls[first[0]].group_name != problem.colls[first[1]].group_name
    return problem, first


def test_bucket_mixing_process_groups_is_invalid():
    problem, members = _two_groups()
    with pytest.raises(ScheduleInvalidError, match="mixes collective types / process groups / dtypes"):
        validate_schedule(problem, merged_schedule(problem, members))


def test_bucket_mixing_dtypes_is_invalid():
    dag = small_dag(graph_kind="forward")
    ags = [n for n, a in dag.nodes(data=True) if a["kind"] == "collective"][:2]
    dag.nodes[ags[1]]["dtype"] = "float32"
    problem = Problem.from_dag(dag)
    assert problem.colls[ags[0]].dtype != problem.colls[ags[1]].dtype
    with pytest.raises(ScheduleInvalidError, match="mixes .*dtypes.*float32"):
        validate_schedule(problem, merged_schedule(problem, ags))


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
def test_a_hint_mixing_process_groups_is_not_returned(solver):
    """A bad warm start does not leak into the result: the solver's schedule still validates."""
    problem, members = _two_groups()
    result = solve(problem, solver=solver, work_limit=2, hint=merged_schedule(problem, members))
    validate_schedule(problem, result.schedule)


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
def test_a_malformed_hint_is_refused_clearly(solver):
    """A hint that drops a bucket its steps still name used to end in IndexError in the
    simulator."""
    problem, _ = _two_groups()
    traced = problem.traced_schedule()
    with pytest.raises(ValueError, match="hint is not a schedule of this graph"):
        solve(problem, solver=solver, hint=Schedule(traced.buckets[:-1], traced.steps))
    extra = Schedule(traced.buckets, (*traced.steps, Step("wait", len(traced.buckets))))
    with pytest.raises(ValueError, match="hint is malformed: steps name buckets"):
        solve(problem, solver=solver, hint=extra)


# --------------------------------------------------------------------------------------------
# solver faults
# --------------------------------------------------------------------------------------------
def test_solver_stopped_by_its_time_limit_returns_a_valid_reported_schedule():
    """A 144-collective backward graph and a 10 ms limit: no CP-SAT window fits in it; the
    answer is still a valid schedule, and the report's stages show it."""
    dag = make_fsdp_dag(n_layers=16, params_per_layer=9, graph_kind="backward", seed=1)
    problem = Problem.from_dag(dag)
    schedule, report = solve_dag(dag, solver=SolverOptions(solver="cpsat", work_limit=0.01))
    validate_schedule(problem, schedule)
    # the limit is too small for a window: the stages say so
    assert report.status in (SolveStatus.HEURISTIC.value, SolveStatus.FEASIBLE.value)
    assert report.stages[0]["name"] == "starts" and "windows" not in [s["name"] for s in report.stages]
    assert report.step_ms_after <= report.step_ms_before + 1e-9


def test_solver_exceeding_its_time_limit_falls_back():
    def timed_out(problem, **kw):
        raise TimeoutError("wall clock cap reached")

    dag = small_dag()
    schedule, report = solve_dag(dag, solver=SolverOptions(work_limit=0.01, solver=timed_out))
    validate_schedule(Problem.from_dag(dag), schedule)
    assert report.fell_back and report.status == SolveStatus.FALLBACK.value


def test_large_graph_is_decomposed_into_rolling_windows():
    """No up-front memory refusal: the model of one window covers ``window_members``
    collectives, so its size does not grow with the graph. With windows of 6, a 30-collective
    graph is solved window by window."""
    from solvers.cpsat import CpSatBackend
    from solvers.search import SearchConfig, search

    dag = make_fsdp_dag(n_layers=3, params_per_layer=9, graph_kind="forward", seed=2)
    problem = Problem.from_dag(dag)
    assert len(problem.colls) > 8
    result = search({"m": problem}, None, backend=CpSatBackend(), work_limit=2,
                    config=SearchConfig(window_members=6, window_sweeps=1))
    validate_schedule(problem, result.schedule)
    assert "windows" in [s.name for s in result.stages]


# --------------------------------------------------------------------------------------------
# interrupted sweep
# --------------------------------------------------------------------------------------------
def test_interrupted_sweep_resumes_from_its_results_file(tmp_path, monkeypatch, capsys):
    dag_path = tmp_path / "g.dag.json"
    save_dag(small_dag(), dag_path)
    args = ["-q", "sweep", str(dag_path), "--solver", "fsdp2", "--budgets", "1.0x", "0.9x", "0.8x",
            "--work-limit", "1", "--out", str(tmp_path / "out"), "--json"]
    real = sweep.solve_point
    calls: list[int] = []

    def interrupted_after_one(dag_json, solver, budget, work_limit):
        if calls:
            raise KeyboardInterrupt
        calls.append(budget)
        return real(dag_json, solver, budget, work_limit)

    monkeypatch.setattr(sweep, "solve_point", interrupted_after_one)
    assert cli.main(args) == 130  # Ctrl-C after the first point: "interrupted", exit status 130
    assert "fsdp-sched: interrupted" in capsys.readouterr().err
    db = tmp_path / "out" / "sweep.sqlite"
    assert sqlite3.connect(db).execute("SELECT budget_bytes FROM results").fetchall() == [(calls[0],)]

    resumed: list[int] = []

    def counting(dag_json, solver, budget, work_limit):
        resumed.append(budget)
        return real(dag_json, solver, budget, work_limit)

    monkeypatch.setattr(sweep, "solve_point", counting)
    assert cli.main(args) == 0
    assert len(resumed) == 2 and calls[0] not in resumed
    points = json.loads(capsys.readouterr().out)["points"]
    assert len(points) == 3 and sorted(p["budget_bytes"] for p in points) == sorted([calls[0], *resumed])


def test_merges_without_a_process_group_are_refused_at_once(tmp_path):
    """Outside any process group (a notebook that traced on a fake group and left it), the
    schedule's merged buckets cannot be written with torch's merge functions: optimize_schedule
    says so in one error naming the fix, and the graph is untouched (it used to try every
    candidate, warn for each, and install one without merges)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch.distributed as dist
        from models import capture_fsdp_graphs
        from scheduler import optimize_schedule, ScheduleError
        from scheduler.check.written import graph_digest
        graphs = capture_fsdp_graphs("llama3-debug", world_size=8, n_layers=2)
        assert not dist.is_initialized()
        gm = graphs.backward
        before = graph_digest(gm)
        try:
            optimize_schedule(gm)
        except ScheduleError as e:
            assert "process group" in str(e) and "fake" in str(e), e
            assert graph_digest(gm) == before
            print("REFUSED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "REFUSED"
