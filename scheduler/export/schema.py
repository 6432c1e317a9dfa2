"""The exported DAG's schema: what every attribute means (below), and the tables of what each
may hold (:data:`GRAPH_ATTRS`, :data:`NODE_ATTRS`) that a saved file is checked against before
anything is built from it (:func:`scheduler.export.dagfile.check_dag_json`, which names the
first field that violates them).

Attributes that older files or :class:`scheduler.whatif.synthetic.DagBuilder` leave out are optional
(``required=False``); an attribute the schema does not know is an error, so that a misspelt
optional attribute is not silently ignored.

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
    size_bytes (int): bytes of the node's output tensors (0 for non-tensors). A graph input that
        is a view of a larger storage no other input shares (a saved slice of an activation)
        counts the whole storage, which it holds while it lives. For collectives, the bytes
        allocated at issue: 0 when the collective writes into a buffer it is given
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
        structure_source (str | None): see :mod:`scheduler.export.structure`.
    Wait nodes also carry: collective (name of the collective they wait on).
    external_wait (str, on "view" nodes only): a wait_tensor that waits on no collective of
        this graph, kept in place as a zero-cost view: "input" (on a graph input: the
        collective was issued in the other graph), "wait" (on an already waited tensor),
        "other".
    unwaited_collective (bool, on "compute" nodes only): a collective whose result leaves the
        graph unwaited (waited in the other graph); kept in place, zero cost.
    structure (graph attribute, dict): the summary of :mod:`scheduler.export.structure` (source,
        n_blocks, block_names, signatures, signature_period, ...).

Edges: ``u -> v`` when ``v`` reads the output of ``u`` (data dependencies).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.costs.hardware import Cluster, GPUSpec, GPU_PRESETS
from scheduler.export.structure import PHASES, SOURCES

SCHEMA = "fsdp-sched/dag"
SCHEMA_VERSION = 1

#: node kinds (see :mod:`scheduler.export.dag`)
KINDS = ("input", "output", "compute", "view", "collective", "wait")
#: ops that are collectives but not modelled (left in place, reported): their ``coll_type`` is
#: the op name (``torch.ops._c10d_functional.<name>``)
UNMODELLED_COLLECTIVES = frozenset({
    "all_to_all_single",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_reduce_coalesced",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
})
#: ``coll_type`` of a collective node: a modelled type, or the op name of an unmodelled one
COLL_TYPES = ("all_gather", "reduce_scatter", "all_reduce", *sorted(UNMODELLED_COLLECTIVES))
ROLES = ("fsdp", "tp", "other")
EXTERNAL_WAITS = ("input", "wait", "other")
#: sizes are counted in int64, as torch counts them; larger integers would overflow the
#: float arithmetic of the cost and memory models
_INT_LIMIT = 2**63


class DagError(ValueError):
    """The graph or file cannot be turned into a DAG; the message says what is wrong."""


# --------------------------------------------------------------------------------------------
# attribute specs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Attr:
    """What one attribute of a record accepts."""

    #: what a valid value is, as the error message says it ("an integer in [0, 2**63)")
    accepted: str
    #: whether a present value is valid (type and range; references are checked after all
    #: records are)
    test: Callable[[Any], bool]
    #: whether the record must carry the attribute
    required: bool = True
    #: the value is a record with this table of attributes (``keyed``: a JSON object of them)
    fields: Mapping[str, "Attr"] | None = None
    #: with ``fields``: the value maps keys accepted by this spec to records
    keyed: "Attr | None" = None
    #: a check of the whole value once its fields passed: why it is invalid, or None
    then: Callable[[Any], str | None] | None = None


def _is_int(v: Any) -> bool:
    return type(v) is int and -_INT_LIMIT < v < _INT_LIMIT


def _is_number(v: Any) -> bool:
    return _is_int(v) or (type(v) is float and math.isfinite(v))


def is_record(v: Any) -> bool:
    return isinstance(v, dict)


def show_value(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut short: a corrupt value can be a whole graph."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # integers past str()'s digit limit, deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def optional(attr: Attr) -> Attr:
    """``attr``, which a record may leave out."""
    return dataclasses.replace(attr, required=False)


def nullable(attr: Attr) -> Attr:
    """``attr`` or null."""
    return dataclasses.replace(attr, accepted=f"{attr.accepted}, or null", test=lambda v: v is None or attr.test(v))


def one_of(*values: str) -> Attr:
    allowed = frozenset(values)
    return Attr("one of " + ", ".join(repr(v) for v in values), lambda v: isinstance(v, str) and v in allowed)


def list_of(attr: Attr) -> Attr:
    return Attr(f"a list, each {attr.accepted}", lambda v: isinstance(v, list) and all(attr.test(x) for x in v))


def record(accepted: str, fields: Mapping[str, Attr], **kw: Any) -> Attr:
    return Attr(accepted, is_record, fields=fields, **kw)


BOOL = Attr("true or false", lambda v: isinstance(v, bool))
STR = Attr("a string", lambda v: isinstance(v, str))
NAME = Attr("a node name (a non-empty string)", lambda v: isinstance(v, str) and v != "")
COUNT = Attr("an integer in [0, 2**63)", lambda v: _is_int(v) and v >= 0)
BYTES = Attr("an integer number of bytes in [0, 2**63)", lambda v: _is_int(v) and v >= 0)
TIME_MS = Attr("a finite time >= 0 (ms)", lambda v: _is_number(v) and v >= 0)
MS_PER_BYTE = Attr("a finite number >= 0 (ms per byte)", lambda v: _is_number(v) and v >= 0)
EMPTY_LIST = Attr("an empty list", lambda v: isinstance(v, list) and not v)


# --------------------------------------------------------------------------------------------
# graph attributes
# --------------------------------------------------------------------------------------------
def _is_comm_key(k: Any) -> bool:
    if not isinstance(k, str) or "|" not in k:
        return False
    coll_type, group = k.split("|", 1)
    return coll_type in COLL_TYPES and group != ""


def _is_comm_table(v: Any) -> bool:
    """Increasing ``[[payload_bytes, ms], ...]``: interpolation bisects on the payloads."""
    if not isinstance(v, list):
        return False
    last = -1
    for point in v:
        if not (isinstance(point, list) and len(point) == 2 and BYTES.test(point[0]) and TIME_MS.test(point[1])):
            return False
        if point[0] <= last:
            return False
        last = point[0]
    return True


_COMM_KEY = Attr(f"'<coll_type>|<group_name>' with coll_type one of {', '.join(COLL_TYPES)}", _is_comm_key)
COMM_ENTRY = {
    "alpha_ms": TIME_MS,
    "beta_ms_per_byte": MS_PER_BYTE,
    "table": optional(Attr("a list of [payload_bytes, ms] pairs: payloads integers >= 0, strictly increasing; "
                           "times finite >= 0", _is_comm_table)),
}
PROCESS_GROUP = {"size": COUNT, "ranks": nullable(list_of(COUNT))}
#: collectives the schedule moves and prices by their group's size (the others keep their
#: place; an exporter that cannot resolve their group records its size as 0)
MODELLED_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _process_groups_problem(groups: dict) -> str | None:
    """A group whose rank list is not as long as its size."""
    for name, g in groups.items():
        if g["ranks"] is not None and len(g["ranks"]) != g["size"]:
            return (f"group {name!r} lists {len(g['ranks'])} ranks but has size={g['size']!r}; expected one rank "
                    "per member of the group")
    return None


def _dataclass_table(cls: type) -> dict[str, Attr]:
    """One spec per field of a config dataclass whose ``to_json`` is stored (Cluster, GPUSpec):
    its type from the annotation; ranges are the dataclass's own ``__post_init__``'s."""
    by_type = {"int": Attr("an integer", _is_int), "float": Attr("a finite number", _is_number), "str": STR}
    gpu = Attr(f"one of {sorted(GPU_PRESETS)}, or a GPU spec record", lambda v: v in GPU_PRESETS if isinstance(v, str)
               else is_record(v))
    return {f.name: gpu if f.name == "gpu" else by_type.get(str(f.type), Attr("a value", lambda v: True))
            for f in dataclasses.fields(cls)}


_GPU_SPEC = _dataclass_table(GPUSpec)


def _cluster_problem(value: dict) -> str | None:
    gpu = value.get("gpu")
    if is_record(gpu):
        missing = sorted(set(_GPU_SPEC) - set(gpu))
        unknown = sorted(set(gpu) - set(_GPU_SPEC))
        bad = sorted(k for k, a in _GPU_SPEC.items() if k in gpu and not a.test(gpu[k]))
        if missing or unknown or bad:
            return (f"gpu={show_value(gpu)} is not a GPU spec (missing {missing}, unknown {unknown}, invalid {bad}); "
                    f"expected the fields {sorted(_GPU_SPEC)}")
    try:
        Cluster.from_json(value)
    except (TypeError, ValueError) as e:  # the dataclass's own range checks
        return str(e)
    return None


STRUCTURE = {
    "source": one_of(*SOURCES, "none", "error"),
    "sources": Attr(f"a JSON object: source ({', '.join(SOURCES)}) -> count",
                    lambda v: is_record(v) and all(k in SOURCES and COUNT.test(n) for k, n in v.items())),
    "n_blocks": COUNT,
    "block_names": list_of(STR),
    "signatures": list_of(COUNT),
    "n_signatures": COUNT,
    "signature_period": nullable(COUNT),
    "unit_collectives": nullable(COUNT),
    "error": optional(STR),
}

#: what a cost model priced from its own data (:func:`scheduler.costs.annotate.annotate_costs`)
FALLBACK_GROUP = {"group_name": STR, "coll_type": STR, "group_size": COUNT, "nodes": COUNT}
COST_COVERAGE = {
    "compute_ms": TIME_MS,
    "compute_matched_ms": nullable(TIME_MS),
    "compute_matched_share": nullable(Attr("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1)),
    "fallback_groups": nullable(Attr("a list of {group_name, coll_type, group_size, nodes} records",
                                     lambda v: isinstance(v, list) and all(
                                         is_record(g) and set(g) == set(FALLBACK_GROUP)
                                         and all(FALLBACK_GROUP[k].test(g[k]) for k in g) for g in v))),
}

def _is_cost_sources(v: Any) -> bool:
    """``{"compute": [...], "collectives": [...], "copies": {"source": ...}}``
    (:func:`scheduler.costs.annotate.annotate_costs`)."""
    def rec(r: Any, fields: Mapping[str, Attr]) -> bool:
        return is_record(r) and set(r) == set(fields) and all(fields[k].test(r[k]) for k in r)

    return (is_record(v) and set(v) == {"compute", "collectives", "copies"}
            and isinstance(v["compute"], list) and all(rec(r, COMPUTE_SOURCE) for r in v["compute"])
            and isinstance(v["collectives"], list) and all(rec(r, COLLECTIVE_SOURCE) for r in v["collectives"])
            and rec(v["copies"], {"source": STR}))


#: what priced a cost component (:func:`scheduler.costs.annotate.annotate_costs`)
COMPUTE_SOURCE = {"source": STR, "measured": BOOL, "nodes": COUNT, "ms": TIME_MS}
COLLECTIVE_SOURCE = {"group_name": STR, "coll_type": STR, "group_size": COUNT, "nodes": COUNT, "source": STR,
                     "measured": BOOL, "count": COUNT, "ms": TIME_MS}

#: ``dag.graph``
GRAPH_ATTRS: dict[str, Attr] = {
    "schema": Attr(repr(SCHEMA), lambda v: v == SCHEMA),
    "version": Attr(repr(SCHEMA_VERSION), lambda v: type(v) is int and v == SCHEMA_VERSION),
    "name": STR,
    "graph_kind": STR,
    "order": list_of(NAME),
    "process_groups": record("a JSON object: group name -> {size, ranks}", PROCESS_GROUP, keyed=STR,
                             then=_process_groups_problem),
    "cluster": record("a cluster record (scheduler.costs.hardware.Cluster.to_json())", _dataclass_table(Cluster),
                      then=_cluster_problem),
    "cost_model": STR,
    "comm_model": record("a JSON object: '<coll_type>|<group_name>' -> {alpha_ms, beta_ms_per_byte, table}",
                         COMM_ENTRY, keyed=_COMM_KEY),
    "copy_ms_per_byte": MS_PER_BYTE,
    "copy_ms_fixed": TIME_MS,
    "structure": optional(record("a structure summary (scheduler.export.structure)", STRUCTURE)),
    "cost_coverage": optional(record("a cost coverage record (scheduler.costs.annotate.annotate_costs)", COST_COVERAGE)),
    "cost_sources": optional(Attr("a cost sources record {compute: [{source, measured, nodes, ms}], collectives: "
                                  "[{group_name, coll_type, group_size, nodes, source, measured, count, ms}], "
                                  "copies: {source}} (scheduler.costs.annotate.annotate_costs)", _is_cost_sources)),
    "world_size": optional(nullable(COUNT)),
    "merge_all_reduces": optional(BOOL),
}


# --------------------------------------------------------------------------------------------
# node attributes, by kind
# --------------------------------------------------------------------------------------------
COMMON_ATTRS = {
    "kind": one_of(*KINDS),
    "index": COUNT,
    "target": STR,
    "runtime_ms": TIME_MS,
    "size_bytes": BYTES,
    "alias_of": nullable(NAME),
    "releasable": BOOL,
    "flops": COUNT,
    "bytes_accessed": BYTES,
    "dtype": nullable(STR),
    "moves_with": nullable(NAME),
}
_COLLECTIVE = {
    "coll_type": one_of(*COLL_TYPES),
    "group_name": STR,
    "group_size": COUNT,
    "reduce_op": nullable(STR),
    "payload_bytes": BYTES,
    "fqns": list_of(STR),
    "param_index": nullable(COUNT),
    "role": one_of(*ROLES),
    "wait": NAME,
    "prologue": list_of(NAME),
    "epilogue": optional(list_of(NAME)),
    "movable": BOOL,
    "block": optional(nullable(COUNT)),
    "phase": optional(nullable(one_of(*PHASES))),
    "structure_source": optional(nullable(one_of(*SOURCES))),
}
#: a collective waited in no wait of the graph, kept as a zero-cost compute node
#: (``unwaited_collective``): it keeps its collective attributes, which nothing reads
_UNWAITED = {
    **{k: optional(a) for k, a in _COLLECTIVE.items() if k not in ("block", "phase", "structure_source")},
    "unwaited_collective": optional(Attr("true", lambda v: v is True)),
    "wait": optional(Attr("null", lambda v: v is None)),
    "prologue": optional(EMPTY_LIST),
    "epilogue": optional(EMPTY_LIST),
    "movable": optional(Attr("false", lambda v: v is False)),
}
UNWAITED_ONLY = frozenset(_UNWAITED) - {"unwaited_collective"}

#: a node returning several results, each a storage of its own (:mod:`scheduler.export.dag`)
_MULTI_OUTPUT = {
    "output_bytes": optional(list_of(BYTES)),
    "output_alias": optional(list_of(nullable(NAME))),
}
#: a node holding one result of a multi-output node
_OUTPUT_INDEX = {"output_index": optional(COUNT)}

NODE_ATTRS: dict[str, dict[str, Attr]] = {
    "input": COMMON_ATTRS,
    "output": COMMON_ATTRS,
    "compute": {**COMMON_ATTRS, **_UNWAITED, **_MULTI_OUTPUT, **_OUTPUT_INDEX},
    "view": {**COMMON_ATTRS, "external_wait": optional(one_of(*EXTERNAL_WAITS)), **_OUTPUT_INDEX},
    "collective": {**COMMON_ATTRS, **_COLLECTIVE, **_OUTPUT_INDEX},
    "wait": {**COMMON_ATTRS, "collective": NAME, **_OUTPUT_INDEX},
}
