"""What an FX op is, read from its target and schema: its name (:func:`op_name`,
:func:`packet_name`), whether its output shares an input's storage (:func:`is_alias_op`), which
arguments it writes into and returns (:func:`written_argument`, :func:`written_arguments`), and
whether it moves data on the device at all (:func:`moves_no_data`). The export, the cost models
and the written graph's judge read ops the same way through these.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.fx


def op_name(target: Any) -> str:
    """'aten.mm.default' for OpOverloads, the function name otherwise."""
    if hasattr(target, "_schema") and hasattr(target, "namespace"):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def packet_name(target: Any) -> str:
    """'all_gather_into_tensor' for torch.ops._c10d_functional.all_gather_into_tensor.default."""
    if hasattr(target, "_schema"):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


#: ops whose output shares its input's storage although their schema does not mark them as
#: views (aten._unsafe_view: a view that autograd does not track as one)
ALIAS_OPS = {"_unsafe_view"}


def is_alias_op(node: "torch.fx.Node") -> bool:
    """Views, ``getitem`` and ``aten._unsafe_view``: their output shares an input's storage and
    no data moves."""
    return (
        node.target is operator.getitem
        or getattr(node.target, "is_view", False)
        or packet_name(node.target) in ALIAS_OPS
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


#: ops that only allocate (no kernel touches the bytes)
ALLOC_ONLY_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def moves_no_data(fx_node: Any) -> bool:
    """Whether an FX node moves no data on the device: ``operator.getitem``, views,
    ``aten._unsafe_view`` (a view autograd does not track) and allocations (``aten.empty``)."""
    import operator

    target = getattr(fx_node, "target", None)
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    schema = getattr(target, "_schema", None)
    name = schema.name.split("::")[-1] if schema is not None else ""
    return name == "_unsafe_view" or name in ALLOC_ONLY_OPS
