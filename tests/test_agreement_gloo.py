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
    # the last rank takes its schedule from itself, the others from rank 0: a fault of the
    # ranks together
    "broadcast-from-differs": ("args", "all"),
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

    from scheduler import AgreementOptions, SolverOptions, api, optimize_schedule
    from scheduler.check.written import graph_digest
    from test_writeback import COSTS, toy_graph

    where, who = CASES[case]
    faulty = who == "all" or rank == world_size - 1
    group_name = dist.group.WORLD.group_name
    kwargs: dict[str, Any] = {"mem_budget": None, "cost_model": COSTS, "solver": SolverOptions(work_limit=1.0)}
    gm = toy_graph(group_name, world_size)
    if faulty and case == "budget-unparsable":
        kwargs["mem_budget"] = "abc"
    elif faulty and case in ("budget-zero", "budget-zero-everywhere"):
        kwargs["mem_budget"] = 0
    elif faulty and case == "solver-not-options":
        kwargs["solver"] = "cpsat"
    elif case == "broadcast-from-differs" and rank == world_size - 1:
        kwargs["agreement"] = AgreementOptions(broadcast_from=world_size - 1)
    elif faulty and case == "no-collectives":
        gm = torch.fx.symbolic_trace(lambda x: (x @ x) @ x)
    elif faulty and case == "solve-raises":
        def hook(problem, schedule):
            raise RuntimeError("injected solve failure")
        kwargs["solver"] = SolverOptions(work_limit=1.0, schedule_hook=hook)
    write = api.install_schedule
    if faulty and case == "write-back-raises":
        def fail(*args, **kw):
            raise RuntimeError("injected write-back failure")
        api.install_schedule = fail  # this rank only: its write-back fails after the ranks agreed
    before = graph_digest(gm)
    try:
        optimize_schedule(gm, **kwargs)
    except Exception as e:  # every rank returns: with the error or with a report
        return {"raised": type(e).__name__, "message": str(e), "changed": graph_digest(gm) != before}
    finally:
        api.install_schedule = write
    report = gm.meta[api.REPORT_KEY]
    return {"raised": None, "status": report.status, "changed": graph_digest(gm) != before,
            "schedule": gm.meta[api.SCHEDULE_KEY] is not None}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_failure_on_any_rank_reaches_every_rank(world_size):
    """No rank hangs. A fault on one rank leaves every rank's graph as traced (status
    "unchanged", no schedule installed); a fault on every rank (or of the ranks together: they
    name different source ranks) raises the same error on every rank."""
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


# --------------------------------------------------------------------------------------------
# ranks with different budgets; faults between the agreement's rounds
# --------------------------------------------------------------------------------------------
#: faults that strike one rank (the last) after the ranks agreed on a schedule and before they
#: agree on the outcome
BETWEEN_ROUNDS = ("cannot-decode-the-received-schedule", "cached-report-unreadable", "backup-raises")


def _budgets_body(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 without a budget, the last rank with the smallest peak its graph can reach (a job
    that sets the budget from each rank's free memory)."""
    from scheduler import AgreementOptions, InfeasibleBudgetError, SolverOptions, api, optimize_schedule
    from scheduler.check.judge import liveness_peak
    import torch.distributed as dist
    from test_writeback import COSTS, toy_graph

    group_name = dist.group.WORLD.group_name
    quick = SolverOptions(work_limit=1.0)
    try:  # the smallest peak a schedule reaches, asked of this rank alone
        optimize_schedule(toy_graph(group_name, world_size), 1, cost_model=COSTS, solver=quick,
                          agreement=AgreementOptions(enabled=False))
    except InfeasibleBudgetError as e:
        smallest = e.min_peak_bytes
    budget = smallest if rank == world_size - 1 else None
    gm = optimize_schedule(toy_graph(group_name, world_size), budget, cost_model=COSTS, solver=quick)
    report = gm.meta[api.REPORT_KEY]

    # the check of a received schedule alone: the ranks solve with their own budgets (the budget
    # round still runs, its answer ignored), so the last rank receives rank 0's schedule
    from scheduler.check.written import graph_digest
    from scheduler.integrate import consensus

    real = consensus.agree_on_budget

    def own_budgets(mem_budget_bytes, **kw):
        real(mem_budget_bytes, **kw)
        return consensus.BudgetAgreement(mem_budget_bytes=mem_budget_bytes)

    consensus.agree_on_budget = own_budgets
    try:
        unagreed = toy_graph(group_name, world_size)
        before = graph_digest(unagreed)
        optimize_schedule(unagreed, budget, cost_model=COSTS, solver=quick)
    finally:
        consensus.agree_on_budget = real
    kept = unagreed.meta[api.REPORT_KEY]
    # a merged all-gather writes each rank's own slice offsets: the ranks' graphs are compared by
    # the schedule written
    return {"budget": budget, "smallest": smallest, "peak": liveness_peak(gm), "schedule": report.digest,
            "status": report.status, "report_budget": report.mem_budget_bytes, "notes": report.notes,
            "solved_peak": optimize_schedule(toy_graph(group_name, world_size), None, cost_model=COSTS, solver=quick,
                                             agreement=AgreementOptions(enabled=False)).meta[api.REPORT_KEY]
            .peak_bytes_after,
            "unagreed": {"status": kept.status, "changed": graph_digest(unagreed) != before, "notes": kept.notes}}


@pytest.mark.slow
def test_ranks_with_different_budgets_install_one_schedule_that_holds_each():
    """Rank 0 without a budget would solve a schedule over rank 1's budget; every rank solves
    with the smallest budget instead, so the one schedule every rank installs holds rank 1's
    (never a silent breach, never divergent graphs). Without the budget round, rank 1 checks the
    schedule it receives against its own budget, and every rank keeps its graph with the
    reason."""
    first, last = run_multiprocess(_budgets_body, 2, timeout_s=300, threads_per_process=1)
    assert first["solved_peak"] > last["budget"]  # without agreeing on the budget, rank 0's schedule breaks it
    assert first["schedule"] == last["schedule"] and first["status"] == last["status"] != "unchanged"
    assert last["peak"] <= last["budget"] and first["peak"] == last["peak"]
    assert first["report_budget"] == last["report_budget"] == last["budget"]
    assert any("budgets differ" in n for n in first["notes"])
    # without that round, the last rank checks rank 0's schedule against its own budget: it does
    # not hold, and every rank keeps its graph, saying why
    for r in (first, last):
        assert r["unagreed"]["status"] == "unchanged" and not r["unagreed"]["changed"], r["unagreed"]
        assert any(f"budget {last['budget']} B" in n for n in r["unagreed"]["notes"]), r["unagreed"]


def _between_rounds_body(rank: int, world_size: int, cache_root: str) -> dict[str, dict[str, Any]]:
    return {case: _between_rounds_case(rank, world_size, case, cache_root) for case in BETWEEN_ROUNDS}


def _between_rounds_case(rank: int, world_size: int, case: str, cache_root: str) -> dict[str, Any]:
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from scheduler import AgreementOptions, SolverOptions, api, optimize_schedule
    from scheduler.check.written import graph_digest
    from scheduler.integrate import cache
    from test_writeback import COSTS, toy_graph

    faulty = rank == world_size - 1
    group_name = dist.group.WORLD.group_name
    solver = SolverOptions(work_limit=1.0)
    patched: list[tuple[Any, str, Any]] = []
    # no case reads an entry of another case: only the one that plants an entry has a cache
    cache_before = os.environ.get("FSDP_SCHED_CACHE")
    os.environ["FSDP_SCHED_CACHE"] = "0"

    def patch(owner: Any, name: str, value: Any) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if faulty and case == "cannot-decode-the-received-schedule":
        # as with another version of this library: its schedule differs, and it cannot read the
        # source rank's
        solver = SolverOptions(work_limit=1.0, schedule_hook=lambda problem, schedule: problem.traced_schedule())

        def cannot_decode(data):
            raise ValueError("a schedule format this version does not read")
        patch(api.Schedule, "from_json", staticmethod(cannot_decode))
    elif faulty and case == "cached-report-unreadable":
        directory = Path(cache_root) / f"rank{rank}"
        os.environ["FSDP_SCHED_CACHE"] = str(directory)
        optimize_schedule(toy_graph(group_name, world_size), None, cost_model=COSTS, solver=solver,
                          agreement=AgreementOptions(enabled=False))
        [entry] = (directory / cache.SCHEDULES_DIR).glob("*.json")
        payload = json.loads(entry.read_text())["payload"]
        payload["report"]["notes"] = 5
        cache.store(entry.stem, payload)
    elif faulty and case == "backup-raises":
        def fail(graph):
            raise MemoryError("injected: no memory for the graph's backup")
        patch(api, "copy_graph", fail)
    gm = toy_graph(group_name, world_size)
    before = graph_digest(gm)
    try:
        optimize_schedule(gm, None, cost_model=COSTS, solver=solver)
    except Exception as e:  # every rank returns: with the error or with a report
        return {"raised": f"{type(e).__name__}: {e}", "changed": graph_digest(gm) != before}
    finally:
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)
        if cache_before is None:
            os.environ.pop("FSDP_SCHED_CACHE", None)
        else:
            os.environ["FSDP_SCHED_CACHE"] = cache_before
    report = gm.meta[api.REPORT_KEY]
    installed = gm.meta[api.SCHEDULE_KEY]
    return {"raised": None, "status": report.status, "changed": graph_digest(gm) != before,
            "schedule": installed.digest() if installed is not None else None, "cache_hit": report.cache_hit}


@pytest.mark.slow
def test_a_failure_between_the_rounds_reaches_every_rank(tmp_path):
    """A rank that fails after the ranks agreed on a schedule and before they agree on the
    outcome (it cannot decode the schedule the source rank sent; its cached entry's report
    cannot be read; its graph's backup fails) leaves no rank waiting: every rank ends within
    the time limit with the same graph, none raises, and a rank that could not take the
    schedule keeps every rank's graph as traced."""
    per_rank = run_multiprocess(_between_rounds_body, 2, str(tmp_path), timeout_s=300, threads_per_process=1)
    for case in BETWEEN_ROUNDS:
        results = [r[case] for r in per_rank]
        assert all(r["raised"] is None for r in results), (case, results)
        assert len({r["schedule"] for r in results}) == 1, (case, results)  # the same graph written
        if case == "cached-report-unreadable":  # a miss: the rank solves, as the others do
            assert all(r["changed"] and not r["cache_hit"] for r in results), (case, results)
        else:
            assert all(r["status"] == "unchanged" and not r["changed"] for r in results), (case, results)
