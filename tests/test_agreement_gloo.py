"""Rank agreement never hangs: a failure on any rank, at any step after the process group is
known (the argument checks, the export, the solve, the write-back), reaches every rank.

Each case runs ``optimize_schedule`` on the toy graph of ``test_writeback`` on every rank of a
real gloo group (2 and 4 local processes), with a fault on one rank or on all. The harness
kills the ranks and fails the test if any of them is still waiting when the time runs out.
(A bad value inside an options object fails when the object is built, in the caller's own line,
before any collective: that is a caller's error on one rank, not a fault the agreement sees.)
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from gloo_harness import run_multiprocess  # noqa: E402

#: the fault of each case: where it happens, and on which ranks ("one": the last rank)
CASES = {
    "budget-unparsable": ("args", "one"),
    "budget-zero": ("args", "one"),
    "solver-not-options": ("args", "one"),
    "budget-zero-everywhere": ("args", "all"),
    "no-collectives": ("graph", "one"),
    "solve-raises": ("solve", "one"),
    "write-back-raises": ("write", "one"),
}


def _body(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Every case in turn on one group: after a case failed on a rank, the ranks must still be
    in step for the next one."""
    return {case: _case(rank, world_size, case) for case in sorted(CASES)}


def _case(rank: int, world_size: int, case: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from scheduler import SolverOptions, api, optimize_schedule
    from scheduler.check.written import graph_digest
    from test_writeback import COSTS, toy_graph

    where, who = CASES[case]
    faulty = who == "all" or rank == world_size - 1
    group_name = dist.group.WORLD.group_name
    kwargs: dict[str, Any] = {"mem_budget": None, "cost_model": COSTS, "solver": SolverOptions(time_limit_s=1.0)}
    gm = toy_graph(group_name, world_size)
    if faulty and case == "budget-unparsable":
        kwargs["mem_budget"] = "abc"
    elif faulty and case in ("budget-zero", "budget-zero-everywhere"):
        kwargs["mem_budget"] = 0
    elif faulty and case == "solver-not-options":
        kwargs["solver"] = "cpsat"
    elif faulty and case == "no-collectives":
        gm = torch.fx.symbolic_trace(lambda x: (x @ x) @ x)
    elif faulty and case == "solve-raises":
        def hook(problem, schedule):
            raise RuntimeError("injected solve failure")
        kwargs["solver"] = SolverOptions(time_limit_s=1.0, schedule_hook=hook)
    write = api.apply_schedule
    if faulty and case == "write-back-raises":
        def fail(*args, **kw):
            raise RuntimeError("injected write-back failure")
        api.apply_schedule = fail  # this rank only: its write-back fails after the ranks agreed
    before = graph_digest(gm)
    try:
        optimize_schedule(gm, **kwargs)
    except Exception as e:  # every rank returns: with the error or with a report
        return {"raised": type(e).__name__, "message": str(e), "changed": graph_digest(gm) != before}
    finally:
        api.apply_schedule = write
    report = gm.meta[api.REPORT_KEY]
    return {"raised": None, "status": report.status, "changed": graph_digest(gm) != before,
            "schedule": gm.meta[api.SCHEDULE_KEY] is not None}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_failure_on_any_rank_reaches_every_rank(world_size):
    """No rank hangs. A fault on one rank leaves every rank's graph as traced (status
    "unchanged", no schedule installed); a fault on every rank raises the same error on every
    rank."""
    per_rank = run_multiprocess(_body, world_size, timeout_s=400, threads_per_process=1)
    for case, (where, who) in CASES.items():
        results = [r[case] for r in per_rank]
        if who == "all":
            assert all(r["raised"] == "ValueError" and r["message"] == results[0]["message"] for r in results), \
                (case, results)
            assert not any(r["changed"] for r in results), (case, results)
            continue
        assert all(r["raised"] is None and r["status"] == "unchanged" for r in results), (case, results)
        assert not any(r["changed"] or r["schedule"] for r in results), (case, results)
