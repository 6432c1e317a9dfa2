"""The MILP twin (solvers/milp.py) against the CP-SAT model it linearises.

Both models are solved to proven optimality on tiny graphs and must agree on the model step time
(integer microseconds), with and without a memory budget; the MILP's schedules must pass the
validator, its LP relaxation must bound its optimum, and an impossible budget must raise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pulp")
pytest.importorskip("ortools")

from solvers.core.simulator import simulate  # noqa: E402
from solvers.core.validator import validate_schedule  # noqa: E402
from solvers import InfeasibleBudgetError, Problem, solve  # noqa: E402
from solvers import milp  # noqa: E402
from solvers.config import CpSatConfig, MilpConfig  # noqa: E402
from solvers.cpsat import CpSatModel, complete_solution, make_solver  # noqa: E402
from solvers.registry import BACKENDS  # noqa: E402
from solvers.model import Anchors, ModelData  # noqa: E402
from solvers.search import SearchConfig, bucket_free, window_order, search  # noqa: E402
from scheduler.whatif.synthetic import DagBuilder, make_fsdp_dag  # noqa: E402

_LIMIT_S = 20.0


def _two_gathers_one_scatter() -> Problem:
    """Two all-gathers and a reduce-scatter on one stream (two chains share process group 0)::

        p0 -> ag0 -> mm0 -> mm1 -> grad -> rs -> output
        p1 -> ag1 ------^       \\-> tail ----------^

    ag0 / ag1 cost 2 ms alone and 1.5 + 0.02 * 50 = 2.5 ms merged; compute nodes 1 ms; copies
    free. Optimal: ag0 + ag1 merged at gap 0 (0-2.5), mm0, mm1, grad (to 5.5), rs (5.5-7.0) over
    tail (5.5-6.5): 7.0 ms; issued separately ag1 ends at 4 and the step is 7.5 ms.
    """
    b = DagBuilder()
    b.add_input("x", size_bytes=100)
    b.add_input("p0", size_bytes=25, releasable=False)
    b.add_input("p1", size_bytes=25, releasable=False)
    w0 = b.add_collective("ag0", "p0", runtime_ms=2.0, payload_bytes=25, size_bytes=100)
    mm0 = b.add_compute("mm0", "x", w0, runtime_ms=1.0, size_bytes=100)
    w1 = b.add_collective("ag1", "p1", runtime_ms=2.0, payload_bytes=25, size_bytes=100)
    mm1 = b.add_compute("mm1", mm0, w1, runtime_ms=1.0, size_bytes=100)
    g = b.add_compute("grad", mm1, runtime_ms=1.0, size_bytes=100)
    rs = b.add_collective("rs", g, coll_type="reduce_scatter", runtime_ms=1.5, payload_bytes=100, size_bytes=25)
    t = b.add_compute("tail", mm1, runtime_ms=1.0, size_bytes=100)
    b.add_output(rs, t)
    dag = b.build(
        comm_model={"all_gather|0": (1.5, 0.02), "reduce_scatter|0": (0.5, 0.01)},
        copy_ms_per_byte=0.0,
        copy_ms_fixed=0.0,
    )
    return Problem.from_dag(dag)


def _fsdp(**kw) -> Problem:
    return Problem.from_dag(make_fsdp_dag(**kw))


#: tiny graphs: forward all-gather chains, and a backward graph with re-gathers whose all-gather
#: and reduce-scatter chains share one stream (exercises the pairwise order binaries)
GRAPHS = {
    "fwd-1x2": lambda: _fsdp(n_layers=1, params_per_layer=2, with_embeddings=False),
    "fwd-1": lambda: _fsdp(n_layers=1),
    "bwd-reshard-1x2": lambda: _fsdp(n_layers=1, params_per_layer=2, graph_kind="backward", reshard_after_forward=True),
    "bwd-3x1": lambda: _fsdp(n_layers=3, params_per_layer=1, with_embeddings=False, graph_kind="backward"),
    "builder-ag-rs": _two_gathers_one_scatter,
}


def _cpsat_optimum_us(problem: Problem, mem_budget_bytes: int | None, cfg: CpSatConfig = CpSatConfig()) -> int | None:
    """Proven optimum of CP-SAT's model (min U_m), None when proven infeasible."""
    cp = CpSatModel(ModelData(problem, cfg, mem_budget_bytes))
    cp.model.Minimize(cp.objective)
    solver = make_solver(_LIMIT_S, 0, 1, cfg)
    status = solver.Solve(cp.model)
    if solver.StatusName(status) == "INFEASIBLE":
        return None
    assert solver.StatusName(status) == "OPTIMAL"
    return int(round(solver.ObjectiveValue()))


def _milp_optimum(problem: Problem, mem_budget_bytes: int | None, cfg: MilpConfig = MilpConfig()):
    """Proven optimum of the MILP (warm-started from the traced schedule) and its model."""
    model, start = milp.build(ModelData(problem, cfg, mem_budget_bytes), problem.traced_schedule(), 2.0, 0, 1,
                              complete_solution)
    if start is not None:
        model.set_initial(start)
    out = milp.solve_lp(model, _LIMIT_S, 0, cfg, warm=start is not None)
    if out.status == "infeasible":
        return None, model
    assert out.status == "optimal", out
    return int(round(out.objective_us)), model


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_milp_optimum_equals_cpsat_optimum(graph):
    problem = GRAPHS[graph]()
    opt_us, model = _milp_optimum(problem, None)
    assert opt_us == _cpsat_optimum_us(problem, None)
    # the extracted schedule is valid and simulates close to the model (anchors, rounding)
    sim = validate_schedule(problem, model.extract())
    assert sim.step_ms == pytest.approx(opt_us / 1000.0, rel=0.01)


def test_builder_graph_known_optimum():
    """See :func:`_two_gathers_one_scatter`: both all-gathers merge, 7.0 ms."""
    problem = _two_gathers_one_scatter()
    result = solve(problem, solver="milp", work_limit=2.0)
    assert result.objective_ms == pytest.approx(7.0)
    assert ("ag0", "ag1") in [b.members for b in result.schedule.buckets]


def test_milp_optimum_equals_cpsat_with_bucket_cap():
    """A bucket cap of one parameter's payload forbids every merge: same optimum in both."""
    problem = GRAPHS["fwd-1"]()
    cap = max(c.payload_bytes for c in problem.colls.values())
    opt_us, model = _milp_optimum(problem, None, MilpConfig(max_bucket_bytes=cap))
    assert opt_us == _cpsat_optimum_us(problem, None, CpSatConfig(max_bucket_bytes=cap))
    assert all(len(b.members) == 1 for b in model.extract().buckets)


@pytest.mark.parametrize("frac", [1.0, 1.1, 1.25])
def test_milp_optimum_equals_cpsat_under_memory_budget(frac):
    """Re-gathers in backward: the budget (a fraction of the traced peak) limits prefetching."""
    problem = GRAPHS["bwd-reshard-1x2"]()
    traced_peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
    budget = int(traced_peak * frac)
    opt_us, _ = _milp_optimum(problem, budget)
    assert opt_us == _cpsat_optimum_us(problem, budget)
    free_us, _ = _milp_optimum(problem, None)
    if frac == 1.0:
        assert opt_us > free_us  # the budget binds: the test exercises group (7)


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_milp_schedules_validate_and_match_cpsat(graph):
    """The search with MILP windows and with CP-SAT windows: valid, equally fast."""
    problem = GRAPHS[graph]()
    result = solve(problem, solver="milp", work_limit=2.0)
    sim = validate_schedule(problem, result.schedule)
    assert result.objective_ms == pytest.approx(sim.step_ms)
    reference = solve(problem, solver="cpsat", work_limit=2.0)
    # equal model optima; the extracted schedules may be different optimal solutions of the model
    assert result.objective_ms == pytest.approx(reference.objective_ms, rel=0.01)


def test_milp_schedule_under_budget_validates():
    problem = GRAPHS["bwd-reshard-1x2"]()
    traced_peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
    budget = int(traced_peak * 1.25)
    result = solve(problem, solver="milp", mem_budget_bytes=budget, work_limit=2.0)
    validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
    assert result.peak_bytes <= budget


@pytest.mark.parametrize("graph", ["fwd-1", "bwd-reshard-1x2", "builder-ag-rs"])
def test_lp_relaxation_bounds_the_optimum(graph):
    problem = GRAPHS[graph]()
    opt_us, _ = _milp_optimum(problem, None)
    lp_ms = milp.lp_relaxation_bound_ms(problem)
    assert 0 < lp_ms <= opt_us / 1000.0 + 1e-6


def test_infeasible_budget_raises():
    """1 MiB is below the pinned parameter shards alone: neither the model nor any heuristic fits."""
    problem = GRAPHS["fwd-1x2"]()
    budget = 1 << 20
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(problem, solver="milp", mem_budget_bytes=budget, work_limit=1.0)
    assert info.value.min_peak_bytes is not None and info.value.min_peak_bytes > budget


def test_config_validation():
    with pytest.raises(ValueError):
        MilpConfig(backend="gurobi")
    with pytest.raises(ValueError):
        MilpConfig(abs_gap_us=1.0)


# -- windows of the search (solvers.search) ---------------------------------------------------
def _window_models(p: Problem, kind_free: str, budget: int | None):
    """CP-SAT's window model over the first collectives in need order, from the FSDP2-like
    incumbent, and the MILP of the same data (fresh data for each, as the solvers build them)."""
    inc = solve(p, solver="fsdp2").schedule
    anchors = Anchors(p)
    order = window_order(p)
    names = order[:8] if kind_free == "head" else order[len(order) // 2 : len(order) // 2 + 8]
    free = bucket_free(inc, names)
    cp = CpSatModel(ModelData(p, CpSatConfig(), budget, free=free, reference=inc, anchors=anchors))
    cp.model.Minimize(cp.objective)
    data = ModelData(p, MilpConfig(), budget, free=free, reference=inc, anchors=anchors)
    return cp, milp.MilpModel(data), free


@pytest.mark.parametrize("where", ["head", "middle"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_window_milp_optimum_equals_cpsat(kind, where):
    p = _fsdp(n_layers=6, params_per_layer=3, graph_kind=kind, reshard_after_forward=True, seed=1)
    cp, model, free = _window_models(p, where, None)
    assert model.window == cp.data.is_window
    solver = make_solver(_LIMIT_S, 0, 1, CpSatConfig())
    status = solver.Solve(cp.model)
    assert solver.StatusName(status) == "OPTIMAL"
    out = milp.solve_lp(model, _LIMIT_S, 0, MilpConfig())
    assert out.status == "optimal"
    assert round(out.objective_us) == round(solver.ObjectiveValue())
    sched = model.extract()
    validate_schedule(p, sched)
    assert set(free) <= {m for b in sched.buckets for m in b.members}


def test_large_graph_milp_uses_the_shared_windows():
    """The MILP backend in the search's windows on a 20-layer graph: the windows stage runs, the
    answer fits and is no slower than the heuristics."""
    p = _fsdp(n_layers=20, params_per_layer=4, graph_kind="forward", reshard_after_forward=True)
    budget = simulate(p.dag, p.traced_schedule(), problem=p).peak_bytes
    res = solve(p, solver="milp", mem_budget_bytes=budget, work_limit=4)
    assert "windows" in [s.name for s in res.stages]
    validate_schedule(p, res.schedule, mem_budget_bytes=budget)
    warm = min(solve(p, solver=h, mem_budget_bytes=budget).objective_ms for h in ("traced", "autoparallel"))
    assert res.objective_ms <= warm + 1e-9


def test_cbc_crash_is_retried_without_preprocessing(monkeypatch, caplog):
    # the bundled CBC can segfault in preprocessing on some warm-started window models; PuLP then
    # raises PulpSolverError: the solve is retried once with preprocessing off
    import pulp

    real_solve = pulp.LpProblem.solve
    calls = []

    def crashing(self, solver=None, **kw):
        calls.append(list(getattr(solver, "options", [])))
        if "preprocess off" not in calls[-1]:
            raise pulp.PulpSolverError("Pulp: Error while trying to execute (simulated crash)")
        return real_solve(self, solver, **kw)

    monkeypatch.setattr(pulp.LpProblem, "solve", crashing)
    p = _two_gathers_one_scatter()
    model = milp.MilpModel(ModelData(p, MilpConfig(), None))
    out = milp.solve_lp(model, _LIMIT_S, 0, MilpConfig(backend="cbc"))
    assert out.status == "optimal" and round(out.objective_us) == 7000
    assert len(calls) == 2 and "CBC failed" in caplog.text


def test_failing_window_solver_is_skipped_not_fatal(monkeypatch):
    """Every MILP window crashing (the solver raising) leaves the search to its starts and
    polish: a valid answer, the windows stage gaining nothing."""
    import pulp

    def always_crash(*a, **kw):
        raise pulp.PulpSolverError("Pulp: Error while trying to execute (simulated crash)")

    monkeypatch.setattr(milp, "solve_lp", always_crash)
    p = _fsdp(n_layers=4, params_per_layer=4, graph_kind="forward", reshard_after_forward=True)
    config = SearchConfig(window_members=8)
    res = search({"m": p}, None, backend=BACKENDS["milp"](config), work_limit=2.0, config=config)
    validate_schedule(p, res.schedule)
    (windows,) = [s for s in res.stages if s.name == "windows"]
    assert windows.gained_ms == 0.0 and windows.work > 0
