"""benchmarks/run.py --quick end to end: tables, budgets, Pareto PNGs and the DAG cache.

Runs the script twice as a subprocess on llama3-debug (2 layers, world 8) with a private cache
directory: the first run traces and fills the cache, the second must load from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "run.py"
MODEL = "llama3-debug"
GRAPHS = ("forward", "backward")
METHODS = ("traced", "fsdp2", "simplefsdp", "autoparallel", "torch overlap_scheduling", "fsdp-sched cpsat",
           "analytic lower bound")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: two runs of the quick benchmark and one of the scaling script in subprocesses (minutes)
pytestmark = pytest.mark.slow


def _run(out: Path, cache: Path) -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--cache-dir", str(cache)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"run.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc, time.perf_counter() - t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_quick")
    cache = tmp / "cache"
    first = _run(tmp / "out1", cache)
    second = _run(tmp / "out2", cache)
    return tmp, cache, first, second


def _table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_tables_have_every_method(runs):
    tmp, _cache, (first, _), _ = runs
    md = (tmp / "out1" / f"{MODEL}.md").read_text()
    assert md in first.stdout  # the tables are printed too
    for key in ("command:", "machine:", "date:", "--quick"):
        assert key in first.stdout, f"header line lacks {key!r}"
    rows = _table_rows(md)
    seen = {(r[0], r[3]) for r in rows if len(r) > 3}
    for g in GRAPHS:
        for m in METHODS:
            assert (g, m) in seen, f"no {m!r} row for the {g} graph"
    assert (tmp / "out1" / "summary.md").read_text().count("| fsdp-sched cpsat |") >= 8


def test_fsdp_sched_respects_budgets(runs):
    tmp = runs[0]
    data = json.loads((tmp / "out1" / f"{MODEL}.json").read_text())
    budgeted = [r for r in data["comparison"] + data["pareto"]
                if r["method"].startswith("fsdp-sched") and r.get("budget_bytes") is not None]
    assert budgeted
    solved = [r for r in budgeted if "peak_bytes" in r]
    assert len(solved) >= 3, "too few budgeted fsdp-sched solves succeeded"
    for r in solved:
        assert r["peak_bytes"] <= r["budget_bytes"], r
    for r in budgeted:
        if "peak_bytes" not in r:
            assert "infeasible" in r["note"], r
    # the Pareto sweep has 3 budgets per graph, by increasing budget
    for g in GRAPHS:
        sweep = [r["budget_bytes"] for r in data["pareto"] if r["graph"] == g]
        assert len(sweep) == 3 and sweep == sorted(sweep)


def test_pareto_pngs(runs):
    tmp = runs[0]
    for out in ("out1", "out2"):
        for g in GRAPHS:
            png = tmp / out / f"pareto-{MODEL}-{g}.png"
            assert png.exists(), png
            data = png.read_bytes()
            assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_second_run_uses_cache(runs):
    tmp, cache, (first, t1), (second, t2) = runs
    assert "cache miss" in first.stderr and "capture: tracing" in first.stderr
    assert "cache hit" in second.stderr
    assert "capture: tracing" not in second.stderr and "capturing" not in second.stderr
    assert sorted(p.name.split("-")[-1] for p in cache.glob("*.json")) == ["backward.json", "forward.json",
                                                                           "torch.json", "torch.json"]
    # the cached torch baseline row is reused
    second_data = json.loads((tmp / "out2" / f"{MODEL}.json").read_text())
    first_data = json.loads((tmp / "out1" / f"{MODEL}.json").read_text())
    pick = lambda d: [r for r in d["comparison"] if r["method"] == "torch overlap_scheduling"]  # noqa: E731
    assert pick(first_data) == pick(second_data)
    print(f"first run {t1:.1f} s, cached run {t2:.1f} s")


def test_scaling_script_reports_both_solvers_per_size(runs):
    """benchmarks/scaling.py on the cache filled above: a row per size, graph, budget and solver,
    every solver at most the best heuristic (both start from it)."""
    tmp, cache, _, _ = runs
    out = tmp / "scaling"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--model", MODEL, "--layers", "2",
         "--world-size", "8", "--cpsat-limits", "2", "--milp-limit", "2", "--cache-dir", str(cache),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "scaling.json").read_text())["rows"]
    for g in GRAPHS:
        for budget in ("none", "traced"):
            mine = {r["method"].split(" (")[0]: r for r in rows if r["graph"] == g and r["budget"] == budget}
            assert {"best heuristic", "cpsat", "milp"} <= mine.keys()
            for solver in ("cpsat", "milp"):
                assert mine[solver]["step_ms"] <= mine["best heuristic"]["step_ms"] + 1e-6
                assert mine[solver]["t_1pct_s"] <= mine[solver]["solve_s"] + 1e-6
    assert "solve time vs layers" in (out / "scaling.md").read_text()
