"""Models sharded with FSDP2 (``fully_shard``) under the compile integrations.

FSDP2 runs its all-gathers and reduce-scatters in module hooks that torch.compile does not
trace (torch 2.13 and 2.14; docs/FSDP2.md), so the graphs the backend and the inductor pass get
hold no collective. The integrations must say so, once per compile, and note it on the reports
(:mod:`scheduler.integrate.fsdp2`); a graph with collectives, or one compiled while no FSDP2
module lives, must not be warned about. (FSDP2 modules compiled in this pytest process are not
always freed when a test ends, so "no FSDP2 module lives" is checked in a fresh process.)

The model: two blocks, each ``fully_shard``-ed, and the root::

    x -> block0 (a: Linear 8x16 -> relu -> b: Linear 16x8, + x) -> block1 (same) -> head (8x4)

Dynamo breaks the graph at each FSDP2 hook and compiles each block's forward (the head is
torch's own Linear, run eagerly between hooks). The quick tests use a fake process group; the
slow one trains on 2 gloo ranks and checks the compiled step against eager FSDP2, bit for bit.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # gloo_harness, and this module in spawned ranks

from gloo_harness import run_multiprocess  # noqa: E402

import scheduler  # noqa: E402

LOGGER = "scheduler.integrate.compile"
c10d = torch.ops._c10d_functional


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fully_sharded_net(world_size: int) -> Net:
    """:class:`Net` with each block and the root ``fully_shard``-ed over all ranks (seed 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name == LOGGER and r.levelno == logging.WARNING
            and "fully_shard" in r.getMessage()]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()  # the test's FSDP2 modules leave the registry of live modules


def test_backend_warns_once_per_compile_on_a_fully_shard_model(group_name, fresh_dynamo, caplog):
    """One training step of the FSDP2 model through ``scheduler.backend``: every graph compiled
    holds no collective; one warning per compile (not per graph), naming fully_shard and
    what to do instead; every report carries it as a note."""
    from conftest import FAKE_WORLD

    model = fully_sharded_net(FAKE_WORLD)
    backend = scheduler.backend(mem_budget="1GiB")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    reports = backend.reports
    compiles = {r.compile_id for r in reports}
    assert reports and all(r.n_collectives_before == 0 for r in reports)
    assert {r.graph_kind for r in reports} == {"forward", "backward"}
    warnings = _fsdp2_warnings(caplog.records)
    assert len(warnings) == len(compiles) >= 1
    assert all("graph_trainer_pass" in w and "SimpleFSDP" in w for w in warnings)
    assert all(any("fully_shard" in n for n in r.notes) for r in reports)


class _Gather(torch.autograd.Function):
    """SimpleFSDP in two ops: all-gather the shard forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
        ctx.group_name, ctx.world_size = group_name, world_size
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world_size, group_name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.world_size,
                                                           ctx.group_name)), None, None


class _GatheredLinear(nn.Module):
    """A linear layer whose weight's shard is gathered on every forward and whose gradient is
    reduce-scattered: both compiled graphs hold their collectives."""

    def __init__(self, group_name: str, world_size: int) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(2, 8))
        self.group_name, self.world_size = group_name, world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _Gather.apply(self.shard, self.group_name, self.world_size).t()


def test_no_warning_for_graphs_with_their_own_collectives(group_name, fresh_dynamo, caplog):
    """While an FSDP2 model lives in the process, a model whose forward and backward graphs hold
    their own collectives is scheduled without the warning and without the note (the negative
    for a process without FSDP2 modules runs in a fresh process: the slow test)."""
    from conftest import FAKE_WORLD

    alive = fully_sharded_net(FAKE_WORLD)
    backend = scheduler.backend(solver=scheduler.SolverOptions(work_limit=1.0))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        torch.compile(_GatheredLinear(group_name, FAKE_WORLD), backend=backend)(torch.randn(3, 8)).sum().backward()
    assert sorted(r.n_collectives_before for r in backend.reports) == [1, 1]
    assert _fsdp2_warnings(caplog.records) == []
    assert not any("fully_shard" in n for r in backend.reports for n in r.notes)
    del alive


def test_inductor_pass_warns_on_graphs_without_collectives_while_fsdp2_lives(group_name, caplog):
    """The inductor pass sees neither inputs nor module: while an FSDP2 model lives, it warns on
    a graph without collectives (called outside torch.compile, on every call) and notes it on
    the report, and not on a graph that holds its collectives."""
    from conftest import FAKE_WORLD
    from torch.fx.experimental.proxy_tensor import make_fx

    plain = make_fx(lambda x: torch.relu(x) * 2, tracing_mode="fake")(torch.randn(4)).graph
    gathering = make_fx(lambda s: c10d.wait_tensor(c10d.all_gather_into_tensor(s, FAKE_WORLD, group_name)) * 2,
                        tracing_mode="fake")(torch.randn(2, 8)).graph
    inductor_pass = scheduler.inductor_post_grad_pass(solver=scheduler.SolverOptions(work_limit=1.0))
    alive = fully_sharded_net(FAKE_WORLD)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        inductor_pass(plain)
        inductor_pass(gathering)
        inductor_pass(plain)
    assert len(_fsdp2_warnings(caplog.records)) == 2
    noted = [any("fully_shard" in n for n in r.notes) for r in inductor_pass.reports]
    assert noted == [True, False, True]
    del alive


# --------------------------------------------------------------------------------------------
# a real 2-rank gloo group
# --------------------------------------------------------------------------------------------
def _train(model: Net, step, rank: int) -> dict[str, Any]:
    """Two SGD steps; per step the loss and every gradient's local shard; then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    losses, grads = [], []
    for step_index in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step_index + rank))
        loss = step(x).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().to_local().clone() for n, p in model.named_parameters()}}


def _rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from gloo_harness import bitwise_mismatches

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(LOGGER).addHandler(handler)
    # no FSDP2 module lives yet in this fresh process: a graph without collectives is no FSDP2 one
    plain = nn.Linear(8, 4)
    torch.compile(plain, backend=scheduler.backend())(torch.randn(2, 8)).sum().backward()
    before_fsdp2 = _fsdp2_warnings(records)
    torch._dynamo.reset()
    eager_model = fully_sharded_net(world_size)
    eager = _train(eager_model, eager_model, rank)
    del eager_model
    model = fully_sharded_net(world_size)
    backend = scheduler.backend(mem_budget="1GiB")
    compiled = _train(model, torch.compile(model, backend=backend), rank)
    return {"mismatch": bitwise_mismatches(eager, compiled), "warnings": _fsdp2_warnings(records),
            "before_fsdp2": before_fsdp2,
            "compiles": sorted({r.compile_id for r in backend.reports}),
            "collectives": sum(r.n_collectives_before for r in backend.reports),
            "noted": all(any("fully_shard" in n for n in r.notes) for r in backend.reports)}


@pytest.mark.slow
def test_fully_shard_model_on_a_real_group_warns_and_trains_as_eager():
    """On 2 gloo ranks, two training steps of the FSDP2 model through ``scheduler.backend``:
    losses, gradients and parameters bitwise equal to eager FSDP2; its graphs hold no
    collective; each rank warned once per compile and noted it on every report. Before any FSDP2
    model exists, a model without collectives compiles without the warning."""
    results = run_multiprocess(_rank_body, 2, timeout_s=300.0, threads_per_process=1)
    assert multiprocessing.active_children() == []
    for rank, res in enumerate(results):
        assert res["before_fsdp2"] == [], (rank, res["before_fsdp2"])
        assert res["mismatch"] == [], (rank, res["mismatch"])
        assert res["collectives"] == 0 and res["compiles"], (rank, res)
        assert len(res["warnings"]) == len(res["compiles"]), (rank, res)
        assert res["noted"], (rank, res)
