"""Data-dependent sizes at export: every node's value (``meta['val']``) with unbacked size
symbols replaced by estimates (:class:`ValOf`, made by :func:`static_vals`).

Sizes read from data (``.item()``, ``.tolist()``: MoE all-to-all split sizes) are unbacked
symbols with no value at trace time. The export gives each a hint (a balanced split for an
all-to-all's splits, else inductor's fallback clamped to the symbol's range) so that bytes and
FLOPs can be counted; :func:`unbacked_hints` gives the same hints to every other count of the
graph (:mod:`scheduler.check.judge`).
"""

from __future__ import annotations

import logging
import math
import types
from typing import TYPE_CHECKING, Any

from scheduler.export.ops import packet_name

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)


class ValOf:
    """``node.meta['val']``, with data-dependent (unbacked) sizes replaced by estimates.

    Sizes read from data (``.item()``, ``.tolist()``: MoE split sizes) are unbacked symbols
    with no value at trace time. :func:`static_vals` gives each a hint; tensors whose shape
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
    return static_vals(types.SimpleNamespace(graph=graph)).hints


def static_vals(gm: "torch.fx.GraphModule") -> ValOf:
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
        return ValOf()
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
        return ValOf(_as_sympy(hints))
    n_backed = len(hints)
    for node in gm.graph.nodes:
        if node.op != "call_function" or packet_name(node.target) != "all_to_all_single":
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
    return ValOf(_as_sympy(hints))


def _as_sympy(hints: dict) -> dict:
    """Hints as sympy integers: ``expr.xreplace`` of a bare symbol returns the hint as given."""
    import sympy

    return {sym: sympy.Integer(v) for sym, v in hints.items()}


def _finite_int(x: Any) -> int | None:
    try:
        return int(x) if bool(getattr(x, "is_finite", True)) and abs(float(x)) != math.inf else None
    except Exception:  # sympy / torch infinities refuse int() in different ways
        return None
