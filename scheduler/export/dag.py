"""Export: FX graph -> cost-annotated networkx DAG (:func:`export_dag`), the only thing solvers see.

One DAG node per FX node (key = FX node name), an edge ``u -> v`` when ``v`` reads the output of
``u``. What each graph and node attribute means, and the table a saved file is checked against:
:mod:`scheduler.export.schema`. How ops are read (names, views, written arguments):
:mod:`scheduler.export.ops`; data-dependent sizes: :mod:`scheduler.export.shapes`; blocks and
directions: :mod:`scheduler.export.structure`; costs: :mod:`scheduler.costs.annotate`; the JSON
file: :mod:`scheduler.export.dagfile`.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.costs.annotate import CoverageCheck, annotate_costs
from scheduler.costs.hardware import Cluster
from scheduler.costs.models import CostModel
from scheduler.costs.spec import resolve_cost_model
from scheduler.export.ops import (
    ALLOC_ONLY_OPS,
    is_alias_op,
    op_name,
    packet_name,
    written_argument,
    written_arguments,
)
from scheduler.export.schema import SCHEMA, SCHEMA_VERSION, UNMODELLED_COLLECTIVES, DagError
from scheduler.export.shapes import ValOf, static_vals

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
    val_of = static_vals(gm)
    for idx, node in enumerate(gm.graph.nodes):
        fx_nodes[node.name] = node
        order.append(node.name)
        attrs = _node_attrs(node, idx, val_of)
        dag.add_node(node.name, **attrs)
        for inp in node.all_input_nodes:
            dag.add_edge(inp.name, node.name)
    dag.graph["order"] = order
    _inputs_at_storage_bytes(dag, fx_nodes)

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


def _inputs_at_storage_bytes(dag: nx.DiGraph, fx_nodes: dict[str, "torch.fx.Node"]) -> None:
    """A graph input that is a view of a larger storage (a saved slice of an activation) holds
    the whole storage while it lives: count it at the storage's bytes, as the reference
    liveness count does (:mod:`scheduler.check.judge`), so that the traced graph's peak is the
    same by both counts and a budget equal to it is never refused. Inputs that share one
    storage keep their view bytes (a storage is counted once only where one input holds it)."""
    import torch

    held: dict[int, list[str]] = {}
    for name, a in dag.nodes(data=True):
        val = fx_nodes[name].meta.get("val") if a["kind"] == "input" else None
        if isinstance(val, torch.Tensor) and val.layout == torch.strided:
            try:
                held.setdefault(val.untyped_storage()._cdata, []).append(name)
            except (NotImplementedError, RuntimeError):  # a tensor with no storage to count
                continue
    for names in held.values():
        if len(names) != 1:
            continue
        nbytes = fx_nodes[names[0]].meta["val"].untyped_storage().nbytes()
        if isinstance(nbytes, int) and nbytes > dag.nodes[names[0]]["size_bytes"]:
            dag.nodes[names[0]]["size_bytes"] = nbytes


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


def _node_attrs(node: "torch.fx.Node", idx: int, val_of: "ValOf | None" = None) -> dict[str, Any]:
    import torch

    attrs: dict[str, Any] = {
        "index": idx,
        "target": op_name(node.target) if node.op == "call_function" else node.op,
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
    val_of = val_of or ValOf()
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

    packet = packet_name(node.target)
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
    elif is_alias_op(node):
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


def _bytes_accessed(node: "torch.fx.Node", out_bytes: int, written: "torch.fx.Node | None", val_of: "ValOf") -> int:
    """Bytes a compute op reads and writes: its output plus its tensor inputs, except that an
    allocation (``empty``) touches nothing and the destination of ``copy_`` / an ``out=``
    argument is written (counted once, as the output), not read."""
    if packet_name(node.target) in ALLOC_ONLY_OPS:
        return 0
    skip_read = written is not None and (
        packet_name(node.target) == "copy_" or written is node.kwargs.get("out")
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


def _collective_attrs(node: "torch.fx.Node", packet: str, val_of: "ValOf") -> dict[str, Any]:
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
        op = packet_name(cur.target)
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


def _count_flops(node: "torch.fx.Node", val_of: "ValOf | None" = None) -> int:
    """FLOPs from torch.utils.flop_counter's registry (0 for ops it does not know)."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0

    val_of = val_of or ValOf()

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
            packet = packet_name(node.target)
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
