"""Units shared by every layer: memory sizes in bytes and times in ms, parsed and formatted, and
the line fit of times against sizes.

Sizes travel as integer bytes (``mem_budget_bytes``), times as float milliseconds
(``step_ms``); model backends count time in integer microseconds (:data:`US_PER_MS`).
"""

from __future__ import annotations

import bisect
import math
import numbers
import re
from collections.abc import Sequence
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, InvalidOperation, localcontext

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

#: the largest memory size accepted: budgets and peaks are int64 in the solver models, so a
#: larger one would overflow there (and no device has that much memory)
MAX_BYTES = 2**63 - 1
_MAX_TEXT = "2**63 - 1 bytes (just under 8 EiB)"
_ACCEPTED = "give a number of bytes from 1 to 2**63 - 1 (a fraction of a byte rounds down) or a size such as '40GiB'"
# Amounts whose decimal exponent is beyond this are out of range for every unit (the largest
# unit is about 1e12 and the largest size about 9.2e18), so they are refused before multiplying.
_MAX_DIGITS = 40
# Exact decimal arithmetic: a product of an exact amount and an integer unit is never rounded.
_EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)


def parse_bytes(x: int | float | str | None) -> int | None:
    """A memory size in bytes, from 1 to :data:`MAX_BYTES`.

    Accepts None (no limit, returned as None), a number of bytes (an int, or a finite float),
    or a string: a number and a unit, case-insensitive: ``B``, decimal ``KB`` / ``MB`` / ``GB`` /
    ``TB`` (powers of 1000) or binary ``KiB`` / ``MiB`` / ``GiB`` / ``TiB`` (powers of 1024),
    e.g. ``"40GiB"``, ``"512MB"``, ``"1.5 GB"``, ``"300 KiB"``. Strings are read exactly in
    decimal (``"1.15 KB"`` is 1150 bytes). A fraction of a byte is rounded down, so that
    rounding never raises a budget; a size below one byte is refused.

    Raises:
        ValueError: an unknown unit or a malformed string (the message lists the units); a
            size that is not finite, below 1 byte or above :data:`MAX_BYTES`; a bool (True
            and False are not byte counts).
        TypeError: neither None, a number nor a string.
    """
    if x is None:
        return None
    if isinstance(x, bool):
        raise ValueError(f"memory size must be a number of bytes, not a bool: got {x!r}; {_ACCEPTED}")
    if isinstance(x, str):
        m = _BYTES_RE.match(x)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse memory size {x!r}: write a number and a unit, one of B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '40GiB' or '1.5 GB'"
            )
        try:
            amount = Decimal(m.group(1))
        except InvalidOperation:  # an exponent past Decimal's own range: far from any size either way
            amount = Decimal(0) if "-" in m.group(1) else Decimal("Infinity")
        unit_bytes = _UNITS[unit]
    elif isinstance(x, numbers.Integral):  # numpy integers too
        amount, unit_bytes = Decimal(int(x)), 1
    elif isinstance(x, numbers.Real):
        f = float(x)
        if not math.isfinite(f):
            raise ValueError(f"memory size must be finite, got {x!r}; {_ACCEPTED}")
        amount, unit_bytes = Decimal(f), 1  # exact: Decimal holds any float
    else:
        raise TypeError(f"a memory size must be bytes (int) or a string like '40GiB', got {type(x).__name__}")
    return _whole_bytes(amount, unit_bytes, x)


def _whole_bytes(amount: Decimal, unit_bytes: int, x: object) -> int:
    """``amount * unit_bytes`` rounded down, checked to lie in ``[1, MAX_BYTES]``."""
    # The magnitude is checked first so that a huge exponent ('1e999999 GiB') costs nothing.
    if amount.is_infinite() or amount.adjusted() > _MAX_DIGITS:
        raise ValueError(f"memory size must be at most {_MAX_TEXT}, got {x!r}; {_ACCEPTED}")
    value = 0
    if amount > 0 and amount.adjusted() >= -_MAX_DIGITS:
        with localcontext(_EXACT):
            value = int(amount * unit_bytes)  # int() truncates, i.e. rounds a positive size down
    if value < 1:
        raise ValueError(f"memory size must be at least 1 byte, got {x!r}; {_ACCEPTED}")
    if value > MAX_BYTES:
        raise ValueError(f"memory size must be at most {_MAX_TEXT}, got {x!r}; {_ACCEPTED}")
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


def interpolate(table: Sequence[Sequence[float]], x: float) -> float:
    """Piecewise-linear value at ``x`` of increasing ``[[x, y], ...]`` points (x in range)."""
    i = bisect.bisect_left([p[0] for p in table], x)
    if table[i][0] == x:
        return float(table[i][1])
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
