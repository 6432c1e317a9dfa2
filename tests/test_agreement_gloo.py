"""Rank agreement never hangs: a failure on any rank, at any step after the process group is
known (the argument checks, the export, the solve, the write-back), reaches every rank.

Each case runs ``optimize_schedule`` on the toy graph of ``test_writeback`` on every rank of a
real gloo group (2 and 4 local processes), with a fault on one rank or on all. The harness
kills the ranks and fails the test if any of them is still waiting when the time runs out.
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
    "time-limit-nan": ("args", "one"),
    "payload-order": ("args", "all"),
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

    from scheduler import api, optimize_schedule
    from scheduler.verify import graph_digest
    from test_writeback import COSTS, toy_graph

    where, who = CASES[case]
    faulty = who == "all" or rank == world_size - 1
    group_name = dist.group.WORLD.group_name
    kwargs: dict[str, Any] = {"mem_budget": None, "cost_model": COSTS, "time_limit_s": 2.0}
    gm = toy_graph(group_name, world_size)
    if faulty and case == "budget-unparsable":
        kwargs["mem_budget"] = "abc"
    elif faulty and case == "budget-zero":
        kwargs["mem_budget"] = 0
    elif faulty and case == "time-limit-nan":
        kwargs["time_limit_s"] = float("nan")
    elif faulty and case == "payload-order":
        kwargs["payload_order"] = "foo"
    elif faulty and case == "no-collectives":
        gm = torch.fx.symbolic_trace(lambda x: (x @ x) @ x)
    elif faulty and case == "solve-raises":
        def hook(problem, schedule):
            raise RuntimeError("injected solve failure")
        kwargs["schedule_hook"] = hook
    install = api.install
    if faulty and case == "write-back-raises":
        def fail(*args, **kw):
            raise RuntimeError("injected write-back failure")
        api.install = fail  # this rank only: its write-back fails after the ranks agreed
    before = graph_digest(gm)
    try:
        optimize_schedule(gm, **kwargs)
    except Exception as e:  # every rank returns: with the error or with a report
        return {"raised": type(e).__name__, "message": str(e), "changed": graph_digest(gm) != before}
    finally:
        api.install = install
    report = gm.meta[api.REPORT_KEY]
    return {"raised": None, "status": report.status, "changed": graph_digest(gm) != before,
            "notes": report.notes}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_failure_on_any_rank_reaches_every_rank(world_size):
    """No rank hangs. A fault on one rank leaves every rank's graph as traced (status
    "unchanged", the failing rank named in a note); a fault on every rank raises on every rank
    the error that names the argument."""
    per_rank = run_multiprocess(_body, world_size, timeout_s=400, threads_per_process=1)
    for case, (where, who) in CASES.items():
        results = [r[case] for r in per_rank]
        if who == "all":
            assert all(r["raised"] == "ValueError" and "payload_order" in r["message"] for r in results), (case, results)
            assert not any(r["changed"] for r in results), (case, results)
            continue
        assert all(r["raised"] is None and r["status"] == "unchanged" for r in results), (case, results)
        assert not any(r["changed"] for r in results), (case, results)
        assert all(any(f"rank(s) [{world_size - 1}]" in n for n in r["notes"]) for r in results), (case, results)


def _torch_chosen_body(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from scheduler import api, optimize_schedule
    from test_writeback import COSTS, n_collectives, toy_graph

    from scheduler import verify

    gm = toy_graph(dist.group.WORLD.group_name, world_size)
    before = n_collectives(gm)
    choose = verify.choose
    # torch's candidate made the choice whatever the figures: the agreement and the install
    # that follow are the real ones
    verify.choose = lambda judged, budget, key=None: choose(
        judged, budget, lambda c: (not c.name.startswith("torch-overlap"), c.figures.primary_step_ms))
    optimize_schedule(gm, None, cost_model=COSTS, time_limit_s=2.0)
    report = gm.meta[api.REPORT_KEY]
    return {"chosen": report.chosen_candidate, "status": report.status, "notes": report.notes,
            "collectives": (before, n_collectives(gm)), "digest": report.digest}


@pytest.mark.slow
def test_torch_candidate_is_installed_on_every_rank():
    """torch's overlap scheduler chosen on both ranks: its merged all-gathers hold each rank's
    own slice offsets, yet the ranks agree on it and install it (they used to compare digests
    of the whole graph, differ, and all keep the traced graph)."""
    results = run_multiprocess(_torch_chosen_body, 2, timeout_s=240, threads_per_process=1)
    assert all(r["chosen"].startswith("torch-overlap") for r in results), results
    assert all(r["status"] != "unchanged" and r["collectives"][1] < r["collectives"][0] for r in results), results
    assert results[0]["digest"] == results[1]["digest"]
