"""The headline at equal memory (scheduler/equal_memory.py): fsdp-sched at each baseline's peak,
both judged on their rewritten graphs, on llama3-debug; and the Pareto picture that marks it."""

from __future__ import annotations

import pytest

from scheduler import equal_memory


@pytest.fixture(scope="module")
def comparison():
    import torch.distributed as dist

    models = pytest.importorskip("models")
    if dist.is_initialized() and dist.get_backend() != "fake":
        pytest.skip("capture needs a process without a real group")
    from models.capture import fake_process_group

    graphs = models.capture_fsdp_graphs("llama3-debug", world_size=4, n_layers=2)
    with fake_process_group(4):
        return equal_memory.compare(graphs.backward, graph="backward", time_limit_s=2.0)


def test_every_baseline_under_every_cost_model(comparison):
    made = set(comparison.baselines)
    assert made | set(comparison.unavailable) == set(equal_memory.BASELINES)
    assert "fsdp2" in made and "simplefsdp" in made
    assert {(r.baseline, r.cost_model) for r in comparison.rows} == {
        (b, m) for b in made for m in equal_memory.COST_MODELS}


def test_budget_is_the_baselines_peak_and_the_product_holds_it(comparison):
    for r in comparison.rows:
        judged = comparison.baselines[r.baseline].figures
        assert r.budget_bytes == judged.max_peak_bytes >= judged.liveness_peak_bytes
        assert r.baseline_ms == judged.step_ms[r.cost_model]
        assert r.fits and r.product_peak_bytes <= r.budget_bytes, r
        # the best baseline that fits is one whose peak is within the budget, and B itself fits
        best = comparison.baselines[r.best_baseline].figures
        assert best.max_peak_bytes <= r.budget_bytes and r.best_baseline_ms <= r.baseline_ms
        assert r.speedup_vs_best <= r.speedup


def test_lower_bound_is_below_every_judged_graph(comparison):
    """The bound holds for any schedule: no baseline and no product graph is faster."""
    for r in comparison.rows:
        assert r.lower_bound_ms is not None and 0 < r.lower_bound_ms
        assert r.lower_bound_ms <= r.best_baseline_ms * (1 + 1e-9), r
        assert r.lower_bound_ms <= r.product_ms * (1 + 1e-9), r
        assert r.headroom == pytest.approx(r.best_baseline_ms / r.lower_bound_ms)
        assert r.headroom >= r.speedup_vs_best * (1 - 1e-9)


def test_headline_and_table_name_each_baseline(comparison):
    text = equal_memory.headline(comparison.rows)
    assert text.count("fsdp-sched at equal memory") == len(equal_memory.COST_MODELS)
    assert "FSDP2-like" in text and "best baseline that fits" in text
    table = equal_memory.format_table(comparison.rows)
    assert "headroom" in table and "possible vs the best baseline" in text
    assert len(table.splitlines()) == len(comparison.rows) + 2
    assert comparison.to_json()["rows"][0]["speedup"] == comparison.rows[0].speedup


def test_pareto_marks_the_equal_memory_points(comparison, tmp_path, monkeypatch):
    from scheduler import plots

    seen = {}
    real = plots._mark_equal_memory

    def spy(ax, pairs, f):
        seen["pairs"] = pairs
        real(ax, pairs, f)

    monkeypatch.setattr(plots, "_mark_equal_memory", spy)
    path = equal_memory.plot(comparison, "analytic", tmp_path / "eq.png")
    assert path.stat().st_size > 0
    rows = [r for r in comparison.rows if r.cost_model == "analytic"]
    assert [(b[0], p[1]) for _, b, p in seen["pairs"]] == [(r.budget_bytes, r.product_ms) for r in rows]
