"""DeepSeek-V3-style mixture-of-experts decoder, sharded FSDP x expert-parallel, as torchtitan trains it.

The model follows torchtitan's ``deepseek_v3`` (``torchtitan/models/deepseek_v3``, the "16B"
flavour; parameter names as there: ``layers.N.attention.wkv_b.weight``,
``layers.N.moe.router.gate.weight``, ``layers.N.moe.experts.w1``,
``layers.N.moe.shared_experts.w1.weight``, ...) closely enough for scheduling: every parameter
with its shape (what FSDP all-gathers and reduce-scatters), the compute of every layer (matmuls,
attention, grouped expert matmuls) and the expert-parallel token exchange.

- Multi-head latent attention (MLA, ``q_lora_rank == 0``): ``wq`` (dim -> heads x 192),
  ``wkv_a`` (dim -> kv_lora_rank + 64), ``kv_norm``, ``wkv_b`` (kv_lora_rank -> heads x
  (128 + 128)), ``wo``; RoPE on the 64 positional dims, the key's shared by all heads;
  attention through the ``fsdp_sched::flash_attn`` stand-in (:mod:`models.attention`) with
  192-wide queries and keys and 128-wide values.
- Layers ``< n_dense_layers`` have a dense SwiGLU ``feed_forward``; the others a ``moe``:
  a softmax top-k router (``router.gate``, computed in fp32), ``n_experts`` routed SwiGLU
  experts as three stacked weights (``experts.w1`` / ``w3``: (E, hidden, dim), ``w2``:
  (E, dim, hidden)) run by ``torch._grouped_mm``, and ``n_shared_experts`` shared experts as
  one SwiGLU of ``n_shared_experts * moe_hidden_dim`` (``shared_experts.w1/w2/w3``).
- The loss is the mean next-token cross-entropy, chunked as :mod:`models.llama` does.

Expert parallelism (``ep_size`` ranks, contiguous: one node): each rank holds
``n_experts / ep_size`` experts. A MoE layer sorts its tokens by expert, exchanges the
per-expert token counts with ``all_to_all_single`` on the expert-parallel group, reads the
split sizes with ``.tolist()`` (data-dependent sizes: unbacked symbols in the traced graphs),
sends each token to the rank of its expert (``all_to_all_single``), reorders the received
tokens from rank-major to expert-major, runs its experts, and sends the results back by the
reverse exchange, where they are weighted by their routing scores and summed per token
(torchtitan's ``AllToAllTokenDispatcher``).

Data parallelism (SimpleFSDP-style, :class:`models.fsdp.ReplicateParametrization`): every
parameter outside the routed experts is ``Shard(0)`` over all ranks (the ``dp`` group); the
routed experts' weights, this rank's ``n_experts / ep_size`` of them, are ``Shard(0)`` over
the ``world_size / ep_size`` ranks that hold the same experts (torchtitan's ``efsdp``
dimension, ``dp_shard_mod_ep``: ranks ``r, r + ep_size, ...``, one per node). The mesh is
torchtitan's sparse mesh ``("efsdp", "ep")``.

``MoEConfig.ep_size == 1`` keeps every expert on every rank: no all-to-all, experts sharded
over all ranks like the other parameters.

What differs from torchtitan, and why it does not matter for scheduling: RoPE is rotate-half
on real tables (torchtitan: complex YaRN tables; the same elementwise work); the router keeps
no load-balancing bias and counts no tokens per expert (buffers updated outside the step);
tokens are summed back with ``index_add`` (torchtitan: a deterministic scatter-add kernel).
``torch._grouped_mm`` gets a FLOP formula here (:func:`grouped_mm_flops`): torch's flop
counter has none, and every cost model prices compute from it.

In the partitioned graphs (:func:`models.capture_fsdp_graphs`), torch's min-cut partitioner
saves the gathered experts' weights (and the router gate's fp32 copy) for the backward rather
than recomputing their all-gathers: the backward re-gathers the other parameters only, as it
would in a torchtitan job compiled with the same partitioner.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.utils.parametrize import register_parametrization

from models.attention import flash_attn
from models.fsdp import FSDPOptions, ReplicateParametrization, groups_alive, mesh_for
from models.llama import RMSNorm, apply_rope, mean_loss, rope_tables

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape and training-step configuration of a DeepSeek-V3-style MoE model."""

    name: str = "custom"
    """Preset name this config came from (informational)."""
    dim: int
    """Model (hidden) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_dense_layers: int = 1
    """The first this-many blocks have a dense MLP instead of a MoE."""
    n_heads: int
    """Attention heads."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (``wkv_a``'s non-positional output)."""
    qk_nope_head_dim: int
    """Per-head width of the query/key part without RoPE."""
    qk_rope_head_dim: int
    """Per-head width of the query/key part with RoPE (the key's is shared by every head)."""
    v_head_dim: int
    """Per-head width of the values."""
    dense_hidden_dim: int
    """Hidden width of the dense blocks' SwiGLU MLP."""
    moe_hidden_dim: int
    """Hidden width of each routed expert (and of each shared expert)."""
    n_experts: int
    """Routed experts per MoE block."""
    n_shared_experts: int
    """Shared experts per MoE block (run on every token, as one SwiGLU of n x moe_hidden_dim)."""
    top_k: int
    """Routed experts per token."""
    vocab_size: int
    """Vocabulary size (embedding rows and output projection rows)."""
    ep_size: int = 1
    """Expert-parallel degree of the training step: ranks that split the routed experts among
    them (contiguous ranks: one node). 1: every rank runs every expert, no all-to-all."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    softmax_mscale: float = 1.0
    """Factor on the softmax scale ``1 / sqrt(qk head dim)`` (YaRN's mscale squared in
    torchtitan's 16B configuration)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    seq_len: int = 4096
    """Tokens per sequence in the traced step."""
    batch_size: int = 4
    """Sequences per rank per step (local batch size)."""
    loss_chunks: int = 1
    """Chunks of the sequence for the output projection + loss (as :class:`models.llama.LlamaConfig`)."""

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "dense_hidden_dim", "moe_hidden_dim", "n_experts", "n_shared_experts", "top_k",
                    "vocab_size", "ep_size", "seq_len", "batch_size", "loss_chunks")
        for f in positive:
            if getattr(self, f) <= 0:
                raise ValueError(f"MoEConfig.{f} must be positive, got {getattr(self, f)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} exceeds n_experts {self.n_experts}")
        if self.n_experts % self.ep_size:
            raise ValueError(f"n_experts {self.n_experts} is not divisible by ep_size {self.ep_size}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for RoPE")
        if self.seq_len % self.loss_chunks:
            raise ValueError(f"seq_len {self.seq_len} is not divisible by loss_chunks {self.loss_chunks}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.softmax_mscale


def _yarn_mscale_squared(rope_factor: float, mscale: float) -> float:
    """torchtitan's MLA softmax scale factor under YaRN RoPE scaling."""
    m = 0.1 * mscale * math.log(rope_factor) + 1.0
    return m * m


# torchtitan's deepseek_v3 "16B" flavour (torchtitan/models/deepseek_v3/__init__.py, ``_16b``) and
# its training config (config_registry.py ``deepseek_v3_16b``: 4 x 4096 tokens per rank, EP 8);
# the debug preset is tiny for tests.
PRESETS: dict[str, MoEConfig] = {
    "dsv3-debug": MoEConfig(
        name="dsv3-debug", dim=64, n_layers=3, n_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, dense_hidden_dim=128, moe_hidden_dim=32, n_experts=8,
        n_shared_experts=1, top_k=2, vocab_size=256, ep_size=2, seq_len=16, batch_size=2,
    ),
    "dsv3-16b": MoEConfig(
        name="dsv3-16b", dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, dense_hidden_dim=10944, moe_hidden_dim=1408,
        n_experts=64, n_shared_experts=2, top_k=6, vocab_size=102400, ep_size=8,
        softmax_mscale=_yarn_mscale_squared(40.0, 0.70), seq_len=4096, batch_size=4, loss_chunks=8,
    ),
}


def list_presets() -> list[str]:
    """Names of the MoE preset configurations."""
    return list(PRESETS)


def get_config(name: str, **overrides) -> MoEConfig:
    """The MoE preset ``name`` with fields replaced by ``overrides`` (None values ignored).

    Raises ValueError for an unknown preset, TypeError for an unknown field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown MoE preset {name!r}; valid presets: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown MoEConfig fields {sorted(unknown)}; valid: {sorted(fields)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------------
# FLOPs of torch._grouped_mm (torch.utils.flop_counter has no formula for it)


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``: each output element of a group is a dot
    product over the contraction width. With a 3-D operand (one matrix per group) that is
    ``2 * out.numel() * a.shape[-1]``; with two 2-D operands the offsets split the contraction
    dim among the groups of the 3-D output (an expert's weight gradient), so each output element
    sums ``a.shape[-1] / groups`` products."""
    out_numel = math.prod(out_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_numel * a_shape[-1] // out_shape[0]
    return 2 * out_numel * a_shape[-1]


def _register_grouped_mm_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = torch.ops.aten._grouped_mm
    if op in flop_registry:  # module re-imported, or a torch that counts it itself
        return

    @register_flop_formula(op)
    def _flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return grouped_mm_flops(a_shape, b_shape, out_shape)


_register_grouped_mm_flops()


# ---------------------------------------------------------------------------------------------


class MLA(nn.Module):
    """Multi-head latent attention with ``q_lora_rank == 0`` (torchtitan's ``Attention``)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, h * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(h * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        h, nope, rope = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.wq(x).view(b, s, h, cfg.qk_head_dim)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [cfg.kv_lora_rank, rope], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, h, nope + cfg.v_head_dim)
        k_nope, v = torch.split(kv, [nope, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, h, -1)], dim=-1)
        out, _lse = flash_attn(q, k, v.contiguous(), True, cfg.softmax_scale)
        return self.wo(out.reshape(b, s, h * cfg.v_head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """This rank's routed experts as stacked SwiGLU weights, run by ``torch._grouped_mm``.

    ``w1`` / ``w3``: (experts, hidden, dim); ``w2``: (experts, dim, hidden). ``n_experts`` is
    the number this rank holds (all of them without expert parallelism).
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``x`` (tokens, dim) sorted by expert, ``tokens_per_expert`` (experts,) -> (tokens, dim)."""
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(xb, self.w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets).type_as(x)


class MoE(nn.Module):
    """Top-k routed experts (exchanged over the expert-parallel group) plus shared experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Module()
        self.router.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.moe_hidden_dim, cfg.n_experts)
        self.shared_experts = FeedForward(cfg.dim, cfg.moe_hidden_dim * cfg.n_shared_experts)
        #: set by :func:`parallelize_moe`: the expert-parallel group and its size
        self.ep_group_name: str | None = None
        self.ep_size = 1

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        x_td = x.reshape(b * s, d)
        # routing in fp32 (torchtitan computes the gate under fp32 autocast)
        scores = F.softmax(F.linear(x_td.float(), self.router.gate.weight.float()), dim=-1)
        _, expert_ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        topk_scores = scores.gather(-1, expert_ids)
        tokens_per_expert = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, expert_ids, True).sum(0)

        # tokens in expert order (torchtitan's _local_reorder)
        order = torch.argsort(expert_ids.view(-1), stable=True)
        sorted_scores = topk_scores.view(-1)[order]
        token_of = order // self.top_k
        routed = x_td[token_of]
        if self.ep_group_name is None:
            out = self.experts(routed, tokens_per_expert)
        else:
            out = self._expert_parallel(routed, tokens_per_expert)
        out = (out.float() * sorted_scores.unsqueeze(-1)).to(x.dtype)
        routed_sum = torch.zeros_like(x_td).index_add_(0, token_of, out)
        return (routed_sum + self.shared_experts(x_td)).view(b, s, d)

    def _expert_parallel(self, routed: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Send ``routed`` (sorted by global expert) to the experts' ranks, run this rank's
        experts on what arrives, send the results back (torchtitan's AllToAllTokenDispatcher)."""
        ep, group = self.ep_size, self.ep_group_name
        with torch.no_grad():
            counts = funcol.all_to_all_single(tokens_per_expert.view(ep, -1), None, None, group)
            received_counts = _c10d.wait_tensor(counts)  # (ep source ranks, local experts)
            send = tokens_per_expert.view(ep, -1).sum(1).tolist()
            recv = received_counts.sum(1).tolist()
        for n in (*send, *recv):
            torch._check(n >= 0)
        tokens = funcol.all_to_all_single_autograd(routed, recv, send, group)
        # rank-major (source rank, local expert) -> expert-major, stable within each expert
        local_experts = received_counts.shape[1]
        segment = torch.arange(received_counts.numel(), device=routed.device)
        expert_of_row = torch.repeat_interleave(segment % local_experts, received_counts.view(-1),
                                                output_size=tokens.shape[0])
        perm = torch.argsort(expert_of_row, stable=True)
        y = self.experts(tokens[perm], received_counts.sum(0))
        back = torch.empty_like(y).index_copy(0, perm, y)
        return funcol.all_to_all_single_autograd(back, send, recv, group)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + ffn_or_moe(norm(h))."""

    def __init__(self, cfg: MoEConfig, layer_id: int) -> None:
        super().__init__()
        self.attention = MLA(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = layer_id >= cfg.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.dense_hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class MoETransformer(nn.Module):
    """DeepSeek-V3-style decoder whose forward returns the training loss."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.qk_rope_head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy (fp32 scalar) of predicting ``labels`` (b, s) from ``tokens`` (b, s)."""
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return mean_loss(self.norm(h), self.output.weight, labels, self.config.loss_chunks)


# ---------------------------------------------------------------------------------------------
# parallelism


#: meshes made by :func:`moe_meshes`, by layout, while their groups live
_SPARSE_MESHES: dict[tuple, DeviceMesh] = {}


@dataclass(frozen=True)
class MoEMeshes:
    """The meshes of an FSDP x expert-parallel step (module docstring)."""

    dp: DeviceMesh
    """1-D mesh of every rank: FSDP of the dense parameters."""
    efsdp: DeviceMesh | None
    """1-D mesh of the ranks that hold the same experts (one per expert-parallel group): FSDP
    of the routed experts; None without expert parallelism."""
    ep: DeviceMesh | None
    """1-D mesh of one expert-parallel group (contiguous ranks); None without expert parallelism."""

    def group_names(self) -> dict[str, str]:
        """Process group name of each mesh, by mesh name ("dp", "efsdp", "ep")."""
        return {name: mesh.get_group().group_name for name, mesh in
                (("dp", self.dp), ("efsdp", self.efsdp), ("ep", self.ep)) if mesh is not None}


def moe_meshes(world_size: int, ep_size: int, device_type: str = "cpu") -> MoEMeshes:
    """The meshes of :func:`parallelize_moe` for ``world_size`` ranks and expert-parallel degree
    ``ep_size``: the dp mesh of :func:`models.fsdp.mesh_for` and torchtitan's sparse mesh
    ("efsdp", "ep") of shape (world_size / ep_size, ep_size), each made once per process group
    world and reused (DTensor caches its redistribution plans by mesh layout)."""
    if world_size % ep_size:
        raise ValueError(f"world_size {world_size} is not divisible by ep_size {ep_size}")
    dp = mesh_for(world_size, FSDPOptions(), device_type)
    if ep_size == 1:
        return MoEMeshes(dp=dp, efsdp=None, ep=None)
    key = (world_size, ep_size, device_type)
    sparse = _SPARSE_MESHES.get(key)
    if sparse is None or not groups_alive(sparse):
        sparse = _SPARSE_MESHES[key] = init_device_mesh(device_type, (world_size // ep_size, ep_size),
                                                        mesh_dim_names=("efsdp", "ep"))
    return MoEMeshes(dp=dp, efsdp=sparse["efsdp"], ep=sparse["ep"])


def is_routed_expert(fqn: str) -> bool:
    """Whether parameter ``fqn`` (``layers.N.moe.experts.w1`` ...) is a routed expert's weight."""
    return ".moe.experts." in f".{fqn}"


def parallelize_moe(model: MoETransformer, meshes: MoEMeshes, options: FSDPOptions) -> MoETransformer:
    """Shard ``model`` in place (module docstring) and return it.

    Each routed-expert weight keeps this rank's ``n_experts / ep_size`` experts (its rank in
    the expert-parallel group picks them), ``Shard(0)`` over the efsdp mesh; every other
    parameter is ``Shard(0)`` over the dp mesh. Both are all-gathered on every read
    (:class:`models.fsdp.ReplicateParametrization`, with ``options``' dtypes and
    ``reshard_after_forward``). Parameters must hold their full values (identical on every
    rank) or be on the meta device.

    Raises:
        ValueError: options this model does not support (tensor parallelism, HSDP / DDP,
            activation checkpointing), or this rank's experts do not split evenly over efsdp.
    """
    if options.tp_size != 1 or options.dp_mode != "fully_shard" or options.activation_checkpointing != "none":
        raise ValueError("MoE presets are traced with FSDP (dp_mode='fully_shard') and expert parallelism only: "
                         f"got tp_size={options.tp_size}, dp_mode={options.dp_mode!r}, "
                         f"activation_checkpointing={options.activation_checkpointing!r}")
    cfg = model.config
    ep_size = cfg.ep_size
    ep_rank = 0
    if meshes.ep is not None:
        if meshes.ep.size() != ep_size:
            raise ValueError(f"the expert-parallel mesh has {meshes.ep.size()} ranks, the config ep_size {ep_size}")
        ep_rank = meshes.ep.get_local_rank()
        local_experts = cfg.n_experts // ep_size
        if local_experts % meshes.efsdp.size():
            raise ValueError(f"{local_experts} experts per expert-parallel rank do not split evenly over the "
                             f"{meshes.efsdp.size()} ranks that shard them (efsdp): choose ep_size so that "
                             f"n_experts / ep_size is a multiple of world_size / ep_size")
        for module in model.modules():
            if isinstance(module, MoE):
                module.ep_group_name, module.ep_size = meshes.ep.get_group().group_name, ep_size
    elif ep_size != 1:
        raise ValueError(f"config ep_size {ep_size} needs the expert-parallel meshes (moe_meshes)")

    param_dtype = options.param_dtype
    for fqn, param in list(model.named_parameters()):
        module_name, _, attr = fqn.rpartition(".")
        module = model.get_submodule(module_name)
        local, mesh = param.detach(), meshes.dp
        if is_routed_expert(fqn) and meshes.ep is not None:
            local, mesh = local.chunk(ep_size, dim=0)[ep_rank], meshes.efsdp
        dtensor = distribute_tensor(local, mesh, [Shard(0)], src_data_rank=None)
        setattr(module, attr, nn.Parameter(dtensor))
        same_dtype = param_dtype is None or param_dtype == param.dtype
        register_parametrization(
            module, attr,
            ReplicateParametrization(None if same_dtype else param_dtype,
                                     options.effective_reduce_dtype if not same_dtype else options.reduce_dtype,
                                     options.reshard_after_forward),
            unsafe=True,
        )
    return model
