"""Units shared by every layer: memory sizes in bytes and times in ms, parsed and formatted.

Sizes travel as integer bytes (``mem_budget_bytes``), times as float milliseconds
(``step_ms``); model backends count time in integer microseconds (:data:`US_PER_MS`).
"""

from __future__ import annotations

import math
import re

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
