"""``cost_model="analytic"`` / ``"torch"`` by name wherever a cost model is accepted: the API,
the torch.compile backend and the inductor post-grad pass (the CLI: tests/test_cli.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import scheduler  # noqa: E402
from scheduler import SolverOptions, optimize_schedule, simulate  # noqa: E402
from scheduler.integrate import compile as compile_  # noqa: E402
from scheduler.api import REPORT_KEY  # noqa: E402
from scheduler.export.dag import export_dag  # noqa: E402
from test_writeback import gloo_group, toy_graph  # noqa: E402

NAMES = ("analytic", "torch")
QUICK = SolverOptions(work_limit=1.0)


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def _traced_ms(pg: str, name: str) -> float:
    return simulate(export_dag(toy_graph(pg, 1), cost_model=name)).step_ms


def _priced_with(report, name: str, pg: str) -> None:
    """The report's traced figure is the named model's, and the schedule was judged under it
    alone."""
    assert report.step_ms_before == pytest.approx(_traced_ms(pg, name))
    assert report.cost_models == [name]


def test_optimize_schedule_by_name(pg):
    assert _traced_ms(pg, "analytic") != _traced_ms(pg, "torch")  # the names price differently
    for name in NAMES:
        gm = toy_graph(pg, 1)
        optimize_schedule(gm, "1 GiB", cost_model=name, solver=QUICK)
        _priced_with(gm.meta[REPORT_KEY], name, pg)
    gm = toy_graph(pg, 1)
    before = str(gm.graph)
    with pytest.raises(ValueError, match="analytic.*torch"):
        optimize_schedule(gm, "1 GiB", cost_model="roofline")
    assert str(gm.graph) == before


def test_inductor_post_grad_pass_by_name(pg):
    for name in NAMES:
        gm = toy_graph(pg, 1)
        post_pass = compile_.inductor_post_grad_pass(mem_budget="1 GiB", cost_model=name, solver=QUICK)
        post_pass(gm.graph)
        (report,) = post_pass.reports
        _priced_with(report, name, pg)


def test_backend_by_name(pg):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_single_autograd as all_gather

    group = dist.group.WORLD

    def f(w1, w2, x):
        h = torch.relu(x @ all_gather(w1, 0, group))
        return (h @ all_gather(w2, 0, group)).sum()

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(2)]
    x = torch.randn(8, 16, generator=g)
    be = scheduler.backend(cost_model="torch", solver=QUICK)
    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend=be, fullgraph=True)(*ws, x)
        out.backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, f(*ws, x))
    assert [r.graph_name for r in be.reports] == ["forward", "backward"]
    for r in be.reports:
        assert r.cost_models == ["torch"]
