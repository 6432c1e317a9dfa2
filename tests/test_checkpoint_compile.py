"""Activation checkpointing with dropout, compiled through the product's own backend.

The partitioned graphs hold ``run_and_save_rng_state`` (a higher-order op traced without
``meta['val']``), and a second batch size recompiles with dynamic shapes: both used to end in
a DagError, failing ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.utils.checkpoint import checkpoint

import scheduler.integrate.compile as compile_
from scheduler import SolverOptions
from test_writeback import gloo_group


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = nn.Parameter(torch.randn(64, 64) / 8)

    def block(self, x):
        w1 = funcol.all_gather_tensor_autograd(self.w1, 0, dist.group.WORLD)
        w2 = funcol.all_gather_tensor_autograd(self.w2, 0, dist.group.WORLD)
        return torch.nn.functional.dropout(torch.relu(x @ w1), 0.1, True) @ w2

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).sum()


def test_checkpoint_with_dropout_compiles_and_recompiles_with_dynamic_shapes():
    """Two batch sizes: the first compile (static), the recompile (dynamic sizes, priced at the
    sizes traced); every graph is scheduled (its collectives seen), and the gradients match
    eager execution under the same RNG seed."""
    with gloo_group():
        model = _Checkpointed()
        backend = compile_.backend(solver=SolverOptions(work_limit=1.0))
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        for batch in (79, 80):
            x = torch.randn(batch, 64)
            torch.manual_seed(batch)
            compiled(x).backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            torch.manual_seed(batch)
            model(x).backward()
            want = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
        kinds = [(r.graph_kind, r.n_collectives_before > 0, r.status) for r in backend.reports]
        assert len(kinds) == 4 and all(has for _, has, _ in kinds), kinds
        assert all(status != "unchanged" for _, _, status in kinds), kinds
