"""Baselines: torch 2.13's own schedulers and memory estimator, runnable without a GPU.

torch's overlap scheduler (``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``)
is the anchor our schedules must beat. The library runs it and reads its written graph back as
a start of the search (:mod:`scheduler.torch_overlap`, where it is described); the harness
judges its written graph as a baseline: :func:`torch_overlap_schedule` (the library's, run as
torch runs it) rewrites a copy; :func:`simulate_torch_baseline` prices the rewritten graph with
*our* cost model and simulator, so it compares with our schedules on one execution model.
:func:`torch_memory_peak` is torch's memory estimate of a graph in its traced order, to
cross-check :func:`solvers.core.simulator.simulate` (``benchmarks/memcheck.py``).

The per-block plan (:func:`torch_manual_schedule`): torch's manual scheduler
(``overlap_manual_scheduling.manual_overlap_bucketing``, the per-transformer-block bucketing
that torchtitan applies to partitioned graphs, and, per block *and per direction*, to joint
graphs) with one plan entry per block and direction, the blocks and directions read by our
structure inference (:mod:`scheduler.export.structure`), so that it runs on any graph, ours or not.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import TYPE_CHECKING, Any

from scheduler.costs.hardware import Cluster
from scheduler.costs.models import CostModel
from scheduler.export.dag import export_dag
from scheduler.readback import TorchPassError as TorchBaselineError
from scheduler.torch_overlap import collective_count
from scheduler.torch_overlap import cpu_estimator_patches
from scheduler.torch_overlap import process_groups_for
from scheduler.torch_overlap import torch_overlap_schedule
from solvers.core.simulator import SimResult, simulate

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

__all__ = ["TorchBaselineError", "manual_bucket_plans", "simulate_torch_baseline", "torch_manual_schedule",
           "torch_memory_peak", "torch_memory_profile", "torch_overlap_schedule"]


def simulate_torch_baseline(
    gm: "torch.fx.GraphModule",
    *,
    cost_model: "CostModel | None" = None,
    cluster: "Cluster | None" = None,
    **kw: Any,
) -> "SimResult":
    """torch's schedule of ``gm``, simulated with our cost model and execution model.

    Rewrites ``gm`` with :func:`torch_overlap_schedule` (``kw`` passed on), exports the result
    (:func:`scheduler.export.dag.export_dag`, so merged buckets are single collectives there) and
    simulates it in its graph order. Result times are in ms, memory in bytes.

    Raises:
        TorchBaselineError: torch's pass failed on this graph.
    """

    cluster = cluster or Cluster()
    rewritten = torch_overlap_schedule(gm, cluster=cluster, **kw)
    with process_groups_for(rewritten):
        dag = export_dag(rewritten, cost_model=cost_model, cluster=cluster, name="torch-overlap")
    return simulate(dag)


# --------------------------------------------------------------------------------------------
# torch's manual per-block plan
# --------------------------------------------------------------------------------------------
def manual_bucket_plans(gm: "torch.fx.GraphModule") -> tuple[list[str], dict[str, str]]:
    """The per-block plan of ``gm`` for torch's manual scheduler: (plan entries in execution
    order, FX node name -> its entry, for every parameter collective and its wait).

    One entry per block and direction (``"forward.block3"``, ``"backward.block3"``); the
    collectives outside every block (embeddings, final norm, output) form one entry per run
    of them between blocks (``"forward.root0"``: the embeddings; ``"forward.root1"``: the
    final norm and output), as torchtitan's plan ``["tok_embeddings", "layers.0", ...,
    ["norm", "output"]]``. Collectives that are no data-parallel parameter's stay out of the
    plan (left in place)."""
    with process_groups_for(gm):
        dag = export_dag(gm)
    entry: dict[str, str] = {}
    roots: dict[str | None, int] = {}
    previous: dict[str | None, bool] = {}  # per direction: was the last collective in a block
    for name in dag.graph["order"]:
        a = dag.nodes[name]
        if a["kind"] != "collective" or a.get("role") != "fsdp":
            continue
        phase = a.get("phase") or dag.graph.get("graph_kind", "graph")
        if a.get("block") is not None:
            key = f"{phase}.block{a['block']}"
            previous[phase] = True
        else:
            if previous.get(phase, True):
                roots[phase] = roots.get(phase, -1) + 1
            previous[phase] = False
            key = f"{phase}.root{roots[phase]}"
        entry[name] = entry[a["wait"]] = key
    return list(dict.fromkeys(entry[n] for n in dag.graph["order"] if n in entry)), entry


def torch_manual_schedule(
    gm: "torch.fx.GraphModule",
    *,
    cluster: "Cluster | None" = None,
    bucket_mode: str = "default",
    inplace: bool = False,
) -> "torch.fx.GraphModule":
    """Run torch's ``manual_overlap_bucketing`` on a copy of ``gm`` (or ``gm`` with ``inplace``)
    with the per-block plan of :func:`manual_bucket_plans` and return the rewritten module.

    What torch's manual scheduler does with it: merges the all-gathers of each entry into one
    bucket and its reduce-scatters into one (parameter order as its bucketer takes them), then
    prefetches each all-gather bucket during the compute of the entry before it and waits each
    reduce-scatter bucket when the next one is issued (FSDP2 eager's pattern). On a joint
    graph the forward and backward of a block are separate entries, as in the graph trainer's
    joint pass; unlike it, torch's walk pairs all-gather buckets across the forward / backward
    boundary (the first backward bucket is prefetched during the last forward one).

    Args:
        gm: a partitioned or joint graph with FakeTensor ``meta['val']``.
        cluster: hardware torch's estimators are told about (it schedules from the plan, not
            from costs; the patches only keep it from asking CUDA).
        bucket_mode: torch's merge implementation (``"default"``: cat + copy, as our write-back).
        inplace: rewrite ``gm`` itself.

    Raises:
        TorchBaselineError: no parameter collective has a block, or torch's pass failed.
    """
    from torch import nn
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    plans, entry = manual_bucket_plans(gm)
    if not any(".block" in p for p in plans):
        raise TorchBaselineError("no parameter collective of this graph is in a block: the per-block plan is empty")

    def module_stack(node: "torch.fx.Node") -> list[tuple[str, type]]:
        key = entry.get(node.name)
        return [] if key is None else [(key.split(".")[0], nn.Module), (key, nn.Module)]

    out = gm if inplace else copy.deepcopy(gm)
    with process_groups_for(out), cpu_estimator_patches(cluster or Cluster()):
        try:
            out = manual_overlap_bucketing(out, plans, module_stack_fn=module_stack, bucket_mode=bucket_mode)
            out.graph.lint()
            out.recompile()
        except Exception as e:
            raise TorchBaselineError(
                f"torch's manual scheduler failed on this graph ({type(e).__name__}: {e}); the per-block "
                "baseline is unavailable for it") from e
    logger.info("torch manual per-block plan: %d entries, %d collectives after", len(plans), collective_count(out))
    return out


# --------------------------------------------------------------------------------------------
# torch's memory estimator
# --------------------------------------------------------------------------------------------
def torch_memory_peak(gm: "torch.fx.GraphModule", *, wait_aliases_input: bool = True) -> int:
    """Peak bytes of ``gm`` in its graph order by torch's memory estimator; see
    :func:`torch_memory_profile`."""
    return max(torch_memory_profile(gm, wait_aliases_input=wait_aliases_input))


def torch_memory_profile(gm: "torch.fx.GraphModule", *, wait_aliases_input: bool = True) -> list[int]:
    """Live bytes of ``gm`` in its graph order by ``memory_estimator.build_memory_profile``:
    the inputs, then for every node after its allocations and after its frees.

    Uses the same releasability rule as our DAG (graph inputs named ``primals*`` are never
    freed) and counts tensors on every device (torch's default filter skips CPU tensors, which
    graphs traced on CPU consist of).

    Args:
        gm: a graph with FakeTensor ``meta['val']``.
        wait_aliases_input: treat ``wait_tensor``'s output as its input's storage (default).
            The real op returns its input (and inductor lowers it as an alias), but its schema
            carries no alias annotation, so under fake tensors it gets a fresh storage and
            torch's estimator allocates the collective's output a second time at every wait
            (freeing the first copy only after the wait). ``False`` gives torch's numbers as is.
    """
    from unittest import mock

    import torch
    from torch._inductor.fx_passes import memory_estimator

    def releasable(node: "torch.fx.Node") -> bool:
        return not node.name.startswith("primals")

    tracker = memory_estimator.GraphAliasTracker
    own_storages = tracker._get_output_storages
    wait = torch.ops._c10d_functional.wait_tensor.default
    # the wait's fake storage (seen by the wait and every view of it) is the collective's
    same_as: dict[Any, Any] = {}
    for node in gm.graph.find_nodes(op="call_function", target=wait):
        coll = node.args[0]
        if isinstance(coll, torch.fx.Node):
            for key, coll_key in zip(own_storages(node), own_storages(coll)):
                same_as[key] = coll_key

    def output_storages(node: "torch.fx.Node") -> Any:
        own = own_storages(node)
        return type(own)(same_as.get(k, k) for k in own)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(memory_estimator, "device_filter", lambda device: True))
        if wait_aliases_input:
            stack.enter_context(mock.patch.object(tracker, "_get_output_storages", staticmethod(output_storages)))
        return [int(b) for b in memory_estimator.build_memory_profile(gm.graph, releasable)]
