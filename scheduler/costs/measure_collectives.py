"""Collectives timed on a live process group: the alpha-beta line of each collective that
:class:`scheduler.costs.measure.MeasuredCostModel` prices them by (:func:`fit_collectives`), and
the table of every collective at a range of sizes (:func:`measure_collective_table`, a
:class:`~scheduler.costs.tables.CollectiveTable`; ``fsdp-sched measure`` writes it as CSV,
``cost_model="table:PATH"`` reads it back).

Every rank takes part in each timing, the slowest rank's median is kept, and rank 0's figures
are broadcast so that the fit is identical on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from scheduler.costs.tables import COLLECTIVES, DEFAULT_TABLE_SIZES, CollectiveRow, CollectiveTable
from solvers.core.units import fit_line, fmt_bytes

logger = logging.getLogger(__name__)


#: per-rank payload sizes, bytes, at which :func:`fit_collectives` times each collective
DEFAULT_COLLECTIVE_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


#: collectives :func:`measure_collective_table` can time (``fsdp-sched measure``): all a table holds
MEASURED_COLLECTIVES = COLLECTIVES


#: a measured time is never recorded below this (ms): a table holds times > 0
_MIN_MS = 1e-6


#: collectives of a sample are repeated up to this many times, until they move this many bytes
_COLLECTIVE_INNER_MAX = 16


_COLLECTIVE_INNER_BYTES = 4 << 20


#: default of :func:`measure_collectives`' ``max_spread``: a row whose repeated timings spread
#: more than this (relative to their median), or that is slower than a larger size of its
#: collective by more than this, measured noise rather than the link
NOISY_SPREAD = 0.25


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    """One collective at one size on one group (:func:`collective_timings`)."""

    collective: str
    #: bytes of the per-rank input
    input_bytes: int
    #: median of the repeated samples, the slowest rank's
    ms: float
    #: (slowest - fastest sample) / median, the largest of the ranks': how far to trust ``ms``
    spread: float


# collectives
def fit_collectives(
    group: Any = None,
    *,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_SIZES,
    repeats: int = 5,
    warmup: int = 2,
) -> dict[str, Any]:
    """Time all-gather and reduce-scatter on a live process group and fit ``alpha + beta * bytes``.

    Every rank of ``group`` (default: the world) must call it together. The times are those of
    :func:`time_collectives` (the functional ops FSDP graphs hold, fp32 payloads of ``sizes``
    bytes per rank: the shard for an all-gather, the full input for a reduce-scatter; the
    median of ``repeats`` samples, then the maximum over ranks). The fit minimises relative
    error with ``alpha_ms >= 0`` and ``beta_ms_per_byte >= 0``; it is computed on rank 0 and
    broadcast, so every rank returns the identical dict::

        {"group_name": str, "group_size": int, "nodes": int, "backend": str, "device": str,
         "all_gather": {"alpha_ms": float, "beta_ms_per_byte": float,
                        "samples": [[payload_bytes, ms], ...]},
         "reduce_scatter": {...}}
    """
    import torch.distributed as dist

    group = group or dist.group.WORLD
    start = time.perf_counter()
    timed = time_collectives(group, ("all_gather", "reduce_scatter"), sizes, repeats=repeats, warmup=warmup)
    n = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    result = None
    if dist.get_rank(group) == 0:
        result = {"group_name": group.group_name, "group_size": n, "nodes": group_nodes(group), "backend": backend,
                  "device": device_name(_collective_device(group))}
        for coll in ("all_gather", "reduce_scatter"):
            points = [(b, ms) for c, b, ms in timed if c == coll]
            alpha, beta = fit_line(points)
            result[coll] = {"alpha_ms": alpha, "beta_ms_per_byte": beta, "samples": [list(p) for p in points]}
        logger.info(
            "collective fit on %d ranks (%.1f s): all_gather %.4f ms + %.3g ms/B, reduce_scatter %.4f ms + %.3g ms/B",
            n, time.perf_counter() - start,
            result["all_gather"]["alpha_ms"], result["all_gather"]["beta_ms_per_byte"],
            result["reduce_scatter"]["alpha_ms"], result["reduce_scatter"]["beta_ms_per_byte"],
        )
    else:
        group_nodes(group)  # a collective: every rank takes part
    return _broadcast_from_rank0(result, group)


def measure_collective_table(
    group: Any = None,
    *,
    collectives: Sequence[str] = MEASURED_COLLECTIVES,
    sizes: Sequence[int] = DEFAULT_TABLE_SIZES,
    repeats: int = 5,
    warmup: int = 2,
) -> CollectiveTable:
    """Measured collective times on a live process group, as a table: the table of
    :func:`measure_collectives` (which says what it times, and warns of its noisy rows)."""
    return measure_collectives(group, collectives=collectives, sizes=sizes, repeats=repeats, warmup=warmup)[0]


def measure_collectives(
    group: Any = None,
    *,
    collectives: Sequence[str] = MEASURED_COLLECTIVES,
    sizes: Sequence[int] = DEFAULT_TABLE_SIZES,
    repeats: int = 5,
    warmup: int = 2,
    max_spread: float = NOISY_SPREAD,
) -> tuple[CollectiveTable, list[str]]:
    """Measured collective times on a live process group, as a table (``fsdp-sched measure``),
    and a line per row not to trust (:func:`noisy_rows`), each also logged as a WARNING on rank 0.

    Every rank of ``group`` (default: the world) must call it together; every rank returns
    the identical table (rank 0's, broadcast). One row per collective and per size of
    ``sizes`` (bytes of the per-rank input, the ``input_bytes`` of
    :mod:`scheduler.costs.tables`), timed by :func:`collective_timings`; ``nodes`` is the
    number of distinct host names among the group's ranks. Write it with
    :meth:`~scheduler.costs.tables.CollectiveTable.to_csv` and use it as
    ``cost_model="table:PATH"``.

    Raises:
        ValueError: an unknown collective, a size < 1 byte or a negative ``max_spread``.
    """
    import torch.distributed as dist

    group = group or dist.group.WORLD
    unknown = [c for c in collectives if c not in MEASURED_COLLECTIVES]
    if unknown or not collectives:
        raise ValueError(f"collectives={list(collectives)!r}: give some of {', '.join(MEASURED_COLLECTIVES)}")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes={list(sizes)!r}: give sizes in bytes >= 1")
    if not max_spread >= 0:
        raise ValueError(f"max_spread={max_spread!r} must be >= 0 (a fraction of the median)")
    timed = collective_timings(group, collectives, sizes, repeats=repeats, warmup=warmup)
    n = dist.get_world_size(group)
    nodes = group_nodes(group)
    rows = [CollectiveRow(t.collective, n, nodes, t.input_bytes, max(t.ms, _MIN_MS), f"measured on {group.group_name}")
            for t in timed]
    doubts = [f"group {group.group_name} ({n} ranks): {line}" for line in noisy_rows(timed, max_spread)]
    if dist.get_rank() == 0:
        for line in doubts:
            logger.warning("%s", line)
    return _broadcast_from_rank0(CollectiveTable(rows), group), doubts


def noisy_rows(timings: Sequence[CollectiveTiming], max_spread: float = NOISY_SPREAD) -> list[str]:
    """A line per timing not to trust: its repeated samples spread more than ``max_spread`` of
    their median, or it takes longer than a larger size of the same collective by more than
    ``max_spread`` (a time that falls as the size grows measured noise, not the link)."""
    out = []
    for t in timings:
        if t.spread > max_spread:
            out.append(f"{t.collective} of {fmt_bytes(t.input_bytes)}: its samples spread {t.spread:.0%} of their "
                       f"median {t.ms:.4f} ms; measure again with more --repeats, on a quiet machine")
        faster = [u for u in timings if u.collective == t.collective and u.input_bytes > t.input_bytes
                  and t.ms > u.ms * (1 + max_spread)]
        if faster:
            u = min(faster, key=lambda u: u.ms)
            out.append(f"{t.collective} of {fmt_bytes(t.input_bytes)} takes {t.ms:.4f} ms, more than "
                       f"{fmt_bytes(u.input_bytes)} takes ({u.ms:.4f} ms): a smaller input cannot be slower; measure "
                       "again")
    return out


def time_collectives(
    group: Any,
    collectives: Sequence[str],
    sizes: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> list[tuple[str, int, float]]:
    """``[(collective, input_bytes, ms), ...]`` of each collective at each size on ``group``: the
    figures of :func:`collective_timings` without their spread."""
    return [(t.collective, t.input_bytes, t.ms)
            for t in collective_timings(group, collectives, sizes, repeats=repeats, warmup=warmup)]


def collective_timings(
    group: Any,
    collectives: Sequence[str],
    sizes: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> list[CollectiveTiming]:
    """Each collective at each size on ``group``, timed.

    Every rank must call it together. Each call runs the functional op that FSDP graphs hold
    (``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce``
    / ``all_to_all_single`` with even splits, then ``wait_tensor``) on an fp32 input of about
    the size's bytes per rank (rounded to whole elements, divisible by the group size where the
    op splits it; the bytes returned are the input's). A sample is a barrier, then a few
    back-to-back calls (more for small inputs); per size the median of ``repeats`` samples and
    their spread, then the maximum of each over ranks (a collective is as slow as its slowest
    rank). Identical on every rank; logged (INFO) on rank 0 only.
    """
    import torch.distributed as dist

    n = dist.get_world_size(group)
    device = _collective_device(group)
    c10d = torch.ops._c10d_functional
    name = group.group_name
    elem = 4
    figures: list[float] = []  # median, spread of each size in turn
    plan: list[tuple[str, int]] = []
    for coll in collectives:
        for nbytes in sizes:
            numel = max(n, nbytes // elem)
            if coll in ("reduce_scatter", "all_to_all"):
                numel = -(-numel // n) * n  # divisible by the group size
            inp = torch.randn(numel, device=device)
            run = _collective_call(c10d, coll, inp, n, name)
            # back-to-back calls after one barrier amortise the skew with which ranks leave
            # it; the count depends on the size only, so that every rank runs the same calls
            inner = max(1, min(_COLLECTIVE_INNER_MAX, _COLLECTIVE_INNER_BYTES // (numel * elem)))
            samples = []
            for i in range(warmup + repeats):
                dist.barrier(group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(inner):
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    samples.append((time.perf_counter() - t0) * 1e3 / inner)
            median = statistics.median(samples)
            figures += [median, (max(samples) - min(samples)) / median if median > 0 else 0.0]
            plan.append((coll, numel * elem))
    maxima = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    values = maxima.tolist()
    timings = [CollectiveTiming(c, b, values[2 * k], values[2 * k + 1]) for k, (c, b) in enumerate(plan)]
    if dist.get_rank() == 0:
        for t in timings:
            logger.info("%s of %d bytes per rank on %d ranks (group %s): %.4f ms, samples spread %.0f%%",
                        t.collective, t.input_bytes, n, name, t.ms, 100 * t.spread)
    return timings


def _collective_call(c10d: Any, coll: str, inp: torch.Tensor, n: int, group_name: str) -> Any:
    """A function running ``coll`` on ``inp`` once, waited."""
    if coll == "all_gather":
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(inp, n, group_name))
    if coll == "reduce_scatter":
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(inp, "sum", n, group_name))
    if coll == "all_reduce":
        return lambda: c10d.wait_tensor(c10d.all_reduce(inp, "sum", group_name))
    split = [inp.numel() // n] * n
    return lambda: c10d.wait_tensor(c10d.all_to_all_single(inp, split, split, group_name))


def group_nodes(group: Any = None) -> int:
    """How many distinct hosts the ranks of ``group`` run on (a collective: every rank of the
    group calls it)."""
    import socket

    import torch.distributed as dist

    group = group or dist.group.WORLD
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts))


def _collective_device(group: Any) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _broadcast_from_rank0(value: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


# random inputs
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
