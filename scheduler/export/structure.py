"""Structure inference: which parameter, and so which collective, belongs to which block,
and in which direction it runs.

Works on any partitioned forward or backward graph and on joint forward + loss + backward
graphs (make_fx of a training step, as torchtitan's graph trainer traces it), including graphs
we did not capture.
For every parameter collective of the DAG (role ``"fsdp"``: the all-gather of a parameter
shard, the reduce-scatter of a gradient) it recovers the parameter's name and the *block*
(transformer layer, MLP block, ...) it belongs to, and says which blocks look alike.

Sources, tried in this order for each collective; the first that names it wins:

1. ``"fsdp_fqn"``: ``node.meta["fsdp_fqn"]``, written by our own capture (models/capture.py).
   One source among others, never a requirement.
2. ``"dynamo"``: ``gm.meta["fsdp_input_names"]``, forward placeholder name -> parameter name
   (forward placeholder order), recorded by a backend that saw the dynamo graph
   (:func:`dynamo_input_names`, :func:`forward_input_names`, :func:`attach_input_names`).
   Forward all-gathers find their source placeholder; backward reduce-scatters the forward
   input whose gradient they produce (output ``j`` is the gradient of forward input ``j``);
   backward re-gathers the forward placeholder they gather again.
3. ``"module_stack"``: what aot_autograd graphs carry: ``nn_module_stack`` (forward) /
   ``fwd_nn_module_stack`` (backward), or what graph-trainer joint graphs carry:
   ``node.meta["custom"]["module_fqn"]`` (the innermost module, on backward nodes copied
   from their forward op), of the collective itself, which names the parameter
   when the gather runs in a parametrization (SimpleFSDP style:
   ``trunk.0.up.parametrizations.weight.0`` -> ``trunk.0.up.weight``); else of the ops that
   consume the gathered parameter (forward) or produce the gradient (backward), whose module
   path plus a guessed attribute (``weight``, then ``bias``) names it.
4. ``"graph"``: the graph itself, when names are missing for some collective. Every parameter
   collective gets a token: its type, dtype, rank of the parameter, and the shape-free op
   sequence from it to the next parameter collective. The longest run of tokens repeating
   with one period is the stack of blocks (one unit of the period per block); what comes
   before or after the run is outside any block. Parameter shapes then tell the blocks'
   signatures apart (e.g. alternating widths). It cannot tell a block that alternates two
   layer kinds from one layer: it then reports the pair as one block.

Joint graphs (``graph_kind`` ``"joint"``, or a graph of unknown kind whose nodes carry
``autograd_backward`` on part of them, or whose reduce-scatters do not feed its scalar first
output while some all-gather does): every node is in the *forward* (the loss and what it reads)
or the *backward* (``node.meta["autograd_backward"]`` where the graph carries it, else what
the loss does not read: gradients, and the recomputed copies that selective checkpointing or
reshard-after-forward put there). Blocks are numbered by the forward; the graph fallback finds
the repetition in each direction apart, and a backward re-gather takes the block of the
forward all-gather of the same parameter shard (the same graph input).

A block from a name is its first purely numeric path component with its prefix
(``trunk.3.up.weight`` -> ``trunk.3``); names without one (embeddings, final norm, output)
are in no block. Blocks are numbered 0, 1, ... in *forward* execution order in both graphs
(so in a backward graph they run from the highest index down); parameters outside any block
get ``None``. Collectives that are not parameter collectives (tensor-parallel all-reduces,
expert all-to-alls) get the block of their module stack when the graph has one, else None.

What :func:`annotate_structure` writes on the DAG:

- every collective node: ``block`` (int | None); ``phase`` (``"forward"``, ``"backward"`` or
  None: the direction it runs in; in a partitioned graph its kind, as given or guessed);
  ``structure_source`` (str | None: the source
  that named it, None when none did); ``fqns`` (list[str]) replaced by the recovered name when
  the collective had no ``fsdp_fqn`` and a source named it.
- ``dag.graph["structure"]`` (JSON-able dict): ``source`` (str: the source that named most
  parameter collectives, ``"graph"`` when the fallback decided the blocks, ``"none"``),
  ``sources`` (dict source -> number of collectives it named), ``n_blocks`` (int),
  ``block_names`` (list[str], per block: ``"trunk.3"``, or ``"block3"`` from the fallback),
  ``signatures`` (list[int], per block: blocks with equal numbers have the same collectives:
  types, dtypes, payload bytes and roles), ``n_signatures`` (int), ``signature_period``
  (int | None: the least ``p`` with ``signatures[b] == signatures[b + p]`` for every ``b``,
  None without blocks), ``unit_collectives`` (int | None: collectives per repeating unit
  found by the fallback, None for named blocks).
- ``dag.graph["graph_kind"]`` set to ``"joint"`` when a graph of unknown kind is a joint graph.
"""

from __future__ import annotations

import logging
import operator
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.export.repetition import find_repetition, least_period, place_units

if TYPE_CHECKING:
    import networkx as nx
    import torch.fx

logger = logging.getLogger(__name__)

#: gm.meta key of the forward-input names recorded from the dynamo graph
INPUT_NAMES_KEY = "fsdp_input_names"
SOURCES = ("fsdp_fqn", "dynamo", "module_stack", "graph")
#: the directions a node of a joint graph runs in
PHASES = ("forward", "backward")
#: ``node.meta["custom"]`` key naming the module whose forward ran a node (torchtitan's graph
#: trainer annotates every node with it)
MODULE_FQN_KEY = "module_fqn"

#: ops a parameter or gradient passes through unchanged (up to dtype / layout)
_PASS_OPS = {"convert_element_type", "_to_copy", "view", "_unsafe_view", "reshape", "t", "permute",
             "transpose", "clone", "contiguous", "detach", "alias", "expand", "unsqueeze", "squeeze",
             "wait_tensor", "getitem", "slice", "split", "narrow"}
_COLLECTIVE_NS = ("_c10d_functional", "c10d_functional")
#: ops kept in a graph token, nearest the collective first: the readers of a gathered
#: parameter or the last steps of a gradient; ops further away (residual adds, accumulation)
#: move between layers as the partitioner orders them
_MAX_TOKEN_OPS = 8


# --------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------
def normalize_path(path: str) -> str | None:
    """A module or parameter path as the user writes it, from dynamo's spellings.

    ``L['self']._modules['trunk']._modules['0']._modules['up']._modules['parametrizations']
    ._modules['weight']._parameters['original']`` and ``L['self'].trunk.0.up.parametrizations
    .weight.0`` both give ``trunk.0.up.weight``; ``L['tokens']`` (a user input, not an
    attribute of the module) gives None.
    """
    s = path.strip()
    m = re.match(r"^(?:L|G)\[['\"](\w+)['\"]\]", s)
    if m:
        if m.group(1) != "self" and not s[m.end():]:
            return None
        s = s[m.end():]
    elif s.startswith("self"):
        s = s[len("self"):]
    s = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    s = s.strip(".")
    if not s:
        return None
    parts = s.split(".")
    # parametrize: <owner>.parametrizations.<attr>.original | .<k> (the parametrization module)
    if "parametrizations" in parts:
        i = parts.index("parametrizations")
        if i + 1 < len(parts):
            parts = parts[:i] + [parts[i + 1]]
    return ".".join(parts)


def block_key(name: str | None) -> tuple[str, int] | None:
    """(container prefix, index) of the first purely numeric component: ``trunk.3.up.weight``
    -> ``("trunk", 3)``; None for names outside a repeated container."""
    if not name:
        return None
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


def dynamo_input_names(dynamo_gm: "torch.fx.GraphModule") -> list[str | None]:
    """Parameter / buffer name of every placeholder of a dynamo graph (None for user inputs).

    For a torch.compile backend, which receives the dynamo graph before aot_autograd: the
    placeholders carry their source (``L['self']._modules['layers']...``).
    """
    out: list[str | None] = []
    for node in dynamo_gm.graph.find_nodes(op="placeholder"):
        ga = node.meta.get("grapharg")
        source = getattr(ga, "source", None)
        name = getattr(source, "name", None) if source is not None else None
        if callable(name):
            name = name()
        if isinstance(name, str) and ("_parameters[" in name or "_buffers[" in name or ".parametrizations." in name):
            out.append(normalize_path(name))
        else:
            out.append(None)
    return out


def forward_input_names(fw_gm: "torch.fx.GraphModule", input_names: Sequence[str | None]) -> dict[str, str | None]:
    """Forward placeholder name -> name of the dynamo input it comes from, in placeholder order.

    aot_autograd's forward placeholders follow the dynamo inputs one for one (a DTensor
    parameter contributes its local shard), with opaque script objects (meshes) in between,
    which get None.
    """
    out: dict[str, str | None] = {}
    names = iter(input_names)
    for node in fw_gm.graph.find_nodes(op="placeholder"):
        if type(node.meta.get("val")).__name__ in ("FakeScriptObject", "ScriptObject"):
            out[node.name] = None
        else:
            out[node.name] = next(names, None)
    return out


def attach_input_names(gm: "torch.fx.GraphModule", names: Mapping[str, str | None]) -> None:
    """Record the forward inputs' names (from :func:`forward_input_names`) on a forward or
    backward graph, for source 2 of :func:`infer_structure`."""
    gm.meta[INPUT_NAMES_KEY] = dict(names)


# --------------------------------------------------------------------------------------------
# graph helpers
# --------------------------------------------------------------------------------------------
def _op(node: Any) -> str:
    if getattr(node, "op", None) != "call_function":
        return str(getattr(node, "op", ""))
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if hasattr(t, "_schema"):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _is_collective(node: Any) -> bool:
    return getattr(node.target, "namespace", None) in _COLLECTIVE_NS and _op(node) != "wait_tensor"


def _upstream(node: Any) -> Any:
    """Follow first arguments through pass-through ops (casts, views, waits)."""
    seen = 0
    while getattr(node, "op", None) == "call_function" and _op(node) in _PASS_OPS and node.args and seen < 64:
        node = node.args[0]
        seen += 1
    return node


def _downstream(node: Any, limit: int = 64) -> list[Any]:
    """The first non-pass-through readers of ``node`` (through casts, views, waits)."""
    out, stack, seen = [], list(node.users), set()
    while stack and len(seen) < limit:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and _op(u) in _PASS_OPS:
            stack.extend(u.users)
        elif u.op != "output":
            out.append(u)
    return out


def _output_index(node: Any) -> int | None:
    """Index ``j`` in the graph output of the value flowing from ``node`` through pass-through
    ops (a backward graph's output ``j`` is the gradient of forward input ``j``)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output":
                outs = u.args[0] if isinstance(u.args[0], (list, tuple)) else [u.args[0]]
                for j, o in enumerate(outs):
                    if o is n:
                        return j
            elif u.op == "call_function" and _op(u) in _PASS_OPS:
                stack.append(u)
    return None


def _module_paths(node: Any) -> list[str]:
    """Module paths (outermost first, normalised) from the node's (fwd_)nn_module_stack, or its
    ``custom`` ``module_fqn`` (the innermost module only)."""
    out = []
    for path in _raw_module_paths(node):
        p = normalize_path(path)
        if p:
            out.append(p)
    return out


def _raw_module_paths(node: Any) -> list[str]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    paths = [str(v[0] if isinstance(v, (tuple, list)) else v) for v in stack.values()]
    custom = node.meta.get("custom")
    fqn = custom.get(MODULE_FQN_KEY) if isinstance(custom, dict) else None
    if not paths and isinstance(fqn, str) and fqn:
        paths.append(fqn)
    return paths


def _param_val(coll: Any) -> Any:
    inp = coll.args[0] if coll.args else None
    return getattr(inp, "meta", {}).get("val")


def _ndim(val: Any) -> int:
    try:
        return len(val.shape)
    except Exception:
        return -1


# --------------------------------------------------------------------------------------------
# the sources
# --------------------------------------------------------------------------------------------
def _name_from_fsdp_fqn(node: Any, graph_kind: str, gm: Any) -> str | None:
    fqn = node.meta.get("fsdp_fqn")
    if isinstance(fqn, (list, tuple)):
        fqn = fqn[0] if fqn else None
    return str(fqn) if fqn else None


def _name_from_dynamo(node: Any, graph_kind: str, gm: Any) -> str | None:
    names = getattr(gm, "meta", {}).get(INPUT_NAMES_KEY)
    if not names:
        return None
    if _op(node).startswith("all_gather"):
        src = _upstream(node.args[0])
        if getattr(src, "op", None) == "placeholder" and names.get(src.name):
            return names[src.name]
    if _op(node).startswith("reduce_scatter"):
        wait = next((u for u in node.users if _op(u) == "wait_tensor"), node)
        j = _output_index(wait)
        keys = list(names)
        if j is not None and j < len(keys):
            return names[keys[j]]
    return None


def _name_from_module_stack(node: Any, graph_kind: str, gm: Any) -> str | None:
    # the gather itself inside a parametrization module names the parameter
    for raw in reversed(_raw_module_paths(node)):
        # a graph trainer's module_fqn of a root parameter starts with "parametrizations."
        if ".parametrizations." in "." + raw or "._modules['parametrizations']" in raw:
            return normalize_path(raw)
    # else the ops that read the gathered parameter / produce the gradient
    if _op(node).startswith("all_gather"):
        wait = next((u for u in node.users if _op(u) == "wait_tensor"), node)
        readers = _downstream(wait)
    else:
        src = _upstream(node.args[0]) if node.args else None
        readers = [src] if getattr(src, "op", None) == "call_function" else []
    paths = [p[-1] for p in (_module_paths(r) for r in readers) if p]
    if not paths:
        return None
    module = Counter(paths).most_common(1)[0][0]
    return f"{module}.weight"  # a second parameter of the module becomes .bias in _dedupe


_NAMERS = {
    "fsdp_fqn": _name_from_fsdp_fqn,
    "dynamo": _name_from_dynamo,
    "module_stack": _name_from_module_stack,
}


# --------------------------------------------------------------------------------------------
# the graph fallback
# --------------------------------------------------------------------------------------------
def _tokens(nodes: list[Any], colls: list[Any]) -> list[tuple]:
    """One hashable token per parameter collective: type, dtype, parameter rank and the
    shape-free op sequence that belongs to it: for an all-gather the ops from it to the next
    parameter collective (its readers), for a reduce-scatter the ops from the previous one
    (the gradient's computation)."""
    pos = {n: i for i, n in enumerate(nodes)}
    bounds = [-1] + [pos[c] for c in colls] + [len(nodes)]
    out = []
    for k, c in enumerate(colls):
        if _op(c).startswith("reduce_scatter"):
            segment = nodes[bounds[k] + 1: bounds[k + 1]][::-1]
        else:
            segment = nodes[bounds[k + 1] + 1: bounds[k + 2]]
        ops = []
        for n in segment:
            if n.op == "call_function" and not _is_collective(n) and _op(n) != "wait_tensor":
                ops.append(_op(n))
                if len(ops) >= _MAX_TOKEN_OPS:
                    break
        out.append(_coarse(c) + (tuple(ops),))
    return out


def _coarse(c: Any) -> tuple:
    """Type, dtype and rank of a parameter collective's payload."""
    val = _param_val(c)
    return (_op(c), str(getattr(val, "dtype", None)), _ndim(val))


# --------------------------------------------------------------------------------------------
# inference
# --------------------------------------------------------------------------------------------
class Structure:
    """Result of :func:`infer_structure` (plain data, see the module docstring)."""

    def __init__(self, block: dict[str, int | None], names: dict[str, str], source_of: dict[str, str],
                 block_names: list[str], signatures: list[int], source: str,
                 unit_collectives: int | None, phase: dict[str, str | None] | None = None,
                 graph_kind: str = "unknown"):
        self.block = block  #: collective node name -> block index | None
        self.phase = phase or {}  #: collective node name -> "forward" | "backward" | None
        self.graph_kind = graph_kind  #: "forward", "backward", "joint" or "unknown"
        self.names = names  #: collective node name -> recovered parameter name
        self.source_of = source_of  #: collective node name -> source that named it
        self.block_names = block_names
        self.signatures = signatures
        self.source = source
        self.unit_collectives = unit_collectives

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sources": dict(sorted(Counter(self.source_of.values()).items())),
            "n_blocks": len(self.block_names),
            "block_names": list(self.block_names),
            "signatures": list(self.signatures),
            "n_signatures": len(set(self.signatures)),
            "signature_period": least_period(self.signatures),
            "unit_collectives": self.unit_collectives,
        }


def _classes(keys: Iterable[Any]) -> list[int]:
    ids: dict[Any, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def infer_structure(gm: "torch.fx.GraphModule", param_colls: Sequence[str], *, graph_kind: str = "unknown",
                    other_colls: Sequence[str] = ()) -> Structure:
    """Blocks and directions of the parameter collectives ``param_colls`` (FX node names, graph
    order).

    Args:
        gm: the partitioned forward or backward graph, or a joint graph.
        param_colls: its parameter collectives (FSDP all-gathers / reduce-scatters).
        graph_kind: ``"forward"``, ``"backward"``, ``"joint"`` or ``"unknown"`` (then a joint
            graph is recognised by :func:`node_phases`, and otherwise a graph with a
            ``tangents_*`` placeholder or reduce-scatters and no all-gather before them is
            taken as backward).
        other_colls: its other collectives (tensor / expert parallel): they get a block from
            their module stack only.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    phases = node_phases(gm, graph_kind)
    if phases is not None:
        graph_kind = "joint"
    elif graph_kind not in ("forward", "backward"):
        graph_kind = _guess_kind(nodes)
    backward = graph_kind == "backward"
    colls = [by_name[c] for c in param_colls]
    phase_of: dict[str, str | None] = {}
    for name in [*param_colls, *other_colls]:
        phase_of[name] = phases.get(by_name[name]) if phases is not None else graph_kind

    names: dict[str, str] = {}
    source_of: dict[str, str] = {}
    for c in colls:
        for source, namer in _NAMERS.items():
            try:
                name = namer(c, graph_kind, gm)
            except Exception as e:  # a source that cannot read this graph: try the next
                logger.debug("structure source %s failed on %s: %s", source, c.name, e)
                name = None
            if name:
                names[c.name], source_of[c.name] = name, source
                break
    _dedupe(names, {c.name: (_op(c), phase_of[c.name]) for c in colls})

    block: dict[str, int | None] = {}
    if colls and len(names) == len(colls):
        block_names = _blocks_from_names(colls, names, block, backward)
        source = Counter(source_of.values()).most_common(1)[0][0]
        unit = None
        sig_keys = []
        for b, bname in enumerate(block_names):
            members = [c for c in colls if block[c.name] == b]
            sig_keys.append(tuple((_op(c), _val_key(c), names[c.name][len(bname):]) for c in members))
    else:
        if phases is None:
            block_names, unit = _blocks_from_graph(nodes, colls, block, backward)
        else:
            block_names, unit = _joint_blocks_from_graph(nodes, colls, block, phase_of)
        source = "graph" if block_names else ("none" if not names else Counter(source_of.values()).most_common(1)[0][0])
        sig_keys = [tuple((_op(c), _val_key(c)) for c in colls if block[c.name] == b) for b in range(len(block_names))]
    for name in other_colls:
        block[name] = _block_of_other(by_name[name], block_names)
    structure = Structure(block, names, source_of, block_names, _classes(sig_keys), source, unit,
                          phase=phase_of, graph_kind=graph_kind)
    logger.info("structure of %s graph: %d blocks from %s, %d signature(s)", graph_kind, len(block_names),
                source, len(set(structure.signatures)))
    return structure


def node_phases(gm: "torch.fx.GraphModule", graph_kind: str = "unknown") -> dict[Any, str] | None:
    """The direction of every ``call_function`` node of a joint graph (``"forward"`` or
    ``"backward"``); None when ``gm`` is not a joint graph (module docstring).

    A node is backward when it carries ``node.meta["autograd_backward"]`` (make_fx of
    ``torch.autograd.grad`` under torch's non-strict tracing, torch's remat pass on its
    recomputed copies), or when the graph's first output (the loss) does not read it: nodes a
    rewrite inserted (merged buckets and their copies) carry no mark, and what the loss reads
    is the forward.
    """
    if graph_kind in ("forward", "backward"):
        return None
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    marked = [bool(n.meta.get("autograd_backward", False)) for n in calls]
    if all(marked) or any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
        return None
    loss = _loss_output(gm)
    forward: set[Any] = set()
    stack = [loss] if loss is not None else []
    while stack:
        n = stack.pop()
        if n in forward:
            continue
        forward.add(n)
        stack.extend(n.all_input_nodes)
    if any(marked):
        return {n: "backward" if m or (loss is not None and n not in forward) else "forward"
                for n, m in zip(calls, marked)}
    if loss is None:
        return None
    colls = [n for n in calls if _is_collective(n)]
    gathers_forward = any(_op(n).startswith("all_gather") and n in forward for n in colls)
    reduces_backward = any(_op(n).startswith("reduce_scatter") and n not in forward for n in colls)
    if graph_kind != "joint" and not (gathers_forward and reduces_backward):
        return None
    return {n: "forward" if n in forward else "backward" for n in calls}


def _loss_output(gm: "torch.fx.GraphModule") -> Any:
    """The graph's first output when it is a scalar (0-dim) tensor node: a training step's loss."""
    outputs = gm.graph.find_nodes(op="output")
    if not outputs:
        return None
    outs = outputs[0].args[0]
    first = outs[0] if isinstance(outs, (list, tuple)) and outs else outs
    val = getattr(first, "meta", {}).get("val")
    return first if getattr(val, "ndim", None) == 0 else None


def _guess_kind(nodes: list[Any]) -> str:
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in nodes):
        return "backward"
    ops = [_op(n) for n in nodes if n.op == "call_function"]
    rs = [i for i, o in enumerate(ops) if o.startswith("reduce_scatter")]
    ag = [i for i, o in enumerate(ops) if o.startswith("all_gather")]
    return "backward" if rs and (not ag or rs[0] < ag[0]) else "forward"


def _val_key(c: Any) -> tuple:
    val = _param_val(c)
    shape = getattr(val, "shape", None)
    return (str(getattr(val, "dtype", None)), tuple(int(s) if isinstance(s, int) else str(s) for s in shape)
            if shape is not None else None)


def _dedupe(names: dict[str, str], kinds: Mapping[str, tuple]) -> None:
    """Two collectives of one graph guessed to one name (one module, two parameters): the
    second becomes ``<module>.bias``, further ones ``<name>#k``. Collectives of one parameter
    that differ in ``kinds`` (op and direction: a backward re-gather beside the reduce-scatter,
    a joint graph's forward gather and backward re-gather) keep their name."""
    seen: dict[tuple, int] = {}
    for c in list(names):
        key = (names[c], kinds.get(c))
        k = seen.get(key, 0)
        seen[key] = k + 1
        if k == 1 and names[c].endswith(".weight"):
            names[c] = names[c][: -len("weight")] + "bias"
        elif k >= 1:
            names[c] = f"{names[c]}#{k}"


def _blocks_from_names(colls: list[Any], names: dict[str, str], block: dict[str, int | None],
                       backward: bool) -> list[str]:
    """Number the blocks named by ``names``: containers in execution order (reversed in a
    backward graph), blocks of a container by their index."""
    first_seen: dict[str, int] = {}
    keys: dict[str, tuple[str, int] | None] = {}
    for i, c in enumerate(colls):
        k = block_key(names[c.name])
        keys[c.name] = k
        if k is not None:
            first_seen.setdefault(k[0], i)
    containers = sorted(first_seen, key=first_seen.get, reverse=backward)
    ordered = sorted({k for k in keys.values() if k is not None}, key=lambda k: (containers.index(k[0]), k[1]))
    index = {k: b for b, k in enumerate(ordered)}
    for c in colls:
        k = keys[c.name]
        block[c.name] = index[k] if k is not None else None
    return [f"{p}.{i}" if p else str(i) for p, i in ordered]


def _blocks_from_graph(nodes: list[Any], colls: list[Any], block: dict[str, int | None],
                       backward: bool) -> tuple[list[str], int | None]:
    for c in colls:
        block[c.name] = None
    tokens = _tokens(nodes, colls)
    rep = find_repetition(tokens) if len(colls) >= 2 else None
    if rep is None:
        return [], None
    period = rep[1]
    start, units = place_units(tokens, [_val_key(c) for c in colls], rep, backward=backward)
    for k in range(units):
        b = units - 1 - k if backward else k
        for c in colls[start + k * period: start + (k + 1) * period]:
            block[c.name] = b
    return [f"block{b}" for b in range(units)], period


def _joint_blocks_from_graph(nodes: list[Any], colls: list[Any], block: dict[str, int | None],
                             phase_of: Mapping[str, str | None]) -> tuple[list[str], int | None]:
    """The graph fallback on a joint graph: the repetition of the forward's collectives numbers
    the blocks; a backward re-gather takes the block of the forward all-gather of the same graph
    input; the backward's own repetition numbers the rest of the backward (from the last block
    down) when it finds as many blocks as the forward."""
    fwd = [c for c in colls if phase_of.get(c.name) == "forward"]
    bwd = [c for c in colls if phase_of.get(c.name) != "forward"]
    names, unit = _blocks_from_graph(nodes, fwd, block, False)
    back: dict[str, int | None] = {}
    back_names, _ = _blocks_from_graph(nodes, bwd, back, True)
    same_count = len(back_names) == len(names)
    source_block = {}
    for c in fwd:
        src = _upstream(c.args[0]) if _op(c).startswith("all_gather") and c.args else None
        if getattr(src, "op", None) == "placeholder":
            source_block[src] = block[c.name]
    for c in bwd:
        src = _upstream(c.args[0]) if _op(c).startswith("all_gather") and c.args else None
        if src in source_block:
            block[c.name] = source_block[src]
        else:
            block[c.name] = back.get(c.name) if same_count else None
    return names, unit


def _block_of_other(node: Any, block_names: list[str]) -> int | None:
    index = {n: b for b, n in enumerate(block_names)}
    for path in reversed(_module_paths(node)):
        k = block_key(path + ".x")
        if k is not None:
            name = f"{k[0]}.{k[1]}" if k[0] else str(k[1])
            if name in index:
                return index[name]
    return None


# --------------------------------------------------------------------------------------------
# the DAG
# --------------------------------------------------------------------------------------------
def annotate_structure(dag: "nx.DiGraph", gm: "torch.fx.GraphModule") -> Structure:
    """Infer the structure of ``gm`` and write it on its DAG (see the module docstring)."""
    order = dag.graph["order"]
    colls = [n for n in order if dag.nodes[n]["kind"] == "collective"]
    param = [n for n in colls if dag.nodes[n].get("role") == "fsdp"]
    other = [n for n in colls if dag.nodes[n].get("role") != "fsdp"]
    structure = infer_structure(gm, param, graph_kind=dag.graph.get("graph_kind", "unknown"), other_colls=other)
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in colls:
        a = dag.nodes[n]
        a["block"] = structure.block.get(n)
        a["phase"] = structure.phase.get(n)
        a["structure_source"] = structure.source_of.get(n)
        if n in structure.names and not by_name[n].meta.get("fsdp_fqn"):
            a["fqns"] = [structure.names[n]]
    if structure.graph_kind == "joint":
        dag.graph["graph_kind"] = "joint"
    dag.graph["structure"] = structure.summary()
    return structure
