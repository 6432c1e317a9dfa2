"""Capture ONE joint forward + loss + backward graph of an FSDP training step, with make_fx.

This is how torchtitan's graph trainer traces by default (``aot_fx_trace``): a training step
``primals -> (loss, grads)`` is traced by ``make_fx`` under a FakeTensorMode, with
``torch.autograd.grad`` inside it, so the backward is part of the same graph and nothing is
partitioned. Reshard-after-forward and activation checkpointing are not traced as
``torch.utils.checkpoint`` regions: the trace has no recompute; afterwards, forward nodes are
tagged with a checkpoint policy (``node.meta["recompute"]``, ``node.meta["ac_graph_id"]``) and
torch's own remat pass (``remat_using_tags_for_fwd_loss_bwd_graph``) copies the tagged nodes
in front of their backward readers (``<name>_recomputed``) and drops the forward originals no
forward node reads. So the backward holds re-gathers of parameters where the policy recomputes
them, exactly as in the graph trainer.

The graph::

    placeholders  primals_1 .. primals_P    parameter shards (the DTensors' local tensors,
                                            ``model.named_parameters()`` order)
                  primals_P+1 .. P+B        buffers (``model.named_buffers()`` order)
                  primals_P+B+1, +2         tokens, labels
    forward       per parameter: [cast] -> all_gather_into_tensor -> wait_tensor -> readers
    loss          the model's mean cross-entropy
    backward      (autograd_backward) per parameter: [re-gather (recomputed)] ... gradient
                  -> [cast] -> reduce_scatter_tensor -> wait_tensor -> [cast]
    output        [loss, grad_1 .. grad_P]   (grad_i: the local shard's gradient, summed over
                                            data-parallel ranks)

Every input is named ``primals_*``: the caller holds all of them through the step (the rule of
every memory count in this project: such inputs are never freed by the graph).

Node metadata written (beside what torch writes: ``val``, ``seq_nr``, ``autograd_backward``):

- ``node.meta["custom"]["module_fqn"]``: the module whose forward ran the op (innermost), on
  forward nodes and, through ``seq_nr``, on the backward nodes of the same op, as the graph
  trainer annotates its graphs;
- ``fsdp_role`` / ``fsdp_fqn`` / ``fsdp_param_index`` on collectives and their waits, as
  :mod:`models.capture` writes them on partitioned graphs;
- ``gm.meta["fsdp_graph_kind"] = "joint"``, ``gm.meta["fsdp_param_fqns"]``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from models.capture import (
    ALL_GATHER,
    COLLECTIVES,
    WAIT,
    capture_config,
    fake_process_group,
    gradient_collectives,
    mark_collective,
    trace_back_to_placeholder,
    user_fqn,
)
from models.fsdp import SAC_SAVE_OPS, FSDPOptions, ReplicateParametrization, dp_group_names, mesh_for, parallelize
from models.llama import LlamaConfig, Transformer, TransformerBlock

logger = logging.getLogger(__name__)

#: ``node.meta["custom"]`` key naming the module that ran a node (the graph trainer's key)
MODULE_FQN_KEY = "module_fqn"

#: ops between a gathered parameter's wait and its reader that only view it: recomputed with the
#: gather, or the saved view would keep the full parameter alive through the backward
_VIEWS = frozenset({torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                    torch.ops.aten.permute.default, torch.ops.aten.reshape.default,
                    torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
                    torch.ops.aten.alias.default, torch.ops.aten.detach.default,
                    # an uneven shard is padded before the gather and sliced after it
                    torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default,
                    torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default})


@dataclass
class JointGraph:
    """One joint forward + loss + backward graph of an FSDP training step, and its context."""

    graph: fx.GraphModule
    """The joint graph (inputs and outputs in the module docstring)."""
    param_fqns: list[str]
    """Parameter FQNs in registration order (``primals_{i+1}`` is parameter ``i``'s shard)."""
    buffer_names: list[str]
    """Buffer names, in input order after the parameters."""
    options: FSDPOptions
    """Parallelism options traced (reshard and activation checkpointing as tags)."""
    world_size: int
    """Ranks of the process group traced on."""
    config: LlamaConfig | None = None
    """Model configuration traced (None for a model given by the caller)."""
    example_inputs: list[Any] = field(default_factory=list)
    """The fake inputs the graph was traced with."""
    trace_time_s: float = 0.0
    """Wall-clock seconds of the trace, tagging and remat."""


# ---------------------------------------------------------------------------------------------
# tracing


@contextlib.contextmanager
def _module_fqn_annotations(model: nn.Module):
    """Every submodule's forward runs under ``annotate({"module_fqn": name})`` (innermost wins)."""
    from torch.fx.traceback import annotate

    wrapped = []

    def wrap(module: nn.Module, name: str):
        inner = module.forward

        def forward(*args, **kwargs):
            with annotate({MODULE_FQN_KEY: name}):
                return inner(*args, **kwargs)

        return forward

    for name, module in model.named_modules():
        if name:
            module.forward = wrap(module, name)
            wrapped.append(module)
    try:
        yield
    finally:
        for module in wrapped:
            del module.forward  # the instance attribute: the class's forward again


@contextlib.contextmanager
def _untraced_recompute(model: nn.Module):
    """Reshard and block checkpointing off while tracing: they become tags afterwards."""
    saved = []
    for module in model.modules():
        if isinstance(module, ReplicateParametrization):
            saved.append((module, "reshard_after_forward", module.reshard_after_forward))
            module.reshard_after_forward = False
        elif isinstance(module, TransformerBlock):
            saved.append((module, "checkpoint_kwargs", module.checkpoint_kwargs))
            module.checkpoint_kwargs = None
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _copy_module_fqn_to_backward(gm: fx.GraphModule) -> None:
    """A backward node gets the ``module_fqn`` of the first node of its ``seq_nr`` (the forward
    op whose gradient it computes)."""
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        seq = node.meta.get("seq_nr")
        if node.op != "call_function" or seq is None:
            continue
        if seq not in first:
            first[seq] = node
            continue
        fqn = first[seq].meta.get("custom", {}).get(MODULE_FQN_KEY)
        if fqn is not None and node.meta.get("autograd_backward"):
            node.meta.setdefault("custom", {})[MODULE_FQN_KEY] = fqn


def trace_joint_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[fx.GraphModule, list]:
    """make_fx of one training step of ``model`` (parameters: DTensors, any mesh) on fake tensors.

    Returns the joint graph (called as ``gm(*inputs)``, returning ``[loss, *grads]``) (no recompute yet: see :func:`apply_recompute`) and its fake inputs.
    The model's parameters and buffers may live on the meta device (no memory) or hold real
    values (they are only read for their shapes); the process group may be fake or real: no
    collective runs while tracing.
    """
    from torch._subclasses import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta

    named = list(model.named_parameters())
    buffers = list(model.named_buffers())
    n_params, n_buffers = len(named), len(buffers)
    specs = []
    for name, p in named:
        if not isinstance(p, DTensor):
            raise TypeError(f"parameter {name!r} is not a DTensor: shard the model first (models.fsdp.parallelize)")
        specs.append((p.device_mesh, p.placements, p.shape, p.stride()))

    fake_mode = FakeTensorMode()
    shards = [fake_mode.from_tensor(p._local_tensor.detach()).requires_grad_(True) for _, p in named]
    inputs = [*shards, *(fake_mode.from_tensor(b) for _, b in buffers),
              fake_mode.from_tensor(tokens), fake_mode.from_tensor(labels)]

    def step(primals):
        local = primals[:n_params]
        state = {name: DTensor.from_local(s, mesh, placements, run_check=False, shape=shape, stride=stride)
                 for (name, _), s, (mesh, placements, shape, stride) in zip(named, local, specs)}
        state.update((name, b) for (name, _), b in zip(buffers, primals[n_params:n_params + n_buffers]))
        loss = functional_call(model, state, (primals[-2], primals[-1]))
        grads = torch.autograd.grad(loss, local)
        return [loss, *grads]

    with (_untraced_recompute(model), _module_fqn_annotations(model), fake_mode, preserve_node_meta(),
          torch.compiler._non_strict_tracing_context(), torch.compiler._patch_engine_backward()):
        gm = make_fx(step)(inputs)
    # called with the inputs as positional arguments, as torch's remat pass leaves it too
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    _copy_module_fqn_to_backward(gm)
    return gm, inputs


# ---------------------------------------------------------------------------------------------
# annotation


def annotate_joint(gm: fx.GraphModule, param_fqns: list[str], dp_group_names: list[str]) -> None:
    """Write ``fsdp_role`` / ``fsdp_fqn`` / ``fsdp_param_index`` on the collectives of a joint
    graph whose inputs start with the ``len(param_fqns)`` parameter shards and whose outputs
    are ``[loss, grad_1, ..]`` in the same order (by data flow, never by node name)."""
    index_of_input = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    n_params = len(param_fqns)

    def mark(coll: fx.Node, i: int | None) -> None:
        fsdp = i is not None and str(coll.args[-1]) in dp_group_names
        mark_collective(coll, "fsdp" if fsdp else "tp", param_fqns[i] if i is not None else None, i)

    marked: set[fx.Node] = set()
    grads = gm.graph.find_nodes(op="output")[0].args[0][1:]
    for i, grad in enumerate(grads[:n_params]):
        for coll in gradient_collectives(grad):
            mark(coll, i)
            marked.add(coll)
    for node in gm.graph.nodes:
        if node.target in COLLECTIVES and node not in marked:
            ph = trace_back_to_placeholder(node.args[0])
            i = index_of_input.get(ph) if ph is not None else None
            mark(node, i if i is not None and i < n_params else None)
    gm.meta["fsdp_graph_kind"] = "joint"
    gm.meta["fsdp_param_fqns"] = list(param_fqns)


# ---------------------------------------------------------------------------------------------
# recompute: tags, then torch's remat pass


def _block_of(node: fx.Node) -> int | None:
    fqn = node.meta.get("custom", {}).get(MODULE_FQN_KEY) or ""
    parts = fqn.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def _gather_chains(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Per forward parameter all-gather: what prepares its input from the shard (single-input,
    single-use ops: casts, the padding of an uneven shard), itself, its wait and the views of
    the gathered parameter up to its readers."""
    chains = []
    for node in gm.graph.nodes:
        if node.target is not ALL_GATHER or node.meta.get("autograd_backward"):
            continue
        if node.meta.get("fsdp_role") != "fsdp":
            continue
        chain = [node]
        src = node.args[0]
        while (isinstance(src, fx.Node) and src.op == "call_function" and len(src.users) == 1
               and len(src.all_input_nodes) == 1):
            chain.append(src)
            src = src.args[0]
        stack = list(node.users)
        while stack:
            user = stack.pop()
            if user.meta.get("autograd_backward") or user in chain:
                continue
            if user.target is WAIT or user.target in _VIEWS or user.target is operator.getitem:
                chain.append(user)
                stack.extend(user.users)
        chains.append(chain)
    return chains


def tag_recompute(gm: fx.GraphModule, options: FSDPOptions) -> int:
    """Tag forward nodes with the checkpoint policy ``options`` asks for; returns how many.

    - reshard after forward (or any activation checkpointing): every parameter's gather chain
      (:func:`_gather_chains`) MUST_RECOMPUTE, so the backward gathers it again;
    - ``"selective"``: in each transformer block, matmuls and attention (``SAC_SAVE_OPS``)
      MUST_SAVE, everything else PREFER_RECOMPUTE (torchtitan's default op list);
    - ``"full"``: everything in each block MUST_RECOMPUTE.

    ``ac_graph_id`` is the block's index + 1 (0 outside blocks), so that torch's remat saves
    the tensors that cross a block boundary.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    ac = options.activation_checkpointing
    tagged = 0
    if options.reshard_after_forward or ac != "none":
        for chain in _gather_chains(gm):
            for n in chain:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                block = _block_of(n)
                n.meta["ac_graph_id"] = 0 if block is None else block + 1
                tagged += 1
    if ac == "none":
        return tagged
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("autograd_backward") or "recompute" in node.meta:
            continue
        block = _block_of(node)
        if block is None:
            continue
        if ac == "full" or node.target not in SAC_SAVE_OPS:
            policy = CheckpointPolicy.MUST_RECOMPUTE if ac == "full" else CheckpointPolicy.PREFER_RECOMPUTE
        else:
            policy = CheckpointPolicy.MUST_SAVE
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = block + 1
        tagged += 1
    return tagged


def apply_recompute(gm: fx.GraphModule, options: FSDPOptions) -> fx.GraphModule:
    """Tag (:func:`tag_recompute`) and run torch's remat pass; returns the new graph module
    (``gm`` itself when nothing is recomputed). Graph metadata is kept."""
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (
        remat_using_tags_for_fwd_loss_bwd_graph,
    )

    if not tag_recompute(gm, options):
        return gm
    meta = dict(gm.meta)
    out = remat_using_tags_for_fwd_loss_bwd_graph(gm)
    out.meta.update(meta)
    return out


# ---------------------------------------------------------------------------------------------


def joint_graph_of(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *, options: FSDPOptions,
                   dp_group_names: list[str]) -> tuple[fx.GraphModule, list[Any], list[str], list[str]]:
    """The joint graph of a sharded ``model`` (traced, annotated, recomputed as ``options``
    ask; ``dp_group_names``: :func:`models.fsdp.dp_group_names` of its mesh): returns (graph,
    fake inputs, parameter FQNs, buffer names)."""
    gm, inputs = trace_joint_step(model, tokens, labels)
    param_fqns = [user_fqn(n) for n, _ in model.named_parameters()]
    annotate_joint(gm, param_fqns, dp_group_names)
    gm = apply_recompute(gm, options)
    return gm, inputs, param_fqns, [n for n, _ in model.named_buffers()]


def capture_joint_graph(name: str, *, world_size: int, n_layers: int | None = None, **options: Any) -> JointGraph:
    """Trace one joint training step of preset ``name`` on a fake group of ``world_size`` ranks.

    Options as :func:`models.capture_fsdp_graphs` (``FSDPOptions`` fields and ``LlamaConfig``
    overrides); ``reshard_after_forward`` and ``activation_checkpointing`` are applied as
    checkpoint tags and torch's remat (module docstring). Uses no tensor memory at any size.

    Raises ValueError for an unknown preset or world_size < 2, TypeError for unknown options.
    """
    config, fsdp_options = capture_config(name, world_size=world_size, n_layers=n_layers, **options)
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"capture_joint_graph traces the LLaMA presets; {name!r} is a MoE preset, whose "
                         "split sizes are read from data: capture it with models.capture_fsdp_graphs "
                         "(partitioned forward and backward graphs)")
    start = time.perf_counter()
    with fake_process_group(world_size):
        mesh = mesh_for(world_size, fsdp_options)
        with torch.device("meta"):
            model = Transformer(config)
        parallelize(model, mesh, fsdp_options)
        tokens = torch.empty((config.batch_size, config.seq_len), dtype=torch.long, device="meta")
        gm, inputs, param_fqns, buffer_names = joint_graph_of(
            model, tokens, tokens.clone(), options=fsdp_options, dp_group_names=dp_group_names(mesh, fsdp_options))
    elapsed = time.perf_counter() - start
    logger.info("captured the joint graph of %s (%d layers, %d nodes) in %.1f s", config.name, config.n_layers,
                len(gm.graph.nodes), elapsed)
    return JointGraph(graph=gm, param_fqns=param_fqns, buffer_names=buffer_names, options=fsdp_options,
                      world_size=world_size, config=config, example_inputs=inputs, trace_time_s=elapsed)
