"""The fast evaluator's analysis of one graph's memory, done once per graph.

Every storage of each count (the execution model's and torch's ``MemoryTracker`` rules,
:mod:`solvers.core.memory`) is allocated at one step and freed at the last release of its uses.
The analysis reads the micro-operations of every compute node's step
(:meth:`~solvers.core.memory.StaticMemory.node_ops`) and of every collective's issue and wait,
alone and as a member of a merged bucket (:meth:`~solvers.core.memory.StaticMemory.bucket_ops`),
and places each storage:

- *static*: its allocation and its last release both happen at compute nodes whatever the
  schedule: into a fixed live-bytes profile over the compute steps (:attr:`prof_alloc`,
  :attr:`prof_free`);
- one collective's: it changes the live bytes only at its bucket's issue or wait steps (or after
  a fixed node that depends on the bucketing): a :class:`Contribution` per collective, variant
  (alone, merged) and count, summed into a bucket's template (:mod:`solvers.core.peaks`);
- *floating*: freed by whichever of several collectives' steps and a compute node runs last (one
  read by two collectives, or by a compute node inside its collective's issue range): its free
  placed per schedule read (:attr:`floating`, :attr:`view_frees`).

A storage that fits none of these, an operation the analysis does not know, or releases that
differ from the uses in the static data make the analysis :class:`Unsupported`: the evaluator
then hands every schedule of the graph to the simulator (:attr:`StorageAnalysis.reason`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from solvers.core.memory import ALLOC, DROP, FREE, REC, REL, StaticMemory, copied_out, each_storage, static_memory
from solvers.core.problem import Problem

#: one use of a storage done: a release by node name (REL) and by storage (DROP) both resolve to
#: it (:meth:`StorageAnalysis.ops`); the other codes are :mod:`solvers.core.memory`'s
USE = max(ALLOC, REC, REL, DROP, FREE) + 1
#: a bucket's two steps
AT_ISSUE, AT_WAIT = 0, 1
#: the two counts: the execution model's, torch's tracker's
MEM, TRK = 0, 1
#: the storage a merged bucket's result becomes for the releases of member ``m``'s storage, where
#: the members are views of that result (``memory.merged_memory``): ``(VIEWED_RESULT, m)``
VIEWED_RESULT = ("wait",)
#: a collective's variants: alone in its bucket, or a member of a merged one
ALONE, MERGED = 0, 1
#: never: a storage that is not freed
NEVER = None

_ALLOC, _REC, _FREE, _USE = ALLOC, REC, FREE, USE
_ISSUE, _WAIT = AT_ISSUE, AT_WAIT
_MEM, _TRK = MEM, TRK
_WAITB = VIEWED_RESULT
_ALONE, _MERGED = ALONE, MERGED
_NEVER = NEVER


class StorageAnalysis:
    """Where each storage of both memory counts of one problem lives, whatever the schedule
    (module docstring); :class:`solvers.core.peaks.MemoryModel` adds the profile and the bucket
    templates."""

    def __init__(self, p: Problem):
        # cached per problem: hold its parts, never the problem itself (the cache is weak)
        self.colls, self.n = p.colls, p.n
        self.st = static_memory(p)
        self.reason: str | None = None
        #: movable collectives whose merged buckets' members are views of one result
        #: (``memory.merged_memory``): the releases of such a member's storage go to it
        self.viewed = frozenset(m for m, c in p.colls.items() if c.movable and not copied_out(p.colls, (m,)))
        #: (single member, merged) -> :meth:`ops`, read by the analysis and the templates
        self.resolved: dict[tuple[tuple[str, ...], bool], tuple[list, list]] = {}
        try:
            self._build(p)
        except Unsupported as e:
            self.reason = str(e)
        #: members -> the bucket's template (:meth:`solvers.core.peaks.MemoryModel.template`)
        self.templates: dict[tuple[str, ...], Any] = {}

    # -- static analysis ---------------------------------------------------------------------
    def _build(self, p: Problem) -> None:
        st = self.st
        counts = (_MEM, _TRK)
        owners = (st.mem_owner, st.trk_owner)
        # static sites: key -> (alloc node (-1: the inputs), bytes); key -> release nodes; key ->
        # the node that frees it right after its record (a result nothing reads)
        s_alloc: list[dict[Any, tuple[int, int]]] = [{}, {}]
        s_rel: list[dict[Any, list[int]]] = [defaultdict(list), defaultdict(list)]
        s_free: list[dict[Any, int]] = [{}, {}]
        for name, size in st.inputs:
            for c in counts:
                key = owners[c].get(name, name)
                if isinstance(key, tuple):
                    raise Unsupported(f"graph input {name!r} holds several storages")
                if size and key not in s_alloc[c]:
                    s_alloc[c][key] = (-1, size)
        for g, name in enumerate(p.seq):
            for c, ops in enumerate(resolved_node_ops(st, name)):
                for _, code, key, amount in ops:
                    if code == _ALLOC:
                        if key in s_alloc[c]:
                            raise Unsupported(f"storage {key!r} is allocated twice")
                        s_alloc[c][key] = (g, amount)
                    elif code == _USE:
                        s_rel[c][key].append(g)
                    elif code == _FREE:
                        s_free[c][key] = g
        # collective sites, per variant: (coll, variant) -> key -> [(anchor, sub), bytes] / [sites]
        c_alloc: list[dict[tuple[str, int], dict[Any, tuple[tuple[int, int], int]]]] = [{}, {}]
        c_rel: list[dict[tuple[str, int], dict[Any, list[tuple[int, int]]]]] = [{}, {}]
        touching: list[dict[Any, set[str]]] = [defaultdict(set), defaultdict(set)]
        for m, coll in p.colls.items():
            variants = (_ALONE, _MERGED) if coll.movable else (_ALONE,)
            for v in variants:
                ops = self.ops((m,), v == _MERGED)
                for c in counts:
                    alloc: dict[Any, tuple[tuple[int, int], int]] = {}
                    rel: dict[Any, list[tuple[int, int]]] = defaultdict(list)
                    for anchor, sub, code, key, amount, member in ops[c]:
                        if member is None:
                            continue  # the bucket's own storages: built with its template
                        if code == _ALLOC:
                            if key in alloc:
                                raise Unsupported(f"storage {key!r} is allocated twice by {m!r}")
                            alloc[key] = ((anchor, sub), amount)
                            touching[c][key].add(m)
                        elif code == _USE:
                            rel[key].append((anchor, sub))
                            touching[c][key].add(m)
                        elif code == _FREE:
                            raise Unsupported(f"collective {m!r} frees a storage of its own directly")
                        elif code != _REC:
                            raise Unsupported(f"collective {m!r} makes a micro-operation the evaluator does not "
                                               f"know ({code!r})")
                    c_alloc[c][(m, v)] = alloc
                    c_rel[c][(m, v)] = dict(rel)
        # in a bucket a collective releases what it releases alone, as often: every storage that
        # may be live there (made by a node, by another collective, by it in a bucket; its own
        # storage, under the bucket's result where the members are views of it)
        for c in counts:
            made_by: dict[Any, set[str]] = defaultdict(set)
            for (m, _v), alloc in c_alloc[c].items():
                for key in alloc:
                    made_by[key].add(m)
            for m, coll in p.colls.items():
                if not coll.movable:
                    continue
                merged = {(k[1] if isinstance(k, tuple) else k): len(v) for k, v in c_rel[c][(m, _MERGED)].items()}
                alone = {k: len(v) for k, v in c_rel[c][(m, _ALONE)].items()}
                live = [k for k in set(alone) | set(merged)
                        if k in s_alloc[c] or made_by[k] - {m} or k in c_alloc[c][(m, _MERGED)] or k == m]
                if any(alone.get(k, 0) != merged.get(k, 0) for k in live):
                    raise Unsupported(f"collective {m!r} releases other uses alone than in a bucket")
        # the releases of every storage must be its uses in the simulator's static data
        for c, uses in ((_MEM, st.mem_uses), (_TRK, st.trk_uses)):
            made: dict[Any, int] = defaultdict(int)
            for key, gs in s_rel[c].items():
                made[key] += len(gs)
            for (m, v), rel in c_rel[c].items():
                if v != _ALONE:
                    continue
                for key, sites in rel.items():
                    made[key] += len(sites)
            diff = [k for k in set(made) | {k for k, u in uses.items() if u} if made.get(k, 0) != uses.get(k, 0)]
            if diff:
                raise Unsupported(f"the releases of {sorted(map(str, diff))[:3]} differ from the simulator's uses "
                                   "(its rules changed: the evaluator follows the static data only)")
        self._classify(s_alloc, s_rel, s_free, c_alloc, c_rel, touching)

    def ops(self, members: tuple[str, ...], merged: bool) -> tuple[list, list]:
        """The simulator's micro-operations of a bucket (:meth:`StaticMemory.bucket_ops`), per count
        as ``(anchor, sub, code, key, amount, member)``: releases resolved to the storages they
        use (several for a node holding several results), a member's storage under the bucket's
        result ``(_WAITB, member)`` where merged members are views of it."""
        if len(members) > 1:  # a bucket's: read once, for its template
            return self._resolve(members, merged)
        out = self.resolved.get((members, merged))
        if out is None:
            out = self.resolved[(members, merged)] = self._resolve(members, merged)
        return out

    def _resolve(self, members: tuple[str, ...], merged: bool) -> tuple[list, list]:
        st = self.st
        viewed = merged and members[0] in self.viewed
        out: tuple[list, list] = ([], [])
        for c, (owner, count_ops) in enumerate(zip((st.mem_owner, st.trk_owner), st.bucket_ops(members, merged))):
            ops = out[c]
            for anchor, step_ops in enumerate(count_ops):
                for sub, code, key, amount, member in step_ops:
                    if code == REL:
                        o = owner.get(key, key)
                        if viewed and o in members:
                            ops.append((anchor, sub, _USE, (_WAITB, o), 0, member))
                        else:
                            ops.extend((anchor, sub, _USE, k, 0, member) for k in each_storage(o))
                    elif code == DROP:
                        ops.append((anchor, sub, _USE, key, 0, member))
                    else:
                        ops.append((anchor, sub, code, key, amount, member))
        return out

    def _classify(self, s_alloc, s_rel, s_free, c_alloc, c_rel, touching) -> None:
        """Each storage of each count: static (into the profile), or one collective's (into its
        contributions per variant), or a reason the evaluator cannot place it."""
        st, n = self.st, self.n
        # profile changes: at node g, before its record (alloc) and after it (free); -1: inputs
        self.prof_alloc = [[0] * (n + 1) for _ in range(2)]  # index g + 1
        self.prof_free = [[0] * n for _ in range(2)]
        # (coll, variant, count) -> contributions
        self.contrib: dict[tuple[str, int, int], Contribution] = {}
        #: storages freed by whichever of several steps and a compute node runs last:
        #: (count, bytes, last compute reader or None, ((collective, last release point per
        #: variant or None), ...))
        self.floating: list[tuple[int, int, int | None, tuple]] = []
        #: (count, member) -> how the releases of a member's storage free its merged bucket's
        #: result: (release nodes, release points in a bucket, never freed, uses)
        self.wait_info: dict[tuple[int, str], tuple[list[int], list[tuple[int, int]], bool, int]] = {}
        #: (count, member) -> how a result that other collectives read is freed
        #: (:meth:`_chained_view`): None: never
        self.view_frees: dict[tuple[int, str], tuple | None] = {}
        for c, never_free, uses in ((_MEM, st.mem_never_free, st.mem_uses), (_TRK, st.trk_never_free, st.trk_uses)):
            keys = set(s_alloc[c]) | set(s_rel[c]) | set(touching[c]) | set(s_free[c])
            for key in keys:
                if isinstance(key, tuple):  # a member's storage under its merged bucket's result
                    continue
                touch = touching[c].get(key, set())
                if key in s_free[c]:  # made and dropped by one node: nothing else may touch it
                    g = s_free[c][key]
                    if touch or s_rel[c].get(key) or s_alloc[c].get(key, (None,))[0] != g:
                        raise Unsupported(f"storage {key!r} is freed at node {g} by another rule than its uses")
                    self._profile(c, g, s_alloc[c][key][1], g)
                    continue
                if key in self.viewed and touch - {key}:
                    never = key in never_free or not uses.get(key, 0)
                    self._chained_view(c, key, never, s_rel[c].get(key, []), touch - {key}, c_alloc[c], c_rel[c])
                    continue
                never = key in never_free or not uses.get(key, 0)
                self._classify_key(c, key, never, s_alloc[c].get(key), s_rel[c].get(key, []), touch, c_alloc[c],
                                   c_rel[c])
            for m in self.viewed:
                self.wait_info[(c, m)] = (list(s_rel[c].get(m, [])), list(c_rel[c][(m, _MERGED)].get((_WAITB, m), [])),
                                          m in never_free, uses.get(m, 0))

    def _classify_key(self, c: int, key: Any, never: bool, s_alloc, s_rel: list[int], touch: set[str],
                      c_alloc, c_rel) -> None:
        colls = self.colls
        by_collective = any(c_alloc.get((m, v), {}).get(key) for m in touch for v in (_ALONE, _MERGED))
        if s_alloc is None and not by_collective:
            return  # never allocated (no bytes): its releases change nothing
        if s_alloc is not None and by_collective:
            raise Unsupported(f"storage {key!r} is allocated by a node and by a collective")
        if not touch:
            a, size = s_alloc
            self._profile(c, a, size, _NEVER if never or not s_rel or max(s_rel) < a else max(s_rel))
            return
        if len(touch) > 1:
            # read by several collectives: static when a compute node frees it after all of them,
            # else freed by whichever runs last, placed per schedule read
            if s_alloc is not None and (never or (s_rel and all(max(s_rel) >= colls[m].needed for m in touch))):
                a, size = s_alloc
                self._profile(c, a, size, _NEVER if never else max(s_rel))
                return
            if s_alloc is None:
                return self._made_by_one(c, key, never, s_rel, touch, c_alloc, c_rel)
            return self._floating(c, key, s_alloc, s_rel, touch, c_rel)
        (m,) = touch
        coll = colls[m]
        lo, hi = coll.ready, coll.needed
        variants = (_ALONE, _MERGED) if coll.movable else (_ALONE,)
        resolved = {}
        for v in variants:
            ca = c_alloc[(m, v)].get(key)
            sites = c_rel[(m, v)].get(key, [])
            # the last release: a node after every step of the collective, or one of its steps
            if never or (not s_rel and not sites):
                last = _NEVER
            elif s_rel and sites:
                q = max(s_rel)
                if q >= hi:
                    last = ("node", q)
                elif q < lo:
                    last = ("site", max(sites))
                elif s_alloc is None:  # a compute node inside the issue range: whichever runs later
                    return self._made_by_one(c, key, never, s_rel, touch, c_alloc, c_rel)
                else:
                    return self._floating(c, key, s_alloc, s_rel, touch, c_rel)
            elif s_rel:
                last = ("node", max(s_rel))
            else:
                last = ("site", max(sites))
            if ca is None and s_alloc is None:
                resolved[v] = None
                continue
            # a release before the allocation frees nothing: the storage then lives on
            if last is not _NEVER:
                if s_alloc is not None:
                    a = s_alloc[0]
                    if last[0] == "node":
                        last = last if last[1] >= a else _NEVER
                    elif a >= hi:
                        last = _NEVER
                    elif a >= lo:
                        raise Unsupported(f"storage {key!r}: allocated at node {a} inside {m!r}'s issue range")
                else:
                    site = ca[0]
                    if last[0] == "site":
                        last = last if last[1] > site else _NEVER
                    elif last[1] < lo:
                        last = _NEVER
                    elif last[1] < hi:
                        raise Unsupported(f"storage {key!r}: freed at node {last[1]} inside {m!r}'s issue range")
            resolved[v] = (ca, last)
        if s_alloc is not None:
            a, size = s_alloc
            lasts = {r[1] for r in resolved.values() if r is not None}
            if all(r is not None and r[1] is not _NEVER and r[1][0] == "node" for r in resolved.values()) \
                    and len(lasts) == 1:
                self._profile(c, a, size, next(iter(lasts))[1])
                return
            self._profile(c, a, size, _NEVER)
            for v, r in resolved.items():
                if r is not None and r[1] is not _NEVER:
                    self._dynamic_free(c, m, v, r[1], size)
            return
        # allocated by the collective: fold a free at a fixed node into the profile when every
        # variant allocates it with the same bytes
        allocs = {r[0][1] if r is not None else None for r in resolved.values()}
        lasts = {r[1] for r in resolved.values() if r is not None}
        fold = (None not in allocs and len(allocs) == 1 and len(lasts) == 1
                and next(iter(lasts)) is not _NEVER and next(iter(lasts))[0] == "node")
        if fold:
            self.prof_free[c][next(iter(lasts))[1]] += next(iter(allocs))
        for v, r in resolved.items():
            if r is None:
                continue
            (site, size), last = r
            self._contrib(m, v, c).add(site, size)
            if last is not _NEVER and not fold:
                self._dynamic_free(c, m, v, last, size)

    def _profile(self, c: int, a: int, size: int, free: int | None) -> None:
        self.prof_alloc[c][a + 1] += size
        if free is not _NEVER:
            self.prof_free[c][free] += size

    def _dynamic_free(self, c: int, m: str, v: int, last, size: int) -> None:
        if last[0] == "node":
            self._contrib(m, v, c).node.append((last[1], -size))
        else:
            self._contrib(m, v, c).add(last[1], -size)

    def _floating(self, c: int, key: Any, s_alloc, s_rel: list[int], touch: set[str], c_rel) -> None:
        """A storage made by a compute node before every step of the collectives that use it,
        freed by whichever of its last compute reader and their steps runs last: live in the
        profile from its node on, its free placed per schedule read (:func:`_place_floating`)."""
        a, size = s_alloc
        if any(a >= self.colls[m].ready for m in touch):
            raise Unsupported(f"storage {key!r}: made inside the issue range of a collective that uses it")
        self._profile(c, a, size, _NEVER)
        self.floating.append((c, size, max(s_rel) if s_rel else None, self._release_points(key, touch, c_rel)))

    def _made_by_one(self, c: int, key: Any, never: bool, s_rel: list[int], touch: set[str], c_alloc,
                     c_rel) -> None:
        """A storage made at one collective's step (its result) and read by other collectives
        (which read it after that step: the graph's data flow, which a valid schedule keeps):
        allocated in that collective's template, freed by whichever of its readers runs last."""
        makers = {m for m in touch for v in (_ALONE, _MERGED) if c_alloc.get((m, v), {}).get(key)}
        if len(makers) != 1:
            raise Unsupported(f"storage {key!r} is made by several collectives {sorted(makers)[:3]}")
        (maker,) = makers
        sizes = set()
        for v in ((_ALONE, _MERGED) if self.colls[maker].movable else (_ALONE,)):
            made = c_alloc[(maker, v)].get(key)
            if made is not None:
                self._contrib(maker, v, c).add(*made)
                sizes.add(made[1])
        if never:
            return
        if len(sizes) != 1:
            raise Unsupported(f"storage {key!r} is made with other bytes alone than in a bucket")
        self.floating.append((c, sizes.pop(), max(s_rel) if s_rel else None, self._release_points(key, touch, c_rel)))

    def _chained_view(self, c: int, m: str, never: bool, s_rel: list[int], readers: set[str], c_alloc,
                      c_rel) -> None:
        """The result of ``m``, read by other collectives (HSDP: a reduce-scatter's result,
        all-reduced), where a merged bucket's members are views of one result: alone, made at
        ``m``'s wait; merged, the bucket's result (its template's). Either is freed by whichever
        of its readers (compute nodes, the collectives' steps) runs last: a floating free of
        the bucket's template (:meth:`_template`)."""
        made = c_alloc[(m, _ALONE)].get(m)
        if made is None or c_alloc[(m, _MERGED)].get(m):
            raise Unsupported(f"the result of {m!r} is read by other collectives and not made at its wait")
        self._contrib(m, _ALONE, c).add(*made)
        if never:
            self.view_frees[(c, m)] = None
            return
        own = c_rel[(m, _ALONE)].get(m)
        self.view_frees[(c, m)] = (made[1], max(s_rel) if s_rel else None, self._release_points(m, readers, c_rel),
                                   max(own) if own else None)

    def view_floating(self, c: int, members: tuple[str, ...], result: tuple[int, int, int] | None) -> list:
        """The floating free of a bucket whose members' results other collectives read
        (:meth:`_chained_view`): alone, the member's; merged (``result``: the bucket's wait
        allocation), the bucket's result, after the last release of any member's."""
        frees = [self.view_frees[(c, m)] for m in members if (c, m) in self.view_frees]
        if any(f is None for f in frees):
            return []  # never freed
        if result is None:
            ((size, q, readers, own),) = frees
            return [(c, size, q, readers + (((members[0], (own, None)),) if own is not None else ()))]
        qs = [f[1] for f in frees if f[1] is not None]
        sites = tuple(site for f in frees for site in f[2])
        own = []
        for m in members:
            rels, points, never, _ = self.wait_info.get((c, m), ([], [], False, 0))
            if never:
                return []
            qs += rels
            own += points
        if own:
            sites += ((members[0], (None, max(own))),)
        return [(c, result[2], max(qs) if qs else None, sites)]

    def _release_points(self, key: Any, touch: set[str], c_rel) -> tuple:
        """((collective, its last release of ``key`` alone, in a bucket (movable only)), ...)."""
        out = []
        for m in sorted(touch):
            variants = (_ALONE, _MERGED) if self.colls[m].movable else (_ALONE,)
            out.append((m, tuple(max(c_rel[(m, v)][key]) if c_rel[(m, v)].get(key) else None for v in variants)))
        return tuple(out)

    def _contrib(self, m: str, v: int, c: int) -> "Contribution":
        k = (m, v, c)
        if k not in self.contrib:
            self.contrib[k] = Contribution()
        return self.contrib[k]


class Contribution:
    """One collective's share of its bucket's template in one count and variant: bytes changed
    at points of the issue and wait steps, and after fixed compute nodes."""

    __slots__ = ("at", "node")

    def __init__(self) -> None:
        self.at: tuple[dict[int, int], dict[int, int]] = (defaultdict(int), defaultdict(int))
        self.node: list[tuple[int, int]] = []

    def add(self, site: tuple[int, int], size: int) -> None:
        self.at[site[0]][site[1]] += size


class Unsupported(Exception):
    """The evaluator cannot place a storage exactly; the simulator judges every schedule."""


def resolved_node_ops(st: StaticMemory, name: str) -> tuple[list, list]:
    """:meth:`StaticMemory.node_ops` per count as ``(sub, code, key, amount)``, each release of
    an input resolved to the storages it uses (:data:`_USE`)."""
    out: tuple[list, list] = ([], [])
    for c, (owner, ops) in enumerate(zip((st.mem_owner, st.trk_owner), st.node_ops(name))):
        for sub, code, key, amount, _ in ops:
            if code == REL:
                out[c].extend((sub, _USE, k, 0) for k in each_storage(owner.get(key, key)))
            else:
                out[c].append((sub, code, key, amount))
    return out
