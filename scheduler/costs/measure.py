"""Costs measured on the current device: a :class:`~scheduler.costs.models.CostModel` that times ops.

:class:`MeasuredCostModel` times each compute node's op on the current device (CUDA when
available, else CPU) with random inputs of the node's traced shapes, dtypes and strides, and
prices collectives with an alpha-beta line fitted by
:func:`~scheduler.costs.measure_collectives.fit_collectives` on a live process
group. Timings of identical op signatures (every transformer layer repeats them) are taken once
and cached on disk as JSON.

On a CPU-only machine this measures CPU kernels and a gloo process group. That makes it a
fidelity check of the execution model (does the simulator predict what the same graph takes
when it really runs?), not a statement about GPU performance.

Ops that cannot be timed in isolation fall back to another model (default:
:class:`~scheduler.costs.models.AnalyticCostModel`): random ops, collectives, views, ops on opaque
script objects or symbolic shapes, ops larger than ``max_op_bytes``, and ops that raise.

Collectives are timed on a live group by :mod:`scheduler.costs.measure_collectives` (the fit
used here, and the table ``fsdp-sched measure`` writes).

Multi-rank use: the collective fit is identical on every rank (broadcast from rank 0), but
compute timings are taken by each process and differ slightly. Schedules must be identical on
every rank, so solve on one rank and broadcast the schedule
(``optimize_schedule(..., broadcast_from=0)``, also an option of ``scheduler.backend``).
Per-op collectives inside a compiler were tried for this and hung in gloo; one broadcast per
graph is also far cheaper.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from scheduler.costs.measure_collectives import DEFAULT_COLLECTIVE_SIZES, device_name, fit_collectives
from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.models import AnalyticCostModel, CostModel, source_of
from scheduler.integrate.cache import cache_root
from solvers.core.units import fit_line

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
#: bytes copied when fitting ``copy_ms`` (bucket copy-in / copy-out)
_COPY_SIZES = (64 << 10, 1 << 20, 8 << 20)
#: log progress every this many newly timed ops
_PROGRESS_EVERY = 25


def default_cache_dir() -> Path | None:
    """The directory of the timing cache: fsdp-sched's cache root
    (:func:`scheduler.integrate.cache.cache_root`: ``$FSDP_SCHED_CACHE``, else a per-user
    directory); None when caching is off."""
    return cache_root()


class _Unsupported(Exception):
    """This op cannot be timed in isolation; the model falls back."""


class MeasuredCostModel:
    """Compute times measured on a device, collective times fitted on a live process group.

    Args:
        device: where ops are timed; default ``cuda`` when available, else ``cpu``.
        cache_dir: directory of the JSON timing cache (default :func:`default_cache_dir`; when
            caching is off there, timings are kept in memory only).
            The cache is keyed by op, argument shapes / dtypes / strides, non-tensor arguments,
            device name and torch version.
        repeats: timed samples per op; the median is kept.
        warmup: untimed runs before sampling (allocator, lazy init, caches).
        min_sample_ms: a sample repeats the op until it lasts at least this long, so that
            microsecond ops are not lost in timer resolution; the time per call is recorded.
        max_op_bytes: ops whose inputs and outputs exceed this many bytes are not run (they
            fall back), so that full-size graphs cannot exhaust host or device memory.
        collective_fit: result(s) of :func:`fit_collectives`; a collective on a group of the
            fitted size spanning the fitted number of nodes uses ``alpha_ms +
            beta_ms_per_byte * payload_bytes``. Others fall back.
        fallback: model for everything not measured (default: ``AnalyticCostModel(cluster)``).
        cluster: counts the nodes a priced group spans (default: the fallback's cluster, else
            :class:`~scheduler.costs.hardware.Cluster`).
    """

    name = "measured"

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        cache_dir: str | Path | None = None,
        repeats: int = 5,
        warmup: int = 2,
        min_sample_ms: float = 0.2,
        max_op_bytes: int = 2 << 30,
        collective_fit: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        fallback: CostModel | None = None,
        cluster: Cluster | None = None,
    ):
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
        if min_sample_ms < 0 or max_op_bytes <= 0:
            raise ValueError("min_sample_ms must be >= 0 and max_op_bytes > 0")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        directory = Path(cache_dir) if cache_dir else default_cache_dir()
        #: the JSON timing cache (None: in memory only)
        self.cache_path = directory / "measured_compute_ms.json" if directory is not None else None
        self.repeats = repeats
        self.warmup = warmup
        self.min_sample_ms = min_sample_ms
        self.max_op_bytes = max_op_bytes
        if collective_fit is None:
            self.collective_fits: list[Mapping[str, Any]] = []
        elif isinstance(collective_fit, Mapping):
            self.collective_fits = [collective_fit]
        else:
            self.collective_fits = list(collective_fit)
        self.cluster = cluster or getattr(fallback, "cluster", None) or Cluster()
        self.fallback = fallback or AnalyticCostModel(self.cluster)
        self.device_name = device_name(self.device)
        #: counters: ops timed, cache hits, fallbacks
        self.stats = {"measured": 0, "cache_hits": 0, "fallbacks": 0}
        self._cache: dict[str, float] = self._load_cache()
        self._unsupported: set[str] = set()  # in memory only: a failure may be transient (OOM)
        self._copy_fit: tuple[float, float] | None = None
        self._timing_started = time.perf_counter()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_live_group(
        cls,
        group: Any = None,
        *,
        sizes: Sequence[int] = DEFAULT_COLLECTIVE_SIZES,
        collective_repeats: int = 5,
        **kwargs: Any,
    ) -> "MeasuredCostModel":
        """Fit collectives on ``group`` (default: the world) and build the model.

        Every rank of the group must call it together; ``kwargs`` go to the constructor.
        """
        return cls(collective_fit=fit_collectives(group, sizes=sizes, repeats=collective_repeats), **kwargs)

    # ------------------------------------------------------------------ CostModel protocol
    def compute_ms(self, attrs: Mapping[str, Any], fx_node: "torch.fx.Node | None" = None) -> float:
        """Median time of the node's op on :attr:`device`, in ms (cached), else the fallback's."""
        with _real_tensors():
            return self._compute_ms_local(attrs, fx_node)

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        """``alpha + beta * payload`` from a fit on a group of ``group.size`` ranks over as
        many nodes as ``group`` spans (the same group name preferred), else the fallback's
        time."""
        fits = self._fits(coll_type, group)
        if not fits:
            return self.fallback.collective_ms(coll_type, payload_bytes, group)
        line = fits[0][coll_type]
        return line["alpha_ms"] + line["beta_ms_per_byte"] * payload_bytes

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool:
        """Whether a fit prices ``coll_type`` on ``group`` (else the fallback does)."""
        return bool(self._fits(coll_type, group))

    def compute_matched(self, attrs: Mapping[str, Any], fx_node: "torch.fx.Node | None" = None) -> bool:
        """Whether the node's time was measured (timed now or read from the timing cache);
        asked after :meth:`compute_ms` priced it, so it times nothing itself."""
        if fx_node is None:
            return False
        try:
            return self._signature(fx_node) in self._cache
        except _Unsupported:
            return False

    def compute_source(self, attrs: Mapping[str, Any], fx_node: "torch.fx.Node | None" = None) -> str:
        if self.compute_matched(attrs, fx_node):
            return f"{self.name} on {self.device_name}"
        return source_of(self.fallback, "compute_source", attrs, fx_node)

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        if self.collective_matched(coll_type, group):
            return f"{self.name} on its group"
        return source_of(self.fallback, "collective_source", coll_type, group)

    def copy_source(self) -> str:
        return f"{self.name} on {self.device_name}"

    def _fits(self, coll_type: str, group: GroupInfo) -> list[Mapping[str, Any]]:
        nodes = group.n_nodes(self.cluster)
        fits = [f for f in self.collective_fits
                if f["group_size"] == group.size and coll_type in f and f.get("nodes", nodes) == nodes]
        fits.sort(key=lambda f: f["group_name"] != group.name)
        return fits

    def copy_ms(self, nbytes: int) -> float:
        """Time of copying ``nbytes`` on :attr:`device`: an affine fit over a few sizes."""
        if self._copy_fit is None:
            with _real_tensors():
                self._copy_fit = self._fit_copy()
        alpha, beta = self._copy_fit
        return alpha + beta * nbytes

    # ------------------------------------------------------------------ compute timing
    def _compute_ms_local(self, attrs: Mapping[str, Any], fx_node: Any) -> float:
        try:
            if fx_node is None:
                raise _Unsupported("no FX node")
            key = self._signature(fx_node)
        except _Unsupported as e:
            logger.debug("not timing %s: %s", attrs.get("name", "?"), e)
            return self._fall_back(attrs, fx_node)
        if key in self._cache:
            self.stats["cache_hits"] += 1
            return self._cache[key]
        if key in self._unsupported:
            return self._fall_back(attrs, fx_node)
        try:
            ms = self._time_node(fx_node)
        except Exception as e:  # an op that cannot run on random inputs: price it otherwise
            logger.debug("timing %s (%s) failed: %s", fx_node.name, fx_node.target, e)
            self._unsupported.add(key)
            return self._fall_back(attrs, fx_node)
        self.stats["measured"] += 1
        if self.stats["measured"] % _PROGRESS_EVERY == 0:
            logger.info(
                "timed %d ops on %s (%d cache hits, %d fallbacks) in %.1f s",
                self.stats["measured"], self.device_name, self.stats["cache_hits"],
                self.stats["fallbacks"], time.perf_counter() - self._timing_started,
            )
        self._cache[key] = ms
        self._save_cache(key, ms)
        return ms

    def _fall_back(self, attrs: Mapping[str, Any], fx_node: Any) -> float:
        self.stats["fallbacks"] += 1
        return self.fallback.compute_ms(attrs, fx_node)

    def _signature(self, node: "torch.fx.Node") -> str:
        """Cache key of the node's op call; raises _Unsupported for ops that cannot be timed."""
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            raise _Unsupported(f"not an aten-style op: {target}")
        if target.namespace in ("_c10d_functional", "c10d_functional", "c10d"):
            raise _Unsupported("collective")
        if target.is_view:
            raise _Unsupported("view")
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise _Unsupported("random op")
        nbytes = 0

        def sig(a: Any) -> Any:
            nonlocal nbytes
            if isinstance(a, torch.fx.Node):
                if "val" not in a.meta:
                    raise _Unsupported(f"input {a.name} has no meta['val']")
                a = a.meta["val"]
            if isinstance(a, torch.Tensor):
                if not all(isinstance(s, int) for s in (*a.shape, *a.stride())):
                    raise _Unsupported("symbolic shape")
                nbytes += a.numel() * a.element_size()
                return ["T", list(a.shape), list(a.stride()), str(a.dtype)]
            if isinstance(a, (list, tuple)):
                return [sig(x) for x in a]
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise _Unsupported("symbolic argument")
            if isinstance(a, torch.device):
                return "<device>"  # replaced by the timing device
            if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)):
                return repr(a)
            raise _Unsupported(f"argument of type {type(a).__name__}")

        args = sig(list(node.args))
        kwargs = {k: sig(v) for k, v in sorted(node.kwargs.items())}
        nbytes += sum(v.numel() * v.element_size() for v in _tensors(node.meta.get("val")))
        if nbytes > self.max_op_bytes:
            raise _Unsupported(f"{nbytes} bytes > max_op_bytes={self.max_op_bytes}")
        return json.dumps([str(target), args, kwargs, self.device_name, torch.__version__])

    def _time_node(self, node: "torch.fx.Node") -> float:
        """Run the op on random inputs; median ms per call over ``repeats`` samples."""
        index_bound = _index_bound(node)

        def real(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                a = a.meta["val"]
            if isinstance(a, torch.Tensor):
                return _random_like(a, self.device, index_bound)
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            if isinstance(a, torch.device):
                return self.device
            return a

        args = real(list(node.args))
        kwargs = {k: real(v) for k, v in node.kwargs.items()}
        op = node.target
        for _ in range(max(1, self.warmup)):
            t0 = self._now()
            op(*args, **kwargs)
            one_ms = (self._now() - t0) * 1e3
        inner = 1 if one_ms >= self.min_sample_ms else min(1000, math.ceil(self.min_sample_ms / max(one_ms, 1e-4)))
        samples = []
        for _ in range(self.repeats):
            t0 = self._now()
            for _ in range(inner):
                op(*args, **kwargs)
            samples.append((self._now() - t0) * 1e3 / inner)
        return float(statistics.median(samples))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _fit_copy(self) -> tuple[float, float]:
        """(alpha_ms, beta_ms_per_byte) of ``dst.copy_(src)`` on the device (cached)."""
        key = json.dumps(["copy_", list(_COPY_SIZES), self.device_name, torch.__version__])
        if key in self._cache:
            return tuple(self._cache[key])  # type: ignore[return-value]
        points = []
        for nbytes in _COPY_SIZES:
            src = torch.randn(nbytes // 4, device=self.device)
            dst = torch.empty_like(src)
            for _ in range(self.warmup):
                dst.copy_(src)
            samples = []
            for _ in range(self.repeats):
                t0 = self._now()
                dst.copy_(src)
                samples.append((self._now() - t0) * 1e3)
            points.append((nbytes, statistics.median(samples)))
        fit = fit_line(points)
        self._cache[key] = list(fit)  # type: ignore[assignment]
        self._save_cache(key, list(fit))
        logger.info("copy on %s: %.4f ms + %.3g ms/byte", self.device_name, *fit)
        return fit

    # ------------------------------------------------------------------ disk cache
    def _load_cache(self) -> dict[str, Any]:
        if self.cache_path is None:
            return {}
        try:
            data = json.loads(self.cache_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("ignoring unreadable timing cache %s (%s)", self.cache_path, e)
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            logger.warning("ignoring timing cache %s of another format version", self.cache_path)
            return {}
        return dict(data.get("entries", {}))

    def _save_cache(self, key: str, value: Any) -> None:
        """Merge one entry into the file (atomic replace; concurrent writers lose nothing of
        their own, at worst a parallel writer's newest entry, which is re-timed later)."""
        if self.cache_path is None:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            on_disk = self._load_cache()
            on_disk.update(self._cache)
            on_disk[key] = value
            tmp = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": on_disk}))
            tmp.replace(self.cache_path)
        except OSError as e:  # a read-only home must not stop a solve
            logger.warning("cannot write timing cache %s: %s", self.cache_path, e)


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _real_tensors() -> Iterator[None]:
    """Real tensors even inside a compiler: aot_autograd calls its fw / bw compilers with its
    fake mode (and possibly a tracing proxy mode) active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


# ---------------------------------------------------------------------------------------------


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _index_bound(node: "torch.fx.Node") -> int:
    """Upper bound (exclusive) for random integer inputs: the smallest dimension of the op's
    floating-point inputs, which keeps indices valid for embedding, gather, scatter, nll_loss."""
    dims = [
        s
        for a in node.all_input_nodes
        for t in _tensors(a.meta.get("val"))
        if t.is_floating_point()
        for s in t.shape
    ]
    return max(1, min(dims)) if dims else 1


def _random_like(meta: torch.Tensor, device: torch.device, index_bound: int) -> torch.Tensor:
    """A real tensor with ``meta``'s shape, strides and dtype on ``device``: normal values for
    floats, integers in ``[0, index_bound)``, random booleans."""
    shape, stride = tuple(meta.shape), tuple(meta.stride())
    storage = 0 if 0 in shape else 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    dtype = meta.dtype
    if dtype == torch.bool:
        base = torch.rand(storage, device=device) < 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(storage, device=device, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)
    else:
        base = torch.randint(0, index_bound, (storage,), device=device).to(dtype)
    return base.as_strided(shape, stride)
