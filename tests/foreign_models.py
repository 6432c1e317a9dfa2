"""FSDP graphs captured the way other people's code captures them, without any helper of models/.

Each style is a small network written here, sharded by :func:`shard_like_simplefsdp` (a
SimpleFSDP-style parametrization: a ``Shard(0)`` DTensor parameter all-gathered on every
read), compiled with plain ``torch.compile(backend=aot_autograd(...))`` on a fake process
group, with parameters on the meta device. Nothing sets ``node.meta["fsdp_fqn"]``: the graphs
carry only what torch puts on them, so structure inference must recover the layers itself.

Styles (``capture(style, ...)``):

- ``"tied"``: input embedding and output projection share one table, read once per forward.
- ``"alternating"``: GELU MLP blocks whose hidden width alternates between two values, every
  ``wide_every``-th block 2x wider again.
- ``"sac"``: reshard after forward through a selective-checkpoint policy on every block that
  recomputes the all-gathers and saves everything else (backward re-gathers parameters);
  ``partitioner="default"`` or ``"min_cut"``.
- ``"tp"``: 2-D (dp, tp) mesh, column-/row-parallel MLP with tensor-parallel all-reduces.
- ``"fp32"``: no mixed precision, fp32 all-gathers and reduce-scatters.
- ``"moe"``: a top-1 MoE block per layer whose tokens go to their expert by ``all_to_all``
  on an expert-parallel group, with split sizes read by ``.tolist()`` (unbacked symbols).

The ground truth (which parameter each collective gathers or reduces) is recovered here by
data flow from the parameters' identities, as an oracle for the tests; it is written on
``gm.meta["foreign_truth"]`` (collective node name -> parameter name), a key that structure
inference never reads.

``capture_joint(style, ...)`` traces the same networks the way torchtitan's graph trainer does
by default: ONE joint graph of forward, loss and backward, make_fx of a training step with
``torch.autograd.grad`` inside, never partitioned (styles ``JOINT_STYLES``: all but the MoE's
data-dependent splits). ``"sac"`` tags the gathers for recompute and runs torch's remat pass,
so that the backward gathers every parameter again; ``module_fqns=True`` annotates every node
with ``custom["module_fqn"]`` as the graph trainer does (backward nodes by ``seq_nr``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_compiler
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

STYLES = ("tied", "alternating", "sac", "tp", "fp32", "moe")
JOINT_STYLES = ("tied", "alternating", "sac", "tp", "fp32")
TRUTH_KEY = "foreign_truth"

_c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------------------------------------
# SimpleFSDP-style sharding


class _GatherOnRead(nn.Module):
    """Parametrization: the full parameter, all-gathered (in ``compute_dtype``) from its shard;
    its gradient is reduce-scattered (in ``grad_dtype``)."""

    def __init__(self, compute_dtype: torch.dtype | None, grad_dtype: torch.dtype | None):
        super().__init__()
        self.compute_dtype, self.grad_dtype = compute_dtype, grad_dtype

    def forward(self, shard):
        full = shard.redistribute(placements=[Replicate()] * shard.device_mesh.ndim,
                                  forward_dtype=self.compute_dtype, backward_dtype=self.grad_dtype)
        return full.to_local(grad_placements=[Partial()] * shard.device_mesh.ndim)


def shard_like_simplefsdp(root: nn.Module, mesh, *, compute_dtype: torch.dtype | None) -> None:
    """Every parameter of ``root`` becomes a Shard(0) DTensor over ``mesh`` (1-D), gathered on read."""
    for owner_name, owner in list(root.named_modules()):
        for attr, p in list(owner.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(owner, attr, nn.Parameter(dt))
            parametrize.register_parametrization(owner, attr, _GatherOnRead(compute_dtype, compute_dtype),
                                                 unsafe=True)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# ---------------------------------------------------------------------------------------------
# networks (parameter names deliberately unlike models/: trunk.N.{scale,up,down,...})


class GeluMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(_rms(x, self.scale))))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPMLP(GeluMLP):
    """Column-parallel ``up`` and row-parallel ``down`` (this rank's slices), all-reduced over tp."""

    def __init__(self, d: int, hidden: int, tp_group):
        super().__init__(d, hidden)
        self.tp_group = tp_group

    def forward(self, x):
        h = _CopyToTP.apply(_rms(x, self.scale), self.tp_group)
        return x + _ReduceFromTP.apply(self.down(F.gelu(self.up(h))), self.tp_group)


class Top1MoE(nn.Module):
    """Top-1 routing to one expert per expert-parallel rank; tokens travel by all_to_all."""

    def __init__(self, d: int, hidden: int, ep_group, ep_size: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.router = nn.Parameter(torch.randn(d, ep_size))
        self.w_in = nn.Parameter(torch.randn(hidden, d))
        self.w_out = nn.Parameter(torch.randn(d, hidden))
        self.ep_group, self.ep_size = ep_group, ep_size

    def forward(self, x):
        b, s, d = x.shape
        h = _rms(x, self.scale).reshape(b * s, d)
        probs = torch.softmax(h @ self.router, dim=-1)
        gate, dest = probs.max(dim=-1)
        order = dest.argsort()
        # a fixed-length count (bincount's length would itself be data-dependent)
        send_counts = (dest.unsqueeze(-1) == torch.arange(self.ep_size, device=x.device)).sum(0)
        recv_counts = funcol.all_to_all_single(send_counts, None, None, self.ep_group).wait()
        send = send_counts.tolist()
        # the fake group leaves received buffers uninitialised: bound the counts it "sent"
        recv = recv_counts.clamp(1, b * s).tolist()
        for n in (*send, *recv):
            torch._check(n >= 0)
        tokens = funcol.all_to_all_single_autograd(h[order], recv, send, self.ep_group)
        y = F.gelu(tokens @ self.w_in.t()) @ self.w_out.t()
        back = funcol.all_to_all_single_autograd(y, send, recv, self.ep_group)
        out = torch.empty_like(back).index_copy(0, order, back)
        return x + (out * gate.unsqueeze(-1)).reshape(b, s, d)


class Net(nn.Module):
    """Embedding -> ``trunk`` blocks -> final scale -> output projection (tied or not)."""

    def __init__(self, vocab: int, d: int, trunk: list[nn.Module], *, tied: bool,
                 recompute_gathers: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.trunk = nn.ModuleList(trunk)
        self.final_scale = nn.Parameter(torch.ones(d))
        self.head = None if tied else nn.Linear(d, vocab, bias=False)
        self.recompute_gathers = recompute_gathers

    def forward(self, tokens, labels):
        table = self.embed.weight  # read once: a second read of a tied DTensor breaks aot
        x = F.embedding(tokens, table)
        for block in self.trunk:
            if self.recompute_gathers:
                x = checkpoint(block, x, use_reentrant=False, context_fn=_recompute_gathers_context)
            else:
                x = block(x)
        logits = _rms(x, self.final_scale) @ (table if self.head is None else self.head.weight).t()
        logits = logits.float()
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (torch.logsumexp(logits, dim=-1) - picked).sum()


_GATHER_OPS = frozenset({_c10d.all_gather_into_tensor.default, _c10d.wait_tensor.default,
                         torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default})


def _gather_policy(ctx, func, *args, **kwargs):
    """Recompute what gathers parameters (reshard after forward), keep every activation."""
    return CheckpointPolicy.MUST_RECOMPUTE if func in _GATHER_OPS else CheckpointPolicy.MUST_SAVE


_recompute_gathers_context = functools.partial(create_selective_checkpoint_contexts, _gather_policy)


# ---------------------------------------------------------------------------------------------
# capture


class Captured(NamedTuple):
    forward: fx.GraphModule
    backward: fx.GraphModule
    true_blocks: dict[str, int | None]
    """parameter name -> index of its block (trunk position), None outside the trunk."""


def _user_name(name: str) -> str:
    parts = name.split(".")
    if "parametrizations" in parts:
        parts.remove("parametrizations")
    return ".".join(parts).removesuffix(".original")


_MESHES: dict = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """One mesh per shape and default group: DTensor caches redistribute plans by mesh
    equality, so a second, equal mesh with new process groups would reuse plans naming the
    first mesh's groups (one parameter's all-gather on group '1', the next on group '5')."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(dist.distributed_c10d._get_default_group()), shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _build(style: str, n_layers: int, world_size: int, dim: int, wide_every: int):
    vocab = 2 * dim
    compute_dtype = None if style == "fp32" else torch.bfloat16
    if style in ("tp", "moe"):
        mesh2 = _mesh((world_size // 2, 2), ("dp", "x"))
        dp_mesh, other = mesh2["dp"], mesh2["x"].get_group()
    else:
        dp_mesh, other = _mesh((world_size,), ("dp",)), None
    # .tolist() cannot run on meta tensors: the MoE step runs on (small) real CPU tensors
    device = "cpu" if style == "moe" else "meta"
    with torch.device(device):
        if style == "alternating":
            widths = [(2 * dim if i % 2 == 0 else 3 * dim) * (2 if i % wide_every == wide_every - 1 else 1)
                      for i in range(n_layers)]
            trunk = [GeluMLP(dim, w) for w in widths]
        elif style == "tp":
            trunk = [TPMLP(dim, 2 * dim // 2, other) for _ in range(n_layers)]
        elif style == "moe":
            trunk = [Top1MoE(dim, 2 * dim, other, 2) for _ in range(n_layers)]
        else:
            trunk = [GeluMLP(dim, 2 * dim) for _ in range(n_layers)]
        net = Net(vocab, dim, trunk, tied=style == "tied", recompute_gathers=style == "sac")
    shard_like_simplefsdp(net, dp_mesh, compute_dtype=compute_dtype)
    return net, vocab, device


def _open_fake_group(world_size: int) -> bool:
    """A fake process group of ``world_size`` for a capture: True when this call opened it (the
    caller destroys it), False when one of that size is already open."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError("a process group of another size is initialised")
        return False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return True


def capture(style: str, *, n_layers: int = 3, world_size: int = 4, dim: int | None = None,
            partitioner: str = "min_cut", wide_every: int = 3, batch: int = 2, seq: int = 8,
            dynamo_names: bool = False) -> Captured:
    """Trace one training step of ``style`` on a fake group of ``world_size`` ranks.

    Args:
        n_layers, world_size: the size knobs (a benchmark traces 16 layers on 64 ranks).
        dim: model width (default ``8 * world_size``: every shard non-empty and even).
        partitioner: ``"min_cut"`` (inductor's) or ``"default"``.
        wide_every: ``"alternating"`` only: every this-many-th block is 2x wider.
        dynamo_names: let the backend record the dynamo graph's parameter names on the graphs
            (``scheduler.export.structure.attach_input_names``), as a backend that sees the dynamo
            graph can.
    """
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {STYLES}")
    dim = dim or 8 * world_size
    owned = _open_fake_group(world_size)
    torch._dynamo.reset()
    graphs: dict[str, Any] = {}
    try:
        net, vocab, device = _build(style, n_layers, world_size, dim, wide_every)
        named = {id(p): _user_name(n) for n, p in net.named_parameters()}

        def backend(gm: fx.GraphModule, example_inputs):
            input_names = [named.get(id(x)) for x in example_inputs]
            names = None
            if dynamo_names:
                from scheduler.export.structure import dynamo_input_names

                names = dynamo_input_names(gm)

            def fw(fw_gm, _inputs):
                graphs["forward"] = fw_gm
                graphs["primal_names"] = _primal_names(fw_gm, input_names)
                if names is not None:
                    from scheduler.export.structure import attach_input_names, forward_input_names

                    graphs["input_names"] = forward_input_names(fw_gm, names)
                    attach_input_names(fw_gm, graphs["input_names"])
                return fw_gm

            def bw(bw_gm, _inputs):
                graphs["backward"] = bw_gm
                if names is not None:
                    from scheduler.export.structure import attach_input_names

                    attach_input_names(bw_gm, graphs["input_names"])
                return bw_gm

            part = min_cut_rematerialization_partition if partitioner == "min_cut" else default_partition
            return aot_autograd(fw_compiler=make_boxed_compiler(fw), bw_compiler=make_boxed_compiler(bw),
                                partition_fn=part)(gm, example_inputs)

        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            step = torch.compile(net, backend=backend, fullgraph=True)
            tokens = torch.zeros((batch, seq), dtype=torch.long, device=device)
            step(tokens, tokens).backward()
    finally:
        torch._dynamo.reset()
        if owned:
            dist.destroy_process_group()
    fw_gm, bw_gm = graphs["forward"], graphs["backward"]
    _write_truth(fw_gm, bw_gm, graphs["primal_names"])
    true_blocks = {}
    for name in named.values():
        parts = name.split(".")
        true_blocks[name] = int(parts[1]) if parts[0] == "trunk" else None
    return Captured(fw_gm, bw_gm, true_blocks)


def _primal_names(fw_gm: fx.GraphModule, input_names: list[str | None]) -> list[str | None]:
    """Forward placeholder -> name: tensor placeholders follow the dynamo inputs one for one
    (a DTensor parameter contributes its local shard); opaque objects get None."""
    out, it = [], iter(input_names)
    for node in fw_gm.graph.find_nodes(op="placeholder"):
        out.append(next(it, None) if isinstance(node.meta.get("val"), torch.Tensor) else None)
    return out


_PASS = frozenset({torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
                   torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                   torch.ops.aten.reshape.default, torch.ops.aten.clone.default,
                   torch.ops.aten.t.default, torch.ops.aten.permute.default,
                   torch.ops.aten.contiguous.default, _c10d.wait_tensor.default})


def _upstream(node: Any) -> fx.Node | None:
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target in _PASS or node.target is operator.getitem):
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _write_truth(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, primal_names: list[str | None]) -> None:
    """Oracle: collective -> parameter, by data flow from the parameters' placeholders."""
    placeholders = fw_gm.graph.find_nodes(op="placeholder")
    by_placeholder = {n.name: name for n, name in zip(placeholders, primal_names) if name}
    fw_nodes = {n.name: n for n in fw_gm.graph.nodes}
    truth_fw = {}
    for node in fw_gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        src = _upstream(node.args[0])
        if src is not None and src.name in by_placeholder:
            truth_fw[node.name] = by_placeholder[src.name]
    truth_bw = {}
    grads = bw_gm.graph.find_nodes(op="output")[0].args[0]
    for j, grad in enumerate(grads):
        if j < len(primal_names) and primal_names[j] and isinstance(grad, fx.Node):
            node = grad
            while node.op == "call_function" and node.target in _PASS and node.target is not _c10d.wait_tensor.default:
                node = node.args[0]
            if node.target is _c10d.wait_tensor.default and node.args[0].target is _c10d.reduce_scatter_tensor.default:
                truth_bw[node.args[0].name] = primal_names[j]
    for node in bw_gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        src = _upstream(node.args[0])
        if src is not None and src.op == "placeholder" and src.name in fw_nodes:
            src = _upstream(fw_nodes[src.name])  # a saved forward value: follow it in forward
        if src is not None and src.name in by_placeholder:
            truth_bw[node.name] = by_placeholder[src.name]
    fw_gm.meta[TRUTH_KEY] = truth_fw
    bw_gm.meta[TRUTH_KEY] = truth_bw


_NAME_META = ("nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack", "stack_trace")


def strip_names(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without the module / source metadata aot_autograd writes, as a graph from a
    compiler that keeps none (re-traced, deserialised) arrives."""
    for node in gm.graph.nodes:
        for key in _NAME_META:
            node.meta.pop(key, None)
    return gm


# ---------------------------------------------------------------------------------------------
# joint graphs (make_fx of a training step)


def capture_joint(style: str, *, n_layers: int = 3, world_size: int = 4, dim: int | None = None,
                  wide_every: int = 3, batch: int = 2, seq: int = 8, module_fqns: bool = False) -> Captured:
    """Trace one training step of ``style`` as one joint graph on a fake group of ``world_size``.

    Returns ``Captured(joint, joint, true_blocks)``: the joint graph in both fields. Its inputs
    are the parameters' local shards (named ``arg<i>_1`` by make_fx), then tokens and labels;
    its outputs ``[loss, *grads]`` in parameter order.
    """
    from torch._subclasses import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta
    if style not in JOINT_STYLES:
        raise ValueError(f"unknown joint style {style!r}; choose one of {JOINT_STYLES}")
    dim = dim or 8 * world_size
    owned = _open_fake_group(world_size)
    try:
        net, _, _ = _build("fp32" if style == "fp32" else style, n_layers, world_size, dim, wide_every)
        net.recompute_gathers = False  # recompute is a graph pass here, as in the graph trainer
        named = [(_user_name(n), p) for n, p in net.named_parameters()]
        unwrapped = [p._local_tensor for _, p in named]
        mode = FakeTensorMode()
        shards = [mode.from_tensor(t).requires_grad_(True) for t in unwrapped]
        tokens = mode.from_tensor(torch.zeros((batch, seq), dtype=torch.long, device="meta"))
        restore = _annotate_modules(net) if module_fqns else []

        def step(*flat):
            local = list(flat[:len(named)])
            state = {}
            for (name, p), t in zip(net.named_parameters(), local):
                state[name] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
            loss = torch.func.functional_call(net, state, (flat[-2], flat[-1]))
            return [loss, *torch.autograd.grad(loss, local)]

        try:
            with (mode, preserve_node_meta(), torch.compiler._non_strict_tracing_context(),
                  torch.compiler._patch_engine_backward()):
                gm = make_fx(step)(*shards, tokens, tokens)
        finally:
            for module in restore:
                del module.forward
        if module_fqns:
            _copy_custom_to_backward(gm)
        if style == "sac":
            gm = _recompute_gathers(gm)
    finally:
        if owned:
            dist.destroy_process_group()
    _write_joint_truth(gm, [n for n, _ in named])
    true_blocks = {}
    for name, _ in named:
        parts = name.split(".")
        true_blocks[name] = int(parts[1]) if parts[0] == "trunk" else None
    return Captured(gm, gm, true_blocks)


def _annotate_modules(net: nn.Module) -> list[nn.Module]:
    from torch.fx.traceback import annotate_fn

    wrapped = []
    for name, module in net.named_modules():
        if name:
            module.forward = annotate_fn({"module_fqn": name})(module.forward)
            wrapped.append(module)
    return wrapped


def _copy_custom_to_backward(gm: fx.GraphModule) -> None:
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        seq = node.meta.get("seq_nr")
        if node.op != "call_function" or seq is None:
            continue
        if seq not in first:
            first[seq] = node
        elif node.meta.get("autograd_backward") and "custom" in first[seq].meta:
            node.meta["custom"] = dict(first[seq].meta["custom"])


def _recompute_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Reshard after forward the graph trainer's way: tag each forward gather (its cast, the
    collective, the wait and the views of the result) MUST_RECOMPUTE; torch's remat pass copies
    them in front of their backward readers."""
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (
        remat_using_tags_for_fwd_loss_bwd_graph,
    )

    views = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.slice.Tensor,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default}
    for ag in gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        if ag.meta.get("autograd_backward"):
            continue
        chain, src = [ag], ag.args[0]
        while src.op == "call_function" and len(src.users) == 1 and len(src.all_input_nodes) == 1:
            chain.append(src)
            src = src.args[0]
        stack = list(ag.users)
        while stack:
            n = stack.pop()
            if not n.meta.get("autograd_backward") and (n.target is _c10d.wait_tensor.default or n.target in views):
                chain.append(n)
                stack.extend(n.users)
        for n in chain:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return remat_using_tags_for_fwd_loss_bwd_graph(gm)


def _write_joint_truth(gm: fx.GraphModule, names: list[str]) -> None:
    """Oracle of a joint graph: gathers by the shard input they read, reduce-scatters by the
    gradient output they produce."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    by_input = {p: names[i] for i, p in enumerate(placeholders[:len(names)])}
    truth = {}
    for node in gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        src = node.args[0]
        while isinstance(src, fx.Node) and src.op == "call_function" and len(src.all_input_nodes) == 1:
            src = src.args[0]
        if src in by_input:
            truth[node.name] = by_input[src]
    grads = gm.graph.find_nodes(op="output")[0].args[0][1:]
    for i, grad in enumerate(grads[:len(names)]):
        node = grad
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target is not _c10d.wait_tensor.default:
            node = node.args[0]
        if isinstance(node, fx.Node) and node.target is _c10d.wait_tensor.default:
            truth[node.args[0].name] = names[i]
    gm.meta[TRUTH_KEY] = truth
