"""Small FSDP x TP and MoE graphs, written by hand and traced with make_fx, for the tests.

Not a test module: the graphs of ``tests/test_parallel_graphs.py`` and
``tests/test_parallel_numerics_gloo.py``. Each reproduces one structure of bigger FSDP x TP /
expert-parallel training graphs (torchtitan's DeepSeek-V3 and LLaMA-3 2-D graphs) at a size a
test traces in a second:

- :func:`sp_forward` / :func:`sp_backward`: sequence-parallel MLP blocks (Megatron SP) under
  FSDP: per block, FSDP all-gathers of two weights on the dp group between a tensor-parallel
  all-gather of the activations (before the first matmul) and a tensor-parallel
  reduce-scatter (after the second); the backward re-gathers the weights, all-gathers the
  saved activations and the output gradient on tp, and reduce-scatters the weight gradients
  on dp and the input gradient on tp.
- :func:`norm_grads_backward`: a norm weight replicated over tp: its gradient all-reduced
  over tp, then that result reduce-scattered over dp.
- :func:`saving_forward`: a forward that returns a gathered weight (saved for the backward).
- :func:`moe_forward`: a top-1 MoE block whose tokens travel by ``all_to_all_single`` on an
  expert-parallel group, split sizes read by ``.tolist()``, beside FSDP all-gathers.
- :func:`tp_chain_forward`: tensor-parallel all-gathers of activations each needed right
  where it is ready (issue ranges that do not meet), beside FSDP all-gathers.
- :func:`wgrad_backward`: the sequence-parallel backward in Megatron's order (the input's
  gradient first): a saved activation's all-gather, ready at the start, is needed just after
  the output gradient's, which is ready only then.

Every function takes its process groups by name (``dp``, ``tp`` / ``ep``, with their sizes),
so that the same code traces on a fake group and on a real gloo group. :func:`trace` traces one
under a FakeTensorMode (``symbolic=True``: with a shape environment, for ``.tolist()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx

_c10d = torch.ops._c10d_functional
BF16 = torch.bfloat16


class Groups(NamedTuple):
    """Two process groups by name and size: FSDP's (``dp``) and another (tp or ep)."""

    dp: str
    dp_size: int
    other: str
    other_size: int


def mesh_groups(mesh: Any, other: str = "tp") -> Groups:
    """:class:`Groups` of a 2-D (dp, ``other``) device mesh."""
    dp, o = mesh["dp"], mesh[other]
    return Groups(dp.get_group().group_name, dp.size(), o.get_group().group_name, o.size())


def _ag(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, size, group))


def _rs(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", size, group))


def _ar(x: torch.Tensor, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))


# --------------------------------------------------------------------------------------------
# sequence-parallel MLP blocks under FSDP


class SPShapes(NamedTuple):
    """Shapes of the sequence-parallel graphs (per rank)."""

    n_blocks: int = 3
    seq: int = 64
    """Tokens of the whole sequence (each tp rank holds seq / tp of them)."""
    dim: int = 64
    hidden: int = 128
    """MLP hidden width of the whole block (each tp rank holds hidden / tp)."""
    head: int = 512
    """Width of the output projection after the blocks (its result is the forward's peak)."""


def sp_inputs(g: Groups, shapes: SPShapes = SPShapes(), *, make=torch.randn) -> list[torch.Tensor]:
    """Inputs of :func:`sp_forward`: the activations' sequence shard (bf16), then per block the
    fp32 shards of w1 (dim, hidden/tp) and w2 (hidden/tp, dim) (rows split over dp), then the
    output projection's shard (dim, head)."""
    s, d, h = shapes.seq // g.other_size, shapes.dim, shapes.hidden // g.other_size
    out = [make(s, d).to(BF16)]
    for _ in range(shapes.n_blocks):
        out += [make(d // g.dp_size, h) * 0.1, make(h // g.dp_size, d) * 0.1]
    out.append(make(d // g.dp_size, shapes.head) * 0.1)
    return out


def sp_forward(g: Groups, shapes: SPShapes = SPShapes()) -> Callable[..., Any]:
    """Sequence-parallel blocks under FSDP, forward::

        per block i:  w1 = AG_dp(bf16(w1_shard))          x = AG_tp(x_sp)        (seq, dim)
                      h = relu(x @ w1)                    w2 = AG_dp(bf16(w2_shard))
                      x_sp = x_sp + RS_tp(h @ w2)        (seq/tp, dim)
        then:         out = AG_tp(x_sp) @ AG_dp(bf16(w_out_shard))   (seq, head): the peak

    Returns (out, x_sp of every block's input): the backward's saved activations.
    """
    n = shapes.n_blocks

    def forward(x_sp, *shards):
        saved = []
        for i in range(n):
            saved.append(x_sp)
            w1 = _ag(shards[2 * i].to(BF16), g.dp_size, g.dp)
            x = _ag(x_sp, g.other_size, g.other)
            h = torch.relu(x @ w1)
            w2 = _ag(shards[2 * i + 1].to(BF16), g.dp_size, g.dp)
            x_sp = x_sp + _rs(h @ w2, g.other_size, g.other)
        w_out = _ag(shards[2 * n].to(BF16), g.dp_size, g.dp)
        return (_ag(x_sp, g.other_size, g.other) @ w_out, *saved)

    return forward


def sp_backward_inputs(g: Groups, shapes: SPShapes = SPShapes(), *, make=torch.randn) -> list[torch.Tensor]:
    """Inputs of :func:`sp_backward`: the saved activations of every block (bf16 sequence
    shards), the gradient of the blocks' output (bf16 sequence shard), then the weight shards
    as :func:`sp_inputs` gives them (without the output projection's)."""
    s, d = shapes.seq // g.other_size, shapes.dim
    saved = [make(s, d).to(BF16) for _ in range(shapes.n_blocks)]
    return [*saved, make(s, d).to(BF16), *sp_inputs(g, shapes, make=make)[1:-1]]


def sp_backward(g: Groups, shapes: SPShapes = SPShapes()) -> Callable[..., Any]:
    """Backward of :func:`sp_forward`'s blocks, reshard after forward (weights re-gathered)::

        per block i, last first:
            gy = AG_tp(g_sp)                      x = AG_tp(saved x_sp)      (ready at the start)
            w1 = AG_dp(bf16(w1_shard))            h = relu(x @ w1)
            w2 = AG_dp(bf16(w2_shard))            gh = (gy @ w2^T) * (h > 0)
            RS_dp(fp32(h^T @ gy))                 RS_dp(fp32(x^T @ gh))     (weight gradients)
            g_sp = g_sp + RS_tp(gh @ w1^T)                                  (input gradient)

    Returns (g_sp, the weight gradients' shards, last block first).
    """
    n = shapes.n_blocks

    def backward(*args):
        saved, g_sp, shards = args[:n], args[n], args[n + 1:]
        grads = []
        for i in reversed(range(n)):
            gy = _ag(g_sp, g.other_size, g.other)
            x = _ag(saved[i], g.other_size, g.other)
            w1 = _ag(shards[2 * i].to(BF16), g.dp_size, g.dp)
            h = torch.relu(x @ w1)
            w2 = _ag(shards[2 * i + 1].to(BF16), g.dp_size, g.dp)
            gh = (gy @ w2.t()) * (h > 0)
            grads.append(_rs((h.t() @ gy).float(), g.dp_size, g.dp))
            grads.append(_rs((x.t() @ gh).float(), g.dp_size, g.dp))
            g_sp = g_sp + _rs(gh @ w1.t(), g.other_size, g.other)
        return (g_sp, *grads)

    return backward


# --------------------------------------------------------------------------------------------
# collectives that read or return another's result


def norm_grads_backward(g: Groups, n_norms: int = 3) -> Callable[..., Any]:
    """Gradients of norm weights replicated over tp, each summed over tp, then reduce-scattered
    over dp (the reduce-scatter reads the all-reduce's result), beside an FSDP re-gather::

        per norm i:  gw = sum(x_i * gy, dim 0)     (dim,)  partial over tp
                     gw = AR_tp(gw)                then RS_dp(gw)
                     gy = gy @ AG_dp(bf16(w_i_shard))
    """

    def backward(gy, *args):
        xs, shards = args[:n_norms], args[n_norms:]
        grads = []
        for i in range(n_norms):
            gw = _ar((xs[i] * gy).float().sum(0), g.other)
            grads.append(_rs(gw, g.dp_size, g.dp))
            gy = gy @ _ag(shards[i].to(BF16), g.dp_size, g.dp)
        return (gy, *grads)

    return backward


def norm_grads_inputs(g: Groups, n_norms: int = 3, dim: int = 64, tokens: int = 32, *,
                      make=torch.randn) -> list[torch.Tensor]:
    """Inputs of :func:`norm_grads_backward`: the output gradient, the norms' inputs (bf16),
    the weight shards (fp32, (dim/dp, dim))."""
    return ([make(tokens, dim).to(BF16)] + [make(tokens, dim).to(BF16) for _ in range(n_norms)]
            + [make(dim // g.dp_size, dim) * 0.1 for _ in range(n_norms)])


def saving_forward(g: Groups, n_layers: int = 3) -> Callable[..., Any]:
    """A forward that returns every gathered weight beside its result (saved for the
    backward, as a forward without reshard-after-forward does)::

        per layer i:  w_i = AG_dp(bf16(w_i_shard));  x = relu(x @ w_i)
        return x, w_0, ..., w_{n-1}
    """

    def forward(x, *shards):
        ws = []
        for i in range(n_layers):
            w = _ag(shards[i].to(BF16), g.dp_size, g.dp)
            ws.append(w)
            x = torch.relu(x @ w)
        return (x, *ws)

    return forward


def saving_inputs(g: Groups, n_layers: int = 3, dim: int = 64, tokens: int = 32, *,
                  make=torch.randn) -> list[torch.Tensor]:
    return [make(tokens, dim).to(BF16)] + [make(dim // g.dp_size, dim) * 0.1 for _ in range(n_layers)]


# --------------------------------------------------------------------------------------------
# expert parallelism


def moe_forward(g: Groups, n_blocks: int = 2) -> Callable[..., Any]:
    """Top-1 MoE blocks with one expert per expert-parallel rank, beside FSDP all-gathers::

        per block i:  router = AG_dp(bf16(router_shard))    dest = argmax(x @ router)
                      counts = A2A_ep(tokens per rank)       send, recv = .tolist() of both
                      tokens = A2A_ep(x sorted by dest, recv, send)
                      w = AG_dp(bf16(w_shard));  y = relu(tokens @ w)
                      x = x + unsort(A2A_ep(y, send, recv))
    """

    def forward(x, *shards):
        for i in range(n_blocks):
            router = _ag(shards[2 * i].to(BF16), g.dp_size, g.dp)
            dest = (x @ router).argmax(-1)
            order = dest.argsort()
            counts = (dest.unsqueeze(-1) == torch.arange(g.other_size, device=x.device)).sum(0)
            ones = [1] * g.other_size
            recv_counts = _c10d.wait_tensor(_c10d.all_to_all_single(counts, ones, ones, g.other))
            send = counts.tolist()
            # a fake group leaves received buffers unset: bound what it "received"
            recv = recv_counts.clamp(0, x.shape[0]).tolist()
            for c in (*send, *recv):
                torch._check(c >= 0)
            tokens = _c10d.wait_tensor(_c10d.all_to_all_single(x[order], recv, send, g.other))
            w = _ag(shards[2 * i + 1].to(BF16), g.dp_size, g.dp)
            y = torch.relu(tokens @ w)
            back = _c10d.wait_tensor(_c10d.all_to_all_single(y, send, recv, g.other))
            x = x + torch.empty_like(back).index_copy(0, order, back)
        return x

    return forward


def moe_inputs(g: Groups, n_blocks: int = 2, dim: int = 64, tokens: int = 32, *,
               make=torch.randn) -> list[torch.Tensor]:
    out = [make(tokens, dim).to(BF16)]
    for _ in range(n_blocks):
        out += [make(dim // g.dp_size, g.other_size), make(dim // g.dp_size, dim) * 0.1]
    return out


def tp_chain_forward(g: Groups, n_blocks: int = 4) -> Callable[..., Any]:
    """Activation all-gathers on tp, each needed right where it is ready (its input is made by
    the node before its reader), beside FSDP all-gathers::

        per block i:  w = AG_dp(bf16(w_shard))
                      x_sp = relu(AG_tp(x_sp) @ w)[rows of this rank]
    """

    def forward(x_sp, *shards):
        rows = x_sp.shape[0]
        for i in range(n_blocks):
            w = _ag(shards[i].to(BF16), g.dp_size, g.dp)
            x_sp = torch.relu(_ag(x_sp, g.other_size, g.other) @ w)[:rows] * 0.5
        return x_sp

    return forward


def tp_chain_inputs(g: Groups, n_blocks: int = 4, dim: int = 64, tokens: int = 32, *,
                    make=torch.randn) -> list[torch.Tensor]:
    return [make(tokens // g.other_size, dim).to(BF16)] + [make(dim // g.dp_size, dim) * 0.1
                                                           for _ in range(n_blocks)]


def wgrad_backward(g: Groups, shapes: SPShapes = SPShapes()) -> Callable[..., Any]:
    """Sequence-parallel MLP blocks' backward in Megatron's order, the input's gradient before
    the weights' (the hidden activation saved, the block input re-gathered)::

        per block i, last first:
            gy = AG_tp(g_sp)                          (ready once the block after is done)
            gh = (gy @ AG_dp(bf16(w2_shard))^T) * (h > 0)
            x = AG_tp(saved x_sp)                     (ready at the start, needed only here)
            RS_dp(fp32(x^T @ gh))  RS_dp(fp32(h^T @ gy))          (weight gradients)
            g_sp = g_sp + RS_tp(gh @ AG_dp(bf16(w1_shard))^T)    (input gradient)

    In the order of need ``x`` of a block follows ``gy`` of that block on tp, which is ready
    only a few nodes before ``x`` is needed. Inputs: :func:`wgrad_inputs`. Returns (g_sp, the
    weight gradients' shards, last block first)."""
    n = shapes.n_blocks

    def backward(*args):
        saved_x, saved_h, g_sp, shards = args[:n], args[n:2 * n], args[2 * n], args[2 * n + 1:]
        grads = []
        for i in reversed(range(n)):
            gy = _ag(g_sp, g.other_size, g.other)
            h = saved_h[i]
            gh = (gy @ _ag(shards[2 * i + 1].to(BF16), g.dp_size, g.dp).t()) * (h > 0)
            x = _ag(saved_x[i], g.other_size, g.other)
            grads.append(_rs((x.t() @ gh).float(), g.dp_size, g.dp))
            grads.append(_rs((h.t() @ gy).float(), g.dp_size, g.dp))
            g_sp = g_sp + _rs(gh @ _ag(shards[2 * i].to(BF16), g.dp_size, g.dp).t(), g.other_size, g.other)
        return (g_sp, *grads)

    return backward


def wgrad_inputs(g: Groups, shapes: SPShapes = SPShapes(), *, make=torch.randn) -> list[torch.Tensor]:
    """Inputs of :func:`wgrad_backward`: every block's saved input (bf16 sequence shard), every
    block's saved hidden activation (bf16, whole sequence, hidden / tp), the gradient of the
    blocks' output (bf16 sequence shard), then the weight shards as :func:`sp_inputs` gives them
    (without the output projection's)."""
    s, d, h = shapes.seq // g.other_size, shapes.dim, shapes.hidden // g.other_size
    saved_x = [make(s, d).to(BF16) for _ in range(shapes.n_blocks)]
    saved_h = [make(shapes.seq, h).to(BF16) for _ in range(shapes.n_blocks)]
    return [*saved_x, *saved_h, make(s, d).to(BF16), *sp_inputs(g, shapes, make=make)[1:-1]]


# --------------------------------------------------------------------------------------------


def trace(fn: Callable[..., Any], inputs: list[torch.Tensor], *, symbolic: bool = False) -> fx.GraphModule:
    """``fn`` traced by make_fx on fake copies of ``inputs`` (``symbolic``: with a shape
    environment, so that ``.tolist()`` gives unbacked symbols)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in inputs]
    with mode:
        return make_fx(fn, tracing_mode="fake")(*fakes)
