"""The saved DAG file: JSON round-trip of an exported DAG (:func:`dag_to_json`,
:func:`dag_from_json`, :func:`save_dag`, :func:`load_dag`) and the check that a file meets the
schema (:mod:`scheduler.export.schema`) before anything is built from it.

A file is ``{"graph": {...}, "nodes": [...], "edges": [...]}``. :func:`check_dag_json` reads it
in three passes; the first violation raises :class:`~scheduler.export.schema.DagError` naming
the field (graph attribute, or node and attribute), the bad value and what is accepted:

1. records (:func:`_check_record`): every graph attribute
   (:data:`~scheduler.export.schema.GRAPH_ATTRS`) and every node by its kind
   (:data:`~scheduler.export.schema.NODE_ATTRS`): required attributes present, no unknown
   ones, types and ranges (integer sizes and finite times >= 0, known enum values);
2. shape (:func:`_check_order`, :func:`_check_edges`, :func:`_check_index`): ``order`` lists
   every node once; edges join known nodes, once each, without self loops; the edges form a
   DAG and ``order`` is a topological order of it; ``index`` is a node's position in it;
3. references (:func:`_check_references`): ``alias_of`` names an earlier node that owns its
   storage; a collective and its wait name each other; prologues and epilogues are the
   single-use chains that :class:`solvers.core.problem.Problem` and the simulator assume, and
   ``moves_with`` names exactly the collective that lists a node; group names are listed in
   ``process_groups``.

:func:`validate_dag` checks a DAG built in memory (:class:`scheduler.whatif.synthetic.DagBuilder`)
for what the solvers need: the required node attributes, every collective waited, no cycle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import networkx as nx

from scheduler.export.schema import (
    COMMON_ATTRS,
    GRAPH_ATTRS,
    KINDS,
    MODELLED_COLLECTIVES,
    NAME,
    NODE_ATTRS,
    SCHEMA,
    SCHEMA_VERSION,
    UNWAITED_ONLY,
    Attr,
    DagError,
    is_record,
    show_value,
)


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


def check_dag_json(data: Any, *, source: str = "<data>") -> None:
    """Check a decoded DAG file against the schema (module docstring); builds nothing.

    Raises:
        DagError: not an fsdp-sched DAG file, another schema version, or the first field that
            violates the schema: its name, its value and what is accepted.
    """
    if not is_record(data) or not is_record(data.get("graph")) or data["graph"].get("schema") != SCHEMA:
        raise DagError(f"{source} is not an fsdp-sched DAG file (missing schema {SCHEMA!r})")
    version = data["graph"].get("version")
    if not GRAPH_ATTRS["version"].test(version):
        raise DagError(
            f"{source} has DAG schema version {show_value(version)}; this fsdp-sched reads version "
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


def _check_record(fail: _Fail, owner: str, prefix: str, rec: Any, table: Mapping[str, Attr]) -> None:
    """Every attribute of ``rec`` against ``table``: required ones present, none unknown, each
    value valid. ``owner`` ("graph", "node 'mm' (compute)") and ``prefix`` (the path of a
    nested record) name the field in errors."""
    if not is_record(rec):
        fail(f"{owner}: {prefix or 'record'}={show_value(rec)}; expected a JSON object with the attributes "
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
        fail(f"{owner}: {path}={show_value(value)}; expected {attr.accepted}")
    if attr.fields is not None:
        if attr.keyed is None:
            _check_record(fail, owner, path, value, attr.fields)
        else:
            for key, sub in value.items():
                if not attr.keyed.test(key):
                    fail(f"{owner}: {path} has the key {show_value(key)}; expected {attr.keyed.accepted}")
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
        fail(f"nodes={show_value(nodes)}; expected a list of node records")
    out: dict[str, dict] = {}
    for i, rec in enumerate(nodes):
        if not is_record(rec) or not NAME.test(rec.get("name")):
            fail(f"nodes[{i}]={show_value(rec)}; expected a node record with a 'name' ({NAME.accepted})")
        rec = dict(rec)
        name = rec.pop("name")
        if name in out:
            fail(f"nodes[{i}] repeats the node name {name!r}; node names must be unique")
        if "kind" not in rec:
            fail(f"node {name!r} lacks attribute 'kind' (required: {COMMON_ATTRS['kind'].accepted})")
        kind = rec["kind"]
        if not (isinstance(kind, str) and kind in NODE_ATTRS):
            fail(f"node {name!r} has unknown kind {show_value(kind)}; accepted: {', '.join(KINDS)}")
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
        fail(f"{what}: it misses {show_value(missing)}")
    return pos


def _check_edges(fail: _Fail, edges: Any, nodes: Mapping[str, dict],
                 pos: Mapping[str, int]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Edges join known nodes, once each, without self loops, and form a DAG of which ``order``
    is a topological order. Returns predecessors and successors per node, in the file's edge
    order."""
    if not isinstance(edges, list):
        fail(f"edges={show_value(edges)}; expected a list of [u, v] node-name pairs")
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    succs: dict[str, list[str]] = {n: [] for n in nodes}
    seen: set[tuple[str, str]] = set()
    backward: tuple[int, str, str] | None = None
    for i, edge in enumerate(edges):
        if not (isinstance(edge, list) and len(edge) == 2 and all(isinstance(x, str) for x in edge)):
            fail(f"edges[{i}]={show_value(edge)}; expected a [u, v] pair of node names")
        u, v = edge
        for x in (u, v):
            if x not in nodes:
                fail(f"edges[{i}]={show_value(edge)} names an unknown node {x!r}")
        if u == v:
            fail(f"edges[{i}]={show_value(edge)} is a self loop; a node cannot read its own output")
        if (u, v) in seen:
            fail(f"edges[{i}]={show_value(edge)} repeats an edge")
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
            fail(f"{owner} reads {show_value(preds[name])} (edges into it); a graph input reads nothing")
        if kind == "output" and succs[name]:
            fail(f"{owner} is read by {show_value(succs[name])} (edges out of it); nothing reads the graph output")
        if kind == "compute" and a.get("unwaited_collective") is not True:
            extra = sorted(UNWAITED_ONLY & set(a))
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
            fail(f"{owner}: output_alias={show_value(written)} without output_bytes; expected both on a multi-output node")
        return
    if a["alias_of"] is not None:
        fail(f"{owner}: output_bytes={show_value(results)} on a node that aliases {a['alias_of']!r}; expected them only on "
             "a node that allocates its results")
    if sum(results) != a["size_bytes"]:
        fail(f"{owner}: output_bytes={show_value(results)} add up to {sum(results)}, but size_bytes={a['size_bytes']!r}; "
             "expected size_bytes to be their sum")
    if written is None:
        return
    if len(written) != len(results):
        fail(f"{owner}: output_alias={show_value(written)} has {len(written)} entries for {len(results)} results; "
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
             f"({show_value(sorted(graph['process_groups']))})")
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
            fail(f"{owner}: prologue={show_value(prologue)} is not a chain of single-use nodes into the collective: "
                 f"{p!r} must feed only {nxt!r}, and {nxt!r} read only {p!r}")
    epilogue = list(a.get("epilogue") or ())
    for prev, e in zip([wait, *epilogue], epilogue):
        if succs[prev] != [e] or preds[e] != [prev]:
            fail(f"{owner}: epilogue={show_value(epilogue)} is not a chain of single-use nodes from the wait: "
                 f"{prev!r} must feed only {e!r}, and {e!r} read only {prev!r}")
    if epilogue and not (succs[epilogue[-1]] and all(nodes[v]["kind"] == "output" for v in succs[epilogue[-1]])):
        fail(f"{owner}: epilogue={show_value(epilogue)} must end in a node that only the graph output reads")


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
        fail(f"{owner} reads {show_value(preds[name])}; expected exactly its collective {coll!r} (edge [{coll!r}, "
             f"{name!r}])")
    root = ca["alias_of"] or coll
    if a["alias_of"] != root:
        fail(f"{owner}: alias_of={a['alias_of']!r}; expected {root!r} (a wait returns its collective's storage)")
