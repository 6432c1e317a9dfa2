"""torch's own cost estimators as a cost model (:class:`TorchCostModel`), made to run without a
GPU: torch's queries of the device (peak FLOP/s, HBM bandwidth, NCCL bandwidths, GPU
generation, devices per node) are answered from a :class:`~scheduler.costs.hardware.Cluster`
for the duration of each estimate (:func:`torch_nccl_topology`, :meth:`TorchCostModel._peaks`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.models import AnalyticCostModel, all_to_all_ms, is_all_to_all
from scheduler.export.ops import moves_no_data

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block, restored after it."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


#: shape environment -> (its state, expression, fallback) -> torch's optimization hint
_HINTS: "weakref.WeakKeyDictionary[Any, dict[tuple, int]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def hints_once() -> Iterator[None]:
    """Inside: torch's ``ShapeEnv.optimization_hint`` (the size a symbolic size is estimated at)
    worked out once per expression and state of the shape environment (torch's own cache key,
    its version counter, and the symbols' ranges, which that key leaves out), kept while the
    environment lives. On a graph with data-dependent sizes (a MoE's) torch's estimators ask for
    the same sizes again and again, and each answer simplifies an expression."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    hint = ShapeEnv.optimization_hint
    if getattr(hint, "_memoised", False):  # already inside
        yield
        return

    def hint_once(self: Any, expr: Any, fallback: int | None = None) -> int:
        try:
            key = (self._version_counter, len(self.replacements), len(self.backed_var_to_val),
                   len(self.var_to_hint_override), frozenset(self.var_to_range.items()), expr, fallback)
            hash(key)
            memo = _HINTS.setdefault(self, {})
        except (AttributeError, TypeError):
            return hint(self, expr, fallback=fallback)
        if key not in memo:
            memo[key] = hint(self, expr, fallback=fallback)
        return memo[key]

    hint_once._memoised = True  # type: ignore[attr-defined]
    with _replaced(ShapeEnv, "optimization_hint", hint_once):
        yield


class TorchCostModel:
    """torch 2.13's own estimators, made usable without a GPU.

    Compute: ``torch._inductor.fx_passes.overlap_scheduling.estimate_roofline_runtime_ms`` with
    the device peak numbers (``torch.utils._runtime_estimation.get_gpu_dram_gbps`` /
    ``get_device_tflops``) replaced by the cluster's GPU (they ask CUDA otherwise), except for
    ops the roofline misprices:

    - ops that move no data cost 0: ``operator.getitem`` (the roofline charges the bytes of the
      whole tuple it indexes, so every member of a split bucket would pay for the bucket),
      views, ``aten._unsafe_view`` and allocations (``aten.empty``: no kernel runs);
    - ``aten.copy_`` reads its source and writes its destination: the roofline also charges a
      read of the destination.

    Collectives: ``torch._inductor.comm_analysis.estimate_nccl_collective_runtime_impl`` (min over
    ring/tree x LL/LL128/Simple), with ``intra_node_bw`` / ``inter_node_bw`` set from the cluster
    and the GPU generation of the cluster's GPU (:data:`TORCH_GPU_GENERATION`; torch detects
    it from CUDA, and without one assumes Ampere). Its ``bytes`` argument is input + output
    bytes, so it is given exactly that. torch counts a group's nodes from its size alone
    (``ceil(size / gpus_per_node)``, 8 GPUs per node without CUDA), so a dp group strided
    across the nodes of a dp x tp mesh would be priced as one NVLink node: the estimate is
    made with torch's GPUs per node set to the group's ranks per node
    (``ceil(size / nodes)``, ``nodes`` from the group's real ranks, :meth:`GroupInfo.n_nodes`),
    so that torch sees the nodes the group spans and prices the network hops, bandwidth and
    protocols of that many nodes.
    Bucket copies (:meth:`copy_ms`): torch's transfer time of reading and writing the bytes.
    """

    name = "torch"

    def __init__(self, cluster: Cluster | None = None, *, name: str | None = None):
        self.cluster = cluster or Cluster()
        self._fallback = AnalyticCostModel(self.cluster)
        if name is not None:
            self.name = name

    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        return "torch"

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        return self.name

    def copy_source(self) -> str:
        return "torch"

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        if fx_node is not None and moves_no_data(fx_node):
            return 0.0
        if fx_node is None or attrs.get("kind") != "compute":
            return self._fallback.compute_ms(attrs)
        import torch
        import torch.utils._runtime_estimation as rte
        from torch._inductor.fx_passes import overlap_scheduling as osched

        with self._peaks(), hints_once():
            try:
                if fx_node.target is torch.ops.aten.copy_.default:
                    src, out = fx_node.args[1].meta["val"], fx_node.meta["val"]
                    return float(rte.get_transfer_time([src], [out])) / 1e6
                return float(osched.estimate_roofline_runtime_ms(fx_node))
            except Exception as e:  # ops the roofline cannot size: use our analytic model
                logger.debug("torch roofline failed on %s: %s", fx_node.name, e)
                return self._fallback.compute_ms(attrs)

    def _peaks(self) -> Any:
        """Answer torch's peak FLOP/s and HBM bandwidth queries from the cluster's GPU."""
        import torch
        import torch.utils._runtime_estimation as rte

        gpu = self.cluster.gpu_spec

        def tflops(dtype: Any = None) -> float:
            return gpu.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else gpu.fp32_tflops

        stack = contextlib.ExitStack()
        stack.enter_context(_replaced(rte, "get_gpu_dram_gbps", lambda: gpu.hbm_gbps))
        stack.enter_context(_replaced(rte, "get_device_tflops", tflops))
        return stack

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        from torch._inductor import comm_analysis

        colls = {
            "all_gather": "ALL_GATHER",
            "reduce_scatter": "REDUCE_SCATTER",
            "all_reduce": "ALL_REDUCE",
            "all_to_all": "ALL_TO_ALL",
        }
        coll = getattr(comm_analysis.NCCL_COLL, colls["all_to_all" if is_all_to_all(coll_type) else coll_type], None)
        if coll is None:  # a torch whose estimator has no all-to-all: the analytic time
            return all_to_all_ms(payload_bytes, group, self.cluster)
        if coll_type == "all_gather":
            nbytes = payload_bytes * (1 + group.size)
        elif coll_type == "reduce_scatter":
            nbytes = payload_bytes + payload_bytes // max(group.size, 1)
        else:  # input and output of one size (all-reduce; all-to-all with an even split)
            nbytes = 2 * payload_bytes
        with torch_nccl_topology(self.cluster, group):
            ms = float(comm_analysis.estimate_nccl_collective_runtime_impl(nbytes, group.size, coll))
        if ms <= 0 and is_all_to_all(coll_type) and group.size > 1:  # estimator declined it
            return all_to_all_ms(payload_bytes, group, self.cluster)
        return ms

    def copy_ms(self, nbytes: int) -> float:
        # priced as the roofline prices the cat / clone kernels of a merged bucket: read and
        # write every byte at peak HBM bandwidth, no per-kernel term
        import torch
        import torch.utils._runtime_estimation as rte

        t = torch.empty(int(nbytes), dtype=torch.uint8, device="meta")
        with self._peaks():
            return float(rte.get_transfer_time([t], [t])) / 1e6


#: GPU presets -> the generation torch's NCCL model keys its tables on (``NVIDIA_GPU_TYPE``)
TORCH_GPU_GENERATION = {"h100-sxm": "HOPPER", "h200": "HOPPER", "a100-sxm": "AMPERE", "b200": "BLACKWELL"}


class _CudaView:
    """``torch.cuda`` as torch's NCCL model sees it inside :func:`torch_nccl_topology`: as
    many devices per node as the priced group has ranks per node; everything else is the real
    module."""

    def __init__(self, gpus_per_node: int):
        import torch

        self._cuda = torch.cuda
        self._gpus_per_node = gpus_per_node

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._gpus_per_node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)


class _TorchView:
    """The ``torch`` module seen from ``comm_analysis`` inside :func:`torch_nccl_topology`:
    the real one, but for ``torch.cuda`` (a :class:`_CudaView`)."""

    def __init__(self, gpus_per_node: int):
        import torch

        self._torch = torch
        self.cuda = _CudaView(gpus_per_node)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def torch_nccl_topology(cluster: Cluster, group: GroupInfo) -> Any:
    """A context in which ``torch._inductor.comm_analysis`` prices a collective of ``group``
    on ``cluster``: the cluster's intra / inter-node bandwidths (``config.intra_node_bw`` /
    ``inter_node_bw``) and GPU generation (:data:`TORCH_GPU_GENERATION`; a GPU outside it keeps
    torch's own detection), NVLink inside a node, and the nodes the group spans by its ranks.

    torch derives the node count as ``ceil(group_size / gpus_per_node)`` with
    ``gpus_per_node = torch.cuda.device_count()`` (8 without CUDA); here the module sees
    ``ceil(size / nodes)`` devices, the group's ranks per node, so the count it derives is the
    group's own (exact when the ranks are spread evenly over the nodes). Only the names that
    ``comm_analysis`` looks up in its own module are replaced, for the duration of the context.
    """
    from torch._inductor import comm_analysis, config

    nodes = group.n_nodes(cluster)
    per_node = max(1, math.ceil(group.size / max(nodes, 1)))
    generation_name = TORCH_GPU_GENERATION.get(cluster.gpu_spec.name)
    generation = (getattr(comm_analysis.NVIDIA_GPU_TYPE, generation_name) if generation_name
                  else comm_analysis.get_gpu_type())
    stack = contextlib.ExitStack()
    stack.enter_context(_replaced(config, "intra_node_bw", cluster.intra_node_gbps))
    stack.enter_context(_replaced(config, "inter_node_bw", cluster.inter_node_gbps))
    stack.enter_context(_replaced(comm_analysis, "get_gpu_type", lambda: generation))
    stack.enter_context(_replaced(comm_analysis, "_has_nvlink", lambda: True))
    stack.enter_context(_replaced(comm_analysis, "torch", _TorchView(per_node)))
    return stack
