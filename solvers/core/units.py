"""Units shared by every layer: memory sizes in bytes and times in ms, parsed and formatted, and
the line fit of times against sizes.

Sizes travel as integer bytes (``mem_budget_bytes``), times as float milliseconds
(``step_ms``); model backends count time in integer microseconds (:data:`US_PER_MS`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

#: microseconds per millisecond: the solver models' time unit
US_PER_MS = 1000.0

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(x: int | float | str | None) -> int | None:
    """A memory size in bytes.

    Accepts None (no limit, returned as None), a number of bytes, or a string: a number and a
    unit, case-insensitive: ``B``, decimal ``KB`` / ``MB`` / ``GB`` / ``TB`` (powers of 1000)
    or binary ``KiB`` / ``MiB`` / ``GiB`` / ``TiB`` (powers of 1024), e.g. ``"40GiB"``,
    ``"512MB"``, ``"1.5 GB"``, ``"300 KiB"``. Fractions of a byte are rounded down.

    Raises:
        ValueError: an unknown unit or a malformed string (the message lists the units), or a
            size that is zero or negative.
        TypeError: neither None, a number nor a string.
    """
    if x is None:
        return None
    if isinstance(x, bool):
        raise TypeError(f"a memory size must be bytes (int) or a string like '40GiB', got {x!r}")
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"memory size must be finite, got {x!r}")
        value = int(x)
    elif isinstance(x, str):
        m = _BYTES_RE.match(x)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse memory size {x!r}: write a number and a unit, one of B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '40GiB' or '1.5 GB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"a memory size must be bytes (int) or a string like '40GiB', got {type(x).__name__}")
    if value <= 0:
        raise ValueError(f"memory size must be > 0 bytes, got {x!r}")
    return value


def fmt_bytes(n: float) -> str:
    """``n`` bytes as '1.50 GiB', '12.00 MiB', '512 B'."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ms(ms: float) -> str:
    """``ms`` as '12.345 ms' (below 100 ms) or '1234.5 ms'."""
    if math.isnan(ms):
        return "nan"
    return f"{ms:.3f} ms" if ms < 100 else f"{ms:.1f} ms"


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha, beta) >= 0`` of ``t = alpha + beta * x`` through ``(x, t)`` points, least
    squares on the relative error (weights ``1 / t^2``, so that small and large sizes count
    alike): a line through the origin when the intercept would be negative, a constant when
    the slope would be."""
    w = [1.0 / max(t, 1e-9) ** 2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # a line through the origin
        alpha, beta = 0.0, sxy / sxx if sxx > 0 else 0.0
    if beta < 0:  # time does not grow with size (noise): a constant
        alpha, beta = sy / sw, 0.0
    return float(alpha), float(beta)
