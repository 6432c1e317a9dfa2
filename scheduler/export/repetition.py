"""Repetition in a sequence of tokens: the graph fallback of :mod:`scheduler.export.structure`
finds the stack of blocks as the longest run of parameter-collective tokens that repeats with
one period (:func:`find_repetition`), then where the blocks of that run lie (:func:`place_units`).
Plain sequences in, positions out: nothing here reads a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def find_repetition(tokens: Sequence[Any], *, min_units: int = 2) -> tuple[int, int, int] | None:
    """(start, period, units) of the longest run of ``tokens`` that repeats with one period.

    The run covers ``units * period`` tokens from ``start``; among runs of equal coverage the
    shortest period wins (a multiple of the true period covers no more). None when nothing
    repeats ``min_units`` times.
    """
    m = len(tokens)
    best: tuple[int, int, int, int] | None = None  # (coverage, -period, start, units)
    for p in range(1, m // min_units + 1):
        i = 0
        while i + p < m:
            if tokens[i] != tokens[i + p]:
                i += 1
                continue
            s = i
            while i + p < m and tokens[i] == tokens[i + p]:
                i += 1
            units = (i + p - s) // p
            if units >= min_units:
                cand = (units * p, -p, s, units)
                if best is None or cand[:2] > best[:2]:
                    best = cand
    if best is None:
        return None
    return best[2], -best[1], best[3]


def place_units(tokens: Sequence[tuple], shapes: Sequence[Any], run: tuple[int, int, int], *,
                 backward: bool) -> tuple[int, int]:
    """(first, units): where the blocks of ``run`` (start, period, units of exactly repeating
    tokens) lie.

    Every phase of the unit grid is tried. A unit is taken if its tokens agree with the
    grid's first unit inside the exact run in type, dtype and rank everywhere, and in the op
    sequence in all but a quarter of its positions (ops hoisted out of the first block, e.g.
    a constant computed once, change one token without changing the block); the longest
    stretch of such units around the run wins; then the phase with more units whose payload
    shapes equal the first unit's. Between phases still tied, a forward
    graph takes the earliest and a backward graph the latest: what resembles part of a block
    outside the stack is, in pre-norm networks, the final norm after it, which a backward
    graph runs first.
    """
    start, p, units = run
    m = len(tokens)
    slack = p // 4

    def good(ref_at: int, at: int) -> bool:
        if at < 0 or at + p > m:
            return False
        diff = 0
        for k in range(p):
            a, b = tokens[ref_at + k], tokens[at + k]
            if a[:3] != b[:3]:
                return False
            diff += a != b
        return diff <= slack

    best: tuple[int, int, int, int] | None = None  # (units, same shapes, signed start, first)
    for offset in range(p):
        ref_at = start + (offset - start) % p
        if ref_at + p > start + units * p + (p - 1) or ref_at + p > m:
            continue
        first = ref_at
        while good(ref_at, first - p):
            first -= p
        last = ref_at + p
        while good(ref_at, last):
            last += p
        n = (last - first) // p
        ref = list(shapes[ref_at: ref_at + p])
        same = sum(1 for k in range(n) if list(shapes[first + k * p: first + (k + 1) * p]) == ref)
        cand = (n, same, first if backward else -first, first)
        if best is None or cand[:3] > best[:3]:
            best = cand
    if best is None:
        return start, units
    return best[3], best[0]


def least_period(seq: Sequence[int]) -> int | None:
    if not seq:
        return None
    for p in range(1, len(seq) + 1):
        if all(seq[i] == seq[i + p] for i in range(len(seq) - p)):
            return p
    return len(seq)
