"""Property tests (hypothesis): every solver's schedule is valid, fits its budget, and is
deterministic on random FSDP-like DAGs; random valid schedules written back onto a traced
graph keep ``graph.lint()`` and the results, bitwise, on a real gloo group of one rank; on
random programs with functional collectives (``tests/random_programs.py``: collectives waited
several times, chains of collectives, zero-size collectives, waits on graph inputs, multi-output
ops), every solver's and heuristic's schedule is valid, its simulated peaks are the written
graph's liveness and torch tracker peaks to the byte, the written graph computes the traced
one's results, and the smallest peak an infeasible budget advises is a budget that holds.

The write-back graph (L = 4 layers; w_i fp32 shards cast to bf16 and all-gathered, one
reduce-scatter of an fp32 gradient per layer)::

    ag_i(w_i) -> wait_i ;  h_i = relu(mm(h_{i-1}, wait_i))        i = 0..3
    g_i = rs_i((h_i.t() @ gy).float()) -> wait                      (every layer)
    output: h_3, g_0..g_3
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from random_programs import random_program, real_program_inputs, trace_program
from scheduler import SolverOptions, export_dag, optimize_schedule, validate_schedule
from scheduler.check.judge import liveness_peak, torch_tracker_peak
from scheduler.writeback import apply_schedule
from solvers import Bucket, InfeasibleBudgetError, Problem, Schedule, solve
from solvers.heuristics import split_feasible, issue_range
from scheduler.whatif.synthetic import make_fsdp_dag
from test_writeback import gloo_group

HEURISTICS = ("traced", "fsdp2", "simplefsdp", "autoparallel")
#: short limits on the 2-core CI machine
WORK_LIMIT = 2.0
PROPS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fsdp_dags(draw, max_layers: int = 4):
    return make_fsdp_dag(
        n_layers=draw(st.integers(1, max_layers)),
        params_per_layer=draw(st.integers(1, 4)),
        param_bytes=draw(st.sampled_from([1 << 16, 1 << 20, 16 << 20])),
        compute_ms_per_node=draw(st.sampled_from([0.05, 0.5, 2.0])),
        graph_kind=draw(st.sampled_from(["forward", "backward"])),
        reshard_after_forward=draw(st.booleans()),
        n_groups=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 10_000)),
    )


def heuristic_peaks(problem: Problem) -> list[int]:
    return [validate_schedule(problem, solve(problem, solver=h).schedule).peak_bytes for h in HEURISTICS]


def budget_between_peaks(problem: Problem, frac: float) -> int:
    """A budget ``frac`` of the way from the smallest to the largest heuristic peak."""
    peaks = heuristic_peaks(problem)
    return int(min(peaks) + frac * (max(peaks) - min(peaks)))


def solve_checked(problem: Problem, solver: str, budget: int | None):
    """Solve; a returned schedule must validate and simulate within ``budget``. None when the
    solver proves (raises) the budget infeasible."""
    try:
        result = solve(problem, solver=solver, mem_budget_bytes=budget, work_limit=WORK_LIMIT)
    except InfeasibleBudgetError as e:
        assert e.mem_budget_bytes == budget
        return None
    sim = validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
    assert sim.peak_bytes <= (budget if budget is not None else math.inf)
    return result


# --------------------------------------------------------------------------------------------
# solvers on random DAGs
# --------------------------------------------------------------------------------------------
@PROPS
@given(dag=fsdp_dags(), frac=st.floats(0.0, 1.0), solver=st.sampled_from(("cpsat", *HEURISTICS)))
def test_every_solver_schedule_is_valid_and_fits_its_budget(dag, frac, solver):
    problem = Problem.from_dag(dag)
    budget = budget_between_peaks(problem, frac)
    solve_checked(problem, solver, None)
    solve_checked(problem, solver, budget)


@settings(max_examples=8, deadline=None)
@given(dag=fsdp_dags(max_layers=1), frac=st.floats(0.0, 1.0))
def test_milp_schedule_is_valid_and_fits_its_budget_on_tiny_dags(dag, frac):
    problem = Problem.from_dag(dag)
    solve_checked(problem, "milp", budget_between_peaks(problem, frac))


@PROPS
@given(dag=fsdp_dags(), frac=st.floats(0.0, 1.0), solver=st.sampled_from(("cpsat", *HEURISTICS)))
def test_solving_twice_gives_the_same_digest(dag, frac, solver):
    problem = Problem.from_dag(dag)
    budget = budget_between_peaks(problem, frac)
    first = solve_checked(problem, solver, budget)
    # a fresh Problem from the same DAG: no state shared between the two solves
    second = solve_checked(Problem.from_dag(dag), solver, budget)
    assert (first is None) == (second is None)
    if first is not None:
        assert first.schedule.digest() == second.schedule.digest()


# --------------------------------------------------------------------------------------------
# random valid schedules
# --------------------------------------------------------------------------------------------
def random_schedule(problem: Problem, rnd: random.Random) -> Schedule:
    """Random merges of consecutive chain members (split where issue ranges do not intersect),
    issued anywhere in the bucket's issue range [max ready, min needed] and waited between issue and
    min needed; fixed collectives stay alone where traced."""
    buckets, issue_at, wait_at = [], [], []
    for members in problem.chains.values():
        runs, cur = [], [members[0]]
        for m in members[1:]:
            if rnd.random() < 0.5:
                cur.append(m)
            else:
                runs.append(cur)
                cur = [m]
        runs.append(cur)
        for run in runs:
            for part in split_feasible(problem, run):
                lo, hi = issue_range(problem, part)
                i = rnd.randint(lo, hi)
                buckets.append(Bucket(tuple(part)))
                issue_at.append(i)
                wait_at.append(rnd.randint(i, hi))
    for c in problem.colls.values():
        if not c.movable:
            buckets.append(Bucket((c.name,)))
            issue_at.append(c.traced_issue)
            wait_at.append(c.traced_wait)
    return problem.schedule_at(buckets, issue_at, wait_at)


@PROPS
@given(dag=fsdp_dags(), seed=st.integers(0, 2**31))
def test_random_schedules_are_valid(dag, seed):
    """The chain / issue-range rules in solvers.core.problem describe every valid schedule: any random
    schedule built from them passes the validator."""
    problem = Problem.from_dag(dag)
    schedule = random_schedule(problem, random.Random(seed))
    validate_schedule(problem, schedule)


# --------------------------------------------------------------------------------------------
# write-back on a real graph (gloo, world 1: collectives are identities)
# --------------------------------------------------------------------------------------------
N_LAYERS, D = 4, 16


def traced_layers(group_name: str) -> torch.fx.GraphModule:
    """The graph of the module docstring, traced with fake tensors, FSDP metadata attached."""
    ops = torch.ops._c10d_functional

    def f(w0, w1, w2, w3, x, gy):
        h, grads = x, []
        for w in (w0, w1, w2, w3):
            a = ops.wait_tensor(ops.all_gather_into_tensor(w.to(torch.bfloat16), 1, group_name))
            h = torch.relu(torch.mm(h, a))
            grads.append(ops.wait_tensor(ops.reduce_scatter_tensor((h.t() @ gy).float(), "sum", 1, group_name)))
        return h, *grads

    with FakeTensorMode():
        args = layer_inputs(torch.randn)
    gm = make_fx(f, tracing_mode="fake")(*args)
    ags = [n for n in gm.graph.nodes if "all_gather_into_tensor" in str(n.target)]
    rss = [n for n in gm.graph.nodes if "reduce_scatter_tensor" in str(n.target)]
    for i, n in enumerate(ags):
        n.meta["fsdp_param_index"] = i
        n.meta["fsdp_fqn"] = f"w{i}"
    for i, n in enumerate(rss):
        n.meta["fsdp_param_index"] = i
    return gm


def layer_inputs(randn):
    return (*(randn(D, D) for _ in range(N_LAYERS)), randn(8, D, dtype=torch.bfloat16), randn(8, D, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def traced_graph():
    """(group name, traced graph, its problem, real inputs, reference outputs), on one real
    gloo group kept for the module."""
    with gloo_group() as name:
        gm = traced_layers(name)
        problem = Problem.from_dag(export_dag(gm))
        g = torch.Generator().manual_seed(0)
        inputs = layer_inputs(lambda *s, dtype=torch.float32: torch.randn(*s, generator=g, dtype=dtype))
        yield name, gm, problem, inputs, gm(*inputs)


def _unwrapped_target(gm, node):
    """The op a node runs, looking through a control_deps wrapper (its subgraph runs one op)."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    if node.target is not control_deps:
        return node.target
    inner = getattr(gm, node.args[1].target)
    return next(n.target for n in inner.graph.nodes if n.op == "call_function")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    source=st.sampled_from(("random", *HEURISTICS)),
    seed=st.integers(0, 2**31),
    payload_order=st.sampled_from(["registration", "execution"]),
    control_deps=st.booleans(),
)
def test_write_back_of_random_valid_schedules_keeps_results(traced_graph, source, seed, payload_order, control_deps):
    _, gm0, problem, inputs, ref = traced_graph
    assert len(problem.colls) == 2 * N_LAYERS and all(c.movable for c in problem.colls.values())
    if source == "random":
        schedule = random_schedule(problem, random.Random(seed))
    else:
        schedule = solve(problem, solver=source).schedule
    validate_schedule(problem, schedule)
    gm = copy.deepcopy(gm0)
    apply_schedule(gm, problem, schedule, payload_order=payload_order, control_deps=control_deps)
    gm.graph.lint()
    targets = [str(_unwrapped_target(gm, n)) for n in gm.graph.nodes]
    n_colls = sum(1 for t in targets if "_c10d_functional" in t and "wait_tensor" not in t)
    assert n_colls == len(schedule.buckets)
    gm.recompile()
    out = gm(*inputs)
    assert len(out) == len(ref)
    for a, b in zip(ref, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# random programs with functional collectives (gloo, world 1: collectives are identities)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def program_group():
    with gloo_group() as name:
        yield name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), solver=st.sampled_from(("cpsat", "milp", "random", *HEURISTICS)))
def test_random_programs_schedules_are_valid_counted_right_and_keep_results(program_group, seed, solver):
    """Every solver's and heuristic's schedule (and a random one from the issue-range rules) of a
    random program validates; the simulator's two counts equal the liveness count and torch's
    tracker on the graph written from it, to the byte; and that graph's results equal the traced
    graph's, bitwise."""
    program = random_program(seed)
    gm0 = trace_program(program, program_group)
    problem = Problem.from_dag(export_dag(gm0))
    if solver == "random":
        schedule = random_schedule(problem, random.Random(seed))
    else:
        schedule = solve(problem, solver=solver, work_limit=WORK_LIMIT).schedule
    sim = validate_schedule(problem, schedule)
    gm = copy.deepcopy(gm0)
    apply_schedule(gm, problem, schedule)
    gm.graph.lint()
    gm.recompile()
    assert (sim.peak_bytes, sim.tracker_peak_bytes) == (liveness_peak(gm), torch_tracker_peak(gm))
    args = real_program_inputs(program)
    for a, b in zip(gm0(*args), gm(*args), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), frac=st.floats(0.05, 0.95))
def test_the_smallest_peak_an_infeasible_budget_advises_holds(program_group, seed, frac):
    """optimize_schedule under a budget a fraction of a random program's own peak either holds
    it or raises stating the smallest peak; at that peak it holds (it used to answer "raise
    mem_budget to at least X" and then, at X, "the smallest is Y" > X)."""
    gm0 = trace_program(random_program(seed), program_group)
    own = max(liveness_peak(gm0), torch_tracker_peak(gm0))
    try:
        optimize_schedule(copy.deepcopy(gm0), mem_budget=max(1, int(own * frac)), solver=SolverOptions(work_limit=1))
        return
    except InfeasibleBudgetError as e:
        advised, least = e.min_peak_bytes, e.least_peak_bytes
    assert advised <= own
    # the least peak it states (no schedule goes below it) is at most the advice
    assert least is None or least <= advised
    out = optimize_schedule(copy.deepcopy(gm0), mem_budget=advised, solver=SolverOptions(work_limit=1))
    assert liveness_peak(out) <= advised
