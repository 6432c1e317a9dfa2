"""LLaMA-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied output.

Module layout and parameter names follow torchtitan's llama3 (``tok_embeddings``,
``layers.N.attention.wq`` ..., ``layers.N.feed_forward.w1`` ..., ``norm``, ``output``), so that
parameter FQNs in captured graphs read like a real training job's.

``Transformer.forward(tokens, labels)`` returns the mean next-token cross-entropy (fp32 scalar).
Tensor parallelism (Megatron style, used by the 2-D mesh option of :mod:`models.fsdp`) is
built in: after :func:`models.fsdp.parallelize` sets ``tp_size`` / ``tp_group_name`` on the
attention and MLP modules, those hold local shards of their weights (column-parallel
wq/wk/wv/w1/w3, row-parallel wo/w2) and all-reduce over the tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.attention import default_scale, flash_attn

# Standard deviation of the normal init of linear and embedding weights (torchtitan / GPT-2 use 0.02).
INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and training-step configuration of a LLaMA-3-style model."""

    name: str = "custom"
    """Preset name this config came from (informational)."""
    dim: int
    """Model (hidden) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; ``dim % n_heads == 0``, head_dim = dim / n_heads."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); divides ``n_heads``."""
    ffn_hidden_dim: int
    """Hidden width of the SwiGLU MLP (w1 / w3 output, w2 input)."""
    vocab_size: int
    """Vocabulary size (embedding rows and output projection rows)."""
    rope_theta: float = 500000.0
    """RoPE base frequency (LLaMA 3 uses 500000)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    seq_len: int = 8192
    """Tokens per sequence in the traced / run step."""
    batch_size: int = 1
    """Sequences per rank per step (local batch size)."""
    loss_chunks: int = 1
    """Chunks of the sequence for the output projection + loss; each chunk's fp32 logits are
    recomputed in backward, so only one chunk's logits is alive at a time. 1 = unchunked."""

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size",
                    "seq_len", "batch_size", "loss_chunks")
        for f in positive:
            if getattr(self, f) <= 0:
                raise ValueError(f"LlamaConfig.{f} must be positive, got {getattr(self, f)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.seq_len % self.loss_chunks:
            raise ValueError(f"seq_len {self.seq_len} is not divisible by loss_chunks {self.loss_chunks}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


# Shapes of the public LLaMA 3 / 3.1 models (Meta's params.json); the debug preset is tiny for tests.
PRESETS: dict[str, LlamaConfig] = {
    "llama3-debug": LlamaConfig(
        name="llama3-debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128,
        vocab_size=256, rope_theta=10000.0, seq_len=32, batch_size=2,
    ),
    "llama3-8b": LlamaConfig(
        name="llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
        vocab_size=128256, loss_chunks=8,
    ),
    "llama3-70b": LlamaConfig(
        name="llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672,
        vocab_size=128256, loss_chunks=8,
    ),
    "llama3-405b": LlamaConfig(
        name="llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248,
        vocab_size=128256, loss_chunks=16,
    ),
}


def list_presets() -> list[str]:
    """Names of the preset configurations."""
    return list(PRESETS)


def get_config(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (e.g. ``n_layers=2``).

    Raises ValueError for an unknown preset, TypeError for an unknown field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown LlamaConfig fields {sorted(unknown)}; valid: {sorted(fields)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel regions (Megatron's f and g): identity one way, all-reduce the other.


def _all_reduce(x: Tensor, group_name: str) -> Tensor:
    y = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(y)


class _CopyToTP(torch.autograd.Function):
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad.contiguous(), ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        return _all_reduce(x.contiguous(), group_name)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _TPModule(nn.Module):
    """Base of modules that may run tensor-parallel (set by models.fsdp.parallelize)."""

    tp_size: int = 1
    tp_group_name: str | None = None

    def _enter_tp(self, x: Tensor) -> Tensor:
        return x if self.tp_group_name is None else _CopyToTP.apply(x, self.tp_group_name)

    def _leave_tp(self, x: Tensor) -> Tensor:
        return x if self.tp_group_name is None else _ReduceFromTP.apply(x, self.tp_group_name)


# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin tables, (seq_len, head_dim // 2) fp32, for rotate-half RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (b, s, h, d) by position; pairs are (i, i + d/2). Computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


class Attention(_TPModule):
    """Grouped-query causal self-attention through the ``fsdp_sched::flash_attn`` op."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        hq, hkv = self.n_heads // self.tp_size, self.n_kv_heads // self.tp_size
        x = self._enter_tp(x)
        q = self.wq(x).view(b, s, hq, self.head_dim)
        k = self.wk(x).view(b, s, hkv, self.head_dim)
        v = self.wv(x).view(b, s, hkv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, _lse = flash_attn(q, k, v, True, default_scale(self.head_dim))
        return self._leave_tp(self.wo(out.reshape(b, s, hq * self.head_dim)))


class FeedForward(_TPModule):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self._enter_tp(x)
        return self._leave_tp(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    checkpoint_kwargs: dict | None = None
    """Set by models.fsdp to run the block under torch.utils.checkpoint with these kwargs."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.checkpoint_kwargs is not None:
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False, **self.checkpoint_kwargs)
        return self._forward(x, cos, sin)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def cross_entropy_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed next-token cross-entropy in fp32, written with logsumexp + gather.

    F.cross_entropy breaks DTensor's redistribute backward under aot_autograd (TORCH_NOTES).
    """
    logits = logits.float()
    target = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - target).sum()


def _chunk_loss_sum(h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    return cross_entropy_sum(F.linear(h, weight), labels)


class Transformer(nn.Module):
    """LLaMA-3-style decoder whose forward returns the training loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` (CPU generator, so identical on every rank/device):
        normal(0, INIT_STD) for linear and embedding weights, ones for norm weights."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            else:
                value = torch.randn(p.shape, generator=gen) * INIT_STD
            p.copy_(value.to(p.dtype))
        cos, sin = rope_tables(self.config.head_dim, self.config.seq_len, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def hidden(self, tokens: Tensor) -> Tensor:
        """Final-norm hidden states (b, s, dim) for ``tokens`` (b, s)."""
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy (fp32 scalar) of predicting ``labels`` (b, s) from ``tokens`` (b, s)."""
        return mean_loss(self.hidden(tokens), self.output.weight, labels, self.config.loss_chunks)


def mean_loss(h: Tensor, weight: Tensor, labels: Tensor, chunks: int) -> Tensor:
    """Mean next-token cross-entropy (fp32 scalar) of the output projection ``weight`` applied
    to the final hidden states ``h`` (b, s, dim), in ``chunks`` chunks of the sequence.

    ``weight`` is read once by the caller: every read of a sharded weight is an all-gather.
    """
    if chunks == 1:
        total = _chunk_loss_sum(h, weight, labels)
    else:
        total = h.new_zeros((), dtype=torch.float32)
        for h_c, l_c in zip(h.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
            # recomputed in backward: only one chunk's fp32 logits is ever alive
            total = total + checkpoint(_chunk_loss_sum, h_c, weight, l_c, use_reentrant=False)
    return total / labels.numel()
