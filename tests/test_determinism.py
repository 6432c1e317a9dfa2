"""Rank determinism of fsdp-sched schedules on a real gloo group.

FSDP ranks must run the same collectives in the same order, or they hang (or silently mix
up buckets). When every rank solves for itself, the solve must therefore be deterministic:

- every rank's schedule digests (``ScheduleReport.digest`` of each graph the backend
  compiled, from ``backend.reports``) are gathered with ``dist.all_gather_object`` and must
  all be equal;
- ``optimize_schedule(..., agreement=AgreementOptions(broadcast_from=0))`` (rank 0 solves and
  broadcasts) must give the same schedule (digest) as solving on every rank;
- the same DAG solved in two separate processes gives an identical ``Schedule.digest()``, at
  its budget and without one, and without one the same as every rank found inside training.

The first two read the multi-process training runs of tests/test_numerics_gloo.py (run once
per session and world size); the third starts two fresh processes on the DAGs exported there.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import test_numerics_gloo as numerics  # noqa: E402
from gloo_harness import run_multiprocess  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", numerics._params())
def test_every_rank_solves_the_same_schedule(world_size, case):
    per_rank = numerics.case_results(world_size, case)
    gathered = [r["all_digests"] for r in per_rank]
    own = [{k: rep["digest"] for k, rep in r["reports"].items()} for r in per_rank]
    for rank, g in enumerate(gathered):
        assert len(g) == world_size
        assert all(d == g[0] for d in g), f"rank {rank} gathered different schedules: {g}"
        assert g[rank] == own[rank]
    assert gathered[0][0].keys() == {"forward", "backward"}
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", numerics._params())
def test_broadcast_from_rank0_gives_the_same_schedule(world_size, case):
    for rank, r in enumerate(numerics.case_results(world_size, case)):
        own = {k: rep["digest"] for k, rep in r["reports"].items()}
        assert r["broadcast_digests"] == own, f"rank {rank}: broadcast {r['broadcast_digests']} != solved {own}"
    assert multiprocessing.active_children() == []


def _solve_body(rank: int, world_size: int, dags: dict[str, Any], budgets: dict[str, Any]) -> dict[str, str]:
    import os

    from scheduler import SolverOptions, solve_dag
    from scheduler.export.dagfile import dag_from_json

    options = SolverOptions(solver="cpsat", work_limit=numerics.SOLVER_WORK_LIMIT, seed=0)
    out = {"pid": str(os.getpid())}
    for kind, data in dags.items():
        for budget, key in ((budgets[kind], kind), (None, f"{kind} unconstrained")):
            schedule, report = solve_dag(dag_from_json(data), budget, solver=options)
            assert report.digest == schedule.digest()
            out[key] = schedule.digest()
    return out


@pytest.mark.slow
def test_same_dag_same_digest_in_two_processes():
    res = numerics.case_results(2, "fp32_reshard")[0]
    dags, budgets = res["dags"], res["budgets"]
    assert set(dags) == {"forward", "backward"}
    a, b = run_multiprocess(_solve_body, 2, dags, budgets, timeout_s=300, threads_per_process=1)
    assert multiprocessing.active_children() == []
    assert a["pid"] != b["pid"]
    for kind in dags:
        assert a[kind] == b[kind], f"{kind}: two processes found different schedules"
        assert a[f"{kind} unconstrained"] == b[f"{kind} unconstrained"]
        # and the schedule every rank found for the same DAG while training
        for rank, r in enumerate(numerics.case_results(2, "fp32_reshard")):
            assert a[f"{kind} unconstrained"] == r["unconstrained"][kind][2], f"{kind}: rank {rank}"
