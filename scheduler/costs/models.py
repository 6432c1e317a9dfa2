"""Costs: pluggable models that put ``runtime_ms`` on every DAG node before any solve.

A cost model is any object with::

    name: str
    compute_ms(attrs: dict, fx_node: torch.fx.Node | None) -> float
    collective_ms(coll_type: str, payload_bytes: int, group: GroupInfo) -> float
    copy_ms(nbytes: int) -> float

``attrs`` are the node's DAG attributes (``target``, ``flops``, ``bytes_accessed``, ``dtype``,
``size_bytes``); ``payload_bytes`` is the per-rank input size of the collective (the shard for
an all-gather, the full-size gradient for a reduce-scatter). ``copy_ms`` is the compute-stream
time of copying ``nbytes`` into or out of a bucket buffer (the cost of merging).

Models here:
- :class:`AnalyticCostModel`: roofline from FLOPs and bytes on a :class:`GPUSpec`, NCCL ring
  alpha-beta over a :class:`Cluster` topology.
- :class:`TorchCostModel`: torch's own estimators (inductor roofline, comm_analysis), made to
  work without a GPU.
- :class:`TableCostModel`: measured collective times (a CSV or nccl-tests output,
  :mod:`scheduler.costs.tables`), a user table or callable, falling back to another model.
- :class:`ProfileCostModel`: compute times from a torch.profiler trace of one step
  (:mod:`scheduler.costs.profiles`), falling back to another model.
- :class:`scheduler.costs.measure.MeasuredCostModel`: timed on the current device (see that module).

:class:`ComposedCostModel` takes each cost component from another model: compute (and bucket
copies) from one, collectives from another.

:func:`resolve_cost_model` turns what a user passes (None, a name of :data:`COST_MODELS`, a spec
of parts such as ``"table:PATH"``, ``"profile:PATH"`` or ``"compute:torch+table:PATH"``
(:class:`CostSpec`), or an object) into a model. What a file measures is fixed; a component the
spec names no model for is open (one model prices it here: the analytic one; the family of
:mod:`scheduler.costs.family` prices it by each plausible model).

Topology: a process group is priced by the nodes its ranks span (:meth:`GroupInfo.n_nodes`:
from the group's real ranks, recorded at export from the initialised process group, and the
cluster's GPUs per node; else ``ceil(size / gpus_per_node)``), never by its size alone, in
every model here (torch's NCCL estimator included, :func:`torch_nccl_topology`).

Models that price some nodes from data and leave the rest to a fallback say which
(``compute_matched(attrs, fx_node)``, ``collective_matched(coll_type, group)``);
:func:`annotate_costs` then records ``dag.graph["cost_coverage"]``: the share of compute time
matched and the process groups whose collectives the fallback priced. Models may also say what
priced each part (``compute_source(attrs, fx_node)``, ``collective_source(coll_type, group)``,
``copy_source()``: the name of a model or a file; the model's ``name`` when it does not say):
:func:`annotate_costs` records them per component in ``dag.graph["cost_sources"]``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import networkx as nx

from scheduler.costs.tables import CollectiveTable, CostTableError
from scheduler.costs.profiles import ProfileTrace, ProfileTraceError
from solvers.core.units import fmt_ms

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """Peak numbers of one GPU (public data-sheet figures)."""

    name: str
    #: dense bf16/fp16 tensor-core peak, TFLOP/s
    bf16_tflops: float
    #: dense fp32 (non-tensor-core) peak, TFLOP/s; fp32 matmuls in training mostly use TF32
    fp32_tflops: float
    #: HBM bandwidth, GB/s
    hbm_gbps: float
    #: device memory, GiB
    memory_gib: float

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "fp32_tflops", "hbm_gbps", "memory_gib"):
            if not getattr(self, f) > 0:
                raise ValueError(f"GPUSpec.{f} must be > 0, got {getattr(self, f)!r}")


#: Sources: NVIDIA H100 / H200 / A100 / B200 data sheets (SXM parts, dense, no sparsity).
#: fp32 figures are the TF32 tensor-core dense peaks, which is what fp32 matmuls use under
#: torch.backends.cuda.matmul.allow_tf32 (the training default of torchtitan).
GPU_PRESETS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec(name="h100-sxm", bf16_tflops=989.0, fp32_tflops=494.5, hbm_gbps=3350.0, memory_gib=80.0),
    "h200": GPUSpec(name="h200", bf16_tflops=989.0, fp32_tflops=494.5, hbm_gbps=4800.0, memory_gib=141.0),
    "a100-sxm": GPUSpec(name="a100-sxm", bf16_tflops=312.0, fp32_tflops=156.0, hbm_gbps=2039.0, memory_gib=80.0),
    "b200": GPUSpec(name="b200", bf16_tflops=2250.0, fp32_tflops=1125.0, hbm_gbps=8000.0, memory_gib=180.0),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """Topology and link figures of the machine the schedule is for.

    Defaults: 64 H100 SXM GPUs, 8 per node, NVLink4 within a node, one 400 Gb/s InfiniBand NIC
    per GPU between nodes (DESIGN.md, public figures).

    The world and the ranks of each process group come from the graph (the groups it names,
    :func:`graph_topology`); a group is priced by the nodes its ranks span on
    ``gpus_per_node``. ``n_gpus`` prices nothing: without a cluster, the export takes the
    graph's world; a given cluster whose ``n_gpus`` is not the graph's world is used as it is,
    and ``optimize_schedule`` warns and notes it in the report.
    """

    #: number of GPUs in the job (the graph's world when the export makes the cluster)
    n_gpus: int = 64
    #: GPUs per node (NVLink domain)
    gpus_per_node: int = 8
    #: GPU model, a key of GPU_PRESETS or a GPUSpec
    gpu: str | GPUSpec = "h100-sxm"
    #: NCCL bus bandwidth inside a node, GB/s (NVLink4: 450 GB/s per direction)
    intra_node_gbps: float = 450.0
    #: NCCL bus bandwidth per GPU between nodes, GB/s (400 Gb/s InfiniBand = 50 GB/s)
    inter_node_gbps: float = 50.0
    #: NCCL base latency of one collective, us (NCCL tuning.cc, ring / Simple protocol: 8.4)
    base_latency_us: float = 8.4
    #: latency per ring step over NVLink, us (NCCL tuning.cc hwLat NVLink ring Simple: 3.4)
    intra_hop_latency_us: float = 3.4
    #: latency per ring step over the network, us (NCCL tuning.cc hwLat NET ring Simple: 14.0)
    inter_hop_latency_us: float = 14.0
    #: fraction of peak FLOP/s that large matmuls reach (cuBLAS bf16 GEMMs reach about 70 % of
    #: the H100's 989 TFLOP/s); applies to every FLOP-bound op
    flops_efficiency: float = 0.7
    #: fraction of peak HBM bandwidth that memory-bound kernels reach (about 80 % in STREAM-like
    #: copies on H100)
    hbm_efficiency: float = 0.8
    #: fixed per-kernel overhead on the compute stream, us (launch + tail; ~2-5 us on H100)
    kernel_overhead_us: float = 3.0

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("Cluster.n_gpus and gpus_per_node must be >= 1")
        if isinstance(self.gpu, str) and self.gpu not in GPU_PRESETS:
            raise ValueError(f"unknown GPU {self.gpu!r}; choose one of {sorted(GPU_PRESETS)} or pass a GPUSpec")
        for f in ("intra_node_gbps", "inter_node_gbps", "flops_efficiency", "hbm_efficiency"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Cluster.{f} must be > 0, got {getattr(self, f)!r}")
        for f in ("base_latency_us", "intra_hop_latency_us", "inter_hop_latency_us", "kernel_overhead_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"Cluster.{f} must be >= 0, got {getattr(self, f)!r}")

    @property
    def gpu_spec(self) -> GPUSpec:
        return GPU_PRESETS[self.gpu] if isinstance(self.gpu, str) else self.gpu

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if not isinstance(self.gpu, str):
            d["gpu"] = dataclasses.asdict(self.gpu)
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Cluster":
        d = dict(d)
        if isinstance(d.get("gpu"), dict):
            d["gpu"] = GPUSpec(**d["gpu"])
        return Cluster(**d)


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """A process group as the cost model sees it."""

    name: str
    size: int
    #: global ranks of the group, when known; decides which hops cross nodes
    ranks: tuple[int, ...] | None = None

    def n_nodes(self, cluster: Cluster) -> int:
        """Number of nodes the group spans.

        With known ranks, counted from them; otherwise a group of ``size`` consecutive ranks is
        assumed (the outermost dimension of the usual (dp, tp) mesh has stride tp, which the
        ranks capture when the graph was traced with the real mesh).
        """
        if self.ranks:
            return len({r // cluster.gpus_per_node for r in self.ranks})
        return max(1, math.ceil(self.size / cluster.gpus_per_node))


def graph_topology(dag: nx.DiGraph) -> dict[str, Any]:
    """The topology ``dag`` was priced on: ``world_size`` (the ranks its process groups live in;
    None: unknown), ``gpus_per_node`` and ``n_gpus`` (its cluster's), and per process group
    (``groups``) ``group_name``, ``size``, ``ranks_known`` (False: priced as ``size``
    consecutive ranks) and ``nodes``, the nodes its ranks span (:meth:`GroupInfo.n_nodes`)."""
    cluster = Cluster.from_json(dag.graph["cluster"]) if dag.graph.get("cluster") else Cluster()
    groups = []
    for name, g in sorted((dag.graph.get("process_groups") or {}).items()):
        gi = GroupInfo(name, int(g["size"]), tuple(g["ranks"]) if g.get("ranks") else None)
        groups.append({"group_name": name, "size": gi.size, "ranks_known": gi.ranks is not None,
                       "nodes": gi.n_nodes(cluster)})
    return {"world_size": dag.graph.get("world_size"), "gpus_per_node": cluster.gpus_per_node,
            "n_gpus": cluster.n_gpus, "groups": groups}


def topology_line(topology: Mapping[str, Any]) -> str:
    """``"64 ranks, 8 per node; group '0': 8 ranks on 8 nodes; group '1': 8 ranks on 1 node"``
    of a :func:`graph_topology` record."""
    world = topology.get("world_size")
    head = f"{world} ranks" if world else "world size unknown"
    parts = [f"{head}, {topology['gpus_per_node']} per node"]
    for g in topology.get("groups", ()):
        where = f"{g['nodes']} node{'s' if g['nodes'] != 1 else ''}"
        guess = "" if g["ranks_known"] else " (ranks unknown: taken as consecutive)"
        parts.append(f"group {g['group_name']!r}: {g['size']} ranks on {where}{guess}")
    return "; ".join(parts)


def cluster_disagreement(topology: Mapping[str, Any], cluster: Cluster | None) -> str | None:
    """Why a ``cluster`` the user gave does not fit the graph (its ``n_gpus`` is not the
    graph's world), or None. Not an error: no price reads ``n_gpus``; each group is priced by
    the nodes its own ranks span on ``gpus_per_node``."""
    world = topology.get("world_size")
    if cluster is None or not world or cluster.n_gpus == world:
        return None
    return (f"cluster.n_gpus={cluster.n_gpus} but the graph's process groups live in a world of {world} ranks: "
            f"each group is priced by the nodes its ranks span at {cluster.gpus_per_node} GPUs per node "
            f"(n_gpus prices nothing); pass Cluster(n_gpus={world}, ...) to silence this")


class CostModel(Protocol):
    name: str

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: "torch.fx.Node | None" = None) -> float: ...

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float: ...

    def copy_ms(self, nbytes: int) -> float: ...


def ring_collective_ms(coll_type: str, payload_bytes: int, group: GroupInfo, cluster: Cluster) -> float:
    """NCCL ring alpha-beta time of one collective, in ms.

    ``t = base_latency + intra_steps * intra_hop + inter_steps * inter_hop + S * steps / (n * busbw)``
    with ``n`` ranks, ``S`` the bytes across all ranks (``payload * n`` for an all-gather,
    ``payload`` for a reduce-scatter whose per-rank input is the full tensor), ``steps = n - 1``
    (``2 (n - 1)`` for all-reduce) of which ``nodes - 1`` (twice that for all-reduce) cross the
    network, and ``busbw`` the inter-node bandwidth when the group spans nodes (DESIGN.md).
    """
    n = group.size
    if n <= 1:
        return 0.0
    nodes = group.n_nodes(cluster)
    if is_all_to_all(coll_type):
        return all_to_all_ms(payload_bytes, group, cluster)
    if coll_type == "all_gather":
        total = payload_bytes * n
        steps, inter = n - 1, nodes - 1
    elif coll_type == "reduce_scatter":
        total = payload_bytes
        steps, inter = n - 1, nodes - 1
    elif coll_type == "all_reduce":
        total = payload_bytes
        steps, inter = 2 * (n - 1), 2 * (nodes - 1)
    else:
        raise ValueError(f"no analytic model for collective type {coll_type!r}")
    busbw_gbps = cluster.inter_node_gbps if nodes > 1 else cluster.intra_node_gbps
    latency_us = (
        cluster.base_latency_us + (steps - inter) * cluster.intra_hop_latency_us + inter * cluster.inter_hop_latency_us
    )
    transfer_us = total * steps / n / (busbw_gbps * 1e3)  # GB/s = 1e3 bytes/us
    return (latency_us + transfer_us) / 1e3


def is_all_to_all(coll_type: str) -> bool:
    """``all_to_all`` (or torch's ``all_to_all_single``, as the export names it)."""
    return coll_type.startswith("all_to_all")


def all_to_all_ms(payload_bytes: int, group: GroupInfo, cluster: Cluster) -> float:
    """Alpha-beta time of one all-to-all, in ms: every rank sends ``(n - 1) / n`` of its
    ``payload_bytes`` input to the others at once (NCCL pairs n - 1 sends and receives), so
    ``t = base_latency + hop + payload * (n - 1) / (n * busbw)`` with the inter-node hop and
    bandwidth when the group spans nodes. With data-dependent split sizes, ``payload_bytes`` is
    the input tensor (an even split)."""
    n = group.size
    if n <= 1:
        return 0.0
    spans = group.n_nodes(cluster) > 1
    busbw_gbps = cluster.inter_node_gbps if spans else cluster.intra_node_gbps
    hop_us = cluster.inter_hop_latency_us if spans else cluster.intra_hop_latency_us
    transfer_us = payload_bytes * (n - 1) / n / (busbw_gbps * 1e3)
    return (cluster.base_latency_us + hop_us + transfer_us) / 1e3


class AnalyticCostModel:
    """Roofline compute + NCCL ring collectives on a :class:`Cluster`.

    Compute: ``max(flops / (peak * flops_efficiency), bytes / (hbm * hbm_efficiency)) +
    kernel_overhead``; bf16/fp16 ops use the tensor-core peak, others the fp32 (TF32) peak.
    Views and ops without FLOPs or bytes cost nothing.

    ``name`` (default ``"analytic"``) names the model's collectives in the report's sources (a
    member of a family on scaled bandwidths is ``"analytic bw-30%"``); its compute and copies
    are ``"analytic"`` whatever the network.
    """

    name = "analytic"

    def __init__(self, cluster: Cluster | None = None, *, name: str | None = None):
        self.cluster = cluster or Cluster()
        if name is not None:
            self.name = name

    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        return "analytic"

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        return self.name

    def copy_source(self) -> str:
        return "analytic"

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        flops = attrs.get("flops", 0) or 0
        nbytes = attrs.get("bytes_accessed", 0) or 0
        if flops == 0 and nbytes == 0:
            return 0.0
        gpu = self.cluster.gpu_spec
        peak = gpu.bf16_tflops if attrs.get("dtype") in ("bfloat16", "float16") else gpu.fp32_tflops
        flops_us = flops / (peak * self.cluster.flops_efficiency * 1e6)
        mem_us = nbytes / (gpu.hbm_gbps * self.cluster.hbm_efficiency * 1e3)
        return (max(flops_us, mem_us) + self.cluster.kernel_overhead_us) / 1e3

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        return ring_collective_ms(coll_type, payload_bytes, group, self.cluster)

    def copy_ms(self, nbytes: int) -> float:
        # read + write of every byte at achievable HBM bandwidth, one kernel
        gpu = self.cluster.gpu_spec
        return (2 * nbytes / (gpu.hbm_gbps * self.cluster.hbm_efficiency * 1e3) + self.cluster.kernel_overhead_us) / 1e3


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

        with self._peaks():
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
        import contextlib
        from unittest import mock

        import torch
        import torch.utils._runtime_estimation as rte

        gpu = self.cluster.gpu_spec

        def tflops(dtype: Any = None) -> float:
            return gpu.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else gpu.fp32_tflops

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(rte, "get_gpu_dram_gbps", lambda: gpu.hbm_gbps))
        stack.enter_context(mock.patch.object(rte, "get_device_tflops", tflops))
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
    import contextlib
    from unittest import mock

    from torch._inductor import comm_analysis, config

    nodes = group.n_nodes(cluster)
    per_node = max(1, math.ceil(group.size / max(nodes, 1)))
    generation_name = TORCH_GPU_GENERATION.get(cluster.gpu_spec.name)
    generation = (getattr(comm_analysis.NVIDIA_GPU_TYPE, generation_name) if generation_name
                  else comm_analysis.get_gpu_type())
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(config, "intra_node_bw", cluster.intra_node_gbps))
    stack.enter_context(mock.patch.object(config, "inter_node_bw", cluster.inter_node_gbps))
    stack.enter_context(mock.patch.object(comm_analysis, "get_gpu_type", lambda: generation))
    stack.enter_context(mock.patch.object(comm_analysis, "_has_nvlink", lambda: True))
    stack.enter_context(mock.patch.object(comm_analysis, "torch", _TorchView(per_node)))
    return stack


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoverageCheck:
    """When a cost model that prices from its own data (a measured table, a profile) priced too
    little of a graph from it, :func:`annotate_costs` logs a WARNING saying how much it priced
    and why the rest was left to its fallback: the process groups (size, nodes) the graph needs
    and those the data has, or the largest compute nodes it did not price. A file measured on
    other groups or profiled from another model otherwise falls back to the analytic model in
    silence (only the report's ``cost_coverage`` shows it)."""

    #: least share of the graph's collectives (by count) the data must price
    min_collective_share: float = 0.5
    #: least share of the graph's compute time the data must price
    min_compute_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("min_collective_share", "min_compute_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} must be a share in [0, 1]")


class TableCostModel:
    """User-supplied costs: measured collective times, a compute table and/or callables.

    - ``collectives``: a :class:`~scheduler.costs.tables.CollectiveTable` of measured times
      (:meth:`from_file` reads one from a CSV or nccl-tests output), looked up by collective,
      group size, the nodes the group's ranks span (:meth:`GroupInfo.n_nodes` on ``cluster``)
      and the per-rank input bytes; log-log interpolation between rows, bandwidth scaling
      outside them (see :class:`~scheduler.costs.tables.CollectiveTable`). A group without a
      row falls back, and :func:`annotate_costs` records it in the DAG's ``cost_coverage``
      (``ScheduleReport.cost_coverage["fallback_groups"]``).
    - ``compute``: ``{node name or target: ms}``, looked up by node name first, then by
      target (e.g. ``"aten.mm.default"``), or a callable receiving the node attributes and
      returning ms or None.
    - ``collective``: a callable ``(coll_type, payload_bytes, GroupInfo) -> ms`` (it covers
      every collective; give either it or ``collectives``).

    Anything not covered falls back to ``fallback`` (default: the analytic model on
    ``cluster``, default :class:`Cluster`).
    """

    def __init__(
        self,
        compute: Mapping[str, float] | Callable[[Mapping[str, Any]], float | None] | None = None,
        *,
        collective: Callable[[str, int, GroupInfo], float] | None = None,
        collectives: CollectiveTable | None = None,
        fallback: CostModel | None = None,
        cluster: Cluster | None = None,
        name: str = "table",
    ):
        if collective is not None and collectives is not None:
            raise ValueError("give a collective callable or a collectives table, not both")
        self.cluster = cluster or getattr(fallback, "cluster", None) or Cluster()
        self._compute = compute
        self._collective = collective
        self.collectives = collectives
        self._fallback = fallback or AnalyticCostModel(self.cluster)
        self.name = name
        #: what the report names the parts this model prices itself by (``name`` as given: a
        #: family renames its members, not their sources)
        self.source = name

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        cluster: Cluster | None = None,
        fallback: CostModel | None = None,
        **nccl_tests_kw: Any,
    ) -> "TableCostModel":
        """Measured collective times from ``path``: a CSV with the header
        ``collective,group_size,nodes,input_bytes,ms``, the stdout of an nccl-tests program
        (``all_gather_perf``, ``reduce_scatter_perf``, ``all_reduce_perf``,
        ``alltoall_perf``: its ``size`` column is the gathered output for an all-gather, so
        ``input_bytes = size / group_size``, and the per-rank input for the others; see
        :func:`scheduler.costs.tables.read_nccl_tests`, which ``nccl_tests_kw`` ``collective``
        / ``group_size`` / ``nodes`` go to), or a directory of such files. Everything else
        (compute, copies, uncovered groups) from ``fallback`` (default: analytic on
        ``cluster``).

        Raises:
            CostTableError (a ValueError): the file is missing or unreadable, or a line is bad;
                the message names the file, the line and the field.
        """
        table = CollectiveTable.read(path, **nccl_tests_kw)
        return cls(collectives=table, fallback=fallback, cluster=cluster, name=f"table:{path}")

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        v = self._own_compute_ms(attrs)
        return v if v is not None else self._fallback.compute_ms(attrs, fx_node)

    def _own_compute_ms(self, attrs: Mapping[str, Any]) -> float | None:
        c = self._compute
        if callable(c):
            v = c(attrs)
            return None if v is None else float(v)
        if c is not None:
            for key in (attrs.get("name"), attrs.get("target")):
                if key is not None and key in c:
                    return float(c[key])
        return None

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        if self._collective is not None:
            return float(self._collective(coll_type, payload_bytes, group))
        if self.collectives is not None:
            ms = self.collectives.lookup_ms(coll_type, group.size, group.n_nodes(self.cluster), payload_bytes)
            if ms is not None:
                return ms
        return self._fallback.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self._fallback.copy_ms(nbytes)

    # coverage (read by annotate_costs): True / False, or None where the model does not say
    def compute_matched(self, attrs: Mapping[str, Any], fx_node: Any = None) -> bool | None:
        """Whether the fallback priced the node from its own data (a profile); None when the
        fallback does not say. A compute table is the user's own figures, not counted."""
        if self._own_compute_ms(attrs) is not None:
            return None
        return _ask(self._fallback, "compute_matched", attrs, fx_node)

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        """With a collectives table: whether it has a row for ``coll_type`` on ``group``
        (else a fallback's measured data may price it); None without a table, unless the
        fallback says."""
        if self._collective is not None:
            return None
        if self.collectives is not None and self.collectives.covers(coll_type, group.size, group.n_nodes(self.cluster)):
            return True
        said = _ask(self._fallback, "collective_matched", coll_type, group)
        if self.collectives is None:
            return said
        return bool(said)

    def collective_keys(self) -> list[tuple[str, int, int]]:
        """(collective, group size, nodes) of every key the measured data holds (for messages)."""
        own = self.collectives.keys() if self.collectives is not None else []
        return sorted({*own, *(_ask(self._fallback, "collective_keys") or ())})
    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        """:attr:`source` for a node of the compute table, else the fallback's source."""
        if self._own_compute_ms(attrs) is not None:
            return self.source
        return source_of(self._fallback, "compute_source", attrs, fx_node)

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        """:attr:`source` for a collective of the callable or a row of the table, else the
        fallback's source."""
        if self._collective is not None or (
                self.collectives is not None
                and self.collectives.covers(coll_type, group.size, group.n_nodes(self.cluster))):
            return self.source
        return source_of(self._fallback, "collective_source", coll_type, group)

    def copy_source(self) -> str:
        return source_of(self._fallback, "copy_source")


class ProfileCostModel:
    """Compute times from a torch.profiler trace of one training step.

    Each compute node is priced by the profiled calls of its aten op on its input shapes
    (:meth:`scheduler.costs.profiles.ProfileTrace.lookup_ms`: the kernels' time in a GPU trace;
    in a CPU trace the op's own time and the host's time up to the next op, see
    :mod:`scheduler.costs.profiles`); nodes without a matching call, collectives and bucket
    copies are priced by ``fallback`` (default: the analytic model on ``cluster``; give a
    :class:`TableCostModel` of measured collective times to price collectives from
    measurements too). :func:`annotate_costs` records the share of compute time that was
    matched in the DAG's ``cost_coverage`` (``ScheduleReport.cost_coverage``).

    A CPU trace of a gloo group also prices each collective it ran, of the same kind on the
    same per-rank input bytes, by the time gloo took for it in that step
    (:meth:`scheduler.costs.profiles.ProfileTrace.collective_ms`); other collectives go to
    ``fallback``.

    Ranks that read their own traces price alike graphs differently: give every rank the same
    trace file (one rank's profile), or solve on one rank (``broadcast_from``), so that every
    rank gets the identical schedule.

    Args:
        trace: a :class:`~scheduler.costs.profiles.ProfileTrace` or the path of the Chrome trace
            JSON (``prof.export_chrome_trace(path)`` of a step profiled with
            ``record_shapes=True``).
        collectives: price collectives from the trace where it ran them (False: all from
            ``fallback``, e.g. to price them from a table measured on an idle group alone).
    """

    def __init__(self, trace: "ProfileTrace | str | Path", *, fallback: CostModel | None = None,
                 cluster: Cluster | None = None, name: str | None = None, collectives: bool = True):
        self.trace = trace if isinstance(trace, ProfileTrace) else ProfileTrace(trace)
        self.collectives = bool(collectives)
        self.cluster = cluster or getattr(fallback, "cluster", None) or Cluster()
        self._fallback = fallback or AnalyticCostModel(self.cluster)
        self.name = name or f"profile:{self.trace.path}"
        #: what the report names the parts this model prices itself by (see TableCostModel)
        self.source = self.name

    @classmethod
    def from_file(cls, path: str | Path, *, cluster: Cluster | None = None,
                  fallback: CostModel | None = None) -> "ProfileCostModel":
        """The model of the Chrome trace in ``path`` (see the class).

        Raises:
            ProfileTraceError (a ValueError): a missing, unreadable or shapeless trace.
        """
        return cls(ProfileTrace(path), fallback=fallback, cluster=cluster)

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        ms = self._profiled_ms(attrs, fx_node)
        return ms if ms is not None else self._fallback.compute_ms(attrs, fx_node)

    def _profiled_ms(self, attrs: Mapping[str, Any], fx_node: Any) -> float | None:
        if fx_node is None or attrs.get("kind", "compute") != "compute":
            return None
        return self.trace.lookup_ms(fx_node)

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        ms = self.trace.collective_ms(coll_type, payload_bytes) if self.collectives else None
        return ms if ms is not None else self._fallback.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self._fallback.copy_ms(nbytes)

    def compute_matched(self, attrs: Mapping[str, Any], fx_node: Any = None) -> bool:
        """Whether the node is priced by the profile (else by the fallback)."""
        if self._profiled_ms(attrs, fx_node) is not None:
            return True
        return bool(_ask(self._fallback, "compute_matched", attrs, fx_node))

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        """True where the trace ran collectives of this kind, else the fallback's answer."""
        if self.collectives and self.trace.has_collectives(coll_type):
            return True
        return _ask(self._fallback, "collective_matched", coll_type, group)

    def collective_keys(self) -> list[tuple[str, int, int]]:
        """The fallback's measured keys (the trace's collectives name no group)."""
        return list(_ask(self._fallback, "collective_keys") or ())


def _ranks_over(size: int, nodes: int) -> str:
    return f"{size} ranks over {nodes} node{'s' if nodes != 1 else ''}"
    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        if self._profiled_ms(attrs, fx_node) is not None:
            return self.source
        return source_of(self._fallback, "compute_source", attrs, fx_node)

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        if self.collectives and self.trace.has_collectives(coll_type):
            return self.source
        return source_of(self._fallback, "collective_source", coll_type, group)

    def copy_source(self) -> str:
        return source_of(self._fallback, "copy_source")


def _ask(model: Any, method: str, *args: Any) -> Any:
    """``model.method(*args)`` when the model has that coverage method, else None."""
    fn = getattr(model, method, None)
    return fn(*args) if callable(fn) else None


def source_of(model: Any, method: str, *args: Any) -> str:
    """What priced a part (``method``: ``"compute_source"``, ``"collective_source"`` or
    ``"copy_source"``): the model's answer, or its ``name`` for a model that does not say."""
    said = _ask(model, method, *args)
    return str(said) if said is not None else str(getattr(model, "name", type(model).__name__))


class ComposedCostModel:
    """A cost model made of parts of others: compute from one model, collectives from another,
    bucket copies from the compute side (or from ``copies``).

    Each part is a cost model object or anything :func:`resolve_cost_model` takes (a name or a
    spec): ``ComposedCostModel(compute="torch", collectives="table:colls.csv")`` prices compute
    by torch's roofline and collectives by the measured table (a group without a row by the
    table's fallback, the analytic model). The spec ``"compute:torch+table:colls.csv"``
    (:class:`CostSpec`) names a model of the same parts.

    What priced each part (:func:`annotate_costs`' ``cost_sources``) and what was measured
    (``compute_matched`` / ``collective_matched``) are each part's own answers.

    Args:
        compute: prices compute nodes (and, unless ``copies`` is given, bucket copies).
        collectives: prices collectives.
        copies: prices the copies into and out of bucket buffers (default: ``compute``'s:
            they are kernels on the compute stream).
        cluster: the topology names and specs are resolved on (default :class:`Cluster`).
        name: the model's name (default: from its parts).
    """

    def __init__(self, *, compute: Any, collectives: Any, copies: Any = None, cluster: Cluster | None = None,
                 name: str | None = None):
        self.cluster = cluster or Cluster()
        self.compute = resolve_cost_model(compute, self.cluster)
        self.collectives = resolve_cost_model(collectives, self.cluster)
        self.copies = self.compute if copies is None else resolve_cost_model(copies, self.cluster)
        self.name = name or f"{_model_name(self.compute)} compute + {_model_name(self.collectives)} collectives"

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        return self.compute.compute_ms(attrs, fx_node)

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        return self.collectives.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self.copies.copy_ms(nbytes)

    def compute_matched(self, attrs: Mapping[str, Any], fx_node: Any = None) -> bool | None:
        return _ask(self.compute, "compute_matched", attrs, fx_node)

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        return _ask(self.collectives, "collective_matched", coll_type, group)

    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        return source_of(self.compute, "compute_source", attrs, fx_node)

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        return source_of(self.collectives, "collective_source", coll_type, group)

    def copy_source(self) -> str:
        return source_of(self.copies, "copy_source")


def _model_name(model: Any) -> str:
    return str(getattr(model, "name", type(model).__name__))


# --------------------------------------------------------------------------------------------
# cost model specs
# --------------------------------------------------------------------------------------------
#: cost models that can be named: ``export_dag(gm, cost_model="torch")``
COST_MODELS: dict[str, type] = {"analytic": AnalyticCostModel, "torch": TorchCostModel}
#: parts of a spec that name a file (:class:`CostSpec`): ``"table:PATH"`` (measured collective
#: times, :meth:`TableCostModel.from_file`) and ``"profile:PATH"`` (compute times from a
#: torch.profiler trace, :class:`ProfileCostModel`)
FILE_COST_MODELS = ("table", "profile")
#: parts of a spec that name the model of one cost component (:class:`CostSpec`)
PART_COST_MODELS = ("compute", "collectives")
#: where a spec splits into parts: a ``+`` followed by a part's keyword (a path may hold ``+``)
_SPEC_SPLIT = re.compile(
    r"\+(?=\s*(?:(?:table|profile|compute|collectives)\s*:|(?:analytic|torch)\s*(?:\+|$)))", re.IGNORECASE)
_SPEC_GRAMMAR = ("'analytic' or 'torch' (the whole model), 'compute:analytic|torch', 'collectives:analytic|torch', "
                 "'table:PATH' (measured collective times: a CSV or nccl-tests output) or 'profile:PATH' (a "
                 "torch.profiler trace), joined by '+'")


def scale_bandwidth(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with its intra- and inter-node bus bandwidths multiplied by ``factor``."""
    return dataclasses.replace(cluster, intra_node_gbps=cluster.intra_node_gbps * factor,
                               inter_node_gbps=cluster.inter_node_gbps * factor)


def family_label(base: str, factor: float = 1.0) -> str:
    """``"analytic"`` for the cluster as given, ``"analytic bw-30%"`` for bandwidths x 0.7."""
    return base if factor == 1.0 else f"{base} bw{factor - 1:+.0%}"


@dataclasses.dataclass(frozen=True)
class CostSpec:
    """A cost model spec (:func:`parse_cost_spec`): where each cost component comes from.

    A spec is parts joined by ``+`` (keywords in any case, blanks around parts ignored):

    - ``analytic`` / ``torch``: that model prices compute, bucket copies and collectives;
    - ``compute:analytic`` / ``compute:torch``: that model prices compute and bucket copies;
    - ``collectives:analytic`` / ``collectives:torch``: that model prices collectives;
    - ``table:PATH``: measured collective times (a CSV, nccl-tests output or a directory of
      them, :class:`TableCostModel`) price the collectives of the groups they have rows for;
      the other collectives are priced by the collectives model;
    - ``profile:PATH``: a torch.profiler trace (:class:`ProfileCostModel`) prices the compute
      nodes it timed (and the collectives of a gloo group it ran); the other nodes are priced by
      the compute model.

    Each kind at most once; a whole model and a part of the same component conflict
    (``"torch+compute:analytic"``). Examples: ``"table:colls.csv"``,
    ``"compute:torch+table:colls.csv"``, ``"profile:step.json+table:colls.csv"``,
    ``"torch+table:colls.csv"`` (torch's estimators for everything the table does not cover).

    A component the spec names no model for (compute without ``compute:`` or a whole model;
    collectives without ``collectives:`` or a whole model) is open: what a file measured is
    fixed, the rest is uncertain. :func:`resolve_cost_model` prices an open component by the
    analytic model (one model); ``optimize_schedule`` judges every schedule under the family of
    the spec (:func:`scheduler.costs.family.cost_models`), which prices it by each plausible
    model (analytic and torch's estimators; collectives also on scaled bandwidths).
    """

    #: the model of compute and bucket copies (a name of :data:`COST_MODELS`), None: open
    compute: str | None = None
    #: the model of collectives (a name of :data:`COST_MODELS`), None: open
    collectives: str | None = None
    #: the collective table's path
    table: str | None = None
    #: the profiler trace's path
    profile: str | None = None
    #: the spec as written, blanks around it removed (a lone model name in lower case)
    text: str = ""

    @property
    def open_parts(self) -> tuple[str, ...]:
        """The components no model is named for: ``"compute"``, ``"collectives"``."""
        return tuple(part for part, model in (("compute", self.compute), ("collectives", self.collectives))
                     if model is None)

    @property
    def files(self) -> tuple[str, ...]:
        """The paths the spec reads."""
        return tuple(p for p in (self.table, self.profile) if p is not None)


def parse_cost_spec(text: str) -> CostSpec:
    """The :class:`CostSpec` of ``text`` (its grammar there).

    Raises:
        ValueError: a part that is no model name, keyword or file part, a file part without a
            path, a kind given twice or a component named twice; the message names the part
            and lists the valid parts.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"cost model {text!r} names nothing; valid names are {sorted(COST_MODELS)}, or a spec of "
                         f"{_SPEC_GRAMMAR}")
    fields: dict[str, str] = {}
    given: dict[str, str] = {}  # field -> the part that set it, for the error of a second one

    def put(field: str, value: str, part: str) -> None:
        if field in fields:
            what = f"two {field} files" if field in FILE_COST_MODELS else f"the {field} model twice"
            raise ValueError(f"cost model {text!r} names {what} ({given[field]!r} and {part!r}); give one "
                             + ("(a table may be a directory)" if field == "table" else "model per component"))
        fields[field], given[field] = value, part

    for raw in _SPEC_SPLIT.split(text.strip()):
        part = raw.strip()
        kind, colon, value = part.partition(":")
        kind = kind.strip().lower()
        if not colon:
            if kind not in COST_MODELS:
                within = f" in {text!r}" if part != text.strip() else ""
                raise ValueError(f"unknown cost model {part!r}{within}; valid names are "
                                 f"{sorted(COST_MODELS)}, or a spec of {_SPEC_GRAMMAR}; or pass a cost model object "
                                 "with compute_ms, collective_ms and copy_ms")
            put("compute", kind, part)
            put("collectives", kind, part)
        elif kind in PART_COST_MODELS:
            name = value.strip().lower()
            if name not in COST_MODELS:
                raise ValueError(f"cost model {text!r}: {part!r} names no model of {kind}; write {kind}:NAME with "
                                 f"NAME one of {sorted(COST_MODELS)}")
            put(kind, name, part)
        elif kind in FILE_COST_MODELS:
            if not value.strip():
                raise ValueError(f"cost model {text!r} names no file after {kind!r}:; write {kind}:PATH")
            put(kind, value.strip(), part)
        else:
            raise ValueError(f"cost model {text!r}: {part!r} is not a part of a spec; valid names are "
                             f"{sorted(COST_MODELS)}, or a spec of {_SPEC_GRAMMAR}")
    stripped = text.strip()
    lone = stripped.lower() if stripped.lower() in COST_MODELS else stripped
    return CostSpec(text=lone, **fields)


def spec_cost_model(spec: CostSpec, cluster: Cluster | None = None, *, hedge: str = "analytic",
                    bandwidth_factor: float = 1.0, name: str | None = None) -> CostModel:
    """The model of ``spec`` on ``cluster`` (default :class:`Cluster`) whose open components
    (:attr:`CostSpec.open_parts`) are priced by the model ``hedge`` (a name of
    :data:`COST_MODELS`), its collectives on the cluster's bandwidths times
    ``bandwidth_factor``: one member of the spec's family (:mod:`scheduler.costs.family`); the
    defaults give :func:`resolve_cost_model`'s model. Its ``name`` is ``name``, else the spec's
    text.

    Files are read once per content: a spec resolved again (every rank, every candidate
    judged, every member of a family) reuses what was read while the file's size and
    modification time are unchanged.

    Raises:
        ValueError: an unknown ``hedge``, or a file that cannot be read
            (:class:`~scheduler.costs.tables.CostTableError`,
            :class:`~scheduler.costs.profiles.ProfileTraceError`; the message names the spec,
            the file, the line and the field).
    """
    cluster = cluster or Cluster()
    if hedge not in COST_MODELS:
        raise ValueError(f"hedge={hedge!r} must be one of {sorted(COST_MODELS)}")
    if spec.compute is None and spec.collectives is None:
        base: CostModel = COST_MODELS[hedge](scale_bandwidth(cluster, bandwidth_factor),
                                             name=family_label(hedge, bandwidth_factor))
    elif spec.compute == spec.collectives:
        base = COST_MODELS[spec.compute](cluster)
    else:
        collectives = (COST_MODELS[spec.collectives](cluster) if spec.collectives is not None else
                       COST_MODELS[hedge](scale_bandwidth(cluster, bandwidth_factor),
                                          name=family_label(hedge, bandwidth_factor)))
        base = ComposedCostModel(compute=COST_MODELS[spec.compute or hedge](cluster), collectives=collectives,
                                 cluster=cluster)
    model: Any = base
    try:
        if spec.table is not None:
            model = TableCostModel(collectives=_read_cached("table", spec.table), fallback=model, cluster=cluster,
                                   name=f"table:{spec.table}")
        if spec.profile is not None:
            model = ProfileCostModel(_read_cached("profile", spec.profile), fallback=model, cluster=cluster,
                                     name=f"profile:{spec.profile}")
    except (CostTableError, ProfileTraceError) as e:
        raise type(e)(f"cost model {spec.text!r}: {e}") from None
    model.name = name or spec.text or model.name
    return model


def resolve_cost_model(spec: "CostModel | str | None", cluster: Cluster | None = None) -> CostModel:
    """The cost model ``spec`` stands for, on ``cluster`` (default :class:`Cluster`).

    Args:
        spec: None (the analytic model), a name of :data:`COST_MODELS` (``"analytic"``,
            ``"torch"``; case and surrounding blanks ignored), a spec of parts
            (:class:`CostSpec`: ``"table:PATH"``, ``"profile:PATH"``,
            ``"compute:torch+table:PATH"``, ...; a component it leaves open is priced by the
            analytic model: :func:`spec_cost_model`), or a cost model object (any object with
            ``compute_ms``, ``collective_ms`` and ``copy_ms``), returned as is.

    Raises:
        ValueError: an unknown name or a bad spec, a file that cannot be read (the message
            names the file, the line and the field), or an object that is not a cost model;
            the message lists the valid names.
    """
    cluster = cluster or Cluster()
    if spec is None:
        return AnalyticCostModel(cluster)
    if isinstance(spec, str):
        return spec_cost_model(parse_cost_spec(spec), cluster)
    missing = [m for m in ("compute_ms", "collective_ms", "copy_ms") if not callable(getattr(spec, m, None))]
    if missing:
        raise ValueError(
            f"cost_model {spec!r} is not a cost model (it lacks {', '.join(missing)}); pass one of the "
            f"names {sorted(COST_MODELS)}, a spec of {_SPEC_GRAMMAR}, or an object with compute_ms, "
            "collective_ms and copy_ms"
        )
    return spec


def cost_model_files(spec: Any) -> list[list[Any]]:
    """``[[path, size, mtime_ns], ...]`` of the files a cost model spec reads (empty for
    anything else): for caches keyed by the cost model's name, which must change when a file
    does."""
    try:
        paths = parse_cost_spec(spec).files if isinstance(spec, str) else ()
    except ValueError:
        return []
    out = []
    for path in paths:
        out += [[p, size, mtime] for p, mtime, size in _file_key(path) or ()]
    return out


def _read_cached(kind: str, path: str) -> Any:
    """The table or trace in ``path``, read once per (path, sizes, modification times)."""
    key = _file_key(path)
    if key is None:  # missing: the reader raises the error that says so
        return _READERS[kind](path)
    return _read_file(kind, path, key)


@functools.lru_cache(maxsize=16)
def _read_file(kind: str, path: str, key: tuple) -> Any:
    return _READERS[kind](path)


_READERS: dict[str, Callable[[str], Any]] = {"table": CollectiveTable.read, "profile": ProfileTrace}


def _file_key(path: str) -> tuple | None:
    p = Path(path)
    try:
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        return tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    except OSError:
        return None


#: ops that only allocate (no kernel touches the bytes)
ALLOC_ONLY_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def moves_no_data(fx_node: Any) -> bool:
    """Whether an FX node moves no data on the device: ``operator.getitem``, views,
    ``aten._unsafe_view`` (a view autograd does not track) and allocations (``aten.empty``)."""
    import operator

    target = getattr(fx_node, "target", None)
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    schema = getattr(target, "_schema", None)
    name = schema.name.split("::")[-1] if schema is not None else ""
    return name == "_unsafe_view" or name in ALLOC_ONLY_OPS


def _check_ms(value: Any, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise ValueError(
            f"cost model returned {value!r} for {what}; it must return a finite time in ms >= 0 "
            "(fix the model or its table)"
        )
    return v


def group_info(dag: nx.DiGraph, group_name: str) -> GroupInfo:
    g = dag.graph["process_groups"][group_name]
    ranks = g.get("ranks")
    return GroupInfo(group_name, int(g["size"]), tuple(ranks) if ranks else None)


#: payloads at which a merged collective's time is tabulated (geometric spacing; linear
#: interpolation between neighbours is within 0.5 % of torch's concave NCCL estimate)
COMM_TABLE_POINTS = 65


def _comm_table(cost_model: CostModel, coll_type: str, gi: GroupInfo, lo: int, hi: int, key: str) -> list[list[float]]:
    """``[[payload_bytes, ms], ...]`` of one collective key, increasing, from ``lo`` to ``hi``."""
    ratio = (hi / lo) ** (1.0 / (COMM_TABLE_POINTS - 1))
    sizes = sorted({int(round(lo * ratio**i)) for i in range(COMM_TABLE_POINTS)} | {lo, hi})
    return [[b, _check_ms(cost_model.collective_ms(coll_type, b, gi), key)] for b in sizes]


def annotate_costs(
    dag: nx.DiGraph,
    cost_model: CostModel,
    cluster: Cluster,
    *,
    fx_nodes: Mapping[str, Any] | None = None,
    coverage_check: CoverageCheck | None = None,
) -> nx.DiGraph:
    """Put ``runtime_ms`` on every node and the bucket cost model on the graph (in place).

    With ``coverage_check``, a model that priced less of the graph from its own data than the
    check's shares is named in a WARNING (:class:`CoverageCheck`); None: no check (a graph
    exported again after a write-back, whose coverage was checked on the traced one).

    Also prices merged collectives, per (collective type, process group): the line
    ``alpha + beta * payload`` through the model's times at the smallest and at the summed
    payload of the graph's collectives of that key (exact for the analytic ring model; the
    linear solver models use it), and a table of the model's own times at
    :data:`COMM_TABLE_POINTS` payloads spaced geometrically over that range, which the
    simulator interpolates (:meth:`solvers.core.problem.Problem.bucket_comm_ms`): torch's NCCL
    estimate is concave in the payload, so the line alone under-prices a block-sized bucket by
    up to 20 % there, and the prediction would disagree with the re-exported graph.

    Records where each price came from: ``dag.graph["cost_sources"]`` (every model:
    :meth:`_Coverage.sources`) and ``dag.graph["cost_coverage"]`` (models that say what they
    measured: :meth:`_Coverage.summary`).

    Raises:
        ValueError: the cost model returned NaN, a negative or a missing time.
    """
    fx_nodes = fx_nodes or {}
    keys: dict[str, list[int]] = {}
    coverage = _Coverage(cost_model, cluster)
    for n, a in dag.nodes(data=True):
        kind = a["kind"]
        if kind == "compute":
            attrs = {**a, "name": n}
            a["runtime_ms"] = _check_ms(cost_model.compute_ms(attrs, fx_nodes.get(n)), f"node {n!r}")
            coverage.compute(attrs, fx_nodes.get(n), a["runtime_ms"])
        elif kind == "collective":
            # all-to-all (expert parallel) too: not movable, but it occupies its group's stream
            if a["coll_type"] in ("all_gather", "reduce_scatter", "all_reduce") or is_all_to_all(a["coll_type"]):
                gi = group_info(dag, a["group_name"])
                a["runtime_ms"] = _check_ms(
                    cost_model.collective_ms(a["coll_type"], a["payload_bytes"], gi), f"collective {n!r}"
                )
                coverage.collective(a["coll_type"], gi, a["runtime_ms"])
                keys.setdefault(f"{a['coll_type']}|{a['group_name']}", []).append(a["payload_bytes"])
            else:
                a["runtime_ms"] = 0.0
        else:
            a["runtime_ms"] = 0.0
    comm_model = {}
    for key, payloads in sorted(keys.items()):
        coll_type, gname = key.split("|", 1)
        gi = group_info(dag, gname)
        lo, hi = max(1, min(payloads)), max(2, sum(payloads))
        if hi <= lo:
            hi = lo * 2
        t_lo = _check_ms(cost_model.collective_ms(coll_type, lo, gi), key)
        t_hi = _check_ms(cost_model.collective_ms(coll_type, hi, gi), key)
        beta = max(0.0, (t_hi - t_lo) / (hi - lo))
        comm_model[key] = {"alpha_ms": max(0.0, t_lo - beta * lo), "beta_ms_per_byte": beta,
                           "table": _comm_table(cost_model, coll_type, gi, lo, hi, key)}
    dag.graph["comm_model"] = comm_model
    # copy_ms is affine in bytes: store it as per-byte rate + a fixed part
    c0 = _check_ms(cost_model.copy_ms(0), "copy of 0 bytes")
    c1 = _check_ms(cost_model.copy_ms(1 << 30), "copy of 1 GiB")
    dag.graph["copy_ms_fixed"] = c0
    dag.graph["copy_ms_per_byte"] = (c1 - c0) / (1 << 30)
    dag.graph["cost_model"] = getattr(cost_model, "name", type(cost_model).__name__)
    dag.graph["cluster"] = cluster.to_json()
    summary = coverage.summary()
    if summary is None:
        dag.graph.pop("cost_coverage", None)
    else:
        dag.graph["cost_coverage"] = summary
    if coverage_check is not None:
        for line in coverage.shortfalls(coverage_check, getattr(cost_model, "name", type(cost_model).__name__)):
            logger.warning("fsdp-sched: %s", line)
    dag.graph["cost_sources"] = coverage.sources(source_of(cost_model, "copy_source"))
    return dag


class _Coverage:
    """What of a DAG a cost model priced from its own data (a profile, a measured table) and
    what it left to its fallback, for models that say (``compute_matched`` /
    ``collective_matched`` returning True or False, as :class:`TableCostModel` with a
    collectives table and :class:`ProfileCostModel` do; None: the model does not say)."""

    def __init__(self, cost_model: CostModel, cluster: Cluster):
        self.cluster = cluster
        self.model = cost_model
        self._compute = getattr(cost_model, "compute_matched", None)
        self._collective = getattr(cost_model, "collective_matched", None)
        self.compute_ms = 0.0
        self.matched_ms = 0.0
        self.compute_said = False
        self.collective_said = False
        self.fallback_groups: dict[tuple[str, str], dict[str, Any]] = {}
        #: collectives the model said of, and those it priced from its data
        self.n_collectives = 0
        self.n_matched = 0
        #: (ms, node name, target) of compute nodes the fallback priced
        self.unmatched: list[tuple[float, str, str]] = []
        #: (source, measured) -> [nodes, ms] of compute
        self.compute_by_source: dict[tuple[str, bool], list[Any]] = {}
        #: (group, collective type, source, measured) -> [collectives, ms, group size, nodes]
        self.collectives_by_source: dict[tuple[str, str, str, bool], list[Any]] = {}

    def compute(self, attrs: Mapping[str, Any], fx_node: Any, runtime_ms: float) -> None:
        self.compute_ms += runtime_ms
        said = self._compute(attrs, fx_node) if callable(self._compute) else None
        if said is not None:
            self.compute_said = True
            if said:
                self.matched_ms += runtime_ms
            else:
                self.unmatched.append((runtime_ms, str(attrs.get("name")), str(attrs.get("target"))))
        entry = self.compute_by_source.setdefault(
            (source_of(self.model, "compute_source", attrs, fx_node), bool(said)), [0, 0.0])
        entry[0] += 1
        entry[1] += runtime_ms

    def collective(self, coll_type: str, group: GroupInfo, runtime_ms: float = 0.0) -> None:
        said = self._collective(coll_type, group) if callable(self._collective) else None
        entry = self.collectives_by_source.setdefault(
            (group.name, coll_type, source_of(self.model, "collective_source", coll_type, group), bool(said)),
            [0, 0.0, group.size, group.n_nodes(self.cluster)])
        entry[0] += 1
        entry[1] += runtime_ms
        if said is None:
            return
        self.collective_said = True
        self.n_collectives += 1
        self.n_matched += bool(said)
        if not said:
            self.fallback_groups.setdefault((group.name, coll_type), {
                "group_name": group.name, "coll_type": coll_type, "group_size": group.size,
                "nodes": group.n_nodes(self.cluster)})

    def shortfalls(self, check: CoverageCheck, model_name: str) -> list[str]:
        """One line per share below ``check``'s: how much the model priced from its data and
        why it priced no more."""
        lines = []
        if self.collective_said and self.n_matched < check.min_collective_share * self.n_collectives:
            needs = "; ".join(f"{g['coll_type']} on group {g['group_name']!r}: {_ranks_over(g['group_size'], g['nodes'])}"
                              for g in self.fallback_groups.values())
            keys = _ask(self.model, "collective_keys") or []
            has = "; ".join(f"{c} on {_ranks_over(n, nodes)}" for c, n, nodes in keys) or "no collective rows"
            lines.append(
                f"cost model {model_name!r} priced {self.n_matched} of {self.n_collectives} collectives "
                f"({self.n_matched / self.n_collectives:.0%}) from its data, less than "
                f"CoverageCheck.min_collective_share {check.min_collective_share:.0%}; its fallback prices the "
                f"rest. The graph needs {needs}; the data has {has}: measure the table on the job's own "
                "groups (fsdp-sched measure)")
        share = self.matched_ms / self.compute_ms if self.compute_ms > 0 else None
        if self.compute_said and share is not None and share < check.min_compute_share:
            largest = sorted(self.unmatched, reverse=True)[:3]
            lines.append(
                f"cost model {model_name!r} priced {share:.1%} of compute time from its data, less than "
                f"CoverageCheck.min_compute_share {check.min_compute_share:.0%}; its fallback prices the rest. "
                f"Not priced, the largest: {', '.join(f'{n} ({t}, {fmt_ms(ms)})' for ms, n, t in largest)}: "
                "was the profile recorded from this model, at these shapes, with record_shapes=True?")
        return lines

    def summary(self) -> dict[str, Any] | None:
        """``cost_coverage`` of the DAG: ``compute_ms`` (all compute), ``compute_matched_ms``
        and ``compute_matched_share`` (priced from the model's data; None when the model does
        not say, the share also when there is no compute time), ``fallback_groups`` (one
        record per process group and collective type priced by the fallback: group_name,
        coll_type, group_size, nodes; None when the model does not say). None for a model
        that says neither."""
        if not self.compute_said and not self.collective_said:
            return None
        matched = self.compute_said
        return {
            "compute_ms": self.compute_ms,
            "compute_matched_ms": self.matched_ms if matched else None,
            "compute_matched_share": self.matched_ms / self.compute_ms if matched and self.compute_ms > 0 else None,
            "fallback_groups": ([self.fallback_groups[k] for k in sorted(self.fallback_groups)]
                                if self.collective_said else None),
        }

    def sources(self, copy_source: str) -> dict[str, Any]:
        """``cost_sources`` of the DAG, for any model: what priced each cost component.
        ``compute``: one record per source (``source``: the model or file that priced the
        nodes, ``measured``: whether from measured data, ``nodes``, ``ms``); ``collectives``: one
        record per process group, collective type and source (``group_name``, ``coll_type``,
        ``group_size``, ``nodes``: the nodes its ranks span, ``source``, ``measured``,
        ``count``, ``ms``); ``copies``: ``{"source": ...}`` of the bucket copies."""
        compute = [{"source": src, "measured": measured, "nodes": n, "ms": ms}
                   for (src, measured), (n, ms) in sorted(self.compute_by_source.items(), key=lambda kv: (not kv[0][1], kv[0][0]))]
        collectives = [{"group_name": g, "coll_type": c, "group_size": size, "nodes": nodes, "source": src,
                        "measured": measured, "count": n, "ms": ms}
                       for (g, c, src, measured), (n, ms, size, nodes) in sorted(
                           self.collectives_by_source.items(), key=lambda kv: (kv[0][0], kv[0][1], not kv[0][3],
                                                                                  kv[0][2]))]
        return {"compute": compute, "collectives": collectives, "copies": {"source": copy_source}}
