"""The fast evaluator's peaks: both memory counts of a schedule in work that grows with its buckets.

A :class:`MemoryModel` is the per-graph analysis (:class:`~solvers.core.memory_analysis.StorageAnalysis`)
made into numbers: the static storages' live-bytes profile over the compute steps, with a sparse
table for range maxima (:meth:`MemoryModel.finish`), and each bucket's :class:`Template` (per
count and step, the net change and the highest point inside the step; changes after fixed
nodes), cached by the bucket's members. The peak of a schedule is a sweep over its issue and wait
steps with a range maximum of the profile between them (:meth:`MemoryModel.peaks`), the floating
frees placed where this schedule runs them (:func:`_place_floating`).

Models are cached per problem and shared by problems with equal memory (one graph priced by
several cost models, :func:`memory_model`).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from solvers.core.memory import ALLOC, FREE, REC, WAIT, static_memory
from solvers.core.memory_analysis import ALONE, AT_ISSUE, AT_WAIT, MEM, MERGED, TRK, StorageAnalysis
from solvers.core.problem import Problem

if TYPE_CHECKING:
    from solvers.core.evaluate import ReadSchedule

logger = logging.getLogger(__name__)

_ALLOC, _REC, _FREE = ALLOC, REC, FREE
_ISSUE, _WAIT = AT_ISSUE, AT_WAIT
_MEM, _TRK = MEM, TRK
_ALONE, _MERGED = ALONE, MERGED


@dataclasses.dataclass(frozen=True)
class Template:
    """One bucket's effect on memory and where it may run. Per count (mem, trk) and step
    (issue, wait): ``(net bytes, highest point above the bytes live when the step starts)``;
    ``node``: ``(gap, mem bytes, trk bytes)`` changes after that compute node's record."""

    issue: tuple[int, int, int, int]
    wait: tuple[int, int, int, int]
    node: tuple[tuple[int, int, int], ...]
    lo: int
    hi: int
    valid: bool
    #: per count and step (issue, wait): the changes by point and the records, to redo a step's
    #: effect with a free placed in it per schedule (:func:`_place_floating`)
    raw: tuple = ()
    #: frees of this bucket's results that other collectives read, placed per schedule as
    #: :attr:`MemoryModel.floating` entries are (:meth:`MemoryModel._chained_view`)
    floating: tuple = ()


class MemoryModel(StorageAnalysis):
    """Both memory counts of one problem: the static profile and the bucket templates."""

    # -- profile and templates -------------------------------------------------------------
    def finish(self) -> None:
        """The static profile of each count: live bytes at each node's record, during the
        steps of each gap, and a sparse table of range maxima."""
        n = self.n
        self.rec: list[list[int]] = []
        self.gap: list[list[int]] = []
        self.table: list[list[list[int]]] = []
        for c in (_MEM, _TRK):
            live = self.prof_alloc[c][0]
            gap, rec = [live], []
            for g in range(n):
                live += self.prof_alloc[c][g + 1]
                rec.append(live)
                live -= self.prof_free[c][g]
                gap.append(live)
            self.rec.append(rec)
            self.gap.append(gap)
            self.table.append(_sparse_table(rec))
        self.init = (self.prof_alloc[_MEM][0], self.prof_alloc[_TRK][0])
        self._least: tuple[int, int] | None = None

    def template(self, members: tuple[str, ...]) -> Template:
        t = self.templates.get(members)
        if t is None:
            t = self.templates[members] = self._template(members)
        return t

    def _template(self, members: tuple[str, ...]) -> Template:
        colls = self.colls
        lo = max(colls[m].ready for m in members)
        hi = min(colls[m].needed for m in members)
        merged = len(members) > 1
        if merged and (len({colls[m].key for m in members}) > 1 or not all(colls[m].movable for m in members)):
            return Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
        v = _MERGED if merged else _ALONE
        ops = self.ops(members, merged)
        per_count, raw, floating = [], [], []
        node: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for c in (_MEM, _TRK):
            deltas: list[dict[int, int]] = [defaultdict(int), defaultdict(int)]
            recs: list[list[tuple[int, int]]] = [[], []]
            for m in members:
                k = self.contrib.get((m, v, c))
                if k is not None:
                    for anchor in (_ISSUE, _WAIT):
                        for sub, d in k.at[anchor].items():
                            deltas[anchor][sub] += d
                    for g, d in k.node:
                        node[g][c] += d
            allocs: dict[Any, tuple[int, int, int]] = {}
            for anchor, sub, code, key, amount, member in ops[c]:
                if code == _REC:
                    recs[anchor].append((sub, amount))
                elif member is None and code == _ALLOC:
                    if key in allocs:
                        return Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
                    allocs[key] = (anchor, sub, amount)
                    deltas[anchor][sub] += amount
                elif member is None and code == _FREE:
                    if key in allocs:  # one of 0 bytes, or one never made, is never live
                        deltas[anchor][sub] -= allocs.pop(key)[2]
                elif member is None:  # a rule the templates do not know: the simulator judges
                    return Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
            if any((c, m) in self.view_frees for m in members):
                # results that other collectives read: freed when the last reader runs, per schedule
                floating += self.view_floating(c, members, allocs.get(WAIT) if merged else None)
            elif merged and members[0] in self.viewed and WAIT in allocs:
                # the result whose views the members are: freed after the last release of any
                # member's storage
                self._merged_wait_free(c, members, allocs[WAIT], deltas, node)
            per_count.append([_step_effect(deltas[a], recs[a]) for a in (_ISSUE, _WAIT)])
            raw.append(tuple((dict(deltas[a]), tuple(recs[a])) for a in (_ISSUE, _WAIT)))
        issue = (*per_count[_MEM][_ISSUE], *per_count[_TRK][_ISSUE])
        wait = (*per_count[_MEM][_WAIT], *per_count[_TRK][_WAIT])
        events = tuple(sorted((g, d[0], d[1]) for g, d in node.items() if d[0] or d[1]))
        return Template(issue, wait, events, lo, hi, True, tuple(raw), tuple(floating))

    def _merged_wait_free(self, c: int, members, alloc: tuple[int, int, int], deltas, node) -> None:
        rels, sites, never, uses = [], [], False, 0
        for m in members:
            r, s, nf, u = self.wait_info.get((c, m), ([], [], False, 0))
            rels += r
            sites += s
            never |= nf
            uses += u
        if never or not uses or not (rels or sites):
            return
        if rels:  # compute nodes that read a member's result run after the bucket's wait
            node[max(rels)][c] -= alloc[2]
        else:
            anchor, sub = max(sites)
            if (anchor, sub) <= alloc[:2]:
                return  # released before it is made: it lives on
            deltas[anchor][sub] -= alloc[2]

    def least_peak(self) -> tuple[int, int]:
        """``(bytes, node)``: no schedule of this problem peaks lower (the execution model's
        count), and every one holds at least ``bytes`` at ``node``'s record (its index in the
        compute order). Computed once.

        At a compute node's record every schedule holds the static profile, plus each
        collective's contribution (:class:`~solvers.core.memory_analysis.Contribution`) at its
        least over the placements its issue range allows: before ``ready`` none of its steps
        has run, from ``needed`` on both have, in between none, the issue or both; the least
        of its variants (alone, merged). A bucket's own storages (its buffers) are allocated
        before they are freed, so leaving them out only lowers the bound. A free placed per
        schedule counts from the earliest point it may happen: after its last compute reader,
        and from the start where it has none; a collective whose result such a free releases
        counts its frees only."""
        if self._least is None:
            self._least = self._least_peak()
        return self._least

    def _least_peak(self) -> tuple[int, int]:
        n = self.n
        change = [0] * (n + 1)  # the collectives' least contribution, as changes by node
        counted_only_frees = {m for (c, m) in self.view_frees if c == _MEM}
        for c, size, q, sites in self.floating:
            if c == _MEM:
                change[q + 1 if q is not None else 0] -= size
                counted_only_frees.update(m for m, _ in sites)
        for name, coll in self.colls.items():
            lo, hi = coll.ready, coll.needed
            shapes = []
            for v in ((_ALONE, _MERGED) if coll.movable else (_ALONE,)):
                k = self.contrib.get((name, v, _MEM))
                shapes.append(((), 0, 0) if k is None else
                              (tuple(k.node), sum(k.at[_ISSUE].values()), sum(k.at[_WAIT].values())))
            points = sorted(g for g in {0, lo, hi, *(at + 1 for shape in shapes for at, _ in shape[0])} if g < n)
            before = 0
            for g in points:
                least = min(_contribution_at(shape, g, lo, hi) for shape in shapes)
                if name in counted_only_frees:
                    least = min(0, least)
                change[g] += least - before
                before = least
        best, at, extra = None, 0, 0
        for g, live in enumerate(self.rec[_MEM]):
            extra += change[g]
            if best is None or live + extra > best:
                best, at = live + extra, g
        return (best if best is not None else self.init[_MEM]), at

    def peaks(self, read: ReadSchedule, templates: Sequence[Template]) -> tuple[int, int]:
        """(peak_bytes, tracker_peak_bytes) of a read schedule whose checks passed."""
        events = [e for t in templates if t.node for e in t.node]
        issue = [t.issue for t in templates]
        wait = [t.wait for t in templates]
        floating = self.floating
        if self.view_frees:
            floating = floating + [e for t in templates if t.floating for e in t.floating]
        if floating:
            _place_floating(floating, read, templates, issue, wait, events)
        if events:
            events.sort()
        return self._sweep(read, issue, wait, events)

    def _sweep(self, read: ReadSchedule, issue: list, wait: list, events: list) -> tuple[int, int]:
        """The peaks: the issue and wait steps in order, each bucket's step effects, the
        static profile's range maxima between them, the changes after fixed nodes."""
        rec_m, rec_t = self.rec
        gap_m, gap_t = self.gap
        tab_m, tab_t = self.table
        peak_m, peak_t = self.init
        dm = dt = 0
        g_next = 0
        ei, ne = 0, len(events)
        for is_issue, b, gap in read.steps:
            while ei < ne and events[ei][0] < gap:
                g, em, et = events[ei]
                if g_next <= g:
                    k = (g - g_next + 1).bit_length() - 1
                    row_m, row_t = tab_m[k], tab_t[k]
                    j = g - (1 << k) + 1
                    v = (row_m[g_next] if row_m[g_next] > row_m[j] else row_m[j]) + dm
                    if v > peak_m:
                        peak_m = v
                    v = (row_t[g_next] if row_t[g_next] > row_t[j] else row_t[j]) + dt
                    if v > peak_t:
                        peak_t = v
                    g_next = g + 1
                dm += em
                dt += et
                ei += 1
            if g_next < gap:
                k = (gap - g_next).bit_length() - 1
                row_m, row_t = tab_m[k], tab_t[k]
                j = gap - (1 << k)
                v = (row_m[g_next] if row_m[g_next] > row_m[j] else row_m[j]) + dm
                if v > peak_m:
                    peak_m = v
                v = (row_t[g_next] if row_t[g_next] > row_t[j] else row_t[j]) + dt
                if v > peak_t:
                    peak_t = v
                g_next = gap
            net_m, top_m, net_t, top_t = issue[b] if is_issue else wait[b]
            v = gap_m[gap] + dm + top_m
            if v > peak_m:
                peak_m = v
            v = gap_t[gap] + dt + top_t
            if v > peak_t:
                peak_t = v
            dm += net_m
            dt += net_t
        n = self.n
        while True:
            end = events[ei][0] if ei < ne else n - 1
            if g_next <= end and end >= 0:
                k = (end - g_next + 1).bit_length() - 1
                row_m, row_t = tab_m[k], tab_t[k]
                j = end - (1 << k) + 1
                v = (row_m[g_next] if row_m[g_next] > row_m[j] else row_m[j]) + dm
                if v > peak_m:
                    peak_m = v
                v = (row_t[g_next] if row_t[g_next] > row_t[j] else row_t[j]) + dt
                if v > peak_t:
                    peak_t = v
                g_next = end + 1
            if ei >= ne:
                break
            dm += events[ei][1]
            dt += events[ei][2]
            ei += 1
        return peak_m, peak_t


def _contribution_at(shape: tuple, g: int, lo: int, hi: int) -> int:
    """The least a collective's contribution ``shape`` (node changes, net issue bytes, net wait
    bytes) holds at node ``g``'s record when its issue range is ``lo`` to ``hi``
    (:meth:`MemoryModel.least_peak`)."""
    node, issue, wait = shape
    fixed = sum(d for at, d in node if at < g)
    if g < lo:
        return fixed
    if g >= hi:
        return fixed + issue + wait
    return fixed + min(0, issue, issue + wait)


def _place_floating(floating: Sequence[tuple], read: ReadSchedule, templates: Sequence[Template], issue: list,
                   wait: list, events: list) -> None:
    """Each floating free (:meth:`MemoryModel._floating`) where it happens in this read: after
    its last compute reader when that runs after every step that releases it (a step in a gap
    up to the node runs before it), else at its point in the last such step, whose effect is
    then redone."""
    bucket_of = {m: b for b, members in enumerate(read.members) for m in members}
    at: dict[tuple[int, int], tuple[int, int]] = {}  # (bucket, anchor) -> (gap, index of the step)
    for k, (is_issue, b, gap) in enumerate(read.steps):
        at[(b, _ISSUE if is_issue else _WAIT)] = (gap, k)
    extra: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (b, anchor) -> frees
    for c, size, q, sites in floating:
        last = (q, 1, 0, 0, None) if q is not None else None
        for m, by_variant in sites:
            b = bucket_of[m]
            site = by_variant[-1 if len(read.members[b]) > 1 else 0]
            if site is None:
                continue
            gap, k = at[(b, site[0])]
            point = (gap, 0, k, site[1], (b, site[0]))
            if last is None or point > last:
                last = point
        if last is None:
            continue
        if last[4] is None:
            events.append((q, -size, 0) if c == _MEM else (q, 0, -size))
        else:
            extra[last[4]].append((c, last[3], -size))
    for (b, anchor), frees in extra.items():
        effect = []
        for c in (_MEM, _TRK):
            deltas, recs = templates[b].raw[c][anchor]
            deltas = defaultdict(int, deltas)
            for count, sub, d in frees:
                if count == c:
                    deltas[sub] += d
            effect.extend(_step_effect(deltas, recs))
        (issue if anchor == _ISSUE else wait)[b] = tuple(effect)


def _step_effect(deltas: Mapping[int, int], recs: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(net change, highest point above the start) of one step: an allocation or a free at
    ``sub`` counts for the records at later points; a record adds its transient bytes."""
    top = None
    for sub, extra in recs:
        v = sum(d for s, d in deltas.items() if s < sub) + extra
        top = v if top is None or v > top else top
    return sum(deltas.values()), (top if top is not None else -(1 << 62))


def _sparse_table(values: list[int]) -> list[list[int]]:
    table = [list(values)]
    k = 1
    while (1 << k) <= len(values):
        prev, half = table[-1], 1 << (k - 1)
        table.append([a if a > b else b for a, b in zip(prev, prev[half:])])
        k += 1
    return table


#: per problem (weak: the values hold no reference to it): both memory counts
_MEMORY: "weakref.WeakKeyDictionary[Problem, MemoryModel]" = weakref.WeakKeyDictionary()


#: memory models by everything they read (:func:`_fingerprint`): one graph priced by several
#: cost models shares one
_SHARED: "weakref.WeakValueDictionary[tuple, MemoryModel]" = weakref.WeakValueDictionary()


def memory_model(p: Problem) -> MemoryModel:
    m = _MEMORY.get(p)
    if m is None:
        key = _fingerprint(p)
        m = _SHARED.get(key)
        if m is None:
            m = MemoryModel(p)
            if m.reason is None:
                m.finish()
            else:
                logger.info("evaluator: the simulator judges every schedule of this graph: %s", m.reason)
            _SHARED[key] = m
        _MEMORY[p] = m
    return m


def _fingerprint(p: Problem) -> tuple:
    """Everything a memory model reads of a problem: problems with equal fingerprints (one
    graph priced by several cost models) have equal peaks under every schedule."""
    st = static_memory(p)
    # in the export's order: exports of one graph list it alike (another order only costs a share)
    return (p.seq, tuple((n, a["kind"], int(a["size_bytes"]), a["alias_of"], st.preds[n])
                         for n, a in p.dag.nodes(data=True)),
            tuple((m, c.key, c.group_size, c.payload_bytes, c.out_bytes, c.merge_read_bytes, c.prologue, c.epilogue,
                   c.folded_cast, c.ready, c.needed, c.movable) for m, c in p.colls.items()),
            tuple((name, allocs, trk_allocs, unread) for name, (_, allocs, trk_allocs, unread) in st.steps.items()),
            tuple(st.mem_owner.items()), tuple(st.trk_owner.items()), tuple(st.mem_uses.items()),
            tuple(st.trk_uses.items()), st.mem_never_free, st.trk_never_free, st.inputs)
