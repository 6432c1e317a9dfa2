"""scheduler.whatif.plots writes non-empty PNGs for synthetic schedules (no torch tracing needed)."""

from __future__ import annotations

import pytest

from scheduler.whatif import plots
from solvers.core.simulator import simulate
from solvers.registry import solve
from solvers.core.problem import Problem
from scheduler.whatif.synthetic import make_fsdp_dag

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def backward():
    """A 3-layer FSDP-like backward graph (all-gathers and reduce-scatters, one group),
    scheduled by the FSDP2-like heuristic so buckets span several collectives."""
    dag = make_fsdp_dag(n_layers=3, graph_kind="backward", seed=0)
    problem = Problem.from_dag(dag)
    sim = simulate(dag, solve(problem, solver="fsdp2").schedule, problem=problem)
    return problem, sim


def _is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_layer_of_reads_layer_index_from_fqns():
    assert plots.layer_of(["layers.3.attention.wq.weight", "layers.2.ffn.w1.weight"]) == 2
    assert plots.layer_of(["model.layers.11.attention.wk.weight"]) == 11
    assert plots.layer_of(["tok_embeddings.weight", "norm.weight"]) is None


def test_gantt_writes_png(backward, tmp_path):
    problem, sim = backward
    path = plots.gantt(sim, problem, tmp_path / "sub" / "gantt.png")
    assert path.exists() and _is_png(path)


def test_memory_writes_png_and_curve_reaches_peak(backward, tmp_path):
    problem, sim = backward
    path = plots.memory(sim, tmp_path / "memory.png", budget_bytes=sim.peak_bytes * 2)
    assert _is_png(path)
    # the drawn curve includes in-step peaks, so its maximum is the simulated peak
    _, live = plots._memory_curve(sim)
    assert max(live) == sim.peak_bytes


def test_pareto_front_and_png(backward, tmp_path):
    _, sim = backward
    pts = [{"peak_bytes": 10, "step_ms": 5.0}, {"peak_bytes": 20, "step_ms": 3.0},
           {"peak_bytes": 30, "step_ms": 4.0}, (40, 1.0)]
    assert plots.pareto_front([plots._xy(p) for p in pts]) == [(10, 5.0), (20, 3.0), (40, 1.0)]
    path = plots.pareto(pts, tmp_path / "pareto.png", baselines={"fsdp2": sim, "traced": (15, 6.0)})
    assert _is_png(path)
