"""benchmarks/moe.py end to end on dsv3-debug (3 layers, 4 fake ranks): every contender judged
at both budgets, fsdp-sched within each, the rows written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: a subprocess that traces and judges two graphs (a minute)
pytestmark = pytest.mark.slow


def test_moe_benchmark_smoke_run(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "moe.py"), "--preset", "dsv3-debug", "--world", "4",
         "--layers", "3", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = json.loads(out.read_text())
    assert [(r["graph"], r["budget"]) for r in rows] == [
        ("forward", "traced"), ("forward", "torch"), ("backward", "traced"), ("backward", "torch")]
    for r in rows:
        assert set(r["contenders"]) == {"torch-overlap", "torch-overlap-no-prebucketing", "traced", "fsdp2",
                                        "simplefsdp", "autoparallel", "fsdp-sched"}
        product = r["contenders"]["fsdp-sched"]
        assert product["fits"] and product["peak_bytes"] <= r["budget_bytes"]
        assert set(product["step_ms"]) == {"analytic", "torch"}
        assert sum(product["by_group"].values()) == product["collectives"]
        if r["budget"] == "traced":
            assert r["budget_bytes"] == r["contenders"]["traced"]["peak_bytes"]
    assert "fsdp-sched" in proc.stdout and "budget = traced peak" in proc.stdout
