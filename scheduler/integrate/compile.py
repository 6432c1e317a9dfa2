"""The compile integrations: a ``torch.compile`` backend (aot_autograd) and an inductor
post-grad custom pass, both running :func:`scheduler.optimize_schedule` on every graph.

Both warn, once per compile, when the graph is one of a model sharded with FSDP2
(``fully_shard``): its collectives run in FSDP2's hooks, outside every compiled graph
(:mod:`scheduler.integrate.fsdp2`), and the pass would otherwise leave it unchanged silently.
The warning is also a note on the graph's report."""

from __future__ import annotations

import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from scheduler.api import REPORT_KEY, current_compile_id, optimize_schedule
from scheduler.costs.spec import cost_model_files
from scheduler.export.dag import graph_has_collectives
from scheduler.integrate.fsdp2 import count_fully_sharded_inputs, fsdp2_evidence, fsdp2_note, fully_sharded_modules
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

    A model sharded with FSDP2 (``fully_shard``) compiles and runs, but its collectives are in
    none of the graphs: the backend logs one WARNING per compile that says so and what to do
    instead, and notes it on the compile's reports (:mod:`scheduler.integrate.fsdp2`).

    Example::

        compiled = torch.compile(model, backend=scheduler.backend(mem_budget="40GiB"))
    """
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import make_boxed_compiler

    options = dict(options)
    partition_fn = options.pop("partition_fn", min_cut_rematerialization_partition)
    fw_budget = options.pop("fw_mem_budget", options.get("mem_budget"))
    bw_budget = options.pop("bw_mem_budget", options.get("mem_budget"))
    options.pop("mem_budget", None)
    # fail on a bad budget now, not at the first compile
    parse_bytes(fw_budget), parse_bytes(bw_budget)
    watch = _FSDP2Watch()
    reports: list[ScheduleReport] = []

    def compiler(kind: str, budget: Any):
        def compile_graph(gm: "torch.fx.GraphModule", example_inputs: Any) -> "torch.fx.GraphModule":
            gm.meta.setdefault("fsdp_graph_kind", kind)
            note = watch.check(gm)
            optimize_schedule(gm, budget, **options)
            report = gm.meta[REPORT_KEY]
            if note is not None:
                report.notes.append(note)
            reports.append(report)
            return gm

        return make_boxed_compiler(compile_graph)

    return _scheduling_backend_class()(watch, reports, fw_compiler=compiler("forward", fw_budget),
                                       bw_compiler=compiler("backward", bw_budget), partition_fn=partition_fn)


@functools.cache
def _scheduling_backend_class() -> type:
    """aot_autograd's backend class with the inputs of each compile counted first (a subclass,
    so that torch still recognises the backend as aot_autograd's)."""
    from torch._dynamo.backends.common import AotAutograd

    class SchedulingBackend(AotAutograd):
        """aot_autograd that first counts the FSDP2 parameters among the compile's inputs."""

        def __init__(self, watch: "_FSDP2Watch", reports: list[ScheduleReport], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.watch = watch
            #: every graph's report, in compile order
            self.reports = reports

        def __call__(self, gm: "torch.fx.GraphModule", example_inputs: Any, **kwargs: Any) -> Any:
            self.watch.saw_inputs(example_inputs)
            return super().__call__(gm, example_inputs, **kwargs)

    return SchedulingBackend


class _FSDP2Watch:
    """Tells, once per compile, that a graph belongs to an FSDP2 model whose collectives it does
    not hold (:func:`scheduler.integrate.fsdp2.fsdp2_evidence`)."""

    def __init__(self) -> None:
        #: per compile id: how many of the compile's inputs are FSDP2-managed parameters
        self.inputs_read: dict[str | None, int] = {}
        #: compile ids already warned about
        self.warned: set[str | None] = set()

    def saw_inputs(self, example_inputs: Any) -> None:
        """Count the FSDP2 parameters among a backend's inputs (dynamo's real tensors)."""
        modules = fully_sharded_modules()
        if modules:
            compile_id = current_compile_id()
            n = count_fully_sharded_inputs(example_inputs, modules)
            self.inputs_read[compile_id] = max(n, self.inputs_read.get(compile_id, 0))

    def check(self, gm: "torch.fx.GraphModule") -> str | None:
        """The note for ``gm``'s report (None: not an FSDP2 graph); warns on the compile's first."""
        compile_id = current_compile_id()
        evidence = fsdp2_evidence(has_collectives=graph_has_collectives(gm),
                                  n_inputs_read=self.inputs_read.get(compile_id, 0))
        if evidence is None:
            return None
        note = fsdp2_note(evidence)
        # outside torch.compile there is no id to tell compiles apart: every call warns
        if compile_id is None or compile_id not in self.warned:
            self.warned.add(compile_id)
            logger.warning("fsdp-sched: %s", note)
        return note


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
    torch's compile id, shared by the forward and backward of one compile). A graph without
    collectives while modules sharded with FSDP2 (``fully_shard``) live in the process gets one
    WARNING per compile (their collectives are outside the graph) and a note on its report. On a process
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
            self.fsdp2 = _FSDP2Watch()

        def __call__(self, graph: "torch.fx.Graph", is_inference: bool = False) -> None:
            import torch.fx

            gm = graph.owning_module
            if not isinstance(gm, torch.fx.GraphModule):
                gm = torch.fx.GraphModule(torch.nn.Module(), graph)
            gm.meta["fsdp_graph_kind"] = _post_grad_graph_kind(graph, is_inference)
            # the pass sees neither the real inputs nor the module: only FSDP2 modules alive
            note = self.fsdp2.check(gm)
            optimize_schedule(gm, **options)
            report = gm.meta[REPORT_KEY]
            if note is not None:
                report.notes.append(note)
            self.reports.append(report)

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
