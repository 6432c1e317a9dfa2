"""Judge a (rewritten) FX graph on torch's side: a reference liveness count of its memory, and
torch's own memory estimator, both in the graph's traced order.

This is the yardstick for the export (``scheduler.export.dag``) and the simulator: re-exporting a
written-back graph and simulating it as traced must give exactly :func:`liveness_peak`
(see ``benchmarks/writeback_agreement.py`` and ``tests/test_judge.py``).

Reference count (:func:`liveness_profile`), one storage at a time:

- Storages are those of the FakeTensors in ``node.meta['val']`` (views share their base's
  storage), with two corrections where fake tensors do not say what the op does:
  ``wait_tensor`` returns its input (its schema has no alias annotation, so under fake tensors
  it gets a fresh storage), and an op whose schema says a result is a written-to argument
  (``Tensor(a!)``: ``all_gather_into_tensor_out``'s ``out``, ``copy_``'s ``self``, each
  ``out=`` tensor of ``topk.values``) returns that argument's storage.
- Each result of a multi-output node is a storage of its own; a ``getitem`` holds its result's,
  and a node reading the multi-output node itself holds them all.
- A storage is allocated by the first node whose output holds it and freed after its last
  reader (any node whose input holds it). A collective's input storages stay alive until the
  collective's wait (NCCL reads them until it completes). Storages of graph inputs named
  ``primals*`` and storages the graph returns are never freed (torch's memory_estimator rule
  for parameters). A storage nobody reads is freed right after the node that made it (FX's
  generated code drops unused values at once).
- Live bytes of a node: after its allocations, before its frees. Peak = the largest of these
  and the live bytes of the graph inputs.

Differences of torch's estimator (:func:`torch_tracker_peak`,
``memory_estimator.MemoryTracker``) from the reference, on graphs traced on CPU / meta (its
default device filter skips CPU tensors; a filter accepting every device is passed):

- it frees a collective's input after the collective node, not after its wait;
- ``wait_tensor`` and ``all_gather_into_tensor_out`` get the fresh storage of their
  FakeTensor, so a bucket in flight is counted twice (buffer and ``out=`` result) and every
  wait allocates the collective's output again until the wait's last reader;
- storages nobody reads are never freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from scheduler.export.ops import written_argument, written_arguments
from scheduler.export.shapes import unbacked_hints

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Liveness:
    """Result of :func:`liveness_profile`.

    Attributes:
        peak_bytes: the largest live bytes.
        peak_node: name of the node at which the peak is reached (None: the graph inputs).
        input_bytes: live bytes of the graph inputs before the first node runs.
        live_bytes: node name -> live bytes while it runs (after its allocations, before its
            frees), for every node that is not a placeholder / get_attr / output.
        allocated_bytes: node name -> bytes of the storages the node allocates.
    """

    peak_bytes: int
    peak_node: str | None
    input_bytes: int
    live_bytes: dict[str, int]
    allocated_bytes: dict[str, int]


def default_is_releasable(node: "torch.fx.Node") -> bool:
    """Parameter shards (graph inputs named ``primals*``) live across forward and backward; the
    graph cannot free them. Same rule as ``memory_estimator._is_releasable`` and our DAG."""
    return not node.name.startswith("primals")


def liveness_profile(
    gm: "torch.fx.GraphModule | torch.fx.Graph",
    *,
    is_releasable: Callable[["torch.fx.Node"], bool] = default_is_releasable,
    storages: str = "structural",
    alias_written_outputs: bool = True,
    inputs_live_until_wait: bool = True,
    free_unread: bool = True,
) -> Liveness:
    """Reference live-memory count of a graph in its node order (rules in the module docstring).

    Args:
        gm: a graph (or GraphModule) whose nodes carry FakeTensors or tensors in
            ``meta['val']``.
        is_releasable: whether storages a graph input allocates may be freed after their last
            reader (default: all but ``primals*``).
        storages: ``"structural"`` (default): which storage a node's output holds follows
            from the graph (views, ``getitem``, waits and ``Tensor(a!)`` results hold their
            argument's; anything else allocates). ``"fake"``: the FakeTensors' storages, as
            torch's ``memory_estimator`` reads them; on rewritten graphs they can be stale
            (torch's merge functions rewire the readers of the old waits but keep their old
            FakeTensors).
        alias_written_outputs, inputs_live_until_wait, free_unread: the rules in which the
            reference differs from torch's ``memory_estimator`` (all True by default):
            ``wait_tensor`` / ``Tensor(a!)`` results share their argument's storage; a
            collective's inputs live until its wait; unread storages are freed at once. With
            ``storages="fake"`` and all three False the count is torch's
            (:func:`torch_tracker_peak`), which is how differences are attributed to them.

    Returns:
        :class:`Liveness` with bytes of every storage counted once.
    """
    graph = getattr(gm, "graph", gm)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    held = _node_storages(nodes, storages=storages, alias_written_outputs=alias_written_outputs,
                          hints=unbacked_hints(graph))

    size: dict[Any, int] = {}
    allocator: dict[Any, "torch.fx.Node"] = {}
    for n in nodes:
        for key, nbytes in held[n]:
            if key not in allocator:
                allocator[key] = n
                size[key] = nbytes

    last_use: dict[Any, int] = {}
    pinned: set[Any] = set()
    for n in nodes:
        for inp in n.all_input_nodes:
            for key, _ in held[inp]:
                if n.op == "output":
                    pinned.add(key)
                else:
                    last_use[key] = max(last_use.get(key, -1), index[n])
    # a collective's input lives until its wait
    for n in nodes if inputs_live_until_wait else ():
        wait = _wait_of(n)
        if wait is None:
            continue
        for inp in n.all_input_nodes:
            for key, _ in held[inp]:
                last_use[key] = max(last_use.get(key, -1), index[wait])
    for key, n in allocator.items():
        if n.op in ("placeholder", "get_attr") and not is_releasable(n):
            pinned.add(key)

    frees: dict[int, list[Any]] = {}
    for key, n in allocator.items():
        if key in pinned:
            continue
        if key in last_use:
            frees.setdefault(last_use[key], []).append(key)
        elif free_unread and n.op not in ("placeholder", "get_attr"):
            frees.setdefault(index[n], []).append(key)  # nobody reads it: dropped at once

    live = 0
    for key, n in allocator.items():
        if n.op in ("placeholder", "get_attr"):
            live += size[key]
    input_bytes = live
    peak, peak_node = live, None
    live_bytes: dict[str, int] = {}
    allocated: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        fresh = sum(size[k] for k, _ in held[n] if allocator[k] is n)
        allocated[n.name] = fresh
        live += fresh
        live_bytes[n.name] = live
        if live > peak:
            peak, peak_node = live, n.name
        live -= sum(size[k] for k in frees.get(i, ()))
    return Liveness(peak, peak_node, input_bytes, live_bytes, allocated)


def liveness_peak(gm: "torch.fx.GraphModule | torch.fx.Graph", **kw: Any) -> int:
    """Peak bytes of :func:`liveness_profile`."""
    return liveness_profile(gm, **kw).peak_bytes


def torch_tracker_peak(
    gm: "torch.fx.GraphModule | torch.fx.Graph",
    *,
    is_releasable: Callable[["torch.fx.Node"], bool] = default_is_releasable,
) -> int:
    """Peak bytes by torch's ``memory_estimator.MemoryTracker``, nodes scheduled in graph order.

    Counts tensors on every device (the default filter skips CPU tensors, so a graph traced
    on CPU or meta would look as if it used no memory). Data-dependent sizes (MoE splits) take
    the export's estimates (:func:`scheduler.export.shapes.unbacked_hints`) instead of torch's fallback. torch's storage rules as they are:
    see the module docstring for how they differ from :func:`liveness_profile`.
    """
    from unittest import mock

    from torch._inductor.fx_passes import memory_estimator

    graph = getattr(gm, "graph", gm)
    hints = unbacked_hints(graph)
    original = memory_estimator.optimization_hint

    def hint(size: Any) -> int:
        expr = getattr(getattr(size, "node", None), "expr", None)
        value = expr.xreplace(hints) if expr is not None else None
        return int(value) if value is not None and value.is_number else original(size)

    # data-dependent sizes at the export's estimates, as every other count of this graph
    # (torch's own hint is inductor's fallback, 8192 rows, whatever the graph)
    with mock.patch.object(memory_estimator, "optimization_hint", hint) if hints else contextlib.nullcontext():
        tracker = memory_estimator.MemoryTracker(graph, is_releasable=is_releasable, device_filter=lambda device: True)
        for n in graph.nodes:
            tracker.schedule_node(n)
    return int(tracker.peak_memory)


# --------------------------------------------------------------------------------------------
# storages
# --------------------------------------------------------------------------------------------
def _nbytes(storage: Any, hints: dict) -> int:
    """Bytes of ``storage``; a data-dependent size is evaluated at ``hints``."""
    n = storage.nbytes()
    if isinstance(n, int):
        return n
    expr = getattr(getattr(n, "node", None), "expr", None)
    value = expr.xreplace(hints) if expr is not None else None
    if value is None or not value.is_number:
        raise ValueError(f"storage size {n} depends on symbols with no estimate; export the graph first")
    return int(value)


def _node_storages(
    nodes: Iterable["torch.fx.Node"], *, storages: str, alias_written_outputs: bool, hints: dict
) -> dict["torch.fx.Node", list[tuple[Any, int]]]:
    """(storage key, bytes) of the storages a node's output holds; data-dependent sizes take
    the export's estimates (``hints``: :func:`scheduler.export.shapes.unbacked_hints`)."""
    if storages == "structural":
        elems = _structural_storages(nodes, alias_written_outputs=alias_written_outputs, hints=hints)
        return {n: list(dict(kv for e in es for kv in e).items()) for n, es in elems.items()}
    if storages == "fake":
        return _fake_storages(nodes, alias_written_outputs=alias_written_outputs, hints=hints)
    raise ValueError(f"storages must be 'structural' or 'fake', got {storages!r}")


def _structural_storages(
    nodes: Iterable["torch.fx.Node"], *, alias_written_outputs: bool, hints: dict
) -> dict["torch.fx.Node", list[list[tuple[Any, int]]]]:
    """Per node and top-level output element, its (storage key, bytes), from the graph's
    structure: a view (``is_view`` ops, ``_unsafe_view``) holds its first argument's storages,
    ``getitem`` the indexed element's, ``wait_tensor`` / ``Tensor(a!)`` results their
    argument's; any other node allocates one storage per output tensor (bytes from its
    ``meta['val']``)."""
    import operator

    from torch.fx import Node

    elems: dict[Any, list[list[tuple[Any, int]]]] = {}
    shared: set[Any] = set()  # nodes whose every element holds all storages of their base
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            base, i = n.args[0], n.args[1]
            parts = elems.get(base, [])
            if base not in shared and isinstance(i, int) and -len(parts) <= i < len(parts):
                elems[n] = [parts[i]]
            else:
                elems[n] = [[kv for e in parts for kv in e]]
            continue
        src = _written_argument(n) if alias_written_outputs else None
        if src is None and _is_view(n):
            src = next((a for a in n.args if isinstance(a, Node)), None)
        if src is not None:
            held = [kv for e in elems.get(src, []) for kv in e]
            elems[n] = [held] * max(1, len(_top_level(n.meta.get("val"))))
            shared.add(n)
            continue
        parts = []
        tops = _top_level(n.meta.get("val"))
        written = written_arguments(n) if alias_written_outputs else []
        for j, top in enumerate(tops):
            if len(written) == len(tops) and written[j] is not None:  # a result written into an argument
                parts.append([kv for e in elems.get(written[j], []) for kv in e])
                continue
            own: dict[Any, int] = {}
            for t in _tensors(top):
                st = t.untyped_storage()
                own.setdefault((n.name, j, st._cdata), _nbytes(st, hints))
            parts.append(list(own.items()))
        elems[n] = parts
    return elems


def _fake_storages(
    nodes: Iterable["torch.fx.Node"], *, alias_written_outputs: bool, hints: dict
) -> dict["torch.fx.Node", list[tuple[Any, int]]]:
    """Storages as the FakeTensors in ``meta['val']`` share them (torch's memory_estimator),
    optionally with the wait / written-argument corrections. On a rewritten graph this is
    wrong where a pass replaced a node's input but not its FakeTensor (torch's merge functions
    leave the readers of the old waits with the old waits' fake storages)."""
    out: dict[Any, list[tuple[Any, int]]] = {}
    # fake storage of a corrected node -> the storage it really is (views of a wait's result
    # share the wait's fake storage and must follow it)
    same_as: dict[Any, Any] = {}
    for n in nodes:
        own: dict[Any, int] = {}
        for t in _tensors(n.meta.get("val")):
            st = t.untyped_storage()
            own.setdefault(st._cdata, _nbytes(st, hints))
        aliased = _written_argument(n) if alias_written_outputs else None
        if aliased is not None:
            target = out.get(aliased, [])
            for key, (target_key, _) in zip(own, target):
                if key != target_key:
                    same_as[key] = target_key
            out[n] = list(target)
        else:
            out[n] = list({same_as.get(k, k): b for k, b in own.items()}.items())
    return out


def _is_view(node: "torch.fx.Node") -> bool:
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    return bool(getattr(node.target, "is_view", False)) or (
        schema is not None and schema.name.split("::")[-1] == "_unsafe_view"
    )


def _top_level(val: Any) -> list:
    return list(val) if isinstance(val, (list, tuple)) else [val]


def _written_argument(node: "torch.fx.Node") -> "torch.fx.Node | None":
    """The input node whose storage ``node`` returns although its FakeTensor has its own:
    ``wait_tensor``'s input, or the argument a ``Tensor(a!)`` result is written into."""
    import torch

    if node.op != "call_function":
        return None
    if node.target is torch.ops._c10d_functional.wait_tensor.default:
        arg = node.args[0]
        return arg if isinstance(arg, torch.fx.Node) else None
    return written_argument(node)


def _wait_of(node: "torch.fx.Node") -> "torch.fx.Node | None":
    """The ``wait_tensor`` of a collective node (None for anything else)."""
    import torch

    if node.op != "call_function" or getattr(node.target, "namespace", "") != "_c10d_functional":
        return None
    wait = torch.ops._c10d_functional.wait_tensor.default
    if node.target is wait:
        return None
    return next((u for u in node.users if u.target is wait), None)


def _tensors(val: Any) -> list:
    import torch

    found: list = []
    stack = [val]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
    return found
