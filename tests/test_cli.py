"""The fsdp-sched command line: trace -> solve round trip, the robust solve, sweep resume, user errors."""

from __future__ import annotations

import json
import sqlite3

import pytest

from scheduler.cli import budget_arg, main, resolve_budget

TINY = ["--model", "llama3-debug", "--n-layers", "2", "--world-size", "16"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """llama3-debug (2 layers, 16 ranks) traced once to DAG JSON files."""
    out = tmp_path_factory.mktemp("trace")
    assert main(["-q", "trace", *TINY, "--out", str(out)]) == 0
    return out / "llama3-debug-forward.dag.json", out / "llama3-debug-backward.dag.json"


def test_budget_arg_parses_sizes_and_multiples():
    assert budget_arg("40GiB") == 40 << 30
    assert budget_arg("1.5 GB") == 1_500_000_000
    assert budget_arg("auto") == "auto" and budget_arg("0.8x") == "0.8x"
    assert resolve_budget("0.5x", 1000) == 500
    assert resolve_budget("auto", 1000, floor_bytes=950) == 950  # never below a reachable peak
    assert resolve_budget("none", 1000) is None


def test_trace_solve_round_trip(traced, tmp_path, capsys):
    _, backward = traced
    out = tmp_path / "solve"
    assert main(["-q", "solve", str(backward), "--budget", "none", "--work-limit", "2", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    report = data["report"]
    assert report["graph_name"] == "backward"
    assert report["step_ms_after"] <= report["step_ms_before"]
    for f in data["files"]:
        assert (out / f.split("/")[-1]).stat().st_size > 0
    assert {"backward_schedule.json", "backward_gantt.png", "backward_trace.json"} <= {p.name for p in out.iterdir()}


def test_solve_human_output(traced, tmp_path, capsys):
    forward, _ = traced
    assert main(["-q", "solve", str(forward), "--solver", "fsdp2", "--out", str(tmp_path)]) == 0
    assert "fsdp-sched report: forward" in capsys.readouterr().out


def test_sweep_resumes_from_sqlite(traced, tmp_path, capsys):
    _, backward = traced
    args = ["-q", "sweep", str(backward), "--budgets", "1.0x", "2MiB", "--work-limit", "1", "--out", str(tmp_path), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["points"]) == 2
    assert (tmp_path / "backward_pareto.png").stat().st_size > 0
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "budget" not in captured.err  # no progress line: every point came from the database
    assert json.loads(captured.out)["points"] == first["points"]
    n = sqlite3.connect(tmp_path / "sweep.sqlite").execute("SELECT count(*) FROM results").fetchone()[0]
    assert n == 2


def test_bad_budget_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["solve", "x.json", "--budget", "40 furlongs"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--budget" in err and "cannot parse memory size" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["solve", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "no such DAG file" in err and "missing.json" in err
    assert len(err.strip().splitlines()) == 1


def test_corrupt_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["solve", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_unknown_model_exits_2(capsys):
    assert main(["trace", "--model", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err


def test_console_script_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["solve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--budget" in text and "--work-limit" in text and "--n-layers" in text


# --------------------------------------------------------------------------------------------
# --cost-model
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["trace", "solve", "sweep"])
def test_every_command_takes_a_cost_model_by_name(command):
    from scheduler.cli.parser import build_parser

    parser = build_parser()
    assert parser.parse_args([command, *TINY, "--cost-model", "torch"]).cost_model == "torch"
    assert parser.parse_args([command, *TINY]).cost_model is None  # the analytic default
    with pytest.raises(SystemExit) as info:
        parser.parse_args([command, *TINY, "--cost-model", "roofline"])
    assert info.value.code == 2


@pytest.mark.slow
def test_trace_and_solve_price_with_the_named_cost_model(tmp_path, capsys):
    from scheduler.export.dagfile import load_dag

    steps = {}
    for name in ("analytic", "torch"):
        out = tmp_path / name
        assert main(["-q", "trace", *TINY, "--graph", "forward", "--cost-model", name, "--out", str(out)]) == 0
        dag = load_dag(out / "llama3-debug-forward.dag.json")
        assert dag.graph["cost_model"] == name
        capsys.readouterr()
        assert main(["-q", "solve", *TINY, "--graph", "forward", "--cost-model", name, "--solver", "fsdp2",
                     "--out", str(out), "--json"]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["report"]["step_ms_before"]
    assert steps["analytic"] != steps["torch"]


def test_cost_model_with_a_dag_file_is_refused(traced, capsys):
    forward, _ = traced
    assert main(["solve", str(forward), "--cost-model", "torch"]) == 2
    assert "a DAG file keeps the costs" in capsys.readouterr().err


def test_sweep_rows_are_monotone_in_memory():
    """A point slower than one at a smaller budget reports that budget's schedule instead."""
    from scheduler.cli.sweep import monotone

    def row(budget, step, peak):
        return {"budget_bytes": budget, "status": "feasible", "step_ms": step, "exposed_comm_ms": 0.0,
                "peak_bytes": peak, "n_collectives": 3, "solve_time_s": 1.0, "gap": 0.1, "error": None}

    rows = monotone([row(300, 12.0, 290), row(200, 10.0, 190), row(100, 11.0, 95)])
    assert [r["budget_bytes"] for r in rows] == [300, 200, 100]
    assert rows[0]["step_ms"] == 10.0 and rows[0]["peak_bytes"] == 190 and rows[0]["status"] == "smaller"
    assert rows[1]["status"] == rows[2]["status"] == "feasible"


def test_robust_solve_needs_a_model(traced, capsys):
    forward, _ = traced
    assert main(["solve", str(forward), "--robust"]) == 2
    assert "--robust" in capsys.readouterr().err


def test_robust_solve_refuses_a_cost_model(capsys):
    assert main(["solve", *TINY, "--robust", "--cost-model", "torch"]) == 2
    assert "--robust" in capsys.readouterr().err


@pytest.mark.slow
def test_robust_solve_is_the_library_default_on_the_written_graph(tmp_path, capsys):
    """``solve --model --robust`` runs optimize_schedule without a cost model: the report names
    the six models of the family, the installed candidate's written graph holds the budget by
    the re-export and the liveness count, and the schedule written out is that candidate's."""
    from solvers.core import Schedule

    out = tmp_path / "robust"
    assert main(["-q", "solve", *TINY, "--graph", "backward", "--robust", "--budget", "1.0x", "--out", str(out),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    report = data["report"]
    assert len(report["cost_models"]) == 6 and {"analytic", "torch"} <= set(report["cost_models"])
    assert report["verified"] and report["mem_budget_bytes"] is not None
    chosen = [c for c in report["candidates"] if c["name"] == report["chosen_candidate"]]
    assert len(chosen) == 1 and chosen[0]["dropped"] is None
    figures = chosen[0]["figures"]
    assert max(figures["peak_bytes"], figures["liveness_peak_bytes"]) \
        <= report["mem_budget_bytes"]
    schedule = Schedule.from_json(json.loads((out / "backward_schedule.json").read_text()))
    assert schedule.digest() == chosen[0]["digest"]
    assert data["sim"]["peak_bytes"] <= report["mem_budget_bytes"]


# --------------------------------------------------------------------------------------------
# arguments refused while parsing: one line naming the argument, exit status 2, no traceback
# (all before any model is traced, so these are fast)
# --------------------------------------------------------------------------------------------
# (argv, the argument, its value); "{tmp}" is a temporary directory holding a regular file "afile"
REFUSED = [
    (["trace", "--out", "{tmp}/afile/sub"], "--out", "afile/sub"),
    (["solve", "x.json", "--out", "{tmp}/afile"], "--out", "afile"),
    (["sweep", "x.json", "--db", "{tmp}/missing/r.sqlite"], "--db", "missing/r.sqlite"),
    (["sweep", "x.json", "--db", "{tmp}"], "--db", "{tmp}"),
    (["solve", "x.json", "--budget", "1e400GiB"], "--budget", "1e400GiB"),
    (["solve", "x.json", "--budget", str(2**63)], "--budget", str(2**63)),
    (["solve", "x.json", "--budget", "infx"], "--budget", "infx"),
    (["solve", "x.json", "--budget", "nanx"], "--budget", "nanx"),
    (["sweep", "x.json", "--budgets", "1GiB", "1e400GiB"], "--budgets", "1e400GiB"),
    (["solve", "x.json", "--work-limit", "inf"], "--work-limit/--time-limit", "inf"),
    (["sweep", "x.json", "--work-limit", "nan"], "--work-limit/--time-limit", "nan"),
    (["solve", "x.json", "--time-limit", "0"], "--work-limit/--time-limit", "0"),  # its old name
    (["trace", "--inter-node-gbps", "inf"], "--inter-node-gbps", "inf"),
    (["trace", "--world-size", "1"], "--world-size", "1"),
    (["trace", "--n-layers", "-2"], "--n-layers", "-2"),
    (["sweep", "x.json", "--workers", "0"], "--workers", "0"),
]


@pytest.mark.parametrize("argv, argument, value", REFUSED, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in REFUSED])
def test_bad_argument_is_one_line_naming_it(argv, argument, value, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argument}:" in err and value.format(tmp=tmp_path) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing created


def test_bad_argument_exit_status_in_a_subprocess(tmp_path):
    """The console script itself exits 2 (not 1 with a traceback) on an overflowing budget."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import scheduler

    root = str(Path(scheduler.__file__).resolve().parents[1])  # the scheduler under test, not another install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "scheduler.cli", "solve", "x.json", "--budget", "1e400 GiB"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2
    assert "argument --budget" in proc.stderr and "1e400 GiB" in proc.stderr and "2**63 - 1" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# inputs refused while running: one line, exit status 2 (a small synthetic DAG, no tracing)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def small_dag_file(tmp_path):
    from scheduler.export.dagfile import save_dag
    from scheduler.whatif.synthetic import make_fsdp_dag

    path = tmp_path / "small.dag.json"
    save_dag(make_fsdp_dag(n_layers=1, params_per_layer=3, graph_kind="backward", seed=0), path)
    return path


def test_dag_argument_that_is_a_directory_exits_2(tmp_path, capsys):
    assert main(["solve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "not a file" in err and len(err.strip().splitlines()) == 1


def test_deeply_nested_json_is_not_a_dag_file(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    assert main(["solve", str(deep)]) == 2
    err = capsys.readouterr().err
    assert "deep.json is not an fsdp-sched DAG file" in err and "Traceback" not in err


def test_db_that_is_not_a_sqlite_file_exits_2(small_dag_file, tmp_path, capsys):
    db = tmp_path / "notes.txt"
    db.write_text("not a database, " * 100)
    argv = ["-q", "sweep", str(small_dag_file), "--budgets", "1.0x", "--out", str(tmp_path / "o"), "--db", str(db)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--db" in err and "notes.txt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("multiple", ["1e30x", "1e305x", "1e-30x"])
def test_budget_multiple_out_of_range_exits_2(small_dag_file, tmp_path, multiple, capsys):
    """A finite multiple of the peak that comes to no real size (more than 2**63 - 1 bytes, or
    less than one) is refused, not stored or solved."""
    argv = ["-q", "sweep", str(small_dag_file), "--budgets", multiple, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--budgets {multiple}" in err and "2**63 - 1" in err
    assert not (tmp_path / "o" / "sweep.sqlite").exists()


def test_solve_refuses_an_unknown_solver_before_tracing(tmp_path, capsys):
    assert main(["solve", *TINY, "--solver", "bogus", "--out", str(tmp_path / "o")]) == 2
    assert "unknown solver 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# defaults and errors users meet
# --------------------------------------------------------------------------------------------
def test_sweep_default_budgets_are_every_one_reachable(traced, tmp_path, capsys):
    """Without --budgets, the sweep spans the smallest peak any schedule reaches up to the larger
    of the traced peak and that of the schedule without a budget: every point has a schedule,
    so the Pareto plot has a point per budget."""
    _, backward = traced
    assert main(["-q", "sweep", str(backward), "--work-limit", "1", "--out", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    points = data["points"]
    assert len(points) == 4 and all(p["status"] != "infeasible" and p["step_ms"] is not None for p in points), points
    assert max(p["budget_bytes"] for p in points) >= data["baselines"]["traced"]["peak_bytes"]


@pytest.mark.parametrize("argv, kind", [
    (["trace", "--model", "gpt-5"], "CliError"),
    (["solve", "no-such.json"], "CliError"),
    (["solve", "x.json", "--budget", "40 furlongs"], "ArgumentError"),
    (["sweep", "no-such.json"], "CliError"),
    (["demo", "--model", "gpt-5"], "CliError"),
    (["measure", "--out", "t.csv"], "CliError"),
])
def test_json_errors_are_a_json_object_on_stdout(argv, kind, tmp_path, monkeypatch, capsys):
    """``--json`` makes an error a JSON object on stdout, with the error's type and message, and
    a non-zero exit status, on every command."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        status = main([*argv, "--json"])
    except SystemExit as e:
        status = e.code
    assert status == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == kind and error["message"]


def test_an_unreachable_budget_names_the_commands_flag(traced, tmp_path, capsys):
    """The library says ``mem_budget``; the command line names its own flag, ``--budget``, and
    the smallest peak found, in one line (and in the JSON error with ``--json``)."""
    _, backward = traced
    assert main(["solve", str(backward), "--budget", "1KiB", "--work-limit", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--budget" in err and "mem_budget" not in err
    assert "raise --budget to at least" in err
    assert main(["solve", str(backward), "--budget", "1KiB", "--work-limit", "1", "--out", str(tmp_path),
                 "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "InfeasibleBudgetError" and "--budget" in error["message"]
