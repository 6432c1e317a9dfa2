"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

#: the benchmark scripts (``benchmarks/``, whose ``harness`` package holds their own pieces) are not
#: installed with the library; the tests of a script import it from the repository
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

#: ranks of the fake process group the tracing tests use
FAKE_WORLD = 4


@pytest.fixture(scope="session", autouse=True)
def _session_schedule_cache(tmp_path_factory):
    """The schedule cache is on by default, in the user's own cache directory: the suite
    caches in a directory of its own (set before any fixture solves; subprocesses inherit it)."""
    before = os.environ.get("FSDP_SCHED_CACHE")
    os.environ["FSDP_SCHED_CACHE"] = str(tmp_path_factory.mktemp("fsdp-sched-cache"))
    yield
    if before is None:
        os.environ.pop("FSDP_SCHED_CACHE", None)
    else:
        os.environ["FSDP_SCHED_CACHE"] = before


@pytest.fixture(autouse=True)
def schedule_cache(tmp_path_factory, monkeypatch):
    """Each test's schedule cache: a fresh directory, so that no test is answered from the
    entries of another."""
    directory = tmp_path_factory.mktemp("fsdp-sched-cache")
    monkeypatch.setenv("FSDP_SCHED_CACHE", str(directory))
    return directory


@pytest.fixture(scope="module")
def group_name():
    """A fake process group of FAKE_WORLD ranks (moves no data; for tracing only), created for
    the module unless one exists already."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    yield dist.group.WORLD.group_name
    if owned:
        dist.destroy_process_group()


#: hidden size and tokens of :func:`three_fsdp_layers`
LAYER_DIM, LAYER_TOKENS = 256, 512


def three_fsdp_layers(gname: str):
    """Three FSDP all-gathers (bf16 casts of fp32 shards) and two reduce-scatters, traced with
    make_fx on the fake group ``gname`` of FAKE_WORLD ranks::

        primals_i -> _to_copy -> AG_i -> wait -> mm(h_{i-1}, .) -> h_i        (i = 1, 2, 3; h_0 = x)
        mm(h_1.T, h_2) -> _to_copy (fp32) -> RS_1 -> wait ->  output
        mm(h_2.T, h_3) -> _to_copy (fp32) -> RS_2 -> wait ->  output
        h_3 (via _unsafe_view)                             ->  output

    Every wait follows its collective directly, as in traced FSDP graphs. torch's pass
    pre-buckets the three all-gathers into one and the two reduce-scatters into one; without
    pre-bucketing it prefetches the all-gathers and defers the reduce-scatters' waits."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = torch.ops._c10d_functional

    def gather(shard):
        return ops.wait_tensor(ops.all_gather_into_tensor(shard.to(torch.bfloat16), FAKE_WORLD, gname))

    def reduce(grad):
        return ops.wait_tensor(ops.reduce_scatter_tensor(grad.float(), "sum", FAKE_WORLD, gname))

    def f(primals_1, primals_2, primals_3, x):
        h1 = torch.mm(x, gather(primals_1))
        h2 = torch.mm(h1, gather(primals_2))
        h3 = torch.mm(h2, gather(primals_3))
        g1 = reduce(torch.mm(h1.t(), h2))
        g2 = reduce(torch.mm(h2.t(), h3))
        return torch.ops.aten._unsafe_view(h3, [LAYER_TOKENS * LAYER_DIM]), g1, g2

    with FakeTensorMode():
        shards = [torch.randn(LAYER_DIM // FAKE_WORLD, LAYER_DIM) for _ in range(3)]
        x = torch.randn(LAYER_TOKENS, LAYER_DIM, dtype=torch.bfloat16)
    return make_fx(f, tracing_mode="fake")(*shards, x)


_CAPTURES: dict = {}


def capture_llama_debug(n_layers: int | None = None, **options):
    """llama3-debug's forward and backward on FAKE_WORLD fake ranks
    (``models.capture_fsdp_graphs``; ``options`` are its options), traced once per session and
    shared by every module that asks for the same: a test must not change these graphs (it
    rewrites a ``copy.deepcopy``). Skips where a real process group is up (the capture makes
    its own fake one)."""
    key = (n_layers, tuple(sorted(options.items())))
    if key not in _CAPTURES:
        models = pytest.importorskip("models")
        if dist.is_initialized() and dist.get_backend() != "fake":
            pytest.skip("capture needs a process without a real group")
        _CAPTURES[key] = models.capture_fsdp_graphs("llama3-debug", world_size=FAKE_WORLD, n_layers=n_layers,
                                                    **options)
    return _CAPTURES[key]
