"""Schedules as entries ``(bucket, issue gap, wait gap)``: how the starts and the polish build
them (:func:`from_entries`), keep every chain issued in order (:func:`chain_ordered`), and count
a chain in blocks (:func:`chain_units`)."""

from __future__ import annotations

from collections.abc import Sequence

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule

Entry = tuple[Bucket, int, int]  # (bucket, issue gap, wait gap)


def chain_units(p: Problem, names: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` (one chain, in chain order) in runs of consecutive collectives of one block
    (the export's ``block``); a collective outside every block is a unit of its own."""
    units: list[list[str]] = []
    for n in names:
        block = p.colls[n].block
        if units and block is not None and p.colls[units[-1][-1]].block == block:
            units[-1].append(n)
        else:
            units.append([n])
    return [tuple(u) for u in units]


def chain_ordered(problem: Problem, entries: list[tuple[Bucket, int, int]]):
    """``entries`` with every chain's buckets issued in chain order (the models' FIFO rule): a
    bucket that would be issued before its predecessor is issued with it instead (and waited no
    earlier). None when that is after one of its members is needed."""
    entries = list(entries)
    entry_of = {m: e for e, (bk, _, _) in enumerate(entries) for m in bk.members}
    for names in problem.chains.values():
        floor, seen = 0, set()
        for n in names:
            e = entry_of[n]
            if e in seen:
                continue
            seen.add(e)
            bk, i, w = entries[e]
            if i < floor:
                if floor > min(problem.colls[m].needed for m in bk.members):
                    return None
                entries[e] = (bk, floor, max(w, floor))
            floor = max(floor, entries[e][1])
    return entries


def from_entries(problem: Problem, entries: list[tuple[Bucket, int, int]]) -> Schedule:
    """The schedule of (bucket, issue gap, wait gap) entries; buckets issued in one gap go in
    chain order (need, then ready), as the streams run them."""

    def chain_key(e):
        c = problem.colls[e[0].members[0]]
        return (e[1], c.needed, c.ready, c.traced_issue, e[0].members)

    entries = sorted(entries, key=chain_key)
    return problem.schedule_at([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
