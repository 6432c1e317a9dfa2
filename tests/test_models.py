"""Tests of models/: presets, the attention op, the loss, FSDP graph capture and real FSDP numerics.

Captures use llama3-debug (dim 64, 2 layers, 21 parameters) on a fake group of 4 ranks, plus
one capture of a 2-layer llama3-8b (full widths) to check byte counts at real size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import FlopCounterMode

import models
from gloo_harness import run_multiprocess
from models import PRESETS, capture_fsdp_graphs, list_presets
from models.attention import BACKWARD_FLOP_RATIO, CAUSAL_FLOP_FRACTION, flash_attn
from models.capture import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT
from models.llama import Transformer, cross_entropy_sum, get_config

W = 4
DEBUG = "llama3-debug"


VIEWS_AND_CASTS = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
                   torch.ops.aten.detach.default}


def collectives(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def full_numel(fqn: str, cfg) -> int:
    """Full (unsharded) element count of a parameter from the config, independent of the model."""
    hd = cfg.head_dim
    table = {
        "tok_embeddings.weight": cfg.vocab_size * cfg.dim, "output.weight": cfg.vocab_size * cfg.dim,
        "norm.weight": cfg.dim, "attention_norm.weight": cfg.dim, "ffn_norm.weight": cfg.dim,
        "attention.wq.weight": cfg.dim * cfg.n_heads * hd, "attention.wo.weight": cfg.dim * cfg.n_heads * hd,
        "attention.wk.weight": cfg.dim * cfg.n_kv_heads * hd, "attention.wv.weight": cfg.dim * cfg.n_kv_heads * hd,
        "feed_forward.w1.weight": cfg.dim * cfg.ffn_hidden_dim, "feed_forward.w2.weight": cfg.dim * cfg.ffn_hidden_dim,
        "feed_forward.w3.weight": cfg.dim * cfg.ffn_hidden_dim,
    }
    key = fqn.split(".", 2)[2] if fqn.startswith("layers.") else fqn
    return table[key]


def nbytes(node) -> int:
    v = node.meta["val"]
    return v.numel() * v.element_size()


@pytest.fixture(scope="module")
def default_capture():
    from conftest import capture_llama_debug

    return capture_llama_debug()  # shared with other modules (W ranks)


@pytest.fixture(scope="module")
def no_reshard_capture():
    return capture_fsdp_graphs(DEBUG, world_size=W, reshard_after_forward=False)


# --------------------------------------------------------------------------------------------
# presets


def test_presets_and_bad_name():
    assert {"llama3-debug", "llama3-8b", "llama3-70b", "llama3-405b"} <= set(list_presets())
    cfg = PRESETS["llama3-8b"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim, cfg.vocab_size) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert cfg.rope_theta == 500000 and cfg.seq_len == 8192 and cfg.batch_size == 1 and cfg.loss_chunks > 1
    assert PRESETS["llama3-405b"].n_layers == 126
    assert get_config("llama3-8b", n_layers=2, seq_len=1024).n_layers == 2
    with pytest.raises(ValueError, match="llama3-8b"):
        capture_fsdp_graphs("llama3-9b", world_size=W)
    with pytest.raises(ValueError, match="world_size"):
        capture_fsdp_graphs(DEBUG, world_size=1)
    with pytest.raises(TypeError, match="bogus"):
        capture_fsdp_graphs(DEBUG, world_size=W, bogus=1)


# --------------------------------------------------------------------------------------------
# attention op


def _reference_attention(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


def test_flash_attn_matches_sdpa_with_gqa():
    torch.manual_seed(0)
    b, s, h, hkv, d = 2, 12, 4, 2, 8
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hkv, d, requires_grad=True)
    v = torch.randn(b, s, hkv, d, requires_grad=True)
    out, lse = flash_attn(q, k, v, True, 1 / math.sqrt(d))
    ref = _reference_attention(q, k, v)
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_flash_attn_flop_formula():
    b, s, h, hkv, d = 2, 16, 4, 2, 8
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hkv, d, requires_grad=True)
    v = torch.randn(b, s, hkv, d, requires_grad=True)
    fwd = 4 * b * h * s * s * d * CAUSAL_FLOP_FRACTION
    with FlopCounterMode(display=False) as counter:
        out, _ = flash_attn(q, k, v, True, 0.5)
    assert counter.get_total_flops() == fwd
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == fwd * BACKWARD_FLOP_RATIO


def _sdpa_scaled(q, k, v, scale):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).transpose(1, 2)


def test_flash_attn_with_narrower_values_matches_sdpa_and_counts_flops():
    """MLA's widths: queries and keys 12 wide, values 8: the output is as wide as the values,
    equal to SDPA's (values and gradients); FLOPs 2bhs^2(d + d_v) forward and
    2bhs^2(3d + 2d_v) backward, halved for the causal mask."""
    torch.manual_seed(0)
    b, s, h, d, dv = 2, 10, 3, 12, 8
    q, k = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(2))
    v = torch.randn(b, s, h, dv, requires_grad=True)
    with FlopCounterMode(display=False) as fwd_counter:
        out, _ = flash_attn(q, k, v, True, 0.3)
    ref = _sdpa_scaled(q, k, v, 0.3)
    assert out.shape == (b, s, h, dv)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    with FlopCounterMode(display=False) as bwd_counter:
        got = torch.autograd.grad(out, (q, k, v), grad)
    for x, y in zip(got, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(x, y)
    assert fwd_counter.get_total_flops() == 2 * b * h * s * s * (d + dv) * CAUSAL_FLOP_FRACTION
    assert bwd_counter.get_total_flops() == 2 * b * h * s * s * (3 * d + 2 * dv) * CAUSAL_FLOP_FRACTION


# --------------------------------------------------------------------------------------------
# loss


@pytest.mark.parametrize("chunks", [1, 4])
def test_loss_equals_cross_entropy(chunks):
    model = models.build_reference_model(DEBUG, seed=1, loss_chunks=chunks)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32), generator=g)
    labels = torch.randint(0, 256, (2, 32), generator=g)
    loss = model(tokens, labels)
    logits = model.output(model.hidden(tokens))
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    # gradients too: chunking (with recompute) must not change them
    (grad,) = torch.autograd.grad(loss, model.output.weight)
    ref = models.build_reference_model(DEBUG, seed=1, loss_chunks=1)
    (ref_grad,) = torch.autograd.grad(ref(tokens, labels), ref.output.weight)
    torch.testing.assert_close(grad, ref_grad)


def test_cross_entropy_sum_random_logits():
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(cross_entropy_sum(logits, labels),
                               F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))


# --------------------------------------------------------------------------------------------
# captured graphs


def test_forward_one_all_gather_per_param_bf16(default_capture):
    c = default_capture
    fqns = c.param_fqns
    assert fqns[0] == "tok_embeddings.weight" and fqns[-1] == "output.weight"
    assert "layers.0.attention.wq.weight" in fqns and not any("parametrizations" in f for f in fqns)
    assert c.forward.meta["fsdp_graph_kind"] == "forward" and c.forward.meta["fsdp_param_fqns"] == fqns
    ags = collectives(c.forward, ALL_GATHER)
    assert sorted(n.meta["fsdp_fqn"] for n in ags) == sorted(fqns)  # exactly one per parameter
    for ag in ags:
        fqn = ag.meta["fsdp_fqn"]
        assert ag.meta["fsdp_role"] == "fsdp"
        assert fqns[ag.meta["fsdp_param_index"]] == fqn
        assert ag.args[1] == W  # group size
        # cast before the all-gather: a bf16 shard goes in, a bf16 full parameter comes out
        assert ag.args[0].target is torch.ops.aten._to_copy.default
        assert ag.args[0].args[0].meta["val"].dtype == torch.float32
        assert ag.meta["val"].dtype == torch.bfloat16
        assert nbytes(ag.args[0]) == full_numel(fqn, c.config) // W * 2
        assert ag.meta["val"].numel() == full_numel(fqn, c.config)
        (wait,) = [u for u in ag.users if u.target is WAIT]
        assert wait.meta["fsdp_fqn"] == fqn and wait.meta["fsdp_param_index"] == ag.meta["fsdp_param_index"]
    # module registration order is what fsdp_param_index follows
    model_order = [n for n, _ in Transformer(get_config(DEBUG)).named_parameters()]
    assert fqns == model_order


def test_backward_one_reduce_scatter_per_param(default_capture):
    c = default_capture
    assert c.backward.meta["fsdp_graph_kind"] == "backward"
    rss = collectives(c.backward, REDUCE_SCATTER)
    assert sorted(n.meta["fsdp_fqn"] for n in rss) == sorted(c.param_fqns)
    for rs in rss:
        fqn = rs.meta["fsdp_fqn"]
        assert rs.args[1] == "sum" and rs.args[2] == W
        assert rs.args[0].meta["val"].dtype == torch.bfloat16  # reduce_dtype defaults to param_dtype
        assert rs.args[0].meta["val"].numel() == full_numel(fqn, c.config)
        assert nbytes(rs) == full_numel(fqn, c.config) // W * 2
        assert all(w.meta["fsdp_fqn"] == fqn for w in rs.users if w.target is WAIT)


def test_fp32_reduce_dtype():
    c = capture_fsdp_graphs(DEBUG, world_size=W, n_layers=1, reduce_dtype=torch.float32)
    rss = collectives(c.backward, REDUCE_SCATTER)
    assert len(rss) == len(c.param_fqns)
    assert all(rs.args[0].meta["val"].dtype == torch.float32 for rs in rss)
    assert all(ag.meta["val"].dtype == torch.bfloat16 for ag in collectives(c.forward, ALL_GATHER))


def test_fp32_params_move_fp32():
    c = capture_fsdp_graphs(DEBUG, world_size=2, n_layers=1, param_dtype=None)
    for ag in collectives(c.forward, ALL_GATHER):
        assert ag.args[1] == 2
        assert nbytes(ag.args[0]) == full_numel(ag.meta["fsdp_fqn"], c.config) // 2 * 4


def test_meta_vals_are_fake(default_capture):
    for gm in (default_capture.forward, default_capture.backward):
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op != "output"]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        assert tensors and all(isinstance(v, FakeTensor) for v in tensors)


def test_reshard_after_forward(default_capture, no_reshard_capture):
    # True: backward gathers every parameter again except the embedding (its grad needs no weight)
    regathered = [n.meta["fsdp_fqn"] for n in collectives(default_capture.backward, ALL_GATHER)]
    assert sorted(regathered) == sorted(f for f in default_capture.param_fqns if f != "tok_embeddings.weight")
    assert all(n.meta["fsdp_role"] == "fsdp" for n in collectives(default_capture.backward, ALL_GATHER))
    # False: no gather in backward, forward saves full parameters (values fed by a wait_tensor)
    assert collectives(no_reshard_capture.backward, ALL_GATHER) == []
    assert len(collectives(no_reshard_capture.backward, REDUCE_SCATTER)) == len(no_reshard_capture.param_fqns)

    def saved_gathered(gm):
        saved = gm.graph.find_nodes(op="output")[0].args[0][1:]
        hits = 0
        for node in saved:
            while node.target in VIEWS_AND_CASTS:
                node = node.args[0]
            hits += node.target is WAIT
        return hits

    assert saved_gathered(no_reshard_capture.forward) >= len(no_reshard_capture.param_fqns) - 1
    assert saved_gathered(default_capture.forward) == 0


def test_repeated_capture_restores_process_group(default_capture):
    assert not dist.is_initialized()  # capture cleans up the group it created
    again = capture_fsdp_graphs(DEBUG, world_size=2, n_layers=1)
    assert len(collectives(again.forward, ALL_GATHER)) == len(again.param_fqns) == 12
    assert not dist.is_initialized()
    # a fake group of another size is replaced for the capture, then restored
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    try:
        third = capture_fsdp_graphs(DEBUG, world_size=2, n_layers=1)
        assert all(n.args[1] == 2 for n in collectives(third.forward, ALL_GATHER))
        assert dist.is_initialized() and dist.get_world_size() == 3 and dist.get_rank() == 1
    finally:
        dist.destroy_process_group()


def test_fake_process_group_restores_the_excepthook():
    """torch's init_process_group wraps sys.excepthook in a ``[rankN]:`` prefix each time: a
    block entered twice (from no group, and over a fake group of another size) leaves the
    hook as it found it, so that a later traceback is not prefixed once per block."""
    import sys

    from models.capture import fake_process_group

    assert not dist.is_initialized()
    hook = sys.excepthook
    for _ in range(2):
        with fake_process_group(3):
            pass
    assert sys.excepthook is hook
    with fake_process_group(2):
        inner = sys.excepthook
        with fake_process_group(3):
            pass
        assert dist.get_world_size() == 2 and sys.excepthook is inner
    assert sys.excepthook is hook


def test_capture_prints_no_checkpoint_notice():
    """torch logs a notice whenever a checkpoint gets a ``context_fn`` (every reshard-after-forward
    all-gather has one); captures leave it out. Run in a fresh process: torch logs it once per
    process, through a handler bound to the stderr it found."""
    import subprocess
    import sys

    code = (f"from models import capture_fsdp_graphs; capture_fsdp_graphs({DEBUG!r}, world_size=2, n_layers=1, "
            "activation_checkpointing='selective')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "context_fn" not in done.stderr


def test_2d_mesh_collectives_on_two_groups():
    c = capture_fsdp_graphs(DEBUG, world_size=W, n_layers=1, tp_size=2)
    dp_groups = {n.args[-1] for gm in (c.forward, c.backward) for n in gm.graph.nodes
                 if n.target in (ALL_GATHER, REDUCE_SCATTER)}
    tp_groups = {n.args[-1] for gm in (c.forward, c.backward) for n in collectives(gm, ALL_REDUCE)}
    assert len(dp_groups) == 1 and len(tp_groups) == 1 and dp_groups != tp_groups
    fwd_ars = collectives(c.forward, ALL_REDUCE)
    assert len(fwd_ars) == 2 * c.config.n_layers  # attention and MLP outputs
    assert all(n.meta["fsdp_role"] == "tp" and "fsdp_fqn" not in n.meta for n in fwd_ars)
    ags = collectives(c.forward, ALL_GATHER)
    assert len(ags) == len(c.param_fqns) and all(n.args[1] == 2 for n in ags)  # dp size 2
    wq = next(n for n in ags if n.meta["fsdp_fqn"] == "layers.0.attention.wq.weight")
    assert wq.meta["val"].numel() == full_numel("layers.0.attention.wq.weight", c.config) // 2  # tp slice


def _groups(gm, target):
    return [(str(n.args[-1]), n.meta.get("fsdp_fqn")) for n in gm.graph.nodes if n.target is target]


@pytest.mark.parametrize("joint", [False, True], ids=["partitioned", "joint"])
def test_hsdp_gathers_and_reduce_scatters_on_the_shard_group_then_all_reduces_on_replicas(joint):
    """2 x 2 (replicate, shard) mesh: one all-gather per parameter on the shard group (of 2
    ranks, so the gathered parameter is twice its shard), one reduce-scatter per gradient on
    the shard group, then one all-reduce of the reduce-scatter's result on the replicate group,
    all named after their parameter."""
    opts = dict(world_size=W, n_layers=1, dp_mode="hybrid_shard", replicate_size=2)
    if joint:
        j = models.capture_joint_graph(DEBUG, **opts)
        fw = bw = j.graph
        fqns = j.param_fqns
    else:
        c = capture_fsdp_graphs(DEBUG, **opts)
        fw, bw, fqns = c.forward, c.backward, c.param_fqns
    gathers = [(g, f) for g, f in _groups(fw, ALL_GATHER)]
    reduces, all_reduces = _groups(bw, REDUCE_SCATTER), _groups(bw, ALL_REDUCE)
    shard_groups = {g for g, _ in gathers} | {g for g, _ in reduces}
    replicate_groups = {g for g, _ in all_reduces}
    assert len(shard_groups) == 1 and len(replicate_groups) == 1 and shard_groups != replicate_groups
    assert sorted(f for _, f in reduces) == sorted(fqns) == sorted(f for _, f in all_reduces)
    assert set(fqns) <= {f for _, f in gathers}
    for ar in (n for n in bw.graph.nodes if n.target is ALL_REDUCE):
        src = ar.args[0]
        assert src.target is WAIT and src.args[0].target is REDUCE_SCATTER  # reduce-scatter first
        assert src.args[0].meta["fsdp_fqn"] == ar.meta["fsdp_fqn"] and ar.meta["fsdp_role"] == "fsdp"
    for ag in (n for n in fw.graph.nodes if n.target is ALL_GATHER):
        assert ag.meta["val"].numel() == 2 * ag.args[0].meta["val"].numel()


@pytest.mark.parametrize("joint", [False, True], ids=["partitioned", "joint"])
def test_ddp_has_one_all_reduce_per_gradient_and_nothing_else(joint):
    """DDP (replicate): no all-gather, no reduce-scatter; one all-reduce per gradient over all
    ranks, of the full parameter's size, named after its parameter."""
    opts = dict(world_size=W, n_layers=1, dp_mode="replicate")
    if joint:
        j = models.capture_joint_graph(DEBUG, **opts)
        graphs, fqns = [j.graph], j.param_fqns
    else:
        c = capture_fsdp_graphs(DEBUG, **opts)
        graphs, fqns = [c.forward, c.backward], c.param_fqns
    for gm in graphs:
        assert collectives(gm, ALL_GATHER) == [] and collectives(gm, REDUCE_SCATTER) == []
    ars = [n for gm in graphs for n in collectives(gm, ALL_REDUCE)]
    assert sorted(n.meta["fsdp_fqn"] for n in ars) == sorted(fqns)
    cfg = get_config(DEBUG, n_layers=1)
    for n in ars:
        assert n.meta["val"].numel() == full_numel(n.meta["fsdp_fqn"], cfg)


def test_other_data_parallel_modes_refuse_tensor_parallelism_and_bad_meshes():
    with pytest.raises(ValueError, match="tp_size > 1 needs dp_mode='fully_shard'"):
        models.FSDPOptions(dp_mode="hybrid_shard", tp_size=2)
    with pytest.raises(ValueError, match="dp_mode must be"):
        models.FSDPOptions(dp_mode="zero3")
    with pytest.raises(ValueError, match="not divisible by replicate_size 3"):
        capture_fsdp_graphs(DEBUG, world_size=W, n_layers=1, dp_mode="hybrid_shard", replicate_size=3)


@pytest.mark.slow
def test_activation_checkpointing_recomputes_in_backward():
    def mms(gm):
        return sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)

    def capture(ac):
        return capture_fsdp_graphs(DEBUG, world_size=2, n_layers=1, reshard_after_forward=False,
                                   activation_checkpointing=ac)

    base, full, sac = capture("none"), capture("full"), capture("selective")
    assert mms(full.backward) > mms(base.backward)  # forward matmuls recomputed
    assert mms(sac.backward) == mms(base.backward)  # matmul outputs saved
    assert len(sac.backward.graph.nodes) > len(base.backward.graph.nodes)  # the rest recomputed


@pytest.mark.slow
def test_8b_widths_two_layers():
    c = capture_fsdp_graphs("llama3-8b", world_size=8, n_layers=2, seq_len=1024)
    ags = {n.meta["fsdp_fqn"]: n for n in collectives(c.forward, ALL_GATHER)}
    assert len(ags) == len(c.param_fqns) == 2 * 9 + 3
    assert nbytes(ags["output.weight"].args[0]) == 128256 * 4096 // 8 * 2
    assert nbytes(ags["layers.1.feed_forward.w1.weight"]) == 14336 * 4096 * 2
    assert len(collectives(c.backward, REDUCE_SCATTER)) == len(c.param_fqns)


# --------------------------------------------------------------------------------------------
# real execution on a gloo group


def _fsdp_gradients(rank: int, world_size: int) -> dict[bool, float]:
    """On one rank of a gloo group (tests/gloo_harness.py): reshard -> the largest difference
    between this rank's gradient shards and the unsharded model's gradient chunks."""
    from models.fsdp import make_mesh

    mesh = make_mesh(world_size)
    ref = models.build_reference_model(DEBUG, seed=3, loss_chunks=4)
    g = torch.Generator().manual_seed(0)
    b = 2
    tokens = torch.randint(0, 256, (b * world_size, 32), generator=g)
    labels = torch.randint(0, 256, (b * world_size, 32), generator=g)
    ref(tokens, labels).backward()
    mine = slice(rank * b, (rank + 1) * b)
    worst = {}
    for reshard in (True, False):
        model = models.build_model(DEBUG, mesh=mesh, seed=3, param_dtype=None,
                                   reshard_after_forward=reshard, loss_chunks=4)
        (model(tokens[mine], labels[mine]) / world_size).backward()  # grads are summed over ranks
        worst[reshard] = max((p.grad.to_local() - rp.grad.chunk(world_size, 0)[rank]).abs().max().item()
                             for (_, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()))
    return worst


@pytest.mark.slow
def test_real_fsdp_gradients_match_reference():
    """2 gloo ranks, fp32: each rank's gradient shard equals the unsharded model's gradient chunk."""
    results = run_multiprocess(_fsdp_gradients, 2, timeout_s=300)
    assert all(set(r) == {True, False} for r in results)
    assert max(max(r.values()) for r in results) < 1e-6
