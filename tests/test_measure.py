"""Tests of scheduler/costs/measure.py and measure_collectives.py (measured costs) and of tests/gloo_harness.py.

Compute timing runs on graphs traced with make_fx in fake mode (meta['val'] holds FakeTensors,
as in captured FSDP graphs). Collective fitting and the harness run real 2-process gloo groups.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).parent))  # gloo_harness, and this module in spawned ranks

from gloo_harness import ChildProcessFailed, MultiprocessTimeout, free_port, run_multiprocess  # noqa: E402

from scheduler.costs.hardware import GroupInfo  # noqa: E402
from scheduler.costs.models import AnalyticCostModel  # noqa: E402
from scheduler.costs.measure import MeasuredCostModel  # noqa: E402
from scheduler.costs.measure_collectives import fit_collectives  # noqa: E402

COMPUTE_ATTRS = {"kind": "compute", "flops": 10**9, "bytes_accessed": 10**6, "dtype": "float32"}


def traced_node(fn, *example_inputs, target):
    """The first node calling ``target`` in ``fn`` traced with fake tensors."""
    gm = make_fx(fn, tracing_mode="fake")(*example_inputs)
    return next(n for n in gm.graph.nodes if n.target is target)


def mm_node(n: int):
    return traced_node(torch.mm, torch.empty(n, n), torch.empty(n, n), target=torch.ops.aten.mm.default)


def test_mm_time_is_positive_and_grows_with_size(tmp_path):
    """mm(n x n, n x n) for n = 16 and n = 256: 4096x the FLOPs must take longer."""
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, repeats=3, warmup=1)
    small = model.compute_ms(COMPUTE_ATTRS, mm_node(16))
    large = model.compute_ms(COMPUTE_ATTRS, mm_node(256))
    assert 0 < small < large
    assert model.stats == {"measured": 2, "cache_hits": 0, "fallbacks": 0}


def test_repeated_signature_is_timed_once_and_cached_on_disk(tmp_path, monkeypatch):
    """Same op and shapes: timed once per process; a fresh model reads the JSON cache."""
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, repeats=1, warmup=0)
    first = model.compute_ms(COMPUTE_ATTRS, mm_node(32))
    again = model.compute_ms(COMPUTE_ATTRS, mm_node(32))  # another node, same signature
    assert again == first
    assert model.stats["measured"] == 1 and model.stats["cache_hits"] == 1
    assert (tmp_path / "measured_compute_ms.json").exists()

    fresh = MeasuredCostModel("cpu", cache_dir=tmp_path)

    def no_timing(node):
        raise AssertionError(f"{node} was timed again despite the cache")

    monkeypatch.setattr(fresh, "_time_node", no_timing)
    assert fresh.compute_ms(COMPUTE_ATTRS, mm_node(32)) == first
    assert fresh.stats == {"measured": 0, "cache_hits": 1, "fallbacks": 0}


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_SCHED_CACHE", str(tmp_path / "env-cache"))
    assert MeasuredCostModel("cpu").cache_path.parent == tmp_path / "env-cache"


def test_index_inputs_are_valid_for_embedding(tmp_path):
    """embedding(weight (10, 8), idx (4, 6)) runs: random indices stay below 10."""
    node = traced_node(
        lambda idx, weight: torch.nn.functional.embedding(idx, weight),
        torch.zeros(4, 6, dtype=torch.long),
        torch.empty(10, 8),
        target=torch.ops.aten.embedding.default,
    )
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, repeats=1, warmup=0)
    assert model.compute_ms(COMPUTE_ATTRS, node) > 0
    assert model.stats["measured"] == 1


@pytest.mark.parametrize(
    "fn, target",
    [
        (lambda x: torch.nn.functional.dropout(x, 0.5), torch.ops.aten.bernoulli_.float),  # random
        (lambda x: x.t(), torch.ops.aten.t.default),  # view
    ],
    ids=["random", "view"],
)
def test_unsupported_ops_fall_back(tmp_path, fn, target):
    node = traced_node(fn, torch.empty(8, 8), target=target)
    fallback = AnalyticCostModel()
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, fallback=fallback)
    assert model.compute_ms(COMPUTE_ATTRS, node) == fallback.compute_ms(COMPUTE_ATTRS, node)
    assert model.stats == {"measured": 0, "cache_hits": 0, "fallbacks": 1}


def test_op_that_raises_falls_back(tmp_path, monkeypatch):
    model = MeasuredCostModel("cpu", cache_dir=tmp_path)
    monkeypatch.setattr(model, "_time_node", lambda node: 1 / 0)
    assert model.compute_ms(COMPUTE_ATTRS, mm_node(8)) == AnalyticCostModel().compute_ms(COMPUTE_ATTRS)
    assert model.stats["fallbacks"] == 1


def test_sources_say_what_was_timed_and_what_fell_back(tmp_path, monkeypatch):
    """A timed matmul is measured (its source names the device), an op that cannot run is
    the fallback's, and the report's coverage counts them so."""
    model = MeasuredCostModel("cpu", cache_dir=tmp_path)
    mm = mm_node(8)
    model.compute_ms(COMPUTE_ATTRS, mm)
    assert model.compute_matched(COMPUTE_ATTRS, mm) is True
    assert model.compute_source(COMPUTE_ATTRS, mm) == f"measured on {model.device_name}"
    other = mm_node(16)
    monkeypatch.setattr(model, "_time_node", lambda node: 1 / 0)
    model.compute_ms(COMPUTE_ATTRS, other)
    assert model.compute_matched(COMPUTE_ATTRS, other) is False
    assert model.compute_source(COMPUTE_ATTRS, other) == "analytic"
    assert model.collective_source("all_gather", GroupInfo("g", 2, (0, 1))) == "analytic"


def test_collective_uses_fit_of_matching_group_size(tmp_path):
    fit = {
        "group_name": "0", "group_size": 2,
        "all_gather": {"alpha_ms": 0.5, "beta_ms_per_byte": 1e-6},
        "reduce_scatter": {"alpha_ms": 0.25, "beta_ms_per_byte": 2e-6},
    }
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, collective_fit=fit)
    assert model.collective_ms("all_gather", 1000, GroupInfo("other", 2)) == pytest.approx(0.501)
    assert model.collective_ms("reduce_scatter", 1000, GroupInfo("0", 2)) == pytest.approx(0.252)
    analytic = AnalyticCostModel()
    g8 = GroupInfo("0", 8)
    assert model.collective_ms("all_gather", 1000, g8) == analytic.collective_ms("all_gather", 1000, g8)


def test_copy_ms_is_affine_and_grows(tmp_path):
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, repeats=1, warmup=0)
    assert 0 <= model.copy_ms(0) < model.copy_ms(1 << 30)


# --------------------------------------------------------------------------------------------
# multi-process: bodies are module-level so that spawned ranks can unpickle them
def _fit_body(rank: int, world_size: int) -> tuple[int, dict]:
    # a largest size whose transfer time dominates a loaded machine's scheduling noise, and
    # medians of five samples: the fitted slope is then the bandwidth's, not one slow sample's
    return os.getpid(), fit_collectives(sizes=(1 << 10, 1 << 20, 16 << 20), repeats=5, warmup=1)


def _hang_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return os.getpid()


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")


def _assert_no_children_left(pids: list[int] = ()) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_fit_collectives_on_two_gloo_ranks_agrees():
    """Also checks the harness: one result per rank, in rank order, from two child processes."""
    pids, fits = zip(*run_multiprocess(_fit_body, 2, timeout_s=60))
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert fits[0] == fits[1]
    for coll in ("all_gather", "reduce_scatter"):
        assert fits[0][coll]["alpha_ms"] >= 0
        assert fits[0][coll]["beta_ms_per_byte"] > 0
    assert fits[0]["group_size"] == 2
    _assert_no_children_left(pids)


@pytest.mark.slow
def test_harness_kills_hung_rank_and_names_it():
    """Rank 1 sleeps forever. Rank 0 normally finishes too, but on a loaded machine the start
    of a spawned process alone may exceed the timeout, so only rank 1 is required in the list."""
    start = time.monotonic()
    with pytest.raises(MultiprocessTimeout, match=r"rank\(s\) \[(0, )?1\] of 2 did not finish within 10 s") as info:
        run_multiprocess(_hang_on_rank1, 2, timeout_s=10)
    assert 1 in info.value.ranks
    assert time.monotonic() - start < 10 + 10  # timeout + terminate/join grace
    _assert_no_children_left()


@pytest.mark.slow
def test_harness_propagates_child_traceback():
    with pytest.raises(ChildProcessFailed, match="(?s)rank 1 of 2 raised.*ValueError: boom from rank 1") as info:
        run_multiprocess(_raise_on_rank1, 2, timeout_s=60)
    assert info.value.rank == 1
    _assert_no_children_left()


def test_collective_fit_matches_the_nodes_a_group_spans(tmp_path):
    """A fit taken on one node prices a group of its size on one node, not the same number of
    ranks spread over several nodes (those fall back, and the model says so)."""
    fit = {"group_name": "0", "group_size": 8, "nodes": 1,
           "all_gather": {"alpha_ms": 0.5, "beta_ms_per_byte": 1e-6}}
    model = MeasuredCostModel("cpu", cache_dir=tmp_path, collective_fit=fit)
    one_node, strided = GroupInfo("a", 8, tuple(range(8))), GroupInfo("b", 8, tuple(range(0, 64, 8)))
    assert model.collective_ms("all_gather", 1000, one_node) == pytest.approx(0.501)
    assert model.collective_matched("all_gather", one_node) and not model.collective_matched("all_gather", strided)
    assert model.collective_ms("all_gather", 1000, strided) == AnalyticCostModel().collective_ms(
        "all_gather", 1000, strided)


# --------------------------------------------------------------------------------------------
# fsdp-sched measure on real gloo groups
MEASURE_SIZES = (4 << 10, 64 << 10)


def _measure_body(rank: int, world_size: int, out: str) -> int:
    from scheduler.cli import main

    return main(["-q", "measure", "--out", out, "--sizes", ",".join(f"{b}B" for b in MEASURE_SIZES),
                 "--repeats", "2", "--warmup", "1"])


def _check_measured_table(path: Path, world_size: int) -> None:
    from scheduler.costs.models import TableCostModel

    model = TableCostModel.from_file(path)
    colls = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    assert model.collectives.keys() == sorted((c, world_size, 1) for c in colls)
    rows = [ln.split(",") for ln in path.read_text().splitlines()[1:]]
    assert len(rows) == len(colls) * len(MEASURE_SIZES)
    group = GroupInfo("0", world_size, tuple(range(world_size)))  # one host
    for coll, n, nodes, nbytes, ms in rows:
        assert float(ms) > 0 and int(nbytes) >= min(MEASURE_SIZES) and int(nbytes) % 4 == 0
        assert model.collective_ms(coll, int(nbytes), group) == pytest.approx(float(ms), rel=1e-5)
        assert model.collective_matched(coll, group)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_measure_writes_a_table_on_a_gloo_group(tmp_path, world_size):
    """``fsdp-sched measure`` on every rank of a live gloo group: rank 0 writes one row per
    collective and size, for the group's size on one node (one host), and the CSV reads back
    as a cost model that prices those collectives at the measured times."""
    out = tmp_path / "collectives.csv"
    assert run_multiprocess(_measure_body, world_size, str(out), timeout_s=180) == [0] * world_size
    _check_measured_table(out, world_size)
    _assert_no_children_left()



def _measure_into_body(rank: int, world_size: int, out: str) -> tuple[int, str]:
    import contextlib
    import io

    from scheduler.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["-q", "measure", "--out", out, "--sizes", "4KiB", "--repeats", "1", "--warmup", "1",
                       "--collectives", "all_gather"])
    return status, err.getvalue()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_table_that_cannot_be_written_is_one_line_and_exit_2_on_every_rank():
    """``--out /dev/full`` (every write fails: no space left): every rank ends with status 2 and
    one line naming the file; none raises, none waits for a rank that failed."""
    per_rank = run_multiprocess(_measure_into_body, 2, "/dev/full", timeout_s=120)
    for status, err in per_rank:
        lines = [ln for ln in err.splitlines() if ln.startswith("fsdp-sched")]
        assert status == 2 and len(lines) == 1 and "/dev/full" in lines[0], per_rank
    _assert_no_children_left()

@pytest.mark.slow
def test_measure_under_torchrun_initialises_its_own_group(tmp_path):
    """Launched by torchrun (no group initialised): the command makes a gloo group from the
    launcher's environment and writes the table."""
    import subprocess

    out = tmp_path / "collectives.csv"
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "scheduler.cli", "-q", "measure", "--out", str(out), "--backend", "gloo",
         "--sizes", ",".join(f"{b}B" for b in MEASURE_SIZES), "--repeats", "2", "--warmup", "1"],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_measured_table(out, 2)


def _measure_logging_body(rank: int, world_size: int, out: str) -> str:
    import contextlib
    import io

    from scheduler.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["measure", "--out", out, "--sizes", "4KiB,64KiB", "--repeats", "2", "--warmup", "1",
                     "--collectives", "all_gather,all_reduce"]) == 0
    return err.getvalue()


@pytest.mark.slow
def test_measure_logs_each_timing_and_its_spread_on_rank_0_only(tmp_path):
    """Every rank measures, rank 0 alone says what it measured: one line per collective and size,
    with the spread of its samples."""
    logs = run_multiprocess(_measure_logging_body, 2, str(tmp_path / "t.csv"), timeout_s=180)
    timed = [[ln for ln in log.splitlines() if "bytes per rank" in ln] for log in logs]
    assert len(timed[0]) == 4 and all("spread" in ln for ln in timed[0]), logs[0]
    assert timed[1] == [], logs[1]


def test_noisy_rows_are_the_spread_and_the_smaller_but_slower():
    """A row whose samples spread more than the threshold, and one slower than a larger size of
    its collective by more than it, are named; timings that grow with size and agree are not."""
    from scheduler.costs.measure_collectives import CollectiveTiming, noisy_rows

    clean = [CollectiveTiming("all_to_all", 4 << 10, 0.050, 0.05), CollectiveTiming("all_to_all", 16 << 10, 0.049, 0.1),
             CollectiveTiming("all_to_all", 1 << 20, 0.5, 0.1)]
    assert noisy_rows(clean) == []
    noisy = [CollectiveTiming("all_to_all", 4 << 10, 0.8, 0.1), CollectiveTiming("all_to_all", 1 << 20, 0.5, 0.6),
             CollectiveTiming("all_gather", 4 << 10, 0.9, 0.0)]
    lines = noisy_rows(noisy)
    assert len(lines) == 2, lines
    assert any("4.00 KiB" in ln and "1.00 MiB" in ln for ln in lines)  # smaller, slower
    assert any("60%" in ln for ln in lines)  # the spread of the 1 MiB row


def test_measure_without_a_group_or_launcher_says_how_to_launch(tmp_path, monkeypatch, capsys):
    from scheduler.cli import main

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["measure", "--out", str(tmp_path / "t.csv")]) == 2
    assert "torchrun" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()
