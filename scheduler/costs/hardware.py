"""The machine a schedule is priced for: GPU peak numbers (:class:`GPUSpec`), the cluster's
topology and link figures (:class:`Cluster`), and a process group as a cost model sees it
(:class:`GroupInfo`).

Topology: a process group is priced by the nodes its ranks span (:meth:`GroupInfo.n_nodes`:
from the group's real ranks, recorded at export from the initialised process group, and the
cluster's GPUs per node; else ``ceil(size / gpus_per_node)``), never by its size alone, in
every cost model (torch's NCCL estimator included,
:func:`scheduler.costs.torch_model.torch_nccl_topology`). :func:`graph_topology` reads the
topology an exported DAG was priced on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import networkx as nx


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


def scale_bandwidth(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with its intra- and inter-node bus bandwidths multiplied by ``factor``."""
    return dataclasses.replace(cluster, intra_node_gbps=cluster.intra_node_gbps * factor,
                               inter_node_gbps=cluster.inter_node_gbps * factor)
