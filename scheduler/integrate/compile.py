"""The compile integrations: a ``torch.compile`` backend (aot_autograd) and an inductor
post-grad custom pass, both running :func:`scheduler.optimize_schedule` on every graph."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from scheduler.api import REPORT_KEY, optimize_schedule
from scheduler.costs.models import cost_model_files
from scheduler.options import WriteBackOptions
from scheduler.report import ScheduleReport
from solvers.core import parse_bytes

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)


def backend(**options: Any):
    """A ``torch.compile`` backend that schedules the partitioned forward and backward graphs.

    Uses aot_autograd; its forward and backward compilers run :func:`optimize_schedule` with
    ``options`` on each graph and return it for eager execution. ``options`` are
    :func:`optimize_schedule`'s keyword arguments, plus ``fw_mem_budget`` / ``bw_mem_budget``
    (budgets for one graph only, overriding ``mem_budget``) and ``partition_fn`` (default
    ``min_cut_rematerialization_partition``, as SimpleFSDP uses). The returned backend has a
    ``reports`` list collecting every graph's :class:`ScheduleReport`.

    Example::

        compiled = torch.compile(model, backend=scheduler.backend(mem_budget="40GiB"))
    """
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler

    options = dict(options)
    partition_fn = options.pop("partition_fn", min_cut_rematerialization_partition)
    fw_budget = options.pop("fw_mem_budget", options.get("mem_budget"))
    bw_budget = options.pop("bw_mem_budget", options.get("mem_budget"))
    options.pop("mem_budget", None)
    # fail on a bad budget now, not at the first compile
    parse_bytes(fw_budget), parse_bytes(bw_budget)
    reports: list[ScheduleReport] = []

    def compiler(kind: str, budget: Any):
        def compile_graph(gm: "torch.fx.GraphModule", example_inputs: Any) -> "torch.fx.GraphModule":
            gm.meta.setdefault("fsdp_graph_kind", kind)
            optimize_schedule(gm, budget, **options)
            reports.append(gm.meta[REPORT_KEY])
            return gm

        return make_boxed_compiler(compile_graph)

    fn = aot_autograd(
        fw_compiler=compiler("forward", fw_budget),
        bw_compiler=compiler("backward", bw_budget),
        partition_fn=partition_fn,
    )
    fn.reports = reports  # type: ignore[attr-defined]
    return fn


def inductor_post_grad_pass(**options: Any):
    """An inductor post-grad custom pass that schedules each graph inductor compiles.

    Usage::

        import torch._inductor.config as inductor_config
        inductor_config.post_grad_custom_post_pass = scheduler.integrate.compile.inductor_post_grad_pass(
            mem_budget="40GiB")
        compiled = torch.compile(model)   # the default inductor backend

    ``options`` are :func:`optimize_schedule`'s keyword arguments; ``writeback`` defaults to
    ``WriteBackOptions(control_deps=True)`` here: inductor reorders by itself (torch 2.14: its ``simple_overlap`` pass), and the
    control dependencies keep every collective and wait between the same matmuls as in the
    schedule, without changing what inductor computes (bitwise equal to inductor without the
    pass, ``tests/test_inductor_gloo.py``). The pass wraps the
    ``fx.Graph`` it receives in its owning GraphModule (or a fresh one) and rewrites it in
    place; reports are collected in the pass's ``reports`` list, each naming its graph
    (``graph_name`` / ``graph_kind``: "forward", "backward" or "inference"; ``compile_id``:
    torch's compile id, shared by the forward and backward of one compile). On a process
    group the ranks agree on the schedule before it is written back (see
    :func:`optimize_schedule`'s ``agreement``). Its ``uuid()`` is built from
    the options, so inductor's FX graph cache tells differently configured passes apart
    (objects such as a cost model enter by ``repr``; give them a stable one to get cache hits
    across processes).
    """
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

    # without pins the order written back is only a hint that inductor may reorder
    options = {"writeback": WriteBackOptions(control_deps=True), **options}
    parse_bytes(options.get("mem_budget"))

    class _FsdpSchedPass(CustomInferenceAwareGraphPass):
        def __init__(self) -> None:
            self.reports: list[ScheduleReport] = []

        def __call__(self, graph: "torch.fx.Graph", is_inference: bool = False) -> None:
            import torch.fx

            gm = graph.owning_module
            if not isinstance(gm, torch.fx.GraphModule):
                gm = torch.fx.GraphModule(torch.nn.Module(), graph)
            gm.meta["fsdp_graph_kind"] = _post_grad_graph_kind(graph, is_inference)
            optimize_schedule(gm, **options)
            self.reports.append(gm.meta[REPORT_KEY])

        def uuid(self) -> str:
            # a cost model named by its files ("table:PATH") prices what the files hold now
            files = cost_model_files(options.get("cost_model"))
            return "fsdp-sched:" + json.dumps({**options, "cost_model_files": files}, sort_keys=True, default=repr)

    return _FsdpSchedPass()


def _post_grad_graph_kind(graph: "torch.fx.Graph", is_inference: bool) -> str:
    """Which graph an inductor post-grad pass sees. Inductor tells a custom pass only whether
    the graph is an inference graph; aot_autograd names the backward graph's gradient inputs
    ``tangents_<i>`` (the forward graph has only ``primals_<i>``)."""
    if is_inference:
        return "inference"
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    return "forward"
