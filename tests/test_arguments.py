"""Every argument of the entry points is checked before anything runs, with an error that names it.

Options are frozen dataclasses checked when they are built (a bad value fails in the caller's
own line, before any collective); ``optimize_schedule`` itself checks ``gm``, ``mem_budget``,
``cost_model``, ``cluster`` and that each option is an options object. The cases are the ones
a user tried: each used to end in a fallback with the error only in the report's notes, an
int-conversion error, an OverflowError, or silence.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from scheduler import (
    AgreementOptions,
    InfeasibleBudgetError,
    SearchConfig,
    SolverOptions,
    WriteBackOptions,
    optimize_schedule,
    solve_dag,
)
from scheduler.api import REPORT_KEY
from scheduler.check.written import graph_digest
from scheduler.export.dag import export_dag
from test_writeback import COSTS, gloo_group, toy_graph


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


BAD_OPTIONS = [
    (WriteBackOptions, {"payload_order": "foo"}, ValueError, "payload_order"),
    (WriteBackOptions, {"control_deps": 1}, TypeError, "control_deps"),
    (SolverOptions, {"work_limit": 0}, ValueError, "work_limit"),
    (SolverOptions, {"work_limit": -1}, ValueError, "work_limit"),
    (SolverOptions, {"work_limit": math.nan}, ValueError, "work_limit"),
    (SolverOptions, {"work_limit": math.inf}, ValueError, "work_limit"),
    (SolverOptions, {"work_limit": "5"}, TypeError, "work_limit"),
    (SolverOptions, {"work_limit": None}, TypeError, "work_limit"),
    (SolverOptions, {"work_limit": True}, TypeError, "work_limit"),
    (SolverOptions, {"seed": "x"}, TypeError, "seed"),
    (SolverOptions, {"seed": -1}, ValueError, "seed"),
    (SolverOptions, {"solver": None}, TypeError, "solver"),
    (SolverOptions, {"solver": 42}, TypeError, "solver"),
    (SolverOptions, {"solver": "cp-sat"}, ValueError, "solver"),
    (SolverOptions, {"num_workers": -1}, ValueError, "num_workers"),
    (SolverOptions, {"num_workers": 1.5}, TypeError, "num_workers"),
    (SolverOptions, {"extra_starts": ["x"]}, TypeError, "extra_starts"),
    (SolverOptions, {"extra_starts": "x"}, TypeError, "extra_starts"),
    (SolverOptions, {"fallback": "yes"}, TypeError, "fallback"),
    (SolverOptions, {"schedule_hook": 3}, TypeError, "schedule_hook"),
    (SolverOptions, {"search": {"window_share": 0.5}}, TypeError, "search"),
    (SolverOptions, {"bandwidth_scales": (0.7, -1.0)}, ValueError, "bandwidth_scales"),
    (SolverOptions, {"bandwidth_scales": [0.7]}, ValueError, "bandwidth_scales"),
    (SolverOptions, {"order_margin": -0.01}, ValueError, "order_margin"),
    (SolverOptions, {"order_margin": math.nan}, ValueError, "order_margin"),
    (SolverOptions, {"order_margin": True}, ValueError, "order_margin"),
    (AgreementOptions, {"enabled": 1}, TypeError, "enabled"),
    (AgreementOptions, {"broadcast_from": -1}, ValueError, "broadcast_from"),
    (AgreementOptions, {"broadcast_from": "0"}, TypeError, "broadcast_from"),
    (SearchConfig, {"window_share": 1.5}, ValueError, "window_share"),
    (SearchConfig, {"start_sizes": ()}, ValueError, "start_sizes"),
    (SearchConfig, {"polish_steps": (0,)}, ValueError, "polish_steps"),
    (SearchConfig, {"evaluated_nodes_per_s": 0.0}, ValueError, "evaluated_nodes_per_s"),
    (SearchConfig, {"fit_moves": -1}, ValueError, "fit_moves"),
]


@pytest.mark.parametrize("cls, kwargs, error, named", BAD_OPTIONS,
                         ids=[f"{c.__name__}-{k}" for c, k, _, _ in BAD_OPTIONS])
def test_a_bad_option_is_named_when_the_options_are_built(cls, kwargs, error, named):
    with pytest.raises(error, match=named):
        cls(**kwargs)


def test_options_are_frozen_and_take_keywords_only():
    options = SolverOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.work_limit = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SolverOptions("cpsat")  # type: ignore[misc]
    # extra starts given as a list are kept as a tuple (hashable, and frozen like the rest)
    assert SolverOptions(extra_starts=[]).extra_starts == ()


def test_the_old_names_of_the_work_limits_still_work_and_warn():
    """``SolverOptions.time_limit_s`` and ``SearchConfig.window_s`` were renamed (they count
    deterministic work, not seconds): for one release the old names still set and read the
    fields, each with a DeprecationWarning that names the new one."""
    with pytest.warns(DeprecationWarning, match="work_limit"):
        old = SolverOptions(time_limit_s=2.5)
    assert old == SolverOptions(work_limit=2.5)
    with pytest.warns(DeprecationWarning, match="work_limit"):
        assert old.time_limit_s == 2.5
    with pytest.warns(DeprecationWarning, match="work_limit"):
        assert dataclasses.replace(old, time_limit_s=4.0).work_limit == 4.0
    with pytest.warns(DeprecationWarning, match="work_limit"), pytest.raises(ValueError, match="work_limit"):
        SolverOptions(time_limit_s=0)  # still checked
    with pytest.warns(DeprecationWarning, match="window_work"):
        config = SearchConfig(window_s=0.1)
    assert config == SearchConfig(window_work=0.1)
    with pytest.warns(DeprecationWarning, match="window_work"):
        assert config.window_s == 0.1


BAD_CALL = [
    ({"cost_model": "roofline"}, ValueError, "cost model"),
    ({"cluster": "h100"}, TypeError, "cluster"),
    ({"agreement": AgreementOptions(broadcast_from=5)}, ValueError, "broadcast_from"),
    ({"solver": "cpsat"}, TypeError, "solver"),
    ({"solver": {"work_limit": 2.0}}, TypeError, "solver"),
    ({"agreement": False}, TypeError, "agreement"),
    ({"writeback": "registration"}, TypeError, "writeback"),
    ({"mem_budget": 2**63}, ValueError, "2**63"),
    ({"mem_budget": "1e400 GiB"}, ValueError, "1e400"),
    ({"mem_budget": "abc"}, ValueError, "abc"),
]


@pytest.mark.parametrize("kwargs, error, named", BAD_CALL, ids=[str(k) for k, _, _ in BAD_CALL])
def test_a_bad_argument_is_named_before_anything_runs(pg, kwargs, error, named):
    """The call raises the named error on this (single) rank, and the graph is untouched."""
    gm = toy_graph(pg, 1)
    before = graph_digest(gm)
    kwargs = {"mem_budget": None, "cost_model": COSTS, **kwargs}
    with pytest.raises(error, match=named.replace("*", r"\*")):
        optimize_schedule(gm, **kwargs)
    assert graph_digest(gm) == before and REPORT_KEY not in gm.meta


def test_gm_must_be_a_graph_module():
    with pytest.raises(TypeError, match="GraphModule"):
        optimize_schedule(torch.nn.Linear(2, 2), None)


@pytest.mark.parametrize("kwargs, error, named", [
    ({"mem_budget": 2**63}, ValueError, "2**63"),
    ({"mem_budget": "abc"}, ValueError, "abc"),
    ({"solver": "cpsat"}, TypeError, "solver"),
], ids=["budget-2**63", "budget-abc", "solver-by-name"])
def test_solve_dag_checks_the_same_arguments(pg, kwargs, error, named):
    dag = export_dag(toy_graph(pg, 1), cost_model=COSTS)
    with pytest.raises(error, match=named.replace("*", r"\*")):
        solve_dag(dag, **{"mem_budget": None, **kwargs})
    with pytest.raises(TypeError, match="DiGraph"):
        solve_dag({"nodes": []})


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
