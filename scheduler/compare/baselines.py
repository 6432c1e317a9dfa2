"""Baselines: torch 2.13's own overlap scheduler and memory estimator, runnable without a GPU.

torch's scheduler (``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``)
is the anchor our schedules must beat. It is a baseline of the benchmarks only, not a candidate
of :func:`scheduler.optimize_schedule`, so it lives with the comparison (:mod:`scheduler.compare`). What it does, in order:

1. Pre-bucketing (``pre_bucketing_fsdp_collectives=True``, default):
   ``fsdp.pre_bucket_fsdp_collectives`` finds the FSDP process groups structurally and merges
   their all-gathers, reduce-scatters and all-reduces into buckets up to a bandwidth-saturating
   cap (``compute_pre_bucket_cap_mb`` from the NCCL model: 89.6 MB for 8 ranks on the default
   cluster; override with ``pre_bucketing_fsdp_collectives_bucket_cap_mb``). This step has no
   memory limit.
2. Overlap scheduling (``OverlapScheduler``): a greedy list scheduler that keeps the compute
   order as traced and moves collectives: each collective is started as early as its inputs,
   the in-flight limit (``max_in_flight_gb``, default 5), the prefetch count limit
   (``max_compute_pre_fetch`` compute nodes, default 200), the look-ahead (``max_coll_distance``
   nodes, default 200) and the memory limit allow, and its wait is pushed as late as its first
   user. Compute time that hides a collective comes from ``compute_estimator`` ("analytical":
   roofline from FLOPs and bytes; "benchmark": runs the op on a GPU), scaled by
   ``compute_overlap_multipler``; collective time from ``collective_estimator`` ("analytical":
   NCCL tuning model of ``comm_analysis``; "benchmark": CUDA events).
   Memory limit: the original peak (``memory_estimator.MemoryTracker``) plus
   ``max(max_memory_increase_gb, max_memory_increase_ratio * peak)`` (the code takes the
   larger allowance, although torch's docstring says the smaller); ``None`` drops one term,
   at least one must be set. Only prefetches are checked against it.
3. Bucketing after scheduling (``collective_bucketing=True``): collectives whose overlap
   windows allow it are merged with ``bucketing.merge_all_gather_bucket`` /
   ``merge_reduce_scatter_bucket`` (``max_off_bucket_gb`` caps the bytes a bucket may add
   outside its members' windows; ``bucket_exposed_first`` / ``bucket_only_internode_comms``
   tune which collectives are bucketed).

:func:`torch_overlap_schedule` runs it on a copy of the graph with every GPU query answered
from a :class:`scheduler.costs.models.Cluster` (roofline peak numbers, NCCL bandwidths, GPU
generation, NVLink); :func:`simulate_torch_baseline` prices the rewritten graph with *our*
cost model and simulator, so it compares with our schedules on one execution model.
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
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from scheduler.costs.models import Cluster, CostModel
from scheduler.export.dag import export_dag
from solvers.core.simulator import SimResult, simulate

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: GPU presets of scheduler.costs.models -> the generation torch's NCCL model keys its tables on
_GPU_GENERATION = {"h100-sxm": "HOPPER", "h200": "HOPPER", "a100-sxm": "AMPERE", "b200": "BLACKWELL"}


class TorchBaselineError(RuntimeError):
    """torch's overlap scheduler cannot produce a baseline for this graph; the message says why."""


# --------------------------------------------------------------------------------------------
# torch's overlap scheduler
# --------------------------------------------------------------------------------------------
def torch_overlap_schedule(
    gm: "torch.fx.GraphModule",
    *,
    cluster: "Cluster | None" = None,
    max_memory_increase_gb: float | None = 1.0,
    max_memory_increase_ratio: float | None = 0.05,
    inplace: bool = False,
    **kw: Any,
) -> "torch.fx.GraphModule":
    """Run torch's ``schedule_overlap_bucketing`` on a deep copy of ``gm`` (or on ``gm`` itself
    with ``inplace``) and return the rewritten module.

    Runs with ``collective_bucketing=True`` and analytical compute and collective estimators
    (no GPU needed), priced for ``cluster`` (default :class:`scheduler.costs.models.Cluster`): the
    roofline uses the cluster GPU's peak FLOP/s and HBM bandwidth, the NCCL model its
    intra / inter-node bandwidths and GPU generation. ``gm`` itself is not modified.

    Args:
        gm: a partitioned forward or backward graph with FakeTensor ``meta['val']`` and
            functional collectives (as from ``models.capture_fsdp_graphs`` or ``make_fx``).
        cluster: hardware the estimators describe.
        max_memory_increase_gb: prefetching may raise the graph's peak memory (as torch's
            estimator sees it) by this many GB (torch default 1.0; None: no absolute term).
        max_memory_increase_ratio: ... or by this fraction of the original peak (torch default
            0.05; None: no ratio term). torch allows the larger of the two.
        inplace: rewrite ``gm``'s own graph object (an inductor pass must mutate the graph it
            was given); default False: ``gm`` is not modified.
        **kw: any other keyword of ``schedule_overlap_bucketing`` (``max_in_flight_gb``,
            ``max_compute_pre_fetch``, ``max_coll_distance``, ``compute_overlap_multipler``,
            ``pre_bucketing_fsdp_collectives``, ``bucket_mode``, ...); they override the
            defaults above, e.g. ``collective_bucketing=False``.

    Raises:
        TorchBaselineError: torch's pass failed on this graph (the cause is chained); the
            torch baseline is unavailable for it.
    """
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    cluster = cluster or Cluster()
    if max_memory_increase_gb is None and max_memory_increase_ratio is None:
        raise ValueError("set max_memory_increase_gb or max_memory_increase_ratio (torch needs a memory limit)")
    options: dict[str, Any] = {
        "collective_bucketing": True,
        "compute_estimator": "analytical",
        "collective_estimator": "analytical",
        "max_memory_increase_gb": max_memory_increase_gb,
        "max_memory_increase_ratio": max_memory_increase_ratio,
    }
    options.update(kw)
    for key in ("compute_estimator", "collective_estimator"):
        if options[key] != "analytical":
            raise ValueError(f"{key}={options[key]!r} needs a GPU; only 'analytical' runs here")

    out = gm if inplace else copy.deepcopy(gm)
    before = _collective_count(out)
    with _process_groups_for(out), _cpu_estimator_patches(cluster):
        try:
            out = schedule_overlap_bucketing(out, **options)
            out.graph.lint()
            out.recompile()
        except Exception as e:
            raise TorchBaselineError(
                f"torch's overlap scheduler failed on this graph ({type(e).__name__}: {e}); the torch "
                "baseline is unavailable for it (compare against a solvers/ heuristic instead)"
            ) from e
    after = _collective_count(out)
    logger.info(
        "torch overlap scheduler: %d -> %d collectives, %d nodes after",
        before,
        after,
        len(out.graph.nodes),
    )
    return out


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
    with _process_groups_for(rewritten):
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
    with _process_groups_for(gm):
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
    with _process_groups_for(out), _cpu_estimator_patches(cluster or Cluster()):
        try:
            out = manual_overlap_bucketing(out, plans, module_stack_fn=module_stack, bucket_mode=bucket_mode)
            out.graph.lint()
            out.recompile()
        except Exception as e:
            raise TorchBaselineError(
                f"torch's manual scheduler failed on this graph ({type(e).__name__}: {e}); the per-block "
                "baseline is unavailable for it") from e
    logger.info("torch manual per-block plan: %d entries, %d collectives after", len(plans), _collective_count(out))
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


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _collective_count(gm: "torch.fx.GraphModule") -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "namespace", "") == "_c10d_functional"
        and "wait_tensor" not in str(n.target)
    )


def _group_names(gm: "torch.fx.GraphModule") -> dict[str, int]:
    """Process group name -> size, from the graph's all-gathers and reduce-scatters."""
    import torch

    c10d = torch.ops._c10d_functional
    groups: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.target is c10d.all_gather_into_tensor.default:
            groups[str(n.args[2])] = int(n.args[1])
        elif n.target is c10d.reduce_scatter_tensor.default:
            groups[str(n.args[3])] = int(n.args[2])
    return groups


@contextlib.contextmanager
def _process_groups_for(gm: "torch.fx.GraphModule") -> Iterator[None]:
    """Make the graph's process groups resolvable: torch's pass looks them up by name.

    Captured graphs outlive the fake group they were traced on. When no group is initialised,
    a fake one of the graph's largest group size is set up for the duration (its world group
    is named "0", as at capture time) and torn down afterwards.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    groups = _group_names(gm)
    created = False
    if groups and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(groups.values()))
        created = True
    try:
        for name, size in groups.items():
            try:
                pg = _resolve_process_group(name)
            except Exception as e:
                raise TorchBaselineError(
                    f"process group {name!r} of the graph is not initialised; run under the process "
                    "group the graph was traced with"
                ) from e
            if dist.get_world_size(pg) != size:
                raise TorchBaselineError(
                    f"process group {name!r} has {dist.get_world_size(pg)} ranks but the graph's "
                    f"collectives use {size}; run under the process group the graph was traced with"
                )
        yield
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def _cpu_estimator_patches(cluster: "Cluster") -> Iterator[None]:
    """Answer torch's GPU queries from ``cluster`` (they ask CUDA / nvidia-smi otherwise).

    - roofline: ``torch.utils._runtime_estimation.get_gpu_dram_gbps`` / ``get_device_tflops``
      (bf16/fp16 -> tensor-core peak, anything else the fp32 peak);
    - NCCL model: ``config.intra_node_bw`` / ``inter_node_bw`` from the cluster,
      ``comm_analysis.get_gpu_type`` from the GPU preset, ``_has_nvlink`` True;
    - memory: the scheduler's ``MemoryTracker`` counts tensors on every device (its default
      skips CPU tensors, so a graph traced on CPU would look like it uses no memory).
    torch assumes 8 GPUs per node without CUDA; a cluster with another figure is warned about.
    """
    from unittest import mock

    import torch
    import torch.utils._runtime_estimation as rte
    from torch._inductor import comm_analysis, config
    from torch._inductor.fx_passes import overlap_scheduling
    from torch._inductor.fx_passes.memory_estimator import MemoryTracker

    gpu = cluster.gpu_spec
    generation = getattr(comm_analysis.NVIDIA_GPU_TYPE, _GPU_GENERATION.get(gpu.name, "HOPPER"))
    if cluster.gpus_per_node != 8:
        logger.warning(
            "torch's NCCL model assumes 8 GPUs per node without CUDA; the cluster has %d",
            cluster.gpus_per_node,
        )

    def tflops(dtype: Any = None) -> float:
        return gpu.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else gpu.fp32_tflops

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(rte, "get_gpu_dram_gbps", lambda: gpu.hbm_gbps))
        stack.enter_context(mock.patch.object(rte, "get_device_tflops", tflops))
        stack.enter_context(mock.patch.object(comm_analysis, "get_gpu_type", lambda: generation))
        stack.enter_context(mock.patch.object(comm_analysis, "_has_nvlink", lambda: True))
        stack.enter_context(config.patch(intra_node_bw=cluster.intra_node_gbps, inter_node_bw=cluster.inter_node_gbps))
        stack.enter_context(
            mock.patch.object(
                overlap_scheduling, "MemoryTracker", functools.partial(MemoryTracker, device_filter=lambda d: True)
            )
        )
        yield
