"""Per-layer repetition of a graph, and replicating one layer's decisions onto the others.

Transformer graphs repeat one block per layer: the same compute nodes with the same costs, and
the same collectives (one per parameter of the block), shifted by a fixed number of positions of
the compute sequence (the *period*). A schedule that is good for one block in the steady state is
then good for the others. :func:`detect_periodicity` finds that structure from the collectives'
parameter names (the layer index is the first integer component of the FQN, e.g.
``layers.12.attention.wq.weight``) and checks it on positions and compute costs;
:func:`replicate` copies one block's buckets and relative issue/wait positions onto other blocks.

Nothing here decides whether a replicated schedule is good or fits memory: the callers simulate
it (:func:`solvers.cpsat.solve_cpsat` keeps it only if it fits the budget and is faster).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterable

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)(\d+)(?=\.)")


def _block_and_role(fqns: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer index, FQNs with the index replaced by '{}') when every FQN names the same layer."""
    blocks, roles = set(), []
    for f in fqns:
        m = _LAYER.search(f)
        if m is None:
            return None
        blocks.add(int(m.group(1)))
        roles.append(f[: m.start(1)] + "{}" + f[m.end(1) :])
    if len(blocks) != 1:
        return None
    return blocks.pop(), "|".join(roles)


@dataclasses.dataclass(frozen=True)
class Periodicity:
    """The repeating blocks of a problem.

    Attributes:
        blocks: layer indices of the regular run, in increasing order (consecutive integers).
        period: positions of the compute sequence between a role's need in block ``b`` and in
            block ``b + stride`` (negative in backward graphs, where layers run in reverse).
        members: block -> role -> collective name, for the blocks of the run.
        stride: blocks per period: 1 when every layer repeats the previous one, k when only
            every k-th does (e.g. 2 for MLP widths that alternate between layers).
    """

    blocks: tuple[int, ...]
    period: int
    members: dict[int, dict[tuple, str]]
    stride: int = 1

    def block_of(self) -> dict[str, int]:
        return {n: b for b, roles in self.members.items() for n in roles.values()}

    def role_of(self) -> dict[str, tuple]:
        return {n: r for roles in self.members.values() for r, n in roles.items()}

    def middle(self) -> int:
        """First block of the middle period (its ``stride`` blocks all lie in the run)."""
        k = self.stride
        mid = self.blocks[0] + (len(self.blocks) // 2 // k) * k
        return mid if mid + k - 1 <= self.blocks[-1] else mid - k

    def source_of(self, source: int, target: int) -> int:
        """The block of the period starting at ``source`` that ``target`` repeats."""
        return source + (target - source) % self.stride


def _roles_by_block(problem: Problem) -> dict[int, dict[tuple, str]] | None:
    """block -> role -> collective, for the movable collectives. The block is the export's
    inferred ``block`` (:mod:`scheduler.export.structure`); the role is the collective's bucket key and
    its rank among its block's members of that chain. Without inferred blocks (an old DAG), the
    block and role come from the FQNs (``layers.N.<name>``). None when one block has two
    collectives of one role (not a plain repetition)."""
    per_block: dict[int, dict[tuple, str]] = {}
    rank: dict[tuple, int] = {}
    for key, names in problem.chains.items():
        for n in names:
            c = problem.colls[n]
            if not c.movable:
                continue
            if c.block is not None:
                b = c.block
                role: tuple = (c.coll_type, key, rank.setdefault((b, key), 0))
                rank[(b, key)] += 1
            else:
                br = _block_and_role(c.fqns)
                if br is None:
                    continue
                b, role = br[0], (c.coll_type, key, br[1])
            if role in per_block.setdefault(b, {}):
                return None
            per_block[b][role] = n
    return per_block


def detect_periodicity(problem: Problem, *, min_blocks: int = 4, max_stride: int = 1) -> Periodicity | None:
    """The longest run of consecutive layers whose collectives and compute repeat with one period.

    With stride ``k`` (1 to ``max_stride``), blocks ``b`` and ``b + k`` repeat when they have the
    same roles (collective type, bucket key, rank in the block), every role's needed and ready
    gaps shift by the same period ``P`` (gaps at the graph's start or end on both sides also
    count: parameters exist from the start, gradients are needed only at the end), and the
    compute costs of the ``|P|`` positions from block ``b``'s first need on equal those ``P``
    later. A run of stride ``k`` is at least ``2k`` blocks long. The longest run wins; ties go to
    the smaller stride. None when no run has ``min_blocks`` blocks.
    """
    per_block = _roles_by_block(problem)
    if per_block is None or len(per_block) < min_blocks:
        return None
    best: tuple[int, int, int, int] | None = None  # (length, -stride, first block, period)
    for k in range(1, max_stride + 1):
        shifts = {b: _shift(problem, per_block, b, b + k) for b in sorted(per_block) if b + k in per_block}
        for first, last, p in _equal_runs(shifts):
            length = last + k - first + 1
            if last - first + 1 >= k and (best is None or (length, -k) > best[:2]):
                best = (length, -k, first, p)
    if best is None or best[0] < min_blocks:
        return None
    length, stride, first, period = best[0], -best[1], best[2], best[3]
    blocks = tuple(range(first, first + length))
    logger.debug("periodicity: blocks %d..%d, %d block(s) per period of %d positions", blocks[0], blocks[-1],
                 stride, period)
    return Periodicity(blocks=blocks, period=period, members={b: per_block[b] for b in blocks}, stride=stride)


def _shift(problem: Problem, per_block: dict[int, dict[tuple, str]], b0: int, b1: int) -> int | None:
    """Positions from block ``b0`` to block ``b1``, or None if they do not repeat. Gaps equal in
    both blocks are fixed points (the graph's start or end, the gradients' common consumer)."""
    r0, r1 = per_block[b0], per_block[b1]
    if r0.keys() != r1.keys():
        return None
    periods, moving = set(), {0: [], 1: []}
    for role, n0 in r0.items():
        c0, c1 = problem.colls[n0], problem.colls[r1[role]]
        for g0, g1 in ((c0.ready, c1.ready), (c0.needed, c1.needed)):
            if g0 != g1:
                periods.add(g1 - g0)
                moving[0].append(g0)
                moving[1].append(g1)
    if len(periods) != 1:
        return None
    p = periods.pop()
    # the compute of the earlier block must equal the later one's, position by position (about
    # one block's positions: a period of k blocks spans |p| positions)
    start = min(moving[0] if p > 0 else moving[1])
    span = range(start, start + max(1, abs(p) // abs(b1 - b0)))
    if start < 0 or span.stop + abs(p) > problem.n:
        return None
    cm = problem.compute_ms
    if any(not math.isclose(cm[i], cm[i + abs(p)], rel_tol=1e-9, abs_tol=1e-12) for i in span):
        return None
    return p


def _equal_runs(shifts: dict[int, int | None]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive blocks with one (not None) shift: (first, last, shift)."""
    runs: list[tuple[int, int, int]] = []
    for b in sorted(shifts):
        p = shifts[b]
        if p is None:
            continue
        if runs and runs[-1][1] == b - 1 and runs[-1][2] == p:
            runs[-1] = (runs[-1][0], b, p)
        else:
            runs.append((b, b, p))
    return runs


def replicate(problem: Problem, per: Periodicity, schedule: Schedule, source: int,
              targets: Iterable[int], *, onto: Schedule | None = None) -> Schedule | None:
    """``schedule`` with the decisions of the period starting at block ``source`` copied onto
    every block in ``targets``.

    A bucket *belongs* to the block of its first member. Target block ``t`` repeats block
    ``s = per.source_of(source, t)``; each bucket of block ``s``, with every member moved
    ``d = t - s`` blocks, is issued and waited ``d / stride * period`` positions from the
    source's positions (issue no earlier than its members are ready, wait no later than they
    are needed). Buckets of the
    schedule that hold a copied collective are dissolved; their other members stay where they
    were, alone. The result keeps every chain's buckets issued in chain order.

    A target block whose copy does not fit (a shifted member lies outside the run, or a position
    outside the graph) keeps its own decisions. Returns None when no block could be copied or
    no bucket could be issued in chain order; the caller then keeps ``schedule``. With ``onto``,
    the copies go into that schedule instead (``schedule`` only supplies block ``source``).
    """
    sources = set(range(source, source + per.stride))
    targets = sorted(set(targets) - sources)
    if not targets:
        return schedule
    block_of, role_of = per.block_of(), per.role_of()
    issue, wait = schedule.positions()
    covered: set[str] = set()
    new: list[tuple[Bucket, int, int]] = []
    for t in targets:
        s = per.source_of(source, t)
        d = t - s
        copies = []
        for b in (b for b, bk in enumerate(schedule.buckets) if block_of.get(bk.members[0]) == s):
            members = []
            for m in schedule.buckets[b].members:
                tb = block_of[m] + d if m in block_of else None
                if tb not in per.members:
                    break  # a bucket reaching past the run: block t keeps its own decisions
                members.append(per.members[tb][role_of[m]])
            else:
                cs = [problem.colls[m] for m in members]
                shift = d // per.stride * per.period
                i = max(issue[b] + shift, max(c.ready for c in cs))
                w = min(wait[b] + shift, min(c.needed for c in cs))
                if 0 <= i <= w <= problem.n:
                    copies.append((Bucket(tuple(members)), i, w))
                    continue
            copies = None
            break
        if copies is None or covered.intersection(m for bk, _, _ in copies for m in bk.members):
            continue
        new.extend(copies)
        covered.update(m for bk, _, _ in copies for m in bk.members)
    if not new:
        return None
    entries = _dissolved(problem, onto or schedule, covered) + new
    placed = [m for bk, _, _ in entries for m in bk.members]
    if len(placed) != len(set(placed)) or set(placed) != set(problem.colls):
        return None
    entries = chain_ordered(problem, entries)
    return None if entries is None else from_entries(problem, entries)


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


def at_traced(problem: Problem, schedule: Schedule, names: Iterable[str]) -> Schedule | None:
    """``schedule`` with the collectives ``names`` alone at their traced positions (buckets
    holding them are split; their other members stay where they were, alone), in chain order.
    Traced positions repeat exactly from layer to layer, so this is a periodic start for the
    tied template window; None if chain order cannot be kept."""
    names = set(names)
    entries = _dissolved(problem, schedule, names)
    entries += [(Bucket((n,)), problem.colls[n].traced_issue, problem.colls[n].traced_wait) for n in sorted(names)]
    entries = chain_ordered(problem, entries)
    return None if entries is None else from_entries(problem, entries)


def isolate(problem: Problem, schedule: Schedule, names: Iterable[str]) -> Schedule:
    """``schedule`` with every bucket that holds one of ``names`` and a collective outside them
    split into single collectives at the bucket's positions (so that a window over ``names``
    frees nothing else); buckets of ``names`` alone are kept whole."""
    names = set(names)
    issue, wait = schedule.positions()
    entries: list[tuple[Bucket, int, int]] = []
    for b, bk in enumerate(schedule.buckets):
        if len(bk.members) > 1 and names.intersection(bk.members) and not names.issuperset(bk.members):
            entries.extend((Bucket((m,)), issue[b], wait[b]) for m in bk.members)
        else:
            entries.append((bk, issue[b], wait[b]))
    return from_entries(problem, entries)


def split_at_blocks(problem: Problem, schedule: Schedule, max_blocks: int) -> tuple[Schedule, int]:
    """``schedule`` with every bucket whose members span more than ``max_blocks`` blocks (the
    export's inferred ``block``; collectives outside any block count as one more) split into
    runs of one block each, at the bucket's positions. Returns (schedule, buckets split)."""
    issue, wait = schedule.positions()
    entries: list[tuple[Bucket, int, int]] = []
    n_split = 0
    for b, bk in enumerate(schedule.buckets):
        blocks = [problem.colls[m].block for m in bk.members]
        if len(set(blocks)) <= max_blocks:
            entries.append((bk, issue[b], wait[b]))
            continue
        n_split += 1
        runs: list[list[str]] = []
        for m, blk in zip(bk.members, blocks):
            if runs and problem.colls[runs[-1][-1]].block == blk:
                runs[-1].append(m)
            else:
                runs.append([m])
        entries.extend((Bucket(tuple(r)), issue[b], wait[b]) for r in runs)
    return (from_entries(problem, entries), n_split) if n_split else (schedule, 0)


def _dissolved(problem: Problem, schedule: Schedule, removed: set[str]) -> list[tuple[Bucket, int, int]]:
    """(bucket, issue gap, wait gap) of ``schedule`` without the collectives ``removed``: a
    bucket holding one of them leaves its other members alone at its positions."""
    issue, wait = schedule.positions()
    kept: list[tuple[Bucket, int, int]] = []
    for b, bk in enumerate(schedule.buckets):
        if not removed.intersection(bk.members):
            kept.append((bk, issue[b], wait[b]))
            continue
        for m in bk.members:
            if m not in removed:
                kept.append((Bucket((m,)), issue[b], wait[b]))
    return kept


def from_entries(problem: Problem, entries: list[tuple[Bucket, int, int]]) -> Schedule:
    """The schedule of (bucket, issue gap, wait gap) entries; buckets issued in one gap go in
    chain order (need, then ready), as the streams run them."""

    def chain_key(e):
        c = problem.colls[e[0].members[0]]
        return (e[1], c.needed, c.ready, c.traced_issue, e[0].members)

    entries = sorted(entries, key=chain_key)
    return problem.schedule_at([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
