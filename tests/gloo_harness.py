"""Run a function on every rank of a real gloo process group of local processes.

Not a test module: a helper for tests and benchmarks that need real collectives on CPU::

    def body(rank, world_size, n):          # module level, so that it pickles
        ...                                 # the gloo group is initialised here
        return result                       # must pickle

    results = run_multiprocess(body, 2, 16, timeout_s=60)   # [rank 0's result, rank 1's]

Processes are started with the ``spawn`` method (no fork of the parent's threads or CUDA
state), find each other through ``MASTER_ADDR=127.0.0.1`` and a free port, and destroy their
process group before they exit. The parent never leaves a child behind: on success, on a
child's exception (re-raised with that child's traceback), on a child that dies, and on a
timeout (raised naming the ranks that did not finish), every child is terminated and joined.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import pickle
import queue as queue_module
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

#: seconds a finished child is given to deliver its result before it counts as lost
_RESULT_GRACE_S = 5.0
#: seconds between SIGTERM and SIGKILL when stopping children
_TERMINATE_GRACE_S = 5.0


class ChildProcessFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit code."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class MultiprocessTimeout(TimeoutError):
    """Some ranks did not finish within the timeout (hung); ``ranks`` lists them."""

    def __init__(self, ranks: list[int], message: str):
        super().__init__(message)
        self.ranks = ranks


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes of one gloo group.

    Args:
        fn: a picklable (module-level) function; its return value must pickle.
        world_size: number of processes (ranks).
        args: passed to ``fn`` after rank and world size; must pickle.
        timeout_s: wall-clock limit for the whole run, seconds; also the gloo timeout.
        threads_per_process: ``torch.set_num_threads`` in each child; default
            ``cpu_count // world_size`` (at least 1), so that the ranks do not oversubscribe.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        ChildProcessFailed: a rank raised (its traceback is in the message) or exited without a
            result.
        MultiprocessTimeout: ranks did not finish within ``timeout_s``; all children are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, timeout_s, threads, results_q, args),
            name=f"gloo-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    restore_sigterm = _raise_on_sigterm()
    try:
        for p in procs:
            p.start()
        dead_since: dict[int, float] = {}
        while len(results) < world_size:
            now = time.monotonic()
            if now > deadline:
                hung = [r for r in range(world_size) if r not in results]
                raise MultiprocessTimeout(
                    hung,
                    f"rank(s) {hung} of {world_size} did not finish within {timeout_s:g} s "
                    f"(hung in a collective?); finished: {sorted(results)}. All ranks were killed.",
                )
            try:
                rank, ok, payload = results_q.get(timeout=min(0.2, max(deadline - now, 0.01)))
            except queue_module.Empty:
                _check_dead(procs, results, dead_since)
                continue
            if not ok:
                raise ChildProcessFailed(rank, f"rank {rank} of {world_size} raised:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        _stop(procs, _TERMINATE_GRACE_S if len(results) == world_size else 0.0)
        results_q.close()
        results_q.join_thread()
        restore_sigterm()
    return [results[r] for r in range(world_size)]


def _raise_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM (e.g. from ``timeout``) raise SystemExit in the parent, so that the cleanup
    in ``finally`` still stops the children; returns the function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _check_dead(procs: list[Any], results: dict[int, Any], dead_since: dict[int, float]) -> None:
    """Raise for a child that exited without a result (after a grace period for the queue)."""
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in results or p.is_alive():
            continue
        first_seen = dead_since.setdefault(rank, now)
        if p.exitcode != 0 or now - first_seen > _RESULT_GRACE_S:
            raise ChildProcessFailed(
                rank, f"rank {rank} exited with code {p.exitcode} without a result (crashed or killed)"
            )


def _stop(procs: list[Any], exit_grace_s: float = 0.0) -> None:
    """Give every child that was started ``exit_grace_s`` to exit by itself, then terminate,
    kill and join it. A child that ended with an error of its own after the run (after every
    rank's result was in: its group's native teardown) is logged, not raised."""
    deadline = time.monotonic() + exit_grace_s
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is None:
            continue
        if p.is_alive():
            p.terminate()
            p.join(_TERMINATE_GRACE_S)
        elif p.exitcode not in (0, None):
            logger.warning("%s exited with code %s", p.name, p.exitcode)
        if p.is_alive():
            logger.warning("%s did not stop on SIGTERM; killing it", p.name)
            p.kill()
            p.join()


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    threads: int,
    results_q: Any,
    args: tuple,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        message = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        message = (rank, False, traceback.format_exc())
    # the result goes out before the teardown: the native teardown of a gloo group (a
    # process group's threads, the store) has aborted a finished rank now and then on the CI
    # machine ("terminate called without an active exception"), which is no result of the test
    results_q.put(message)
    if dist.is_initialized():
        if message[1]:
            try:
                dist.barrier()  # no rank tears its group down while another still communicates
            except Exception:  # noqa: BLE001  a rank that failed has said so; the parent stops every rank
                pass
        dist.destroy_process_group()
    gc.collect()  # process groups still referenced (meshes, modules) go while the interpreter is whole


def bitwise_mismatches(a: dict, b: dict) -> list[str]:
    """Names of the losses, gradients and parameters of two training runs (dicts with
    "losses", "grads" (per step, name -> tensor) and "params") that are not bitwise equal."""
    bad = [f"loss[{i}]" for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if not torch.equal(x, y)]
    for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        bad += [f"grad[{i}].{n}" for n in ga if not torch.equal(ga[n], gb[n])]
    bad += [f"param.{n}" for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    return bad
