"""Cost models: what puts ``runtime_ms`` on every DAG node before any solve.

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
- :class:`AnalyticCostModel`: roofline from FLOPs and bytes on a
  :class:`~scheduler.costs.hardware.GPUSpec`, NCCL ring alpha-beta over a
  :class:`~scheduler.costs.hardware.Cluster` topology.
- :class:`TableCostModel`: measured collective times (a CSV or nccl-tests output,
  :mod:`scheduler.costs.tables`), a user table or callable, falling back to another model.
- :class:`ProfileCostModel`: compute times from a torch.profiler trace of one step
  (:mod:`scheduler.costs.profiles`), falling back to another model.

Elsewhere: torch's own estimators (:class:`scheduler.costs.torch_model.TorchCostModel`), models
timed on the current device (:class:`scheduler.costs.measure.MeasuredCostModel`), and models
composed of parts of others or named by a spec (:mod:`scheduler.costs.spec`).

Models that price some nodes from data and leave the rest to a fallback say which
(``compute_matched(attrs, fx_node)``, ``collective_matched(coll_type, group)``); they may also
say what priced each part (``compute_source(attrs, fx_node)``, ``collective_source(coll_type,
group)``, ``copy_source()``: the name of a model or a file; the model's ``name`` when it does
not say). :func:`scheduler.costs.annotate.annotate_costs` records both in the DAG.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.profiles import ProfileTrace
from scheduler.costs.tables import CollectiveTable

if TYPE_CHECKING:
    import torch.fx


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


class TableCostModel:
    """User-supplied costs: measured collective times, a compute table and/or callables.

    - ``collectives``: a :class:`~scheduler.costs.tables.CollectiveTable` of measured times
      (:meth:`from_file` reads one from a CSV or nccl-tests output), looked up by collective,
      group size, the nodes the group's ranks span (:meth:`GroupInfo.n_nodes` on ``cluster``)
      and the per-rank input bytes; log-log interpolation between rows, bandwidth scaling
      above them, the smallest row's time below them (see :class:`~scheduler.costs.tables.CollectiveTable`). A group without a
      row falls back, and :func:`~scheduler.costs.annotate.annotate_costs` records it in the
      DAG's ``cost_coverage`` (``ScheduleReport.cost_coverage["fallback_groups"]``).
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
        return ask_model(self._fallback, "compute_matched", attrs, fx_node)

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        """With a collectives table: whether it has a row for ``coll_type`` on ``group``
        (else a fallback's measured data may price it); None without a table, unless the
        fallback says."""
        if self._collective is not None:
            return None
        if self.collectives is not None and self.collectives.covers(coll_type, group.size, group.n_nodes(self.cluster)):
            return True
        said = ask_model(self._fallback, "collective_matched", coll_type, group)
        if self.collectives is None:
            return said
        return bool(said)

    def collective_keys(self) -> list[tuple[str, int, int]]:
        """(collective, group size, nodes) of every key the measured data holds (for messages)."""
        own = self.collectives.keys() if self.collectives is not None else []
        return sorted({*own, *(ask_model(self._fallback, "collective_keys") or ())})
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
    measurements too). :func:`~scheduler.costs.annotate.annotate_costs` records the share of
    compute time that was matched in the DAG's ``cost_coverage`` (``ScheduleReport.cost_coverage``).

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
        return bool(ask_model(self._fallback, "compute_matched", attrs, fx_node))

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        """True where the trace ran collectives of this kind, else the fallback's answer."""
        if self.collectives and self.trace.has_collectives(coll_type):
            return True
        return ask_model(self._fallback, "collective_matched", coll_type, group)

    def collective_keys(self) -> list[tuple[str, int, int]]:
        """The fallback's measured keys (the trace's collectives name no group)."""
        return list(ask_model(self._fallback, "collective_keys") or ())


def ask_model(model: Any, method: str, *args: Any) -> Any:
    """``model.method(*args)`` when the model has that coverage method, else None."""
    fn = getattr(model, method, None)
    return fn(*args) if callable(fn) else None


def source_of(model: Any, method: str, *args: Any) -> str:
    """What priced a part (``method``: ``"compute_source"``, ``"collective_source"`` or
    ``"copy_source"``): the model's answer, or its ``name`` for a model that does not say."""
    said = ask_model(model, method, *args)
    return str(said) if said is not None else str(getattr(model, "name", type(model).__name__))


def model_name(model: Any) -> str:
    return str(getattr(model, "name", type(model).__name__))
