"""Collectives waited several times, and collectives of collectives: every solver and heuristic
returns a schedule the validator accepts, and the written graph computes what the traced one did.

Two graphs, traced with make_fx on a real gloo group of one rank (collectives are identities, so
the results can be compared bitwise)::

    several waits (an aot_autograd GPT backward had a reduce-scatter with 14 wait_tensor users):
        a_i = wait(all_gather(w_i.to(bf16)))                          i = 0, 1
        h_0 = relu(x @ a_0);  h_1 = relu(h_0 @ a_1)
        r_1 = reduce_scatter(h_1.t() @ gy);  r_0 = reduce_scatter(h_0.t() @ gy)
        u = wait(r_1) * 2;  v = wait(r_1) + wait(r_0);  z = wait(r_1) * u
        output: h_1, u, v, z

    a chain (all_gather -> wait -> all_reduce -> wait before any compute reads the parameter):
        a_i = wait(all_reduce(wait(all_gather(w_i.to(bf16)))))       i = 0, 1
        h_1 = relu(relu(x @ a_0) @ a_1);  g = wait(reduce_scatter(h_1.t() @ gy))
        output: h_1, g
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from scheduler import export_dag, validate_schedule
from scheduler.writeback import apply_schedule
from solvers import Problem, solve
from test_writeback import gloo_group

_c10d = torch.ops._c10d_functional
D = 8
SOLVERS = ("traced", "fsdp2", "simplefsdp", "autoparallel", "cpsat", "milp")


def several_waits(group_name: str):
    def f(primals_1, primals_2, x, gy):
        def gather(w):
            return _c10d.wait_tensor(_c10d.all_gather_into_tensor(w.to(torch.bfloat16), 1, group_name)).float()

        h0 = torch.relu(x @ gather(primals_1))
        h1 = torch.relu(h0 @ gather(primals_2))
        r1 = _c10d.reduce_scatter_tensor(h1.t() @ gy, "sum", 1, group_name)
        r0 = _c10d.reduce_scatter_tensor(h0.t() @ gy, "sum", 1, group_name)
        u = _c10d.wait_tensor(r1) * 2
        v = _c10d.wait_tensor(r1) + _c10d.wait_tensor(r0)
        z = _c10d.wait_tensor(r1) * u
        return h1, u, v, z

    return f


def chain(group_name: str):
    def f(primals_1, primals_2, x, gy):
        def gather_and_reduce(w):
            a = _c10d.wait_tensor(_c10d.all_gather_into_tensor(w.to(torch.bfloat16), 1, group_name))
            return _c10d.wait_tensor(_c10d.all_reduce(a, "sum", group_name)).float()

        h1 = torch.relu(torch.relu(x @ gather_and_reduce(primals_1)) @ gather_and_reduce(primals_2))
        return h1, _c10d.wait_tensor(_c10d.reduce_scatter_tensor(h1.t() @ gy, "sum", 1, group_name))

    return f


PROGRAMS = {"several_waits": several_waits, "chain": chain}


def inputs(make):
    return tuple(make(D, D) for _ in range(4))


def traced(fn):
    with FakeTensorMode():
        args = inputs(torch.randn)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    gathers = [n for n in gm.graph.nodes if n.target is _c10d.all_gather_into_tensor.default]
    for i, n in enumerate(gathers):
        n.meta.update(fsdp_fqn=f"w{i}", fsdp_param_index=i)
    scatters = [n for n in gm.graph.nodes if n.target is _c10d.reduce_scatter_tensor.default]
    for i, n in enumerate(scatters):
        n.meta.update(fsdp_param_index=len(scatters) - 1 - i)
    return gm


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def program(request):
    """(name, traced graph, its problem, real inputs, reference outputs) on a gloo group of one
    rank kept for the module."""
    with gloo_group() as group_name:
        gm = traced(PROGRAMS[request.param](group_name))
        g = torch.Generator().manual_seed(0)
        args = inputs(lambda *s: torch.randn(*s, generator=g))
        yield request.param, gm, Problem.from_dag(export_dag(gm)), args, gm(*args)


def test_the_graphs_hold_what_they_are_drawn_with(program):
    name, _, problem, _, _ = program
    waits_of = {c: [v for v in problem.dag.successors(c)] for c in problem.colls}
    if name == "several_waits":
        assert sorted(len(w) for w in waits_of.values()) == [1, 1, 1, 3]
        (multi,) = [c for c, w in waits_of.items() if len(w) == 3]
        assert problem.colls[multi].movable and not problem.colls[multi].mergeable
    else:
        reduces = [c for c in problem.colls.values() if c.coll_type == "all_reduce"]
        assert len(reduces) == 2 and all(problem.issue_after[c.name] for c in reduces)


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_solver_schedule_is_valid_and_keeps_the_results(program, solver):
    """The schedule validates (no reader of a collective's result before its wait, further
    waits included; no all-reduce issued before the wait of the all-gather it reduces), and the
    graph written from it computes the traced graph's outputs, bitwise."""
    _, gm0, problem, args, ref = program
    schedule = solve(problem, solver=solver, work_limit=2).schedule
    validate_schedule(problem, schedule)
    gm = copy.deepcopy(gm0)
    apply_schedule(gm, problem, schedule)
    gm.graph.lint()
    gm.recompile()
    for a, b in zip(ref, gm(*args), strict=True):
        assert torch.equal(a, b)
