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
