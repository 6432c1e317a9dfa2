"""The saved DAG file: its schema, and the check that a file meets it before anything is built.

A file (:func:`scheduler.export.dag.save_dag`) is ``{"graph": {...}, "nodes": [...], "edges": [...]}``;
what each attribute means is documented in :mod:`scheduler.export.dag`. :func:`check_dag_json` reads it
in three passes; the first violation raises :class:`DagError` naming the field (graph attribute,
or node and attribute), the bad value and what is accepted:

1. records (:func:`_check_record`): every graph attribute (:data:`GRAPH_ATTRS`) and every node
   by its kind (:data:`NODE_ATTRS`): required attributes present, no unknown ones, types and
   ranges (integer sizes and finite times >= 0, known enum values);
2. shape (:func:`_check_order`, :func:`_check_edges`, :func:`_check_index`): ``order`` lists
   every node once; edges join known nodes, once each, without self loops; the edges form a
   DAG and ``order`` is a topological order of it; ``index`` is a node's position in it;
3. references (:func:`_check_references`): ``alias_of`` names an earlier node that owns its
   storage; a collective and its wait name each other; prologues and epilogues are the
   single-use chains that :class:`solvers.core.problem.Problem` and the simulator assume, and
   ``moves_with`` names exactly the collective that lists a node; group names are listed in
   ``process_groups``.

Attributes that older files or :class:`scheduler.whatif.synthetic.DagBuilder` leave out are optional
(``required=False``); an attribute the schema does not know is an error, so that a misspelt
optional attribute is not silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import networkx as nx

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


def _is_record(v: Any) -> bool:
    return isinstance(v, dict)


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
    return Attr(accepted, _is_record, fields=fields, **kw)


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
               else _is_record(v))
    return {f.name: gpu if f.name == "gpu" else by_type.get(str(f.type), Attr("a value", lambda v: True))
            for f in dataclasses.fields(cls)}


_GPU_SPEC = _dataclass_table(GPUSpec)


def _cluster_problem(value: dict) -> str | None:
    gpu = value.get("gpu")
    if _is_record(gpu):
        missing = sorted(set(_GPU_SPEC) - set(gpu))
        unknown = sorted(set(gpu) - set(_GPU_SPEC))
        bad = sorted(k for k, a in _GPU_SPEC.items() if k in gpu and not a.test(gpu[k]))
        if missing or unknown or bad:
            return (f"gpu={_show(gpu)} is not a GPU spec (missing {missing}, unknown {unknown}, invalid {bad}); "
                    f"expected the fields {sorted(_GPU_SPEC)}")
    try:
        Cluster.from_json(value)
    except (TypeError, ValueError) as e:  # the dataclass's own range checks
        return str(e)
    return None


STRUCTURE = {
    "source": one_of(*SOURCES, "none", "error"),
    "sources": Attr(f"a JSON object: source ({', '.join(SOURCES)}) -> count",
                    lambda v: _is_record(v) and all(k in SOURCES and COUNT.test(n) for k, n in v.items())),
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
                                         _is_record(g) and set(g) == set(FALLBACK_GROUP)
                                         and all(FALLBACK_GROUP[k].test(g[k]) for k in g) for g in v))),
}

def _is_cost_sources(v: Any) -> bool:
    """``{"compute": [...], "collectives": [...], "copies": {"source": ...}}``
    (:func:`scheduler.costs.annotate.annotate_costs`)."""
    def rec(r: Any, fields: Mapping[str, Attr]) -> bool:
        return _is_record(r) and set(r) == set(fields) and all(fields[k].test(r[k]) for k in r)

    return (_is_record(v) and set(v) == {"compute", "collectives", "copies"}
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
_COMMON = {
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
_UNWAITED_ONLY = frozenset(_UNWAITED) - {"unwaited_collective"}

#: a node returning several results, each a storage of its own (:mod:`scheduler.export.dag`)
_MULTI_OUTPUT = {
    "output_bytes": optional(list_of(BYTES)),
    "output_alias": optional(list_of(nullable(NAME))),
}
#: a node holding one result of a multi-output node
_OUTPUT_INDEX = {"output_index": optional(COUNT)}

NODE_ATTRS: dict[str, dict[str, Attr]] = {
    "input": _COMMON,
    "output": _COMMON,
    "compute": {**_COMMON, **_UNWAITED, **_MULTI_OUTPUT, **_OUTPUT_INDEX},
    "view": {**_COMMON, "external_wait": optional(one_of(*EXTERNAL_WAITS)), **_OUTPUT_INDEX},
    "collective": {**_COMMON, **_COLLECTIVE, **_OUTPUT_INDEX},
    "wait": {**_COMMON, "collective": NAME, **_OUTPUT_INDEX},
}


# --------------------------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------------------------
def check_dag_json(data: Any, *, source: str = "<data>") -> None:
    """Check a decoded DAG file against the schema (module docstring); builds nothing.

    Raises:
        DagError: not an fsdp-sched DAG file, another schema version, or the first field that
            violates the schema: its name, its value and what is accepted.
    """
    if not _is_record(data) or not _is_record(data.get("graph")) or data["graph"].get("schema") != SCHEMA:
        raise DagError(f"{source} is not an fsdp-sched DAG file (missing schema {SCHEMA!r})")
    version = data["graph"].get("version")
    if not GRAPH_ATTRS["version"].test(version):
        raise DagError(
            f"{source} has DAG schema version {_show(version)}; this fsdp-sched reads version "
            f"{SCHEMA_VERSION}: re-export the graph with `fsdp-sched trace` or export_dag()"
        )
    fail = _Fail(source)
    for key in ("nodes", "edges"):
        if key not in data:
            fail(f"the file lacks {key!r}; expected the keys 'graph', 'nodes', 'edges'")
    if len(data) != 3:
        fail(f"unknown top-level keys {sorted(set(data) - {'graph', 'nodes', 'edges'})}; expected 'graph', "
             "'nodes', 'edges'")
    graph = data["graph"]
    _check_record(fail, "graph", "", graph, GRAPH_ATTRS)
    nodes = _check_nodes(fail, data["nodes"])
    pos = _check_order(fail, graph["order"], nodes)
    preds, succs = _check_edges(fail, data["edges"], nodes, pos)
    _check_index(fail, nodes, pos)
    _check_references(fail, graph, nodes, pos, preds, succs)


class _Fail:
    """Raises the :class:`DagError` of one file."""

    def __init__(self, source: str):
        self.source = source

    def __call__(self, what: str) -> None:
        raise DagError(f"{self.source} is corrupt: {what}")


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut short: a corrupt value can be a whole graph."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # integers past str()'s digit limit, deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_record(fail: _Fail, owner: str, prefix: str, rec: Any, table: Mapping[str, Attr]) -> None:
    """Every attribute of ``rec`` against ``table``: required ones present, none unknown, each
    value valid. ``owner`` ("graph", "node 'mm' (compute)") and ``prefix`` (the path of a
    nested record) name the field in errors."""
    if not _is_record(rec):
        fail(f"{owner}: {prefix or 'record'}={_show(rec)}; expected a JSON object with the attributes "
             f"{', '.join(table)}")
    for name, attr in table.items():
        if attr.required and name not in rec:
            fail(f"{owner} lacks attribute {_join(prefix, name)!r} (required: {attr.accepted})")
    for name, value in rec.items():
        attr = table.get(name)
        path = _join(prefix, name)
        if attr is None:
            fail(f"{owner} has unknown attribute {path!r}; accepted: {', '.join(table)}")
        _check_value(fail, owner, path, value, attr)


def _check_value(fail: _Fail, owner: str, path: str, value: Any, attr: Attr) -> None:
    if not attr.test(value):
        fail(f"{owner}: {path}={_show(value)}; expected {attr.accepted}")
    if attr.fields is not None:
        if attr.keyed is None:
            _check_record(fail, owner, path, value, attr.fields)
        else:
            for key, sub in value.items():
                if not attr.keyed.test(key):
                    fail(f"{owner}: {path} has the key {_show(key)}; expected {attr.keyed.accepted}")
                _check_record(fail, owner, f"{path}[{key!r}]", sub, attr.fields)
    if attr.then is not None:
        problem = attr.then(value)
        if problem is not None:
            fail(f"{owner}: {path}: {problem}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _check_nodes(fail: _Fail, nodes: Any) -> dict[str, dict]:
    """Node records by name (without their ``name``), each checked against its kind's table."""
    if not isinstance(nodes, list):
        fail(f"nodes={_show(nodes)}; expected a list of node records")
    out: dict[str, dict] = {}
    for i, rec in enumerate(nodes):
        if not _is_record(rec) or not NAME.test(rec.get("name")):
            fail(f"nodes[{i}]={_show(rec)}; expected a node record with a 'name' ({NAME.accepted})")
        rec = dict(rec)
        name = rec.pop("name")
        if name in out:
            fail(f"nodes[{i}] repeats the node name {name!r}; node names must be unique")
        if "kind" not in rec:
            fail(f"node {name!r} lacks attribute 'kind' (required: {_COMMON['kind'].accepted})")
        kind = rec["kind"]
        if not (isinstance(kind, str) and kind in NODE_ATTRS):
            fail(f"node {name!r} has unknown kind {_show(kind)}; accepted: {', '.join(KINDS)}")
        _check_record(fail, f"node {name!r} ({kind})", "", rec, NODE_ATTRS[kind])
        out[name] = rec
    return out


def _check_order(fail: _Fail, order: list[str], nodes: Mapping[str, dict]) -> dict[str, int]:
    """``order`` is a permutation of the nodes. Returns node -> position."""
    what = "graph attribute 'order' must list every node exactly once"
    pos: dict[str, int] = {}
    for i, name in enumerate(order):
        if name not in nodes:
            fail(f"{what}: order[{i}]={name!r} is no node")
        if name in pos:
            fail(f"{what}: {name!r} is at order[{pos[name]}] and at order[{i}]")
        pos[name] = i
    missing = [n for n in nodes if n not in pos]
    if missing:
        fail(f"{what}: it misses {_show(missing)}")
    return pos


def _check_edges(fail: _Fail, edges: Any, nodes: Mapping[str, dict],
                 pos: Mapping[str, int]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Edges join known nodes, once each, without self loops, and form a DAG of which ``order``
    is a topological order. Returns predecessors and successors per node, in the file's edge
    order."""
    if not isinstance(edges, list):
        fail(f"edges={_show(edges)}; expected a list of [u, v] node-name pairs")
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    succs: dict[str, list[str]] = {n: [] for n in nodes}
    seen: set[tuple[str, str]] = set()
    backward: tuple[int, str, str] | None = None
    for i, edge in enumerate(edges):
        if not (isinstance(edge, list) and len(edge) == 2 and all(isinstance(x, str) for x in edge)):
            fail(f"edges[{i}]={_show(edge)}; expected a [u, v] pair of node names")
        u, v = edge
        for x in (u, v):
            if x not in nodes:
                fail(f"edges[{i}]={_show(edge)} names an unknown node {x!r}")
        if u == v:
            fail(f"edges[{i}]={_show(edge)} is a self loop; a node cannot read its own output")
        if (u, v) in seen:
            fail(f"edges[{i}]={_show(edge)} repeats an edge")
        seen.add((u, v))
        preds[v].append(u)
        succs[u].append(v)
        if backward is None and pos[u] > pos[v]:
            backward = (i, u, v)
    if backward is not None:
        try:
            cycle = [u for u, _ in nx.find_cycle(nx.DiGraph(list(seen)))]
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            fail(f"edges form a cycle {' -> '.join(repr(n) for n in [*cycle, cycle[0]])}; a DAG file is acyclic")
        i, u, v = backward
        fail(f"graph attribute 'order' is not a topological order of the edges: edges[{i}]={[u, v]!r} but order "
             f"lists {v!r} (at {pos[v]}) before {u!r} (at {pos[u]})")
    return preds, succs


def _check_index(fail: _Fail, nodes: Mapping[str, dict], pos: Mapping[str, int]) -> None:
    """Each node's ``index`` is its position in ``order`` (so that two swapped entries of
    ``order``, still a topological order, are caught: they would move the traced schedule)."""
    for name, a in nodes.items():
        if a["index"] != pos[name]:
            fail(f"node {name!r} ({a['kind']}): index={a['index']!r}; expected its position in graph attribute "
                 f"'order', {pos[name]}")


def _check_references(fail: _Fail, graph: Mapping[str, Any], nodes: Mapping[str, dict], pos: Mapping[str, int],
                      preds: Mapping[str, list[str]], succs: Mapping[str, list[str]]) -> None:
    """What one node says about others (module docstring, pass 3). Storage first, then the
    collectives and waits, then ``moves_with``, so that the error names the side of a broken
    link that lists the other (a prologue naming a node) before the side that points back."""
    for name, a in nodes.items():
        _check_alias(fail, _owner(name, a), name, a, nodes, pos)
    for name, a in nodes.items():
        if a["kind"] == "collective":
            _check_collective(fail, _owner(name, a), name, a, graph, nodes, preds, succs)
        elif a["kind"] == "wait":
            _check_wait(fail, _owner(name, a), name, a, nodes, preds)
    for name, a in nodes.items():
        kind, owner = a["kind"], _owner(name, a)
        mw = a["moves_with"]
        if mw is not None:
            if kind not in ("compute", "view"):
                fail(f"{owner}: moves_with={mw!r}; expected null (only compute and view nodes move with a "
                     "collective)")
            ca = nodes.get(mw)
            if ca is None or ca["kind"] != "collective":
                fail(f"{owner}: moves_with={mw!r} names no collective node")
            if name not in ca["prologue"] and name not in (ca.get("epilogue") or ()):
                fail(f"{owner}: moves_with={mw!r}, but that collective's prologue and epilogue do not list it")
        if kind == "input" and preds[name]:
            fail(f"{owner} reads {_show(preds[name])} (edges into it); a graph input reads nothing")
        if kind == "output" and succs[name]:
            fail(f"{owner} is read by {_show(succs[name])} (edges out of it); nothing reads the graph output")
        if kind == "compute" and a.get("unwaited_collective") is not True:
            extra = sorted(_UNWAITED_ONLY & set(a))
            if extra:
                fail(f"{owner} has collective attributes {extra} without unwaited_collective=true; accepted on "
                     "a compute node only for a collective waited in no wait of the graph")


def _owner(name: str, a: Mapping[str, Any]) -> str:
    return f"node {name!r} ({a['kind']})"


def _check_alias(fail: _Fail, owner: str, name: str, a: Mapping[str, Any], nodes: Mapping[str, dict],
                 pos: Mapping[str, int]) -> None:
    """``alias_of`` names the node owning the storage: earlier, and owning its own;
    ``output_index`` one of that node's results; a multi-output node's results add up to its
    ``size_bytes`` and the arguments it writes into come before it."""
    _check_outputs(fail, owner, name, a, nodes, pos)
    alias = a["alias_of"]
    if alias is None:
        if "output_index" in a:
            fail(f"{owner}: output_index={a['output_index']!r} without alias_of; expected it only on a node holding "
                 "one result of the multi-output node alias_of")
        return
    if a["kind"] in ("input", "output"):
        fail(f"{owner}: alias_of={alias!r}; expected null (a graph {a['kind']} shares no node's storage)")
    if alias not in nodes:
        fail(f"{owner}: alias_of={alias!r} names no node; expected null or the earlier node owning its storage")
    if alias == name:
        fail(f"{owner}: alias_of={alias!r} names the node itself; expected null when it owns its storage")
    if pos[alias] >= pos[name]:
        fail(f"{owner}: alias_of={alias!r}, which does not come before it in graph attribute 'order'; expected "
             "the earlier node owning its storage")
    if nodes[alias]["alias_of"] is not None:
        fail(f"{owner}: alias_of={alias!r}, which itself aliases {nodes[alias]['alias_of']!r}; expected the node "
             "owning the storage")
    index = a.get("output_index")
    if index is not None:
        results = nodes[alias].get("output_bytes")
        if results is None or index >= len(results):
            fail(f"{owner}: output_index={index!r}, but alias_of={alias!r} has "
                 f"{'no output_bytes' if results is None else f'{len(results)} results'}; expected the index of "
                 "one of its results")
        if (nodes[alias].get("output_alias") or [None] * len(results))[index] is not None:
            fail(f"{owner}: output_index={index!r} names a result that {alias!r} writes into "
                 f"{nodes[alias]['output_alias'][index]!r}; expected alias_of to name that argument's storage")


def _check_outputs(fail: _Fail, owner: str, name: str, a: Mapping[str, Any], nodes: Mapping[str, dict],
                   pos: Mapping[str, int]) -> None:
    results = a.get("output_bytes")
    written = a.get("output_alias")
    if results is None:
        if written is not None:
            fail(f"{owner}: output_alias={_show(written)} without output_bytes; expected both on a multi-output node")
        return
    if a["alias_of"] is not None:
        fail(f"{owner}: output_bytes={_show(results)} on a node that aliases {a['alias_of']!r}; expected them only on "
             "a node that allocates its results")
    if sum(results) != a["size_bytes"]:
        fail(f"{owner}: output_bytes={_show(results)} add up to {sum(results)}, but size_bytes={a['size_bytes']!r}; "
             "expected size_bytes to be their sum")
    if written is None:
        return
    if len(written) != len(results):
        fail(f"{owner}: output_alias={_show(written)} has {len(written)} entries for {len(results)} results; "
             "expected one per result")
    for j, arg in enumerate(written):
        if arg is None:
            continue
        if arg not in nodes or pos[arg] >= pos[name]:
            fail(f"{owner}: output_alias[{j}]={arg!r} is no earlier node; expected the argument result {j} is "
                 "written into")
        if results[j] != 0:
            fail(f"{owner}: output_alias[{j}]={arg!r} (result {j} is written into it) but output_bytes[{j}]="
                 f"{results[j]!r}; expected 0 (it allocates nothing)")


def _check_collective(fail: _Fail, owner: str, name: str, a: Mapping[str, Any], graph: Mapping[str, Any],
                      nodes: Mapping[str, dict], preds: Mapping[str, list[str]],
                      succs: Mapping[str, list[str]]) -> None:
    """Its wait names it back; its group is listed; its prologue is a chain of single-use nodes
    into it (the problem reads the inputs of the first only) and its epilogue a chain of
    single-use nodes from its wait to the graph output (they run at the wait)."""
    wait = a["wait"]
    wa = nodes.get(wait)
    if wa is None or wa["kind"] != "wait":
        fail(f"{owner}: wait={wait!r} names no wait node; expected the name of its wait")
    if wa["collective"] != name:
        fail(f"{owner}: wait={wait!r}, but that wait has collective={wa['collective']!r}; a collective and its "
             "wait name each other")
    if a["group_name"] not in graph["process_groups"]:
        fail(f"{owner}: group_name={a['group_name']!r} is not listed in graph attribute 'process_groups' "
             f"({_show(sorted(graph['process_groups']))})")
    if a["coll_type"] in MODELLED_COLLECTIVES:
        # the cost models divide by the group's size and the write-back passes it to torch
        group_size = graph["process_groups"][a["group_name"]]["size"]
        if a["group_size"] < 1:
            fail(f"{owner}: group_size={a['group_size']!r}; expected the number of ranks of process group "
                 f"{a['group_name']!r} (>= 1): re-export the graph with its process group initialised")
        if a["group_size"] != group_size:
            fail(f"{owner}: group_size={a['group_size']!r}, but graph attribute 'process_groups' gives group "
                 f"{a['group_name']!r} size={group_size!r}; expected them equal")
    for attr in ("prologue", "epilogue"):
        for m in a.get(attr) or ():
            ma = nodes.get(m)
            if ma is None:
                fail(f"{owner}: {attr} lists {m!r}, which is no node")
            if ma["kind"] not in ("compute", "view") or ma["moves_with"] != name:
                fail(f"{owner}: {attr} lists {m!r}, a {ma['kind']} node with moves_with={ma['moves_with']!r}; "
                     f"expected compute or view nodes whose moves_with is {name!r}")
    prologue = list(a["prologue"])
    for p, nxt in zip(prologue, [*prologue[1:], name]):
        if succs[p] != [nxt] or preds[nxt] != [p]:
            fail(f"{owner}: prologue={_show(prologue)} is not a chain of single-use nodes into the collective: "
                 f"{p!r} must feed only {nxt!r}, and {nxt!r} read only {p!r}")
    epilogue = list(a.get("epilogue") or ())
    for prev, e in zip([wait, *epilogue], epilogue):
        if succs[prev] != [e] or preds[e] != [prev]:
            fail(f"{owner}: epilogue={_show(epilogue)} is not a chain of single-use nodes from the wait: "
                 f"{prev!r} must feed only {e!r}, and {e!r} read only {prev!r}")
    if epilogue and not (succs[epilogue[-1]] and all(nodes[v]["kind"] == "output" for v in succs[epilogue[-1]])):
        fail(f"{owner}: epilogue={_show(epilogue)} must end in a node that only the graph output reads")


def _check_wait(fail: _Fail, owner: str, name: str, a: Mapping[str, Any], nodes: Mapping[str, dict],
                preds: Mapping[str, list[str]]) -> None:
    """It names its collective back, reads it alone, and returns its storage."""
    coll = a["collective"]
    ca = nodes.get(coll)
    if ca is None or ca["kind"] != "collective":
        fail(f"{owner}: collective={coll!r} names no collective node; expected the collective it waits on")
    if ca["wait"] != name:
        fail(f"{owner}: collective={coll!r}, but that collective has wait={ca['wait']!r}; a collective and its "
             "wait name each other")
    if preds[name] != [coll]:
        fail(f"{owner} reads {_show(preds[name])}; expected exactly its collective {coll!r} (edge [{coll!r}, "
             f"{name!r}])")
    root = ca["alias_of"] or coll
    if a["alias_of"] != root:
        fail(f"{owner}: alias_of={a['alias_of']!r}; expected {root!r} (a wait returns its collective's storage)")
