"""A flash-attention stand-in: custom ops with fake kernels, CPU kernels and FLOP formulas.

On meta / CPU, ``F.scaled_dot_product_attention`` decomposes into the math path, which
materialises the (seq x seq) score matrix: traced graphs would then show FLOPs and memory
that a GPU flash kernel never has. These ops keep the traced graph faithful instead:

- ``fsdp_sched::flash_attn(q, k, v, causal, scale) -> (out, lse)``
- ``fsdp_sched::flash_attn_backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``

Layout follows flash-attention: q is (batch, seq, n_heads, head_dim), k is
(batch, seq, n_kv_heads, head_dim) and v is (batch, seq, n_kv_heads, v_head_dim) with
``n_heads % n_kv_heads == 0`` (grouped-query attention); the output is
(batch, seq, n_heads, v_head_dim). ``v_head_dim`` may differ from ``head_dim``, as in
DeepSeek-V3's multi-head latent attention (192-wide queries and keys, 128-wide values).
``lse`` is the fp32 log-sum-exp of the scaled scores, (batch, n_heads, seq), which flash
attention saves for backward.

The CPU kernels are plain math (fp32 accumulation), for real multi-process numerics tests.

FLOPs (registered with ``torch.utils.flop_counter``; ``d`` the query/key head width, ``d_v``
the value head width):
- forward: two matmuls (Q K^T and P V), ``2 * b * h * s_q * s_k * (d + d_v)``
  (``4 * b * h * s_q * s_k * d`` when ``d_v == d``);
- backward: five matmuls (recomputed Q K^T, dQ and dK over ``d``; dV and dP over ``d_v``),
  ``2 * b * h * s_q * s_k * (3 d + 2 d_v)``: 2.5x the forward when ``d_v == d``;
- ``causal=True`` counts half of that (``CAUSAL_FLOP_FRACTION``): flash kernels skip the
  fully masked key blocks, so a causal attention does about half the work (the FlashAttention-2
  paper reports causal throughput on this basis). torch's own SDPA formula does not halve.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

# Fraction of the dense attention FLOPs a causal flash kernel performs (masked blocks skipped).
CAUSAL_FLOP_FRACTION = 0.5
# Backward / forward FLOP ratio of flash attention when values are as wide as keys: 5 matmuls against 2.
BACKWARD_FLOP_RATIO = 2.5


def _expand_kv(kv: Tensor, n_heads: int) -> Tensor:
    """(b, s, h_kv, d) -> (b, s, n_heads, d), each kv head repeated for its query group."""
    return kv.repeat_interleave(n_heads // kv.shape[2], dim=2)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scaled scores (b, h, s_q, s_k) in fp32, -inf where the causal mask hides a key."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        s_q, s_k = s.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=s.device).tril(s_k - s_q)
        s = s.masked_fill(~mask, float("-inf"))
    return s


@torch.library.custom_op("fsdp_sched::flash_attn", mutates_args=())
def flash_attn(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention forward; returns (out like q, lse fp32 (b, h, s_q))."""
    n_heads = q.shape[2]
    s = _scores(q, _expand_kv(k, n_heads), causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, n_heads).float())
    # same layout as the fake kernel: compiled graphs view the output with its strides
    return _empty_out(q, v).copy_(out), lse


def _empty_out(q: Tensor, v: Tensor) -> Tensor:
    """The attention output, uninitialised: like q, with v's head width."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@flash_attn.register_fake
def _flash_attn_fake(q, k, v, causal, scale):
    b, s, h, _ = q.shape
    return _empty_out(q, v), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("fsdp_sched::flash_attn_backward", mutates_args=())
def flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward from the saved (out, lse); returns (dq, dk, dv) like (q, k, v)."""
    n_heads, n_kv = q.shape[2], k.shape[2]
    k_full, v_full = _expand_kv(k, n_heads).float(), _expand_kv(v, n_heads).float()
    p = torch.exp(_scores(q, k_full, causal, scale) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v_full)
    delta = (do * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, s_q, 1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_full)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())

    def fold(g: Tensor) -> Tensor:  # sum the gradients of each query group onto its kv head
        b, s, _, d = g.shape
        return g.view(b, s, n_kv, n_heads // n_kv, d).sum(3)

    return torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(fold(dk)), torch.empty_like(v).copy_(fold(dv))


@flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fsdp_sched.flash_attn_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attn.register_autograd(_backward, setup_context=_setup_context)


def attention_flops(q_shape, k_shape, causal: bool, v_shape=None) -> int:
    """Forward FLOPs of attention for q (b, s_q, h, d), k (b, s_k, h_kv, d) and v
    (b, s_k, h_kv, d_v) (None: ``d_v == d``)."""
    b, s_q, h, d = q_shape
    s_k = k_shape[1]
    d_v = d if v_shape is None else v_shape[-1]
    dense = 2 * b * h * s_q * s_k * (d + d_v)
    return int(dense * CAUSAL_FLOP_FRACTION) if causal else dense


def attention_backward_flops(q_shape, k_shape, causal: bool, v_shape=None) -> int:
    """Backward FLOPs of attention (module docstring): Q K^T, dQ and dK over the query/key width,
    dV and dP over the value width."""
    b, s_q, h, d = q_shape
    s_k = k_shape[1]
    d_v = d if v_shape is None else v_shape[-1]
    dense = 2 * b * h * s_q * s_k * (3 * d + 2 * d_v)
    return int(dense * CAUSAL_FLOP_FRACTION) if causal else dense


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry

    fwd, bwd = torch.ops.fsdp_sched.flash_attn, torch.ops.fsdp_sched.flash_attn_backward
    if fwd in flop_registry:  # module re-imported (e.g. importlib.reload): already registered
        return

    @register_flop_formula(fwd)
    def _fwd_flops(q_shape, k_shape, v_shape, causal, scale, *args, out_shape=None, **kwargs) -> int:
        return attention_flops(q_shape, k_shape, causal, v_shape)

    @register_flop_formula(bwd)
    def _bwd_flops(dout_shape, q_shape, k_shape, v_shape, out_shape_, lse_shape, causal, *args, out_shape=None,
                   **kwargs) -> int:
        return attention_backward_flops(q_shape, k_shape, causal, v_shape)


_register_flops()


def default_scale(head_dim: int) -> float:
    """Softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
