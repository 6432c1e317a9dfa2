"""The registry as a user meets it: a solver of one's own written to the documented signature,
and the backends' knobs reached from the options.

Graphs are the toy graph of ``test_writeback`` (three all-gathers, two reduce-scatters) traced
on a real single-process gloo group, with fixed collective costs.
"""

from __future__ import annotations

import pytest

from scheduler import SolverOptions, optimize_schedule
from scheduler import api
from solvers import solve
from solvers.config import CpSatConfig, MilpConfig
from solvers.objective import SearchConfig
from solvers.registry import BACKENDS
from test_writeback import COSTS, gloo_group, toy_graph


@pytest.fixture
def pg():
    with gloo_group() as name:
        yield name


def test_a_solver_written_as_the_options_document_it_is_used(pg):
    """``SolverOptions.solver`` documents a callable ``fn(problem, *, mem_budget_bytes,
    work_limit, seed, hint, num_workers, extra_starts)``: one written exactly so is called
    with every keyword and its schedule installed, not turned into a fallback by a TypeError."""
    seen = {}

    def my_solver(problem, *, mem_budget_bytes, work_limit, seed, hint, num_workers, extra_starts):
        seen.update(hint=hint, extra_starts=extra_starts, num_workers=num_workers)
        return solve(problem, solver="fsdp2", mem_budget_bytes=mem_budget_bytes, work_limit=work_limit,
                     seed=seed)

    gm = toy_graph(pg, 1)
    optimize_schedule(gm, "1 GiB", cost_model=COSTS, solver=SolverOptions(solver=my_solver, fallback=False))
    report = gm.meta[api.REPORT_KEY]
    assert seen == {"hint": None, "extra_starts": (), "num_workers": 1}
    assert report.requested_solver == "my_solver" and report.solver == "fsdp2" and not report.fell_back


def test_a_solver_written_before_work_limit_still_gets_its_limit():
    """A solver of one's own that takes ``time_limit_s`` (the work limit's name before) and
    ``solve(time_limit_s=...)`` still work for one release, each with a DeprecationWarning."""
    from scheduler.whatif.synthetic import make_fsdp_dag
    from solvers import Problem

    problem = Problem.from_dag(make_fsdp_dag(n_layers=2, graph_kind="forward"))
    seen = {}

    def old_solver(problem, *, mem_budget_bytes, time_limit_s, seed, hint, num_workers, extra_starts):
        seen["limit"] = time_limit_s
        return solve(problem, solver="fsdp2")

    with pytest.warns(DeprecationWarning, match="work_limit"):
        solve(problem, solver=old_solver, work_limit=3.0)
    assert seen == {"limit": 3.0}
    with pytest.warns(DeprecationWarning, match="work_limit"):
        solve(problem, solver=old_solver, time_limit_s=2.0)
    assert seen == {"limit": 2.0}


def test_the_old_names_of_the_reach_fields_still_work_and_warn():
    """``window_anchors`` / ``wait_window_anchors`` of the backends' configs were renamed
    ``issue_reach_anchors`` / ``wait_reach_anchors`` (the search's windows are another thing):
    for one release the old names still set and read the fields of every backend's config,
    each with a DeprecationWarning that names the new one."""
    for config_class in (CpSatConfig, MilpConfig):
        with pytest.warns(DeprecationWarning, match="issue_reach_anchors"):
            old = config_class(window_anchors=5)
        assert old == config_class(issue_reach_anchors=5)
        with pytest.warns(DeprecationWarning, match="wait_reach_anchors"):
            assert config_class(wait_window_anchors=3).wait_reach_anchors == 3
        with pytest.warns(DeprecationWarning, match="issue_reach_anchors"):
            assert old.window_anchors == 5
        with pytest.warns(DeprecationWarning, match="issue_reach_anchors"), pytest.raises(ValueError, match="issue_reach"):
            config_class(window_anchors=0)  # still checked
    with pytest.warns(DeprecationWarning, match="issue_reach_anchors"):
        config = SearchConfig(cpsat=CpSatConfig(window_anchors=5))
    assert BACKENDS["cpsat"](config).config.issue_reach_anchors == 5


def test_backend_knobs_are_reached_from_the_search_config():
    """Each backend is built with its own config from ``SearchConfig`` (so from
    ``SolverOptions.search``); a config of the wrong backend is refused where it is given."""
    config = SearchConfig(cpsat=CpSatConfig(issue_reach_anchors=5), milp=MilpConfig(max_nodes=7))
    assert BACKENDS["cpsat"](config).config.issue_reach_anchors == 5
    assert BACKENDS["milp"](config).config.max_nodes == 7
    with pytest.raises(TypeError, match="milp"):
        SearchConfig(milp=CpSatConfig())
