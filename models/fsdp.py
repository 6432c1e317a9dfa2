"""SimpleFSDP-style data parallelism (and optional Megatron tensor parallelism) for the LLaMA model.

Each parameter is stored as ``nn.Parameter(DTensor)`` sharded ``Shard(0)`` over the
data-parallel mesh dimension; a parametrization all-gathers it on every read::

    x.redistribute(placements=[Replicate()], forward_dtype=param_dtype, backward_dtype=reduce_dtype)
     .to_local(grad_placements=[Partial()])

so that traced graphs hold one ``all_gather_into_tensor`` + ``wait_tensor`` per parameter in
forward and one ``reduce_scatter_tensor(.., 'sum', ..)`` + ``wait_tensor`` per parameter in
backward. Gradients are summed over data-parallel ranks (not averaged): to match a reference
step on the global batch, divide each rank's loss by the data-parallel size.

Mixed precision: the sharded parameter is cast to ``param_dtype`` *before* the all-gather, so
the all-gather moves ``param_dtype`` bytes; the gradient is cast to ``reduce_dtype`` before the
reduce-scatter and back to the parameter dtype (fp32) after it.

``reshard_after_forward=True`` wraps the all-gather in a checkpoint whose policy recomputes
everything, so the partitioner saves the sharded parameter and backward re-all-gathers;
``False`` keeps the full parameters alive from forward to backward.

2-D mesh (dp, tp): each rank first takes its tensor-parallel slice of the weight (rows of
wq/wk/wv/w1/w3, columns of wo/w2; other parameters are replicated over tp), then FSDP shards
that slice over dp. The parameter is a DTensor on the dp sub-mesh only; the tp slicing is held
by the modules (``tp_size``, ``tp_group_name``), which all-reduce activations over tp.

Other data-parallel modes (``FSDPOptions.dp_mode``, as torchtitan's ``data_parallel`` names
them):

- ``"hybrid_shard"`` (HSDP): a 2-D (dp_replicate, dp_shard) mesh; each parameter is sharded
  over dp_shard and replicated over dp_replicate (``[Replicate(), Shard(0)]``). Forward
  all-gathers it on the shard group; backward reduce-scatters the gradient on the shard group
  and then all-reduces the shard on the replicate group (FSDP2's order: the all-reduce moves
  1 / shard-size of the bytes), each collective followed by its wait
  (:class:`HybridShardParametrization`).
- ``"replicate"`` (DDP): a 1-D dp_replicate mesh; each parameter is replicated
  (``[Replicate()]``); forward reads it (cast to ``param_dtype``), backward all-reduces its
  gradient.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils.parametrize import register_parametrization
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.llama import Attention, FeedForward, TransformerBlock, Transformer

logger = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional

# Ops that selective activation checkpointing saves (their outputs are expensive to recompute):
# matmuls and attention, as in torchtitan's default SAC op list.
SAC_SAVE_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.fsdp_sched.flash_attn.default,
})

# Tensor-parallel slicing of each linear weight (shape (out, in)): column-parallel splits the
# output features (dim 0), row-parallel splits the input features (dim 1).
TP_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
TP_ROWWISE = ("attention.wo", "feed_forward.w2")


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """How :func:`parallelize` shards, casts and checkpoints the model."""

    param_dtype: torch.dtype | None = torch.bfloat16
    """Dtype of all-gathered parameters and of compute; None keeps the stored dtype (fp32)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduce-scatter; None means ``param_dtype`` (FSDP2's default)."""
    reshard_after_forward: bool = True
    """True: free full parameters after forward and all-gather again in backward."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Per transformer block: 'selective' saves matmul / attention outputs and recomputes the
    rest, 'full' recomputes the whole block in backward."""
    tp_size: int = 1
    """Tensor-parallel degree; > 1 asks for a 2-D (dp, tp) mesh (``dp_mode="fully_shard"`` only)."""
    dp_mode: Literal["fully_shard", "hybrid_shard", "replicate"] = "fully_shard"
    """Data parallelism: FSDP (``"fully_shard"``), HSDP (``"hybrid_shard"``: sharded within a
    group of ``world_size / replicate_size`` ranks, replicated across ``replicate_size`` such
    groups) or DDP (``"replicate"``: every rank holds every parameter; gradients all-reduced)."""
    replicate_size: int = 2
    """``"hybrid_shard"`` only: ranks of each replicate group (the mesh's first dimension)."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in ("none", "selective", "full"):
            raise ValueError(f"activation_checkpointing must be none/selective/full, "
                             f"got {self.activation_checkpointing!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.dp_mode not in ("fully_shard", "hybrid_shard", "replicate"):
            raise ValueError(f"dp_mode must be fully_shard/hybrid_shard/replicate, got {self.dp_mode!r}")
        if self.dp_mode != "fully_shard" and self.tp_size > 1:
            raise ValueError(f"tp_size > 1 needs dp_mode='fully_shard', got {self.dp_mode!r}")
        if self.replicate_size < 1:
            raise ValueError(f"replicate_size must be >= 1, got {self.replicate_size}")

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        """Dtype of the reduce-scatter (None: the parameter's own dtype)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


def make_mesh(world_size: int, tp_size: int = 1, device_type: str = "cpu", *,
              dp_mode: str = "fully_shard", replicate_size: int = 2) -> DeviceMesh:
    """A (dp,) mesh, or a (dp, tp) mesh named ("dp", "tp") when ``tp_size > 1``; for
    ``dp_mode="hybrid_shard"`` a (dp_replicate, dp_shard) mesh of shape
    (replicate_size, world_size / replicate_size), for ``"replicate"`` a (dp_replicate,) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size < 2:
        raise ValueError(f"FSDP needs world_size >= 2, got {world_size}")
    if world_size % tp_size:
        raise ValueError(f"world_size {world_size} is not divisible by tp_size {tp_size}")
    if dp_mode == "hybrid_shard":
        if world_size % replicate_size:
            raise ValueError(f"world_size {world_size} is not divisible by replicate_size {replicate_size}")
        return init_device_mesh(device_type, (replicate_size, world_size // replicate_size),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    if dp_mode == "replicate":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_replicate",))
    if tp_size == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


#: meshes made by :func:`mesh_for`, by layout, while their groups live
_MESHES: dict[tuple, DeviceMesh] = {}


def mesh_for(world_size: int, options: FSDPOptions, device_type: str = "cpu") -> DeviceMesh:
    """The mesh :func:`parallelize` needs for ``options`` on ``world_size`` ranks: one per layout
    and process group world, reused. DTensor caches its redistribution plans by mesh equality
    (the layout, not the groups), so a second mesh of one layout in the same world would trace
    with the first one's groups while :func:`dp_group_names` named its own."""
    key = (world_size, options.tp_size, device_type, options.dp_mode, options.replicate_size)
    mesh = _MESHES.get(key)
    if mesh is not None and groups_alive(mesh):
        return mesh
    mesh = _MESHES[key] = make_mesh(world_size, options.tp_size, device_type, dp_mode=options.dp_mode,
                                    replicate_size=options.replicate_size)
    return mesh


def groups_alive(mesh: DeviceMesh) -> bool:
    """Whether every group of ``mesh`` still resolves to itself (its world was not torn down)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return all(_resolve_process_group(g.group_name) is g for g in (mesh.get_group(d) for d in range(mesh.ndim)))
    except Exception:
        return False


def dp_group_names(mesh: DeviceMesh, options: FSDPOptions) -> list[str]:
    """Names of the process groups that carry the parameters' and gradients' collectives: the
    dp group (FSDP), the shard and replicate groups (HSDP), the replicate group (DDP)."""
    if options.tp_size > 1:
        return [mesh["dp"].get_group().group_name]
    return [mesh.get_group(d).group_name for d in range(mesh.ndim)]


def _recompute_everything(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _save_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class ReplicateParametrization(nn.Module):
    """All-gathers a Shard(0) DTensor parameter into a full local tensor (see module docstring)."""

    def __init__(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 reshard_after_forward: bool) -> None:
        super().__init__()
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.reshard_after_forward = reshard_after_forward

    def _gather(self, x):
        full = x.redistribute(
            placements=[Replicate()],
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        return full.to_local(grad_placements=[Partial()])

    def forward(self, x):
        if self.reshard_after_forward:
            return checkpoint(self._gather, x, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                           _recompute_everything))
        return self._gather(x)


class _HybridGather(torch.autograd.Function):
    """All-gather a shard over the shard group; the gradient is reduce-scattered over the shard
    group, then all-reduced over the replicate group (HSDP, see the module docstring)."""

    @staticmethod
    def forward(ctx, local, param_dtype, reduce_dtype, shard_size: int, shard_group: str, replicate_group: str):
        ctx.dtype, ctx.reduce_dtype = local.dtype, reduce_dtype
        ctx.shard_size, ctx.shard_group, ctx.replicate_group = shard_size, shard_group, replicate_group
        x = local if param_dtype is None else local.to(param_dtype)
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), shard_size, shard_group))

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype)
        g = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g.contiguous(), "sum", ctx.shard_size, ctx.shard_group))
        g = _c10d.wait_tensor(_c10d.all_reduce(g, "sum", ctx.replicate_group))
        return g.to(ctx.dtype), None, None, None, None, None


class HybridShardParametrization(ReplicateParametrization):
    """HSDP: all-gathers a ``[Replicate(), Shard(0)]`` DTensor parameter on the shard group
    (see the module docstring); ``reshard_after_forward`` as :class:`ReplicateParametrization`."""

    def _gather(self, x):
        mesh = x.device_mesh
        shard_size = mesh.size(1)
        if x.shape[0] % shard_size:
            raise ValueError(f"HSDP shards dim 0 evenly: {x.shape[0]} rows over {shard_size} ranks")
        return _HybridGather.apply(x.to_local(), self.param_dtype, self.reduce_dtype, shard_size,
                                   mesh.get_group(1).group_name, mesh.get_group(0).group_name)


def _tp_slice(fqn: str, p: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    for suffix in TP_COLWISE:
        if fqn.endswith(suffix + ".weight"):
            return p.chunk(tp_size, dim=0)[tp_rank]
    for suffix in TP_ROWWISE:
        if fqn.endswith(suffix + ".weight"):
            return p.chunk(tp_size, dim=1)[tp_rank]
    return p


def _check_tp(model: Transformer, tp_size: int) -> None:
    cfg = model.config
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                    ("ffn_hidden_dim", cfg.ffn_hidden_dim)):
        if n % tp_size:
            raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")


def parallelize(model: Transformer, mesh: DeviceMesh, options: FSDPOptions) -> Transformer:
    """Shard ``model`` in place over ``mesh`` (1-D dp, or 2-D (dp, tp)) and return it.

    Parameters must already hold their (identical on every rank) full values, or be on the meta
    device for tracing. Parameter names are unchanged apart from parametrize's
    ``parametrizations.<name>.original`` wrapping.
    """
    if dist.get_world_size() < 2:
        raise ValueError("FSDP needs a process group with world_size >= 2")
    tp_size = options.tp_size
    if tp_size > 1:
        if mesh.ndim != 2:
            raise ValueError(f"tp_size={tp_size} needs a 2-D (dp, tp) mesh, got {mesh.ndim}-D")
        if mesh.size(1) != tp_size:
            raise ValueError(f"mesh tp size {mesh.size(1)} != tp_size {tp_size}")
        _check_tp(model, tp_size)
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        tp_rank = tp_mesh.get_local_rank()
        tp_group_name = tp_mesh.get_group().group_name
        for module in model.modules():
            if isinstance(module, (Attention, FeedForward)):
                module.tp_size, module.tp_group_name = tp_size, tp_group_name
    else:
        ndim = 2 if options.dp_mode == "hybrid_shard" else 1
        if mesh.ndim != ndim:
            raise ValueError(f"dp_mode={options.dp_mode!r} needs a {ndim}-D mesh, got {mesh.ndim}-D "
                             "(models.fsdp.mesh_for builds it)")
        dp_mesh, tp_rank = mesh, 0
    placements = {"fully_shard": [Shard(0)], "hybrid_shard": [Replicate(), Shard(0)],
                  "replicate": [Replicate()]}[options.dp_mode]
    parametrization = HybridShardParametrization if options.dp_mode == "hybrid_shard" else ReplicateParametrization

    param_dtype = options.param_dtype
    for fqn, param in list(model.named_parameters()):
        module_name, _, attr = fqn.rpartition(".")
        module = model.get_submodule(module_name)
        local = _tp_slice(fqn, param.detach(), tp_rank, tp_size)
        # src_data_rank=None: every rank chunks its own (identical) copy, no scatter
        dtensor = distribute_tensor(local, dp_mesh, placements, src_data_rank=None)
        setattr(module, attr, nn.Parameter(dtensor))
        same_dtype = param_dtype is None or param_dtype == param.dtype
        register_parametrization(
            module, attr,
            parametrization(
                None if same_dtype else param_dtype,
                options.effective_reduce_dtype if not same_dtype else options.reduce_dtype,
                # a replicated parameter is never gathered: there is nothing to reshard
                options.reshard_after_forward and options.dp_mode != "replicate",
            ),
            unsafe=True,
        )
    if options.activation_checkpointing != "none":
        _apply_activation_checkpointing(model, options.activation_checkpointing)
    logger.debug("parallelized %d parameters over mesh %s", len(list(model.parameters())), mesh)
    return model


def _apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    kwargs = {} if mode == "full" else {
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)}
    for block in model.layers:
        assert isinstance(block, TransformerBlock)
        block.checkpoint_kwargs = kwargs
