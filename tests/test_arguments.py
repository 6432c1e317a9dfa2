"""Every argument of the entry points is checked before any solve, with an error that names it.

The cases are the ones a user tried: each used to end in a fallback with the error only in
the report's notes, an int-conversion error, an OverflowError, or silence.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from scheduler import InfeasibleBudgetError, optimize_schedule, solve_dag
from scheduler.api import REPORT_KEY
from scheduler.dag import export_dag
from scheduler.verify import graph_digest
from test_writeback import COSTS, gloo_group, toy_graph


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


BAD = [
    ({"payload_order": "foo"}, ValueError, "payload_order"),
    ({"time_limit_s": 0}, ValueError, "time_limit_s"),
    ({"time_limit_s": -1}, ValueError, "time_limit_s"),
    ({"time_limit_s": math.nan}, ValueError, "time_limit_s"),
    ({"time_limit_s": math.inf}, ValueError, "time_limit_s"),
    ({"time_limit_s": "5"}, TypeError, "time_limit_s"),
    ({"time_limit_s": None}, TypeError, "time_limit_s"),
    ({"seed": "x"}, TypeError, "seed"),
    ({"seed": -1}, ValueError, "seed"),
    ({"solver": None}, TypeError, "solver"),
    ({"solver": 42}, TypeError, "solver"),
    ({"solver": "cp-sat"}, ValueError, "solver"),
    ({"num_workers": -1}, ValueError, "num_workers"),
    ({"num_workers": 1.5}, TypeError, "num_workers"),
    ({"extra_starts": ["x"]}, TypeError, "extra_starts"),
    ({"extra_starts": "x"}, TypeError, "extra_starts"),
    ({"fallback": "yes"}, TypeError, "fallback"),
    ({"verify": 1}, TypeError, "verify"),
    ({"robust": True, "verify": False}, ValueError, "verify"),
    ({"schedule_hook": 3}, TypeError, "schedule_hook"),
    ({"cost_model": "roofline"}, ValueError, "cost model"),
    ({"cluster": "h100"}, TypeError, "cluster"),
    ({"broadcast_from": 5}, ValueError, "broadcast_from"),
    ({"mem_budget": 2**63}, ValueError, "2**63"),
    ({"mem_budget": "1e400 GiB"}, ValueError, "1e400"),
    ({"mem_budget": "abc"}, ValueError, "abc"),
]


@pytest.mark.parametrize("kwargs, error, named", BAD, ids=[str(k) for k, _, _ in BAD])
def test_a_bad_argument_is_named_before_anything_runs(pg, kwargs, error, named):
    """The call raises the named error on this (single) rank, and the graph is untouched."""
    gm = toy_graph(pg, 1)
    before = graph_digest(gm)
    kwargs = {"mem_budget": None, "cost_model": COSTS, **kwargs}
    with pytest.raises(error, match=named.replace("*", r"\*")):
        optimize_schedule(gm, **kwargs)
    assert graph_digest(gm) == before and REPORT_KEY not in gm.meta


@pytest.mark.parametrize("kwargs, error, named", [b for b in BAD if set(b[0]) <= {
    "time_limit_s", "seed", "solver", "num_workers", "fallback", "mem_budget"}])
def test_solve_dag_checks_the_same_arguments(pg, kwargs, error, named):
    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    with pytest.raises(error, match=named.replace("*", r"\*")):
        solve_dag(dag, **{"mem_budget": None, **kwargs})


def test_a_graph_without_collectives_holds_its_budget():
    """``(x @ x) @ x`` peaks far above 1 KiB: with nothing to schedule, the budget is refused
    with the graph's own peak, which is then accepted."""
    x = torch.randn(256, 256)
    gm = make_fx(lambda x: (x @ x) @ x, tracing_mode="fake")(x)
    with pytest.raises(InfeasibleBudgetError) as err:
        optimize_schedule(gm, "1 KiB")
    peak = err.value.min_peak_bytes
    assert peak >= 2 * 256 * 256 * 4
    optimize_schedule(gm, peak)
    assert gm.meta[REPORT_KEY].status == "unchanged"
