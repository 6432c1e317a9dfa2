"""Synthetic cost-annotated DAGs, built by hand without torch.

Two tools, both producing DAGs with exactly the node and graph attributes of the schema in
:mod:`scheduler.export.dag` (so that :func:`scheduler.export.dagfile.validate_dag`, :class:`solvers.Problem`, the
simulator and the validator accept them like exported graphs):

- :func:`make_fsdp_dag`: an FSDP-like forward or backward graph of a decoder with ``n_layers``
  transformer blocks, parameters named like LLaMA's (``layers.3.attention.wq.weight``), costs
  from :class:`scheduler.costs.models.AnalyticCostModel` through :func:`scheduler.costs.annotate.annotate_costs`
  (so the bucket cost line ``comm_model`` is fitted exactly as for exported graphs).
- :class:`DagBuilder`: a few-line way to draw an arbitrary small DAG in a test::

      b = DagBuilder()
      b.add_input("x", size_bytes=100)
      b.add_input("primals_1", size_bytes=25, releasable=False)
      w = b.add_collective("ag", "primals_1", runtime_ms=2.0, payload_bytes=25, size_bytes=100)
      b.add_compute("mm", "x", w, runtime_ms=1.0, size_bytes=100)
      b.add_output("mm")
      dag = b.build()

Neither imports torch: :mod:`scheduler.costs.models` and :mod:`scheduler.export.dag` import it only inside
the functions that need an FX graph.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from scheduler.costs.annotate import annotate_costs
from scheduler.costs.hardware import Cluster
from scheduler.costs.models import AnalyticCostModel, TableCostModel
from scheduler.export.dag import NODE_DEFAULTS
from scheduler.export.dagfile import validate_dag
from scheduler.export.schema import SCHEMA, SCHEMA_VERSION

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: parameter names of one LLaMA transformer block, in registration (FSDP2 payload) order
LLAMA_BLOCK_PARAMS = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
    "attention_norm.weight",
    "ffn_norm.weight",
)

_AG_TARGET = "_c10d_functional.all_gather_into_tensor.default"
_RS_TARGET = "_c10d_functional.reduce_scatter_tensor.default"
_AR_TARGET = "_c10d_functional.all_reduce.default"
_WAIT_TARGET = "_c10d_functional.wait_tensor.default"
_CAST_TARGET = "aten._to_copy.default"
_COLL_TARGETS = {"all_gather": _AG_TARGET, "reduce_scatter": _RS_TARGET, "all_reduce": _AR_TARGET}


# --------------------------------------------------------------------------------------------
# DagBuilder
# --------------------------------------------------------------------------------------------
class DagBuilder:
    """Build a small schema-valid DAG node by node, in execution order.

    Every ``add_*`` method appends one node (the graph order is the call order) and returns the
    name that consumers should read: the node itself, or for :meth:`add_collective` its wait.
    Runtimes given explicitly are kept as they are; ``None`` asks the analytic cost model of
    :meth:`build`'s ``cluster``.

    Args:
        name: stored as the DAG's ``name``.
        graph_kind: "forward", "backward" or "unknown".
        group_size: size of process groups not listed in ``group_sizes``.
        group_sizes: process group name -> size.
    """

    def __init__(
        self,
        name: str = "test",
        *,
        graph_kind: str = "unknown",
        group_size: int = 4,
        group_sizes: Mapping[str, int] | None = None,
    ):
        self._name = name
        self._graph_kind = graph_kind
        self._group_size = group_size
        self._group_sizes = dict(group_sizes or {})
        self._nodes: dict[str, dict[str, Any]] = {}
        self._edges: list[tuple[str, str]] = []
        #: node name -> explicit runtime (ms)
        self._runtime: dict[str, float] = {}

    # ---- nodes ----------------------------------------------------------------------------
    def _add(self, name: str, inputs: Sequence[str], **attrs: Any) -> str:
        if name in self._nodes:
            raise ValueError(f"node {name!r} added twice")
        for u in inputs:
            if u not in self._nodes:
                raise ValueError(f"node {name!r} reads {u!r}, which is not added yet")
        base = {"index": len(self._nodes), "target": "placeholder", **NODE_DEFAULTS}
        base.update(attrs)
        self._nodes[name] = base
        self._edges.extend((u, name) for u in inputs)
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def _root(self, name: str) -> str:
        return self._nodes[name]["alias_of"] or name

    def add_input(self, name: str, *, size_bytes: int, releasable: bool = True, dtype: str = "float32") -> str:
        """A graph input of ``size_bytes``; ``releasable=False`` pins it (parameter shards)."""
        return self._add(name, (), kind="input", size_bytes=int(size_bytes), releasable=releasable, dtype=dtype)

    def add_compute(
        self,
        name: str,
        *inputs: str,
        runtime_ms: float | None = None,
        size_bytes: int = 0,
        target: str = "aten.mm.default",
        flops: int = 0,
        dtype: str | None = "bfloat16",
    ) -> str:
        """A compute node reading ``inputs``, producing ``size_bytes``, running ``runtime_ms``
        (None: roofline of ``flops`` and the bytes read and written)."""
        accessed = int(size_bytes) + sum(int(self._nodes[self._root(u)]["size_bytes"]) for u in inputs)
        if runtime_ms is not None:
            self._runtime[name] = float(runtime_ms)
        return self._add(
            name,
            inputs,
            kind="compute",
            target=target,
            size_bytes=int(size_bytes),
            flops=int(flops),
            bytes_accessed=accessed,
            dtype=dtype,
        )

    def add_view(self, name: str, base: str, *, target: str = "aten.t.default") -> str:
        """A view of ``base``: no new storage, no runtime."""
        root = self._root(base)
        a = self._nodes[root]
        return self._add(
            name, (base,), kind="view", target=target, size_bytes=int(a["size_bytes"]), alias_of=root, dtype=a["dtype"]
        )

    def add_collective(
        self,
        name: str,
        inp: str,
        *,
        coll_type: str = "all_gather",
        group: str = "0",
        payload_bytes: int | None = None,
        size_bytes: int | None = None,
        runtime_ms: float | None = None,
        fqn: str | None = None,
        param_index: int | None = None,
        dtype: str | None = "bfloat16",
        reduce_op: str | None = None,
        movable: bool = True,
        cast_ms: float | None = None,
        cast: bool = False,
        wait: str | None = None,
    ) -> str:
        """A collective on ``inp`` plus its wait; returns the wait's name.

        Args:
            coll_type: "all_gather", "reduce_scatter" or "all_reduce".
            group: process group name; its size comes from the builder.
            payload_bytes: per-rank input bytes (default: ``inp``'s size).
            size_bytes: per-rank output bytes (default: ``payload * size`` for an all-gather,
                ``payload / size`` for a reduce-scatter, ``payload`` for an all-reduce).
            runtime_ms: communication time (None: NCCL ring model of the cluster).
            fqn: parameter FQN, e.g. ``"layers.0.attention.wq.weight"``.
            reduce_op: default "sum" for reduce-scatter and all-reduce.
            movable: whether the scheduler may bucket and move it.
            cast, cast_ms: insert a dtype cast ``<name>_cast`` as the collective's prologue
                (it runs with the issue, for ``cast_ms``, None: roofline).
            wait: name of the wait node (default ``<name>_wait``).
        """
        gsize = self._group_sizes.get(group, self._group_size)
        payload = int(payload_bytes if payload_bytes is not None else self._nodes[self._root(inp)]["size_bytes"])
        if size_bytes is None:
            size_bytes = {"all_gather": payload * gsize, "reduce_scatter": payload // max(gsize, 1)}.get(
                coll_type, payload
            )
        if reduce_op is None and coll_type in ("reduce_scatter", "all_reduce"):
            reduce_op = "sum"
        prologue: list[str] = []
        src = inp
        if cast or cast_ms is not None:
            src = self.add_compute(
                f"{name}_cast", inp, runtime_ms=cast_ms, size_bytes=payload, target=_CAST_TARGET, dtype=dtype
            )
            self._nodes[src]["moves_with"] = name
            prologue = [src]
        if runtime_ms is not None:
            self._runtime[name] = float(runtime_ms)
        wait = wait or f"{name}_wait"
        self._add(
            name,
            (src,),
            kind="collective",
            target=_COLL_TARGETS.get(coll_type, coll_type),
            size_bytes=int(size_bytes),
            dtype=dtype,
            coll_type=coll_type,
            group_name=group,
            group_size=gsize,
            reduce_op=reduce_op,
            payload_bytes=payload,
            fqns=[fqn] if fqn else [],
            param_index=param_index,
            role="fsdp" if movable else "other",
            wait=wait,
            prologue=prologue,
            movable=movable,
        )
        return self._add(
            wait,
            (name,),
            kind="wait",
            target=_WAIT_TARGET,
            size_bytes=int(size_bytes),
            alias_of=name,
            dtype=dtype,
            collective=name,
        )

    def add_output(self, *inputs: str, name: str = "output") -> str:
        """The graph output, reading ``inputs`` (they are never freed)."""
        return self._add(name, inputs, kind="output", target="output")

    # ---- build ----------------------------------------------------------------------------
    def build(
        self,
        *,
        cluster: Cluster | None = None,
        comm_model: Mapping[str, tuple[float, float]] | None = None,
        copy_ms_per_byte: float | None = None,
        copy_ms_fixed: float | None = None,
    ) -> nx.DiGraph:
        """The DAG, with costs and the graph attributes of the schema.

        Costs: :func:`scheduler.costs.annotate.annotate_costs` with the analytic model of ``cluster``
        (default :class:`Cluster`), then explicit runtimes override. ``comm_model`` maps
        ``"<coll_type>|<group>"`` to ``(alpha_ms, beta_ms_per_byte)``; a key not given is
        fitted by ``annotate_costs``, except when all of its collectives have explicit
        runtimes: then it is left out, and a merged bucket costs the sum of its members
        (:meth:`solvers.Problem.bucket_comm_ms`). ``copy_ms_per_byte`` / ``copy_ms_fixed``
        override the merge copy cost (default: the analytic model's).
        """
        cluster = cluster or Cluster()
        dag = nx.DiGraph(
            schema=SCHEMA,
            version=SCHEMA_VERSION,
            name=self._name,
            graph_kind=self._graph_kind,
            order=list(self._nodes),
            process_groups={},
        )
        for n, a in self._nodes.items():
            dag.add_node(n, **{k: (list(v) if isinstance(v, list) else v) for k, v in a.items()})
        dag.add_edges_from(self._edges)
        groups = dag.graph["process_groups"]
        explicit_keys: dict[str, bool] = {}
        for n, a in dag.nodes(data=True):
            if a["kind"] == "collective":
                groups.setdefault(a["group_name"], {"size": a["group_size"], "ranks": None})
                key = f"{a['coll_type']}|{a['group_name']}"
                explicit_keys[key] = explicit_keys.get(key, True) and n in self._runtime
        compute_table = {n: ms for n, ms in self._runtime.items() if self._nodes[n]["kind"] == "compute"}
        annotate_costs(dag, TableCostModel(compute_table, fallback=AnalyticCostModel(cluster)), cluster)
        for n, ms in self._runtime.items():
            dag.nodes[n]["runtime_ms"] = ms
        cm = dag.graph["comm_model"]
        for key, explicit in explicit_keys.items():
            if explicit:
                cm.pop(key, None)
        for key, (alpha, beta) in (comm_model or {}).items():
            cm[key] = {"alpha_ms": float(alpha), "beta_ms_per_byte": float(beta)}
        if copy_ms_per_byte is not None:
            dag.graph["copy_ms_per_byte"] = float(copy_ms_per_byte)
        if copy_ms_fixed is not None:
            dag.graph["copy_ms_fixed"] = float(copy_ms_fixed)
        dag.graph["cost_model"] = "builder"
        validate_dag(dag, source=f"DagBuilder({self._name!r})")
        return dag


# --------------------------------------------------------------------------------------------
# FSDP-like graphs
# --------------------------------------------------------------------------------------------
def make_fsdp_dag(
    *,
    n_layers: int,
    params_per_layer: int = 4,
    param_bytes: int = 16 << 20,
    compute_ms_per_node: float = 0.5,
    graph_kind: str = "forward",
    world_size: int = 8,
    reshard_after_forward: bool = False,
    n_groups: int = 1,
    seed: int | None = None,
    cluster: Cluster | None = None,
    activation_bytes: int = 8 << 20,
    param_dtype: str = "bfloat16",
    with_embeddings: bool = True,
    name: str | None = None,
) -> nx.DiGraph:
    """An FSDP-like forward or backward graph of a decoder, cost-annotated.

    Parameters, in registration order: ``tok_embeddings.weight``, then per block ``L`` the
    first ``params_per_layer`` of :data:`LLAMA_BLOCK_PARAMS` as ``layers.L.<name>`` (more
    than nine are named ``layers.L.extra<j>.weight``), then ``norm.weight`` and
    ``output.weight`` (those three only with ``with_embeddings``). Each parameter ``k`` is
    consumed by one forward compute node (embedding / mul / mm) reading the previous activation.

    Forward, per parameter (as traced, every all-gather right before its use)::

        primals_k (fp32 shard, pinned) -> _to_copy_k (cast, prologue) -> all_gather_k -> wait_k
        h_{k-1}, wait_k -> <op>_k (compute_ms_per_node, activation_bytes) -> h_k

    The output reads every activation (saved for backward) and, without
    ``reshard_after_forward``, every all-gathered parameter.

    Backward, per parameter in reverse order::

        [reshard_after_forward: primals_k -> cast -> all_gather_k -> wait_k (re-gather)]
        dh_k, W_k -> grad_in_k (mm) -> dh_{k-1}          (skipped for the first parameter)
        dh_k, saved h_{k-1} -> grad_w_k (mm, full-size gradient) -> reduce_scatter_k -> wait
        -> output

    Args:
        n_layers: transformer blocks (>= 1).
        params_per_layer: parameters per block (>= 1).
        param_bytes: unsharded size of each parameter in ``param_dtype`` (bytes). With
            ``seed``, each parameter's size is drawn uniformly from [param_bytes/4, 2*param_bytes].
        compute_ms_per_node: runtime of every mm-like node (ms); with ``seed``, each is drawn
            from [0.5, 1.5] times it. Casts cost their analytic roofline.
        graph_kind: "forward" or "backward".
        world_size: size of every (data-parallel) process group.
        reshard_after_forward: forward frees the gathered parameters; backward re-gathers them.
        n_groups: process groups "0".."n_groups-1"; parameter ``k`` uses group ``k % n_groups``.
        seed: draw sizes and runtimes from ``random.Random(seed)``; None: all equal.
        cluster: topology for collective costs (default :class:`Cluster`: 8 GPUs per node).
        activation_bytes: size of every activation and activation gradient (bytes).
        param_dtype: "bfloat16" (fp32 shards cast before the all-gather, as FSDP2 mixed
            precision) or "float32" (no cast).
        with_embeddings: include the non-block parameters.
        name: the DAG's name (default ``"synthetic-<graph_kind>"``).
    """
    _check_fsdp_args(n_layers, params_per_layer, graph_kind, world_size, n_groups, param_dtype, param_bytes,
                     activation_bytes, compute_ms_per_node)
    g = _FsdpGraph(
        n_layers=n_layers, params_per_layer=params_per_layer, param_bytes=param_bytes,
        compute_ms_per_node=compute_ms_per_node, graph_kind=graph_kind, world_size=world_size, n_groups=n_groups,
        rng=random.Random(seed) if seed is not None else None, activation_bytes=activation_bytes,
        param_dtype=param_dtype, with_embeddings=with_embeddings, name=name,
    )
    if graph_kind == "forward":
        g.forward(reshard_after_forward)
    else:
        g.backward(reshard_after_forward)
    # collectives have no explicit runtimes: annotate_costs prices them and fits comm_model
    dag = g.b.build(cluster=cluster or Cluster(n_gpus=max(world_size, 8)))
    dag.graph["cost_model"] = "synthetic"
    logger.debug("synthetic %s DAG: %d nodes, %d parameters", graph_kind, dag.number_of_nodes(), len(g.fqns))
    return dag


def _check_fsdp_args(n_layers, params_per_layer, graph_kind, world_size, n_groups, param_dtype, param_bytes,
                     activation_bytes, compute_ms_per_node) -> None:
    if n_layers < 1 or params_per_layer < 1:
        raise ValueError(f"need n_layers >= 1 and params_per_layer >= 1, got {n_layers}, {params_per_layer}")
    if graph_kind not in ("forward", "backward"):
        raise ValueError(f"graph_kind must be 'forward' or 'backward', got {graph_kind!r}")
    if world_size < 1 or n_groups < 1:
        raise ValueError(f"need world_size >= 1 and n_groups >= 1, got {world_size}, {n_groups}")
    if param_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"param_dtype must be 'bfloat16' or 'float32', got {param_dtype!r}")
    if param_bytes <= 0 or activation_bytes <= 0 or compute_ms_per_node < 0:
        raise ValueError("param_bytes and activation_bytes must be > 0, compute_ms_per_node >= 0")


class _FsdpGraph:
    """The builder of :func:`make_fsdp_dag`: parameters, their sizes, and the two graph kinds."""

    def __init__(self, *, n_layers: int, params_per_layer: int, param_bytes: int, compute_ms_per_node: float,
                 graph_kind: str, world_size: int, n_groups: int, rng: random.Random | None, activation_bytes: int,
                 param_dtype: str, with_embeddings: bool, name: str | None):
        self.graph_kind, self.world_size, self.n_groups = graph_kind, world_size, n_groups
        self.rng, self.compute_ms_per_node = rng, compute_ms_per_node
        self.activation_bytes, self.param_dtype = activation_bytes, param_dtype
        self.fqns = []
        if with_embeddings:
            self.fqns.append("tok_embeddings.weight")
        for layer in range(n_layers):
            for j in range(params_per_layer):
                leaf = LLAMA_BLOCK_PARAMS[j] if j < len(LLAMA_BLOCK_PARAMS) else f"extra{j}.weight"
                self.fqns.append(f"layers.{layer}.{leaf}")
        if with_embeddings:
            self.fqns += ["norm.weight", "output.weight"]
        self.elem = _DTYPE_BYTES[param_dtype]
        self.full_elems: list[int] = []
        for _ in self.fqns:
            nbytes = rng.randint(max(1, param_bytes // 4), 2 * param_bytes) if rng else param_bytes
            # whole elements, divisible by the world size, so that every shard is equal
            self.full_elems.append(max(world_size, math.ceil(nbytes / self.elem / world_size) * world_size))
        self.b = DagBuilder(name or f"synthetic-{graph_kind}", graph_kind=graph_kind, group_size=world_size)
        self.b.add_input("primals_tokens", size_bytes=activation_bytes // 4, releasable=False, dtype="int64")

    def compute_ms(self) -> float:
        return self.compute_ms_per_node * (self.rng.uniform(0.5, 1.5) if self.rng else 1.0)

    def gather(self, k: int) -> str:
        """primals_k -> (cast) -> all-gather -> wait; returns the wait."""
        b, world = self.b, self.world_size
        shard = self.full_elems[k] // world
        src = f"primals_{k + 1}"
        if src not in b:
            b.add_input(src, size_bytes=shard * 4, releasable=False, dtype="float32")
        suffix = f"{k}" if self.graph_kind == "forward" else f"bw_{k}"
        return b.add_collective(
            f"all_gather_into_tensor_{suffix}", src, group=str(k % self.n_groups), payload_bytes=shard * self.elem,
            size_bytes=self.full_elems[k] * self.elem, fqn=self.fqns[k], param_index=k, dtype=self.param_dtype,
            cast=self.param_dtype != "float32", wait=f"wait_tensor_{suffix}",
        )

    def op_of(self, k: int) -> str:
        f = self.fqns[k]
        if f.startswith("tok_embeddings"):
            return "aten.embedding.default"
        return "aten.mul.Tensor" if "norm" in f else "aten.mm.default"

    def forward(self, reshard_after_forward: bool) -> None:
        b = self.b
        h = "primals_tokens"
        saved: list[str] = []
        full: list[str] = []
        tokens = max(1, self.activation_bytes // self.elem // 4096)  # for a hidden size of 4096
        for k in range(len(self.fqns)):
            w = self.gather(k)
            full.append(w)
            op = self.op_of(k)
            h = b.add_compute(
                f"{op.split('.')[1]}_{k}", h, w, runtime_ms=self.compute_ms(), size_bytes=self.activation_bytes,
                target=op, flops=2 * tokens * self.full_elems[k] if op == "aten.mm.default" else 0,
                dtype=self.param_dtype,
            )
            saved.append(h)
        b.add_output(*saved, *([] if reshard_after_forward else full))

    def backward(self, reshard_after_forward: bool) -> None:
        b, n, dt = self.b, len(self.fqns), self.param_dtype
        saved_h = ["primals_tokens"]
        for k in range(n - 1):
            saved_h.append(b.add_input(f"saved_h_{k}", size_bytes=self.activation_bytes, dtype=dt))
        saved_w: dict[int, str] = {}
        if not reshard_after_forward:
            for k in range(1, n):
                saved_w[k] = b.add_input(f"saved_w_{k}", size_bytes=self.full_elems[k] * self.elem, dtype=dt)
        dh = b.add_input("tangents_1", size_bytes=self.activation_bytes, dtype=dt)
        grads: list[str] = []
        for k in reversed(range(n)):
            if k > 0:
                w = self.gather(k) if reshard_after_forward else saved_w[k]
                dh_next = b.add_compute(f"grad_in_{k}", dh, w, runtime_ms=self.compute_ms(),
                                        size_bytes=self.activation_bytes, dtype=dt)
            else:
                dh_next = dh
            gw = b.add_compute(f"grad_w_{k}", dh, saved_h[k], runtime_ms=self.compute_ms(),
                               size_bytes=self.full_elems[k] * self.elem, dtype=dt)
            grads.append(b.add_collective(
                f"reduce_scatter_tensor_{k}", gw, coll_type="reduce_scatter", group=str(k % self.n_groups),
                payload_bytes=self.full_elems[k] * self.elem,
                size_bytes=self.full_elems[k] // self.world_size * self.elem, fqn=self.fqns[k], param_index=k,
                dtype=dt, wait=f"wait_tensor_rs_{k}",
            ))
            dh = dh_next
        b.add_output(*grads)
