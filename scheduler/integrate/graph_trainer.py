"""The pass for torchtitan's graph trainer: its default mode traces one joint forward + loss +
backward graph with make_fx and applies a list of passes, each called as
``gm = pass_fn(gm, example_inputs)`` and named by its ``__name__`` (the trainer's
``--compile.disable_passes`` matches that name).

:func:`graph_trainer_pass` returns such a pass that runs :func:`scheduler.optimize_schedule` on
the joint graph; users put it in the list in place of the trainer's own FSDP bucketing and
reordering pass (``joint_transformer_block_bucketing_reordering_pass``)::

    import scheduler
    fsdp_sched = scheduler.graph_trainer_pass(mem_budget="40GiB")
    passes = [fsdp_sched if getattr(p, "func", p).__name__ == "joint_transformer_block_bucketing_reordering_pass"
              else p for p in passes]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.api import REPORT_KEY, check_arguments, optimize_schedule
from scheduler.report import ScheduleReport

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: the pass's ``__name__``: what the graph trainer logs and ``--compile.disable_passes`` matches
PASS_NAME = "fsdp_sched_pass"
#: the keyword options the pass accepts: :func:`scheduler.optimize_schedule`'s
OPTIONS = ("cost_model", "cluster", "solver", "agreement", "writeback")


def graph_trainer_pass(mem_budget: int | str | None = None, **options: Any
                       ) -> Callable[["torch.fx.GraphModule", Sequence[Any]], "torch.fx.GraphModule"]:
    """A graph pass ``(gm, example_inputs) -> gm`` for torchtitan's graph trainer that schedules
    the collectives of its joint forward + loss + backward graph.

    Args:
        mem_budget: peak-memory budget of the joint graph, bytes or a string like ``"40GiB"``;
            None (default): no limit. As :func:`scheduler.optimize_schedule`'s.
        options: :func:`scheduler.optimize_schedule`'s keyword options (``cost_model``,
            ``cluster``, ``solver``, ``agreement``, ``writeback``), checked here, so that a bad
            one fails where the pass is built rather than after the trace. ``writeback``: the
            default writes the order into the graph, which the trainer runs as it is;
            ``WriteBackOptions(control_deps=True)`` also pins it where the trainer hands the
            whole graph to inductor (``inductor_compilation="full"``), which reorders.

    Returns:
        The pass, named ``fsdp_sched_pass``. It rewrites ``gm`` in place and returns it; the
        report is at ``gm.meta["fsdp_sched_report"]`` (as :func:`optimize_schedule` leaves it)
        and in the pass's ``reports`` list (later passes may build a new module without
        ``gm.meta``). ``example_inputs`` are not read: the graph's FakeTensor metadata is what
        the pass prices. Merging buckets needs the trainer's process group, on which the graph
        was traced; the ranks agree on the schedule (``agreement``).

    Raises:
        TypeError, ValueError: a bad budget or option (the message names it).
    """
    import inspect

    import torch.fx

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"graph_trainer_pass() got unknown option(s) {unknown}; it accepts mem_budget and "
                        f"{', '.join(OPTIONS)} (scheduler.optimize_schedule's keyword options)")
    # the arguments alone decide (an empty graph stands for the joint graph still to come), with
    # optimize_schedule's own defaults for the options not given
    defaults = {name: p.default for name, p in inspect.signature(optimize_schedule).parameters.items()
                if name in OPTIONS}
    check_arguments(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), mem_budget, **{**defaults, **options})
    reports: list[ScheduleReport] = []

    def fsdp_sched_pass(gm: "torch.fx.GraphModule", example_inputs: Sequence[Any]) -> "torch.fx.GraphModule":
        optimize_schedule(gm, mem_budget, **options)
        reports.append(gm.meta[REPORT_KEY])
        return gm

    fsdp_sched_pass.__name__ = fsdp_sched_pass.__qualname__ = PASS_NAME
    fsdp_sched_pass.reports = reports  # type: ignore[attr-defined]
    return fsdp_sched_pass

