"""torch's overlap scheduler as starts of the search: run on a copy, its written graph read back.

torch 2.13's ``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` is
what a user of torch.compile gets without this library. The search starts from its answer
and counts it among its baselines (:mod:`solvers.search`), so that, wherever torch's schedule
fits the budget, the answer is no slower than it under the models the search judges by (the
cost model given, else the strict ones of the family) as the simulator prices both. This module

1. runs torch's pass on a copy of the graph (:func:`torch_overlap_schedule`) with every GPU
   query answered from a :class:`scheduler.costs.hardware.Cluster` (roofline peak numbers, NCCL
   bandwidths, GPU generation, NVLink), so that it runs without a GPU, as the evaluation
   harness runs it as a baseline;
2. reads its written graph back (:func:`scheduler.readback.read_back`) into a
   :class:`solvers.core.schedule.Schedule` over the traced graph's
   :class:`solvers.core.problem.Problem`: a collective torch merged carries its members in
   ``node.meta["from_node"]`` (one ``NodeSource`` of torch's ``"bucketing_pass"`` per member,
   recorded against the graph it ran on; a member merged twice, by the pre-bucketing and then
   by the bucketer, is followed down), a collective torch left alone keeps its name, and torch
   keeps its compute nodes in order; each bucket is issued and waited where torch put its
   collective and its wait among the traced compute and view nodes (``Problem.seq``). What
   torch wrote into the
   graph besides names and order (a merged all-gather's slice offsets, which differ from rank to
   rank) is never read, so every rank reads the same schedule;
3. gives the variants of :data:`VARIANTS` as named starts (:func:`torch_starts`), each
   validated on the traced problem; a variant that fails (torch's pass raises on some graphs,
   its buckets cannot be read) is skipped with the reason logged and kept, never an error.

What our model cannot represent is moved to the nearest schedule it can, and each such repair
is recorded (:attr:`TorchStart.repairs`, counted per kind): torch lets views and pointwise ops
run wherever they are ready, our schedules keep every traced node where traced, so each issue
and wait keeps its place between the compute nodes torch keeps in order (:func:`read_back`);
a bucket that then lies outside its issue range (after its members' inputs, before their first
reader) moves into it; a merged bucket whose members do not share one bucket key (type, group,
dtype, reduce op, mergeable: :attr:`solvers.core.problem.Collective.key`), or that holds a
collective our problem keeps where traced, is split into the largest groups that do, each
issued and waited where torch's bucket was; a collective our problem keeps where traced goes
back there. Anything still invalid drops the variant, with the validator's reason.

What torch's pass does, in order:

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
   NCCL tuning model of ``comm_analysis``; "benchmark": CUDA events). With both analytical, no
   rank talks to another. Memory limit: the original peak (``memory_estimator.MemoryTracker``)
   plus ``max(max_memory_increase_gb, max_memory_increase_ratio * peak)`` (the code takes the
   larger allowance, although torch's docstring says the smaller); ``None`` drops one term, at
   least one must be set. Only prefetches are checked against it.
3. Bucketing after scheduling (``collective_bucketing=True``): collectives whose overlap
   windows allow it are merged with ``bucketing.merge_all_gather_bucket`` /
   ``merge_reduce_scatter_bucket`` (``max_off_bucket_gb`` caps the bytes a bucket may add
   outside its members' windows; ``bucket_exposed_first`` / ``bucket_only_internode_comms``
   tune which collectives are bucketed).

Cost. torch's pass spends most of its time tracing its merge functions (one ``make_fx`` per
bucket), in its bucketer's path queries (each builds ordered sets of every node it visits),
estimating every node's roofline twice, working out the same symbolic sizes' hints again and
again (on graphs with data-dependent sizes) and formatting a log of the estimates that nothing
reads unless structured tracing is on. Run as a start (``reuse=True``), each bucket shape is
traced once (:func:`scheduler.writeback.merge_traces_reused`; the buckets merged after the
bucketer has decided share their FakeTensors, since only the graph's structure is read back),
the path queries search plain sets, each node's roofline and each size's hint is worked out
once, and the unread log is not formatted: torch decides and writes the same graph (the same nodes, order and
arguments), in a fraction of the time. The graph of :func:`torch_overlap_schedule` with
``reuse=True`` is to be read, not run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs.hardware import Cluster
from scheduler.readback import TorchPassError, is_collective, read_back, torch_order
from solvers.core.order import in_order
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: torch's overlap scheduler with its FSDP pre-bucketing, as torch runs it by default
TORCH = "torch-overlap"
#: torch's overlap scheduler without its pre-bucketing
TORCH_NO_PREBUCKETING = "torch-overlap-no-prebucketing"
#: the variants of torch's pass -> the options of :func:`torch_overlap_schedule` that make them
VARIANTS: dict[str, dict[str, Any]] = {TORCH: {}, TORCH_NO_PREBUCKETING: {"pre_bucketing_fsdp_collectives": False}}

#: GPU presets of scheduler.costs.hardware -> the generation torch's NCCL model keys its tables on
_GPU_GENERATION = {"h100-sxm": "HOPPER", "h200": "HOPPER", "a100-sxm": "AMPERE", "b200": "BLACKWELL"}


# --------------------------------------------------------------------------------------------
# running torch's pass
# --------------------------------------------------------------------------------------------
def torch_overlap_schedule(
    gm: "torch.fx.GraphModule",
    *,
    cluster: Cluster | None = None,
    max_memory_increase_gb: float | None = 1.0,
    max_memory_increase_ratio: float | None = 0.05,
    inplace: bool = False,
    reuse: bool = False,
    make_group: bool = True,
    **kw: Any,
) -> "torch.fx.GraphModule":
    """Run torch's ``schedule_overlap_bucketing`` on a deep copy of ``gm`` (or on ``gm`` itself
    with ``inplace``) and return the rewritten module.

    Runs with ``collective_bucketing=True`` and analytical compute and collective estimators
    (no GPU needed, and no rank waits for another), priced for ``cluster`` (default
    :class:`scheduler.costs.hardware.Cluster`): the roofline uses the cluster GPU's peak FLOP/s and
    HBM bandwidth, the NCCL model its intra / inter-node bandwidths and GPU generation.

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
        reuse: run it at the cost of a start (module docstring): on a copy of the graph's nodes
            that shares their values, each merge shape traced once, each roofline estimated
            once, the unread estimate log skipped, no code generated. torch's decisions
            and the graph it writes are the same, but buckets of one shape merged after the
            bucketer decided share FakeTensors: a graph to read, not to run or count. False
            (default) runs torch's code as is, the cost torch.compile pays.
        make_group: when no process group is initialised, set up a fake one of the graph's
            largest group for the call (default; for graphs whose fake group is gone). False:
            raise :class:`TorchPassError` instead (a library call must not make a world).
        **kw: any other keyword of ``schedule_overlap_bucketing`` (``max_in_flight_gb``,
            ``max_compute_pre_fetch``, ``max_coll_distance``, ``compute_overlap_multipler``,
            ``pre_bucketing_fsdp_collectives``, ``bucket_mode``, ...); they override the
            defaults above, e.g. ``collective_bucketing=False``.

    Raises:
        TorchPassError: torch's pass failed on this graph (the cause is chained), or the
            graph's process groups do not resolve.
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

    if inplace:
        out = gm
    elif reuse:  # a graph to read: its nodes copied, their values shared (torch's pass replaces nodes, never values)
        from scheduler.writeback import copy_module

        out = copy_module(gm)
    else:
        out = copy.deepcopy(gm)
    before = collective_count(out)
    with process_groups_for(out, make_group=make_group), cpu_estimator_patches(cluster), \
            (_reused_work() if reuse else contextlib.nullcontext()):
        try:
            out = schedule_overlap_bucketing(out, **options)
            out.graph.lint()
            if not reuse:  # a graph to read needs no code
                out.recompile()
        except Exception as e:
            raise TorchPassError(
                f"torch's overlap scheduler failed on this graph ({type(e).__name__}: {e}); torch's schedule "
                "(the torch baseline, the torch start) is unavailable for it") from e
    logger.info("torch overlap scheduler: %d -> %d collectives, %d nodes after", before, collective_count(out),
                len(out.graph.nodes))
    return out


@contextlib.contextmanager
def _reused_work() -> Iterator[None]:
    """torch's pass at the cost of a start (module docstring): merge traces reused by shape
    (:func:`scheduler.writeback.merge_traces_reused`; once the bucketer has decided, without
    fresh FakeTensors for a reused trace, :func:`scheduler.writeback.merge_values_shared`), the
    bucketer's path queries over plain sets (:func:`_has_path`), each symbolic size's hint worked out
    once (:func:`scheduler.costs.torch_model.hints_once`), each node's roofline estimated once
    (the pass estimates every compute node again when it aligns the estimates across ranks,
    which with analytical estimators only logs them), and the estimate log, which nothing
    reads unless torch's structured tracing is on, not formatted."""
    from unittest import mock

    from torch._inductor.augmented_graph_helper import AugmentedGraphHelper
    from torch._inductor.fx_passes import node_runtime_estimation, overlap_preserving_bucketer, overlap_scheduling

    from scheduler.costs.torch_model import hints_once
    from scheduler.writeback import merge_traces_reused, merge_values_shared

    estimate = overlap_scheduling.estimate_roofline_runtime_ms
    # by node, and by the values it and its inputs carry: a node whose inputs a merge replaced
    # is estimated again. The values are kept with the estimate, so that no id is reused
    memo: dict[tuple, tuple[float, tuple]] = {}

    def estimate_once(node: "torch.fx.Node") -> float:
        values = (node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes))
        key = (node, *map(id, values))
        if key not in memo:
            memo[key] = (estimate(node), values)
        return memo[key][0]

    finalize = overlap_preserving_bucketer.finalize_overlap_scheduling

    @functools.wraps(finalize)
    def finalize_on_shared_values(*args: Any, **kwargs: Any) -> Any:
        # the bucketer finds every bucket before it merges any, and nothing reads the merged
        # nodes' values after: the graph is read back for its structure
        with merge_values_shared():
            return finalize(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(merge_traces_reused())
        stack.enter_context(mock.patch.object(overlap_preserving_bucketer, "finalize_overlap_scheduling",
                                              finalize_on_shared_values))
        stack.enter_context(mock.patch.object(overlap_scheduling, "estimate_roofline_runtime_ms", estimate_once))
        stack.enter_context(mock.patch.object(AugmentedGraphHelper, "has_path", _has_path))
        stack.enter_context(hints_once())
        if not _structured_trace_on():
            stack.enter_context(mock.patch.object(node_runtime_estimation, "_log_compute_estimations",
                                                  lambda *args, **kwargs: None))
        yield


def _has_path(self: Any, source: "torch.fx.Node", target: "torch.fx.Node") -> bool:
    """torch's ``AugmentedGraphHelper.has_path`` (is ``source`` an ancestor of ``target`` through
    data and extra dependencies of merged nodes?) by the same search, backwards from ``target``
    and never through an ancestor of ``source``, over plain sets, with the ancestors of
    ``source``'s merged nodes in one bitset: torch's builds an ordered set of every visited
    node's dependencies and asks each source node about each visited one, which on a graph of
    thousands of nodes costs its bucketer most of its time. A reachability question has one
    answer, whatever the order the search takes."""
    merge_sets, extra, ancestors = self.merge_sets, self.extra_deps, self.node_ancestors
    source_set = merge_sets[source]
    assert source_set is not merge_sets[target]
    index = ancestors._node_to_idx if ancestors else {}
    above = 0  # ancestors of source (of any node merged with it), one bit per node
    for s in source_set:
        if s in index:
            above |= ancestors.get_ancestor_bits(s)
    visited = {target}
    queue = [target]
    while queue:
        current = queue.pop()
        for merged in merge_sets[current]:
            for deps in (merged._input_nodes, extra[merged]):
                for dep in deps:
                    if dep in source_set:
                        return True
                    if dep in visited:
                        continue
                    visited.add(dep)
                    j = index.get(dep)
                    if j is not None and (above >> j) & 1:
                        continue
                    queue.append(dep)
    return False


def _structured_trace_on() -> bool:
    """Whether torch's structured trace (tlparse) records artifacts in this process."""
    from torch._logging import _internal

    return bool(_internal.trace_log.handlers)


def collective_count(gm: "torch.fx.GraphModule") -> int:
    """Functional collectives of ``gm`` (waits not counted)."""
    return sum(1 for n in gm.graph.nodes if is_collective(n))


def group_sizes(gm: "torch.fx.GraphModule") -> dict[str, int]:
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
def process_groups_for(gm: "torch.fx.GraphModule", *, make_group: bool = True) -> Iterator[None]:
    """Make the graph's process groups resolvable: torch's pass looks them up by name.

    Captured graphs outlive the fake group they were traced on. When no group is initialised
    and ``make_group``, a fake one of the graph's largest group size is set up for the duration
    (its world group is named "0", as at capture time) and torn down afterwards.

    Raises:
        TorchPassError: a group of the graph does not resolve, or has another size.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    groups = group_sizes(gm)
    created = False
    if groups and not dist.is_initialized():
        if not make_group:
            raise TorchPassError("torch's overlap scheduler needs an initialised process group in which the graph's "
                                 "groups resolve (a fake one is enough); none is")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(groups.values()))
        created = True
    try:
        for name, size in groups.items():
            try:
                pg = _resolve_process_group(name)
            except Exception as e:
                raise TorchPassError(
                    f"process group {name!r} of the graph is not initialised; run under the process "
                    "group the graph was traced with") from e
            if dist.get_world_size(pg) != size:
                raise TorchPassError(
                    f"process group {name!r} has {dist.get_world_size(pg)} ranks but the graph's "
                    f"collectives use {size}; run under the process group the graph was traced with")
        yield
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def cpu_estimator_patches(cluster: Cluster) -> Iterator[None]:
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
        logger.warning("torch's NCCL model assumes 8 GPUs per node without CUDA; the cluster has %d",
                       cluster.gpus_per_node)

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


# --------------------------------------------------------------------------------------------
# reading torch's graph back
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class TorchStart:
    """One variant of torch's pass, read back as a start (or why it is not one)."""

    #: the variant (:data:`VARIANTS`)
    name: str
    #: the schedule read back, over the traced graph's problem; None when skipped
    schedule: Schedule | None = None
    #: what was changed to make torch's schedule one our model represents (module docstring)
    repairs: list[str] = dataclasses.field(default_factory=list)
    #: why the variant is no start (torch's pass failed, its graph could not be read back)
    skipped: str | None = None
    #: wall time of torch's pass and the read-back (s)
    wall_s: float = 0.0
    #: collectives in torch's written graph
    n_collectives: int = 0
    #: the traced graph's nodes in torch's order (:func:`torch_order`); None where torch keeps
    #: the traced order of the compute and view nodes
    order: tuple[str, ...] | None = None
    #: torch's schedule read back over the traced graph in torch's order (exact where
    #: ``schedule`` needed the repairs of torch's order of compute); None without ``order``
    schedule_in_order: Schedule | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.schedule.digest() if self.schedule is not None else None,
                "repairs": list(self.repairs), "skipped": self.skipped, "wall_s": self.wall_s,
                "n_collectives": self.n_collectives, "reorders_compute": self.order is not None}


def torch_starts(gm: "torch.fx.GraphModule", problem: Problem, variants: Sequence[str], *,
                 cluster: Cluster | None = None) -> list[TorchStart]:
    """Each variant of torch's pass (:data:`VARIANTS`) run on a copy of ``gm`` (at the cost of a
    start, ``reuse=True``) and read back over ``problem``, the traced graph's. A variant that
    fails, in torch's pass or in the read-back, is returned skipped, its reason logged; nothing
    here raises for torch's sake.

    Raises:
        ValueError: an unknown variant.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown torch variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    out = []
    for name in variants:
        t0 = time.perf_counter()
        start = TorchStart(name=name)
        try:
            written = torch_overlap_schedule(gm, cluster=cluster, reuse=True, make_group=False, **VARIANTS[name])
            start.n_collectives = collective_count(written)
            start.schedule, start.repairs = read_back(written, problem)
        except Exception as e:  # a start is optional: nothing in torch's pass or its reading fails the call
            start.skipped = str(e) if isinstance(e, TorchPassError) else f"{type(e).__name__}: {e}"
            logger.warning("fsdp-sched: %s is no start: %s", name, start.skipped)
        if start.schedule is not None:
            try:
                start.order = torch_order(written, problem)
                if start.order is not None:
                    start.schedule_in_order, _ = read_back(written, in_order(problem, start.order))
            except Exception as e:  # the start over the traced order stands
                start.order = start.schedule_in_order = None
                logger.warning("fsdp-sched: %s is no start in torch's order of compute: %s: %s", name,
                               type(e).__name__, e)
        for repair in start.repairs:
            logger.info("fsdp-sched: %s read back: %s", name, repair)
        start.wall_s = time.perf_counter() - t0
        out.append(start)
    return out
