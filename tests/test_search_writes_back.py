"""Every schedule the search returns writes back.

A schedule valid on the exported DAG must be one the FX graph can run: if the DAG lacked a
dependency the graph has, or the search placed a bucket outside its members' issue ranges, the
search would rank schedules that write-back then refuses one by one (the installed answer
would be its last resort). Here each graph the tests use is searched under the default family
and under one model, and the search's schedule and every alternative it offers are validated
and written back on a copy of the graph.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import foreign_models as fm  # noqa: E402
from conftest import FAKE_WORLD, capture_llama_debug  # noqa: E402
from scheduler.costs.family import cost_models  # noqa: E402
from scheduler.costs.pricing import export_problems  # noqa: E402
from scheduler.writeback import apply_schedule  # noqa: E402
from solvers.core import validate_schedule  # noqa: E402
from solvers.search import search  # noqa: E402

STYLES = ("tied", "tp", "moe", "sac")


def _every_schedule_writes_back(gm, cost_model=None) -> int:
    problems = export_problems(gm, cost_models(cost_model, None, (0.7, 1.3)), None)
    problem = next(iter(problems.values()))
    result = search(problems, None, work_limit=0.3)
    schedules = [result.schedule, *result.alternatives]
    for schedule in schedules:
        validate_schedule(problem, schedule)
        apply_schedule(copy.deepcopy(gm), problem, schedule)
    return len(schedules)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_every_schedule_of_the_search_writes_back_on_foreign_graphs(style):
    from models.capture import fake_process_group

    with fake_process_group(FAKE_WORLD):  # open through the capture: its sub-groups resolve
        captured = fm.capture(style, world_size=FAKE_WORLD)
        for gm in (captured.forward, captured.backward):
            assert _every_schedule_writes_back(gm) > 1


def test_every_schedule_of_the_search_writes_back_on_llama_debug():
    from models.capture import fake_process_group

    graphs = capture_llama_debug()
    with fake_process_group(FAKE_WORLD):
        for gm in (graphs.forward, graphs.backward):
            assert _every_schedule_writes_back(gm, "analytic") > 1
