"""Export: FX graph -> cost-annotated networkx DAG, and its versioned JSON round-trip.

The DAG is the only thing solvers see. Its schema (``SCHEMA_VERSION``; the loader checks a file
against it field by field, :mod:`scheduler.export.schema`):

Graph attributes (``dag.graph``):
    schema (str): always ``"fsdp-sched/dag"``; version (int): ``SCHEMA_VERSION``.
    name (str), graph_kind (str): ``"forward"``, ``"backward"``, ``"joint"`` (forward, loss
        and backward in one graph: make_fx of a training step) or ``"unknown"``.
    order (list[str]): node names in graph (execution) order.
    process_groups (dict): group name -> {"size": int, "ranks": list[int] | None}: the ranks
        from the initialised process group in which the group's name resolves (None where it
        does not: the group is then priced as ``size`` consecutive ranks).
    world_size (int | None): ranks of the world the groups live in (the initialised default
        group's size, else one more than the largest rank named); None when unknown.
    cluster (dict): the :class:`scheduler.costs.hardware.Cluster` the costs were computed for.
    cost_model (str): name of the cost model.
    cost_sources (dict): what priced each cost component (compute, each group's collectives,
        bucket copies) and whether it was measured (:func:`scheduler.costs.annotate.annotate_costs`).
    comm_model (dict): "<coll_type>|<group_name>" -> {"alpha_ms": float,
        "beta_ms_per_byte": float}: time of a merged collective of ``payload_bytes`` is
        ``alpha_ms + beta_ms_per_byte * payload_bytes`` (fitted from the cost model; the
        linear solver models use it), and "table": ``[[payload_bytes, ms], ...]``, the cost
        model's own times, which the simulator interpolates (optional).
    copy_ms_per_byte (float): compute-stream time per byte copied into or out of a bucket.

Node attributes (key = FX node name):
    kind (str): "input" (placeholder / get_attr), "output", "compute", "view" (no new storage),
        "collective", "wait".
    index (int): position in graph order.
    target (str): op name, e.g. "aten.mm.default".
    runtime_ms (float): compute-stream time (compute), communication time (collective),
        0 for everything else.
    size_bytes (int): bytes of the node's output tensors (0 for non-tensors). For collectives,
        the bytes allocated at issue: 0 when the collective writes into a buffer it is given
        (``all_gather_into_tensor_out``; ``alias_of`` names the buffer).
    alias_of (str | None): for nodes whose output shares another node's storage (views,
        ``getitem``, ``_unsafe_view``, waits, in-place ops such as ``copy_``, and collectives
        that write into a given buffer such as ``all_gather_into_tensor_out``), the node that
        owns that storage; None when the node allocates its output.
    output_bytes (list[int], compute nodes returning a tuple or list only): bytes of each of
        its results (top-level elements). Each result is a storage of its own: one that nothing
        but the node's ``getitem`` nodes reads is freed after them, while its siblings live on
        (torch's ``MemoryTracker`` counts them so). ``size_bytes`` is their sum.
    output_alias (list[str | None], optional beside ``output_bytes``): per result, the argument
        the op writes it into (``Tensor(a!)`` results: ``topk.values``'s ``values=`` and
        ``indices=``); such a result is that argument's storage and has 0 in ``output_bytes``.
    output_index (int, on nodes with ``alias_of`` only): the result of the multi-output node
        ``alias_of`` that this node's storage is (a ``getitem`` and views of it); without it a
        node holds every result of that node.
    releasable (bool): for inputs, whether the graph may free it after its last use.
    flops (int), bytes_accessed (int): for compute nodes, used by roofline cost models.
    dtype (str | None): dtype of the (first) output tensor.
    moves_with (str | None): name of the collective this node is a prologue or epilogue of:
        a prologue is a view or dtype cast whose only user is that collective (it moves with the
        issue); an epilogue is a chain of views / dtype casts from the collective's wait whose
        only reader is the graph output (e.g. the fp32 cast of a bf16 reduce-scatter's result;
        it moves with the wait).
    Collective nodes also carry: coll_type ("all_gather", "reduce_scatter", "all_reduce",
        or the op name for unmodelled ones), group_name, group_size, reduce_op (str | None),
        payload_bytes (per-rank input bytes), fqns (list[str]), param_index (int | None),
        role ("fsdp", "tp" or "other"), wait (name of its wait node), prologue (list[str]),
        epilogue (list[str]),
        movable (bool: the scheduler may bucket and move it; fixed collectives keep their
        traced issue and wait positions).
        block (int | None: index of the collective's block in forward execution order, None
        outside any repeated block), phase ("forward" | "backward" | None: the direction it
        runs in, which tells a joint graph's forward gathers from its backward re-gathers),
        structure_source (str | None): see scheduler/structure.py.
    Wait nodes also carry: collective (name of the collective they wait on).
    external_wait (str, on "view" nodes only): a wait_tensor that waits on no collective of
        this graph, kept in place as a zero-cost view: "input" (on a graph input: the
        collective was issued in the other graph), "wait" (on an already waited tensor),
        "other".
    unwaited_collective (bool, on "compute" nodes only): a collective whose result leaves the
        graph unwaited (waited in the other graph); kept in place, zero cost.
    structure (graph attribute, dict): the summary of scheduler/structure.py (source,
        n_blocks, block_names, signatures, signature_period, ...).

Edges: ``u -> v`` when ``v`` reads the output of ``u`` (data dependencies).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import types
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.costs.family import ComputeFrom, compute_key
from scheduler.costs.annotate import CoverageCheck, annotate_costs
from scheduler.costs.hardware import Cluster
from scheduler.costs.models import CostModel
from scheduler.costs.spec import resolve_cost_model
from solvers.core.problem import Problem
from scheduler.export.schema import KINDS, SCHEMA, SCHEMA_VERSION, UNMODELLED_COLLECTIVES, DagError, check_dag_json

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: collective op names (``torch.ops._c10d_functional.<name>``) -> coll_type
_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}
#: collectives the scheduler may move (a bucket of torch's merge writes all_gather_into_tensor_out,
#: which only a re-export of a written graph holds, in place)
MOVABLE_COLLECTIVES = frozenset({"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"})
_CAST_OPS = {"convert_element_type", "_to_copy", "to"}
#: ops whose output shares its input's storage although their schema does not mark them as
#: views (aten._unsafe_view: a view that autograd does not track as one)
_ALIAS_OPS = {"_unsafe_view"}


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
def export_dag(
    gm: "torch.fx.GraphModule",
    *,
    cost_model: "CostModel | str | None" = None,
    cluster: "Cluster | None" = None,
    name: str | None = None,
    merge_all_reduces: bool = False,
    coverage_check: CoverageCheck | None = CoverageCheck(),
) -> nx.DiGraph:
    """Export an FX graph to the cost-annotated DAG described in the module docstring.

    Args:
        gm: a partitioned forward or backward graph whose nodes carry ``meta['val']``
            (FakeTensors or real tensors) with static shapes.
        cost_model: assigns ``runtime_ms``: a cost model object, or a name (``"analytic"``,
            ``"torch"``; see :func:`scheduler.costs.spec.resolve_cost_model`); default the analytic
            model on ``cluster``.
        cluster: topology; default :class:`scheduler.costs.hardware.Cluster` with the graph's
            world (``world_size``: H100s, 8 per node). Each group is priced by the nodes its
            ranks span on the cluster's ``gpus_per_node``.
        name: stored as the DAG's name (default: ``gm.meta["fsdp_graph_kind"]`` or "graph").
        merge_all_reduces: whether a schedule may merge the graph's gradient all-reduces (DDP,
            HSDP's replicate group) into buckets (``dag.graph["merge_all_reduces"]``). They are
            moved either way. Off by default: a ring all-reduce sums an element over the ranks in
            an order set by where the element lies in the buffer, so one all-reduce of a
            concatenation rounds differently from separate ones (bitwise equal on 2 ranks, not
            on more), while a merged reduce-scatter's results are bitwise those of its members.
        coverage_check: a WARNING when a cost model that prices from a file priced too little
            of the graph from it (:class:`scheduler.costs.annotate.CoverageCheck`); None: no check.

    Raises:
        DagError: a tensor node without ``meta['val']``, a symbolic shape, or a collective
            without a wait.
        ValueError: an unknown cost model name.
    """
    import torch

    given_cluster = cluster
    cost_model = resolve_cost_model(cost_model, cluster)
    graph_kind = str(getattr(gm, "meta", {}).get("fsdp_graph_kind", "unknown"))
    dag = nx.DiGraph(
        schema=SCHEMA,
        version=SCHEMA_VERSION,
        name=name or (graph_kind if graph_kind != "unknown" else "graph"),
        graph_kind=graph_kind,
        process_groups={},
        merge_all_reduces=bool(merge_all_reduces),
    )
    order: list[str] = []
    fx_nodes: dict[str, torch.fx.Node] = {}
    val_of = _static_vals(gm)
    for idx, node in enumerate(gm.graph.nodes):
        fx_nodes[node.name] = node
        order.append(node.name)
        attrs = _node_attrs(node, idx, val_of)
        dag.add_node(node.name, **attrs)
        for inp in node.all_input_nodes:
            dag.add_edge(inp.name, node.name)
    dag.graph["order"] = order

    _link_collectives(dag, fx_nodes)
    dag.graph["world_size"] = _world_size(dag)
    # the cluster's world is the graph's (what the process groups say), unless one is given
    cluster = given_cluster or Cluster(n_gpus=dag.graph["world_size"] or Cluster.n_gpus)
    _mark_prologues(dag)
    _mark_epilogues(dag)
    _resolve_aliases(dag)
    _annotate_structure(dag, gm)
    annotate_costs(dag, cost_model, cluster, fx_nodes=fx_nodes, coverage_check=coverage_check)
    logger.info(
        "exported %s: %d nodes, %d collectives",
        dag.graph["name"],
        dag.number_of_nodes(),
        sum(1 for _, a in dag.nodes(data=True) if a["kind"] == "collective"),
    )
    return dag


def _op_name(target: Any) -> str:
    """'aten.mm.default' for OpOverloads, the function name otherwise."""
    if hasattr(target, "_schema") and hasattr(target, "namespace"):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def _packet_name(target: Any) -> str:
    """'all_gather_into_tensor' for torch.ops._c10d_functional.all_gather_into_tensor.default."""
    if hasattr(target, "_schema"):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _tensor_bytes(val: Any, node_name: str) -> tuple[int, str | None]:
    """Sum of bytes of all tensors in ``val`` and the dtype of the first one."""
    import torch

    total = 0
    dtype = None
    stack = [val]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            try:
                numel = int(v.numel())
            except (TypeError, RuntimeError) as e:  # symbolic shapes
                raise DagError(
                    f"node {node_name!r} has a symbolic shape {tuple(v.shape)}; fsdp-sched needs "
                    "static shapes: compile with dynamic=False or mark the dims static"
                ) from e
            if any(not isinstance(s, int) for s in v.shape):
                raise DagError(
                    f"node {node_name!r} has a symbolic shape {tuple(v.shape)}; fsdp-sched needs "
                    "static shapes: compile with dynamic=False or mark the dims static"
                )
            total += numel * v.element_size()
            if dtype is None:
                dtype = str(v.dtype).replace("torch.", "")
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
    return total, dtype


#: node attributes every exported node carries, at their value for a node that does nothing
#: (the export and :class:`scheduler.whatif.synthetic.DagBuilder` start from these)
NODE_DEFAULTS: dict[str, Any] = {
    "runtime_ms": 0.0,
    "size_bytes": 0,
    "alias_of": None,
    "releasable": True,
    "flops": 0,
    "bytes_accessed": 0,
    "dtype": None,
    "moves_with": None,
}


def _node_attrs(node: "torch.fx.Node", idx: int, val_of: "_ValOf | None" = None) -> dict[str, Any]:
    import torch

    attrs: dict[str, Any] = {
        "index": idx,
        "target": _op_name(node.target) if node.op == "call_function" else node.op,
        **NODE_DEFAULTS,
    }
    if node.op in ("placeholder", "get_attr"):
        attrs["kind"] = "input"
        # Parameter shards (primals) live across forward and backward; the graph cannot free
        # them. Same rule as torch's memory_estimator._is_releasable.
        attrs["releasable"] = not node.name.startswith("primals")
    elif node.op == "output":
        attrs["kind"] = "output"
        return attrs
    elif node.op != "call_function":
        raise DagError(
            f"node {node.name!r} has op {node.op!r}; fsdp-sched handles flat aten graphs "
            "(placeholder/call_function/output), as produced by aot_autograd"
        )
    val_of = val_of or _ValOf()
    val = val_of(node)
    if val is None and "val" not in node.meta and _may_return_tensor(node):
        raise DagError(
            f"node {node.name!r} ({attrs['target']}) has no meta['val']; trace with fake tensors "
            "(make_fx(..., tracing_mode='fake') or aot_autograd) so that shapes are known"
        )
    size, dtype = _tensor_bytes(val, node.name)
    attrs["size_bytes"] = size
    attrs["dtype"] = dtype
    if node.op != "call_function":
        return attrs

    packet = _packet_name(node.target)
    namespace = getattr(node.target, "namespace", "")
    written = written_argument(node)
    if namespace in ("_c10d_functional", "c10d_functional") and packet == "wait_tensor":
        attrs["kind"] = "wait"
    elif namespace in ("_c10d_functional", "c10d_functional") and (
        packet in _COLLECTIVES or packet in UNMODELLED_COLLECTIVES
    ):
        attrs["kind"] = "collective"
        attrs.update(_collective_attrs(node, packet, val_of))
        if written is not None:
            # all_gather_into_tensor_out writes into the buffer it is given: no new storage.
            # size_bytes of a collective is what it allocates at issue, so 0 here.
            attrs["alias_of"] = written.name
            attrs["size_bytes"] = 0
    elif _is_alias_op(node):
        attrs["kind"] = "view"
        base = node.args[0] if node.args else None
        attrs["alias_of"] = getattr(base, "name", None)
        if node.target is operator.getitem and isinstance(node.args[1], int) and isinstance(
                val_of(base) if isinstance(base, torch.fx.Node) else None, (list, tuple)):
            # one result of a multi-output node; _resolve_aliases drops the index where the
            # base turns out not to count its results one by one (a view's list)
            attrs["output_index"] = node.args[1] % max(1, len(val_of(base)))
    else:
        attrs["kind"] = "compute"
        attrs["bytes_accessed"] = _bytes_accessed(node, size, written, val_of)
        attrs["flops"] = _count_flops(node, val_of)
        if written is not None:  # in-place op (copy_ into a bucket slot): returns its argument
            attrs["alias_of"] = written.name
        elif isinstance(val, (list, tuple)):
            attrs.update(_output_attrs(node, val))
            attrs["size_bytes"] = sum(attrs["output_bytes"])
    del torch
    return attrs


def _output_attrs(node: "torch.fx.Node", val: "list | tuple") -> dict[str, Any]:
    """``output_bytes`` and ``output_alias`` of a node returning several results (module
    docstring): each result is a storage of its own, except one the op writes into an argument
    (``Tensor(a!)``), which is that argument's."""
    written = written_arguments(node)
    output_bytes, output_alias = [], []
    for j, item in enumerate(val):
        arg = written[j] if j < len(written) and len(written) == len(val) else None
        output_alias.append(None if arg is None else arg.name)
        output_bytes.append(0 if arg is not None else _tensor_bytes(item, node.name)[0])
    out: dict[str, Any] = {"output_bytes": output_bytes}
    if any(a is not None for a in output_alias):
        out["output_alias"] = output_alias
    return out


# --------------------------------------------------------------------------------------------
# storage: which node's output owns the bytes a node returns, and the bytes an op moves
# --------------------------------------------------------------------------------------------
def _is_alias_op(node: "torch.fx.Node") -> bool:
    """Views, ``getitem`` and ``aten._unsafe_view``: their output shares an input's storage and
    no data moves."""
    return (
        node.target is operator.getitem
        or getattr(node.target, "is_view", False)
        or _packet_name(node.target) in _ALIAS_OPS
    )


def written_argument(node: "torch.fx.Node") -> "torch.fx.Node | None":
    """The argument an op writes into and returns (schema ``Tensor(a!) -> Tensor(a!)``: the
    ``out`` of ``all_gather_into_tensor_out``, the ``self`` of ``copy_`` and other in-place ops);
    None when the op returns new storage or several results (:func:`written_arguments`)."""
    written = written_arguments(node)
    return written[0] if len(written) == 1 else None


def written_arguments(node: "torch.fx.Node") -> "list[torch.fx.Node | None]":
    """Per result of the op's schema, the argument it writes into and returns (``Tensor(a!)``:
    an in-place op's ``self``, each ``out=`` tensor of ``topk.values`` or ``max.dim_max``), or
    None where the result is new storage. Empty for a call without a schema (higher-order ops:
    every result is new)."""
    from torch.fx import Node

    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out: list[Node | None] = []
    for ret in schema.returns:
        info = ret.alias_info
        found = None
        if info is not None and info.is_write:
            for i, arg in enumerate(schema.arguments):
                a_info = arg.alias_info
                if a_info is None or not a_info.is_write or not (a_info.before_set & info.before_set):
                    continue
                value = node.kwargs.get(arg.name) if (arg.kwarg_only or i >= len(node.args)) else node.args[i]
                if isinstance(value, Node):
                    found = value
                    break
        out.append(found)
    return out


def _bytes_accessed(node: "torch.fx.Node", out_bytes: int, written: "torch.fx.Node | None", val_of: "_ValOf") -> int:
    """Bytes a compute op reads and writes: its output plus its tensor inputs, except that an
    allocation (``empty``) touches nothing and the destination of ``copy_`` / an ``out=``
    argument is written (counted once, as the output), not read."""
    from scheduler.costs.torch_model import ALLOC_ONLY_OPS

    if _packet_name(node.target) in ALLOC_ONLY_OPS:
        return 0
    skip_read = written is not None and (
        _packet_name(node.target) == "copy_" or written is node.kwargs.get("out")
    )
    return out_bytes + sum(
        _tensor_bytes(val_of(i), i.name)[0]
        for i in node.all_input_nodes
        if not (skip_read and i is written)
    )


def _get_attr_value(node: "torch.fx.Node") -> Any:
    """What a get_attr node reads from its graph module (None when it cannot be resolved)."""
    value: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _may_return_tensor(node: "torch.fx.Node") -> bool:
    """False for call_function nodes that return no tensor (``aten._assert_scalar``,
    ``torch._check`` and SymInt arithmetic of data-dependent sizes carry no meta['val']), for
    get_attr nodes of submodules and for inputs nothing reads."""
    import torch

    if node.op == "get_attr":
        # a submodule (flex attention's score and mask functions) is code, not data
        return not isinstance(_get_attr_value(node), torch.nn.Module)
    if node.op == "placeholder" and not node.users:
        # make_fx gives an int argument a placeholder without meta['val']; unread, it holds
        # nothing the step uses
        return False
    if node.op != "call_function":
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return any("Tensor" in str(r.type) for r in schema.returns)
    return getattr(node.target, "__module__", None) not in ("_operator", "operator", "builtins", "math", "torch")


def _collective_attrs(node: "torch.fx.Node", packet: str, val_of: "_ValOf") -> dict[str, Any]:
    from torch.fx import Node

    args = list(node.args)
    inp = args[0]
    payload = 0
    if isinstance(inp, Node):
        payload = _tensor_bytes(val_of(inp), inp.name)[0]
    reduce_op = None
    if packet in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
        group_size, group_name = args[1], args[2]
    elif packet == "reduce_scatter_tensor":
        reduce_op, group_size, group_name = args[1], args[2], args[3]
    elif packet == "all_reduce":
        reduce_op, group_name = args[1], args[2]
        group_size = _group_size(group_name)
    else:
        group_name = next((a for a in args if isinstance(a, str)), "unknown")
        group_size = next((a for a in args[1:] if isinstance(a, int)), _group_size(group_name))
    fqn = node.meta.get("fsdp_fqn")
    fqns = list(fqn) if isinstance(fqn, (list, tuple)) else ([fqn] if fqn else [])
    role = node.meta.get("fsdp_role")
    coll_type = _COLLECTIVES.get(packet, packet)
    if role is None:
        role = _infer_role(node, coll_type, fqns)
    if not fqns and role == "fsdp" and coll_type == "all_gather":
        src = _source_placeholder(node)
        fqns = [src.name] if src is not None else []
    return {
        "coll_type": coll_type,
        "group_name": str(group_name),
        "group_size": int(group_size) if group_size is not None else 0,
        "reduce_op": reduce_op,
        "payload_bytes": payload,
        "fqns": fqns,
        "param_index": node.meta.get("fsdp_param_index"),
        "role": role,
        "wait": None,
        "prologue": [],
        "epilogue": [],
        # every collective the execution model prices moves within its data dependencies:
        # tensor- and expert-parallel ones too (they are merged only when FSDP's: see
        # solvers.core.problem.Collective.mergeable)
        "movable": packet in MOVABLE_COLLECTIVES,
    }


def _source_placeholder(node: "torch.fx.Node") -> "torch.fx.Node | None":
    """The placeholder an all-gather's input comes from through single-use casts and views."""
    cur = node.args[0] if node.args else None
    while cur is not None and getattr(cur, "op", None) == "call_function":
        if len(cur.all_input_nodes) != 1:
            return None
        op = _packet_name(cur.target)
        if not (op in _CAST_OPS or getattr(cur.target, "is_view", False)):
            return None
        cur = cur.all_input_nodes[0]
    return cur if getattr(cur, "op", None) == "placeholder" else None


def _infer_role(node: "torch.fx.Node", coll_type: str, fqns: list[str]) -> str:
    """FSDP collectives when the graph carries no ``fsdp_role`` meta: all-gathers of a graph
    input (a parameter shard) and reduce-scatters (gradient reductions)."""
    if coll_type == "reduce_scatter":
        return "fsdp"
    if coll_type == "all_gather" and (fqns or _source_placeholder(node) is not None):
        return "fsdp"
    return "other"


def _group_size(group_name: Any) -> int | None:
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        return dist.get_world_size(_resolve_process_group(group_name))
    except Exception:  # no process group: size unknown
        return None


def _count_flops(node: "torch.fx.Node", val_of: "_ValOf | None" = None) -> int:
    """FLOPs from torch.utils.flop_counter's registry (0 for ops it does not know)."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0

    val_of = val_of or _ValOf()

    def meta(a: Any) -> Any:
        from torch.fx import Node

        return val_of(a) if isinstance(a, Node) else a

    args, kwargs = tree_map(meta, (node.args, node.kwargs))
    try:
        return int(fn(*args, out_val=val_of(node), **kwargs))
    except Exception as e:  # a formula that rejects these args: count nothing, say so
        logger.debug("flop formula for %s failed on %s: %s", packet, node.name, e)
        return 0


def _link_collectives(dag: nx.DiGraph, fx_nodes: dict[str, Any]) -> None:
    """Connect each collective with its wait; record process groups.

    Graphs as torch produces them also hold waits that wait on no collective of this graph
    and collectives waited in no wait of it: see :func:`_mark_external_wait` and
    :func:`_mark_unwaited_collective`.
    """
    groups = dag.graph["process_groups"]
    for name, a in dag.nodes(data=True):
        if a["kind"] != "wait":
            continue
        coll = fx_nodes[name].args[0]
        coll_name = getattr(coll, "name", None)
        ca = dag.nodes[coll_name] if coll_name is not None else None
        if ca is None or ca["kind"] != "collective" or ca["wait"] is not None:
            _mark_external_wait(dag, name, coll_name)
            continue
        a["collective"] = coll_name
        a["alias_of"] = coll_name
        ca["wait"] = name
    for name, a in dag.nodes(data=True):
        if a["kind"] != "collective":
            continue
        if a["wait"] is None:
            if not all(dag.nodes[v]["kind"] == "output" for v in dag.successors(name)):
                raise DagError(
                    f"collective {name!r} ({a['target']}) has no wait_tensor; fsdp-sched needs "
                    "functional collectives each followed by a wait"
                )
            _mark_unwaited_collective(dag, name)
            continue
        gname = a["group_name"]
        if gname not in groups:
            groups[gname] = {"size": a["group_size"], "ranks": _group_ranks(gname)}


def _mark_external_wait(dag: nx.DiGraph, name: str, waited: str | None) -> None:
    """A ``wait_tensor`` that waits on no collective of this graph: on a graph input (the
    collective was issued in the other graph: a backward graph waiting on a forward
    all-gather), on a tensor already waited (a wait on a wait), or on anything else.

    Modelled as a fixed point: a zero-cost view of its input (wait_tensor returns its input),
    kept in traced order; ``external_wait`` says which case it is. Its stream time is not
    known in this graph.
    """
    a = dag.nodes[name]
    wa = dag.nodes[waited] if waited is not None else None
    if wa is None:
        what = "other"
    elif wa["kind"] == "input":
        what = "input"
    elif wa["kind"] in ("wait", "collective") or wa.get("external_wait"):
        what = "wait"
    else:
        what = "other"
    a["kind"] = "view"
    a["alias_of"] = waited
    a["external_wait"] = what
    logger.info("wait %r waits on %s %r, not on a collective of this graph: kept in place as a "
                "zero-cost view", name, {"input": "graph input", "wait": "already waited"}.get(what, "node"),
                waited)


def _mark_unwaited_collective(dag: nx.DiGraph, name: str) -> None:
    """A collective whose result only leaves the graph, unwaited (the other graph waits on
    it: a forward all-gather prefetched for backward): kept in traced order as a zero-cost compute node whose output lives on;
    ``unwaited_collective`` is True. Its stream time is not modelled."""
    a = dag.nodes[name]
    a["kind"] = "compute"
    a["unwaited_collective"] = True
    a["flops"] = 0
    a["bytes_accessed"] = 0
    a["movable"] = False
    logger.warning("collective %r (%s) has no wait_tensor in this graph: kept in place, its "
                   "communication time is not modelled", name, a["target"])


def _world_size(dag: nx.DiGraph) -> int | None:
    """Ranks of the world the graph's process groups live in: the initialised default group's
    size, else one more than the largest rank a group names; None when neither is known."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # no usable process group: the ranks recorded say what they can
        pass
    ranks = [r for g in dag.graph["process_groups"].values() for r in (g.get("ranks") or ())]
    return max(ranks) + 1 if ranks else None


def _group_ranks(group_name: str) -> list[int] | None:
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        return list(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    except Exception:
        return None


def _is_cast_or_view(a: dict) -> bool:
    op = a["target"].split(".")[1] if a["target"].count(".") >= 2 else a["target"]
    return a["kind"] == "view" or (a["kind"] == "compute" and op in _CAST_OPS)


def _mark_epilogues(dag: nx.DiGraph) -> None:
    """Mark chains of single-use views / casts from a movable collective's wait to the graph
    output as the collective's epilogue (they run right after the wait)."""
    for name, a in dag.nodes(data=True):
        if a["kind"] != "collective" or not a["movable"]:
            continue
        chain: list[str] = []
        cur = a["wait"]
        while dag.out_degree(cur) == 1:
            nxt = next(iter(dag.successors(cur)))
            na = dag.nodes[nxt]
            if na["kind"] == "output":
                break
            if not _is_cast_or_view(na) or dag.in_degree(nxt) != 1:
                chain = []
                break
            chain.append(nxt)
            cur = nxt
        else:
            chain = []
        if chain and all(dag.nodes[v]["kind"] == "output" for v in dag.successors(chain[-1])):
            a["epilogue"] = chain
            for v in chain:
                dag.nodes[v]["moves_with"] = name


def _mark_prologues(dag: nx.DiGraph) -> None:
    """Mark single-use views and dtype casts feeding a movable collective as its prologue."""
    for name, a in dag.nodes(data=True):
        if a["kind"] != "collective" or not a["movable"]:
            continue
        chain: list[str] = []
        cur = name
        while True:
            preds = list(dag.predecessors(cur))
            if len(preds) != 1:
                break
            p = preds[0]
            pa = dag.nodes[p]
            op = pa["target"].split(".")[1] if pa["target"].count(".") >= 2 else pa["target"]
            if dag.out_degree(p) != 1 or not (pa["kind"] == "view" or (pa["kind"] == "compute" and op in _CAST_OPS)):
                break
            chain.append(p)
            cur = p
        chain.reverse()
        a["prologue"] = chain
        for p in chain:
            dag.nodes[p]["moves_with"] = name


def _resolve_aliases(dag: nx.DiGraph) -> None:
    """Point every view at the node owning its storage (views of views collapse), and at the
    result it holds of a multi-output node (``output_index``): a result the node wrote into an
    argument is that argument's storage; a view of one result holds that result."""
    nodes = dag.nodes
    for name in dag.graph["order"]:  # a node's base comes before it and is resolved already
        a = nodes[name]
        base = a["alias_of"]
        if base is None:
            continue
        index = a.pop("output_index", None)
        b = nodes[base]
        if index is not None and b.get("output_bytes") is None:
            index = None  # a getitem of a view's list: the view's whole storage
        if index is not None and (b.get("output_alias") or [None] * (index + 1))[index] is not None:
            base, index = b["output_alias"][index], None  # written into that argument
            b = nodes[base]
        if b["alias_of"] is not None:
            base, index = b["alias_of"], b.get("output_index")
        a["alias_of"] = base
        if index is not None:
            a["output_index"] = index


def graph_has_collectives(gm: "torch.fx.GraphModule") -> bool:
    """Whether ``gm`` calls any functional collective or wait (reads no metadata)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") in ("_c10d_functional", "c10d_functional"):
            packet = _packet_name(node.target)
            if packet in _COLLECTIVES or packet in UNMODELLED_COLLECTIVES or packet == "wait_tensor":
                return True
    return False


def _annotate_structure(dag: nx.DiGraph, gm: "torch.fx.GraphModule") -> None:
    """Blocks of the collectives (:mod:`scheduler.export.structure`). A failure to infer them never
    fails the export: every collective then gets ``block`` None and the summary says why."""
    from scheduler.export.structure import annotate_structure

    try:
        annotate_structure(dag, gm)
    except Exception as e:  # structure is advisory: the schedule is valid without it
        logger.warning("structure inference failed on %s: %s", dag.graph.get("name"), e)
        for _, a in dag.nodes(data=True):
            if a["kind"] == "collective":
                a["block"] = None
                a["phase"] = None
                a["structure_source"] = None
        dag.graph["structure"] = {"source": "error", "error": str(e), "n_blocks": 0, "block_names": [],
                                  "signatures": [], "n_signatures": 0, "signature_period": None,
                                  "sources": {}, "unit_collectives": None}


class _ValOf:
    """``node.meta['val']``, with data-dependent (unbacked) sizes replaced by estimates.

    Sizes read from data (``.item()``, ``.tolist()``: MoE split sizes) are unbacked symbols
    with no value at trace time. :func:`_static_vals` gives each a hint; tensors whose shape
    holds them are replaced by meta tensors of the hinted shape, for byte and FLOP counts.
    """

    def __init__(self, hints: dict | None = None):
        self.hints = hints or {}
        self._cache: dict[Any, Any] = {}

    def __call__(self, node: Any) -> Any:
        if node not in self._cache:
            val = node.meta["val"] if "val" in node.meta else _val_from_getitems(node)
            self._cache[node] = _substitute(val, self.hints) if self.hints else val
        return self._cache[node]


def _val_from_getitems(node: Any) -> Any:
    """The value of a multi-output node traced without ``meta['val']`` (higher-order ops such as
    ``run_and_save_rng_state`` under activation checkpointing), from the values of the
    ``getitem`` nodes that read it: a tuple with None for outputs nothing reads. None when
    some reader is not a ``getitem`` by a constant index."""
    import operator

    items: dict[int, Any] = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int) or "val" not in user.meta:
            return None
        items[user.args[1]] = user.meta["val"]
    if not items:
        return None
    return tuple(items.get(i) for i in range(max(items) + 1))


def _sym_expr(x: Any) -> Any:
    node = getattr(x, "node", None)
    return getattr(node, "expr", None)


def _substitute(val: Any, hints: dict) -> Any:
    import torch

    if isinstance(val, (list, tuple)):
        return type(val)(_substitute(v, hints) for v in val)
    if not isinstance(val, torch.Tensor) or all(isinstance(s, int) for s in val.shape):
        return val
    shape = []
    for s in val.shape:
        expr = _sym_expr(s)
        if expr is None:
            shape.append(int(s))
            continue
        v = expr.xreplace(hints)
        if not v.is_number:  # a symbol without a hint: left to the static-shape check
            return val
        shape.append(int(v))
    return torch.empty(shape, dtype=val.dtype, device="meta")


def unbacked_hints(gm: "torch.fx.GraphModule | torch.fx.Graph") -> dict:
    """The export's estimate of every data-dependent (unbacked) size symbol of ``gm``
    (symbol -> int; empty when sizes are static): what byte counts of such graphs use, so
    that every memory count of one graph agrees (:mod:`scheduler.check.judge`)."""
    graph = getattr(gm, "graph", gm)
    return _static_vals(types.SimpleNamespace(graph=graph)).hints


def _static_vals(gm: "torch.fx.GraphModule") -> _ValOf:
    """Hints for the unbacked symbols of ``gm`` (none: the plain ``meta['val']``).

    An all-to-all's split sizes that are plain unbacked symbols get a balanced share of the
    input's rows (each rank sends and receives as many rows as it holds: the expected split of
    a balanced router); any other unbacked symbol gets torch inductor's own fallback
    (``torch._inductor.config.unbacked_symint_fallback``) clamped to the symbol's value range.
    """
    from torch.fx import Node
    from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

    unbacked: set = set()
    symbols: set = set()
    shape_env = None
    for node in gm.graph.nodes:
        val = node.meta.get("val", None)
        try:
            unbacked |= free_unbacked_symbols(val)
            symbols |= free_symbols(val)
        except Exception:  # values free_unbacked_symbols cannot walk (script objects)
            continue
        if shape_env is None:
            shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    if not symbols:
        return _ValOf()
    # a dynamic size traced from an input (a recompile for a new batch size) is priced at the
    # size it was traced with: the schedule (order and buckets) holds for every size, and its
    # costs are those of the size seen
    # backed_var_to_val where torch has it: reading its deprecated var_to_val warns every time
    if shape_env is None:
        traced_with = {}
    elif hasattr(shape_env, "backed_var_to_val"):
        traced_with = shape_env.backed_var_to_val
    else:
        traced_with = getattr(shape_env, "var_to_val", {})
    hints: dict = {sym: int(traced_with[sym]) for sym in symbols - unbacked if sym in traced_with}
    if hints:
        logger.info("%d dynamic sizes priced at the sizes traced", len(hints))
    if not unbacked:
        return _ValOf(_as_sympy(hints))
    n_backed = len(hints)
    for node in gm.graph.nodes:
        if node.op != "call_function" or _packet_name(node.target) != "all_to_all_single":
            continue
        inp = node.args[0]
        if not isinstance(inp, Node):
            continue
        rows_val = _substitute(inp.meta.get("val", None), _as_sympy(hints))
        shape = getattr(rows_val, "shape", ())
        rows = shape[0] if len(shape) and isinstance(shape[0], int) else None
        for splits in node.args[1:3]:
            if not isinstance(splits, (list, tuple)) or not splits or rows is None:
                continue
            for sp in splits:
                expr = _sym_expr(sp.meta.get("val", None)) if isinstance(sp, Node) else None
                if expr is not None and expr in unbacked and expr not in hints:
                    hints[expr] = max(0, rows // len(splits))
    import torch._inductor.config as inductor_config

    from_splits = len(hints) - n_backed
    fallback = int(inductor_config.unbacked_symint_fallback)
    ranges = getattr(shape_env, "var_to_range", {}) if shape_env is not None else {}
    for sym in unbacked - set(hints):
        h = fallback
        vr = ranges.get(sym)
        if vr is not None:
            lo, hi = _finite_int(vr.lower), _finite_int(vr.upper)
            h = max(h, lo) if lo is not None else h
            h = min(h, hi) if hi is not None else h
        hints[sym] = h
    logger.info("%d data-dependent sizes estimated (%d from all-to-all splits)", len(unbacked), from_splits)
    return _ValOf(_as_sympy(hints))


def _as_sympy(hints: dict) -> dict:
    """Hints as sympy integers: ``expr.xreplace`` of a bare symbol returns the hint as given."""
    import sympy

    return {sym: sympy.Integer(v) for sym, v in hints.items()}


def _finite_int(x: Any) -> int | None:
    try:
        return int(x) if bool(getattr(x, "is_finite", True)) and abs(float(x)) != math.inf else None
    except Exception:  # sympy / torch infinities refuse int() in different ways
        return None


# --------------------------------------------------------------------------------------------
# JSON round-trip
# --------------------------------------------------------------------------------------------
def dag_to_json(dag: nx.DiGraph) -> dict:
    """The DAG as JSON-able data (``{"graph", "nodes", "edges"}``; module docstring)."""
    nodes = [{"name": n, **_jsonable(a)} for n, a in dag.nodes(data=True)]
    edges = [[u, v] for u, v in dag.edges()]
    return {"graph": _jsonable(dict(dag.graph)), "nodes": nodes, "edges": edges}


def dag_from_json(data: Any, *, source: str = "<data>") -> nx.DiGraph:
    """The DAG of decoded JSON written by :func:`dag_to_json`, once every field of it passed
    :func:`scheduler.export.schema.check_dag_json` (``source`` names the data in errors).

    Raises:
        DagError: not an fsdp-sched DAG, another schema version, or a field that violates the
            schema (the message names it, its value and what is accepted).
    """
    check_dag_json(data, source=source)
    try:
        dag = nx.DiGraph(**data["graph"])
        for n in data["nodes"]:
            n = dict(n)
            dag.add_node(n.pop("name"), **n)
        dag.add_edges_from((u, v) for u, v in data["edges"])
    except (KeyError, TypeError, ValueError, nx.NetworkXError) as e:  # a gap in the check still fails here
        raise DagError(f"{source} is corrupt: {e}") from e
    return dag


def save_dag(dag: nx.DiGraph, path: str | Path) -> None:
    """Write the DAG as versioned JSON (see module docstring for the schema)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(dag_to_json(dag), separators=(",", ":")))
    tmp.replace(path)


def load_dag(path: str | Path) -> nx.DiGraph:
    """Read a DAG written by :func:`save_dag`.

    Raises:
        DagError: the file is not valid JSON, not an fsdp-sched DAG, of another schema version,
            or a field of it violates the schema (:func:`dag_from_json`).
        OSError: the file cannot be read (FileNotFoundError: no such file).
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # bad UTF-8 or JSON, integers past the digit limit
        raise DagError(f"{path} is not valid JSON ({e}); was it truncated? re-export it") from e
    except RecursionError as e:  # deeper than the parser follows: no DAG file nests like that
        raise DagError(f"{path} is not an fsdp-sched DAG file (its JSON is nested too deeply)") from e
    return dag_from_json(data, source=str(path))


_REQUIRED_NODE_ATTRS = ("kind", "index", "runtime_ms", "size_bytes")


def validate_dag(dag: nx.DiGraph, *, source: str = "DAG") -> None:
    """Check a DAG built in memory is self-consistent and its costs are usable (the lighter
    check :class:`scheduler.whatif.synthetic.DagBuilder` runs; a file gets the full schema,
    :func:`dag_from_json`).

    Raises:
        DagError: naming the first problem found (missing attribute, unknown kind, a runtime
            that is NaN / negative, a collective without a wait, a cycle, an order that does
            not list every node).
    """
    order = dag.graph.get("order")
    if not isinstance(order, list) or sorted(order) != sorted(dag.nodes):
        raise DagError(f"{source}: graph attribute 'order' must list every node exactly once")
    for n, a in dag.nodes(data=True):
        for key in _REQUIRED_NODE_ATTRS:
            if key not in a:
                raise DagError(f"{source}: node {n!r} lacks attribute {key!r}")
        if a["kind"] not in KINDS:
            raise DagError(f"{source}: node {n!r} has unknown kind {a['kind']!r}")
        rt = a["runtime_ms"]
        if not isinstance(rt, (int, float)) or math.isnan(rt) or rt < 0 or math.isinf(rt):
            raise DagError(
                f"{source}: node {n!r} has runtime_ms={rt!r}; the cost model must return a finite "
                "time >= 0 for every node"
            )
        if a["kind"] == "collective" and not a.get("wait"):
            raise DagError(f"{source}: collective {n!r} has no wait")
    if not nx.is_directed_acyclic_graph(dag):
        raise DagError(f"{source}: the graph has a cycle")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
def export_problems(gm: "torch.fx.GraphModule", models: Mapping[str, Any], cluster: Cluster | None, *,
                    merge_all_reduces: bool = False) -> "PricedProblems":
    """``gm`` exported once and priced by each of ``models`` (label -> Problem, in order): the
    first at once, the others when one of them is first asked for (:class:`PricedProblems`).
    A family (:class:`scheduler.costs.family.CostModelFamily`) first leaves out the members
    that would price this graph as another does (:meth:`~scheduler.costs.family.CostModelFamily.needed`)."""
    labels = list(models)
    dag = export_dag(gm, cost_model=models[labels[0]], cluster=cluster, merge_all_reduces=merge_all_reduces)
    needed = getattr(models, "needed", None)
    if callable(needed):  # a family leaves out the members that price this graph alike
        models = needed(dag)
        labels = list(models)
        dag.graph["cost_model"] = _model_name(models[labels[0]])
    key_of = getattr(models, "compute_key", compute_key)
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    priced_on = Cluster.from_json(dag.graph["cluster"])

    def price_the_others() -> dict[str, Problem]:
        out: dict[str, Problem] = {}
        priced = {key_of(labels[0]): dag}
        for label in labels[1:]:
            other: nx.DiGraph = dag.copy()
            other.graph = copy.deepcopy(dag.graph)
            model = resolve_cost_model(models[label], cluster)
            base = priced.get(key_of(label))
            annotate_costs(other, model if base is None else ComputeFrom(model, base), priced_on, fx_nodes=fx_nodes)
            priced.setdefault(key_of(label), other)
            out[label] = Problem.from_dag(other)
        return out

    return PricedProblems(labels, Problem.from_dag(dag), price_the_others,
                          model_names={label: _model_name(models[label]) for label in labels})


def _model_name(model: Any) -> str:
    return model if isinstance(model, str) else str(getattr(model, "name", type(model).__name__))


class PricedProblems(Mapping):
    """Label -> the graph's :class:`Problem` under that cost model, in the models' order. The
    first is priced when made; the others together, the first time one of them is read: an
    answer from the schedule cache reads only the first (its key is the first's export)."""

    def __init__(self, labels: list[str], first: Problem, price_the_others: Any,
                 model_names: Mapping[str, str] | None = None):
        self._labels = labels
        #: label -> the name of the model that priced it (a family's members are named by
        #: their spec and label), known before the others are priced
        self.model_names = dict(model_names or {label: label for label in labels})
        self._problems: dict[str, Problem] = {labels[0]: first}
        self._price_the_others = price_the_others

    def __getitem__(self, label: str) -> Problem:
        if label not in self._problems and label in self._labels and self._price_the_others is not None:
            self._problems.update(self._price_the_others())
            self._price_the_others = None
        return self._problems[label]

    def __iter__(self):
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)
