"""Check, fast: the step time and both peak-memory counts of a schedule, equal to the simulator's.

:func:`solvers.core.simulator.simulate` walks every node of the graph in Python; a search that
judges thousands of neighbours, each under several cost models, spends most of its time there.
An :class:`Evaluator` is built per problem (its analysis is cached per problem) and gives the
same numbers from work that grows with the number of buckets, not of nodes:

- Compute positions are fixed: a schedule only places issue and wait steps into the gaps
  between compute nodes (:mod:`solvers.core.schedule`). The timeline walks the issue and wait
  steps in order and adds the compute runtimes between them as the simulator does, one by one
  in the same order (``functools.reduce`` in C), so ``step_ms``, ``exposed_comm_ms`` and
  ``comm_ms`` are the simulator's floats bit for bit.
- Memory is split in two. Every storage of each count (the execution model's and torch's
  ``MemoryTracker`` rules, module docstring of :mod:`solvers.core.simulator`) is allocated at
  one step and freed at the last release of its uses. A storage whose allocation and last
  release both happen at compute nodes whatever the schedule is *static*: together they make a
  fixed live-bytes profile over the compute steps, with a sparse table for range maxima. Every
  other storage (a collective's inputs held until its wait, its result, the wait's result,
  prologue and epilogue casts, bucket buffers, the tracker's own storages) changes the live
  bytes only at its bucket's issue or wait steps (or after a fixed node that depends on the
  bucketing): each bucket gets, per step, the net change and the highest point inside the step
  (a template, cached by the bucket's members). A storage freed by whichever of several
  collectives' steps and a compute node runs last (one read by two collectives, or by a compute
  node inside its collective's window) has its free placed per schedule (a *floating* free).
  The peak is a sweep over the issue and wait steps with a range maximum of the static profile
  between them.

One source of the rules. The storages, their owners, their uses and those never freed are the
simulator's own static analysis (``memory.static_memory``: ``mem_owner`` / ``trk_owner``,
``mem_uses`` / ``trk_uses``, ``*_never_free``, ``preds``, ``inputs``), and so is what each step
does with them: a compute node's storages (``steps``: the results it allocates by each count, those
nothing reads, which the execution model's count drops at once) and a bucket's issue and wait as
the micro-operations the simulator itself runs (``StaticMemory.bucket_ops``: allocations, records,
releases, frees). Where a merged bucket's members are views of one result (a reduce-scatter, an
all-gather on one rank: ``memory.copied_out``), the releases of a member's storage go to
that result, as ``memory.merged_memory`` makes them. A change of those rules reaches
both at once; what keeps it from making the evaluator silently wrong is a guard at build time
(the releases the operations make of every storage are exactly its uses in the static data, and a
collective releases alone what it releases in a bucket) and the tests
(``tests/test_evaluate.py``: the evaluator's numbers against the simulator's on every graph and
schedule kind, the traced and a merged schedule of each among them). Where the guard fails, where an operation is one the templates do not know, or where a storage cannot be placed
(one made by several collectives, by a node and a collective, made inside the window of a
collective that frees it, or the result of a merged bucket whose members are views of it read by
another collective), the evaluator does not guess: :attr:`Evaluator.fast` is False and every
evaluation is :func:`simulate`'s (the reason is logged and kept in :attr:`Evaluator.reason`).

Assumption: the schedule is valid (:func:`~solvers.core.validator.validate_schedule` accepts
it) and its compute nodes run in ``problem.seq`` order, as every schedule builder here makes
them. All of that but the order of the compute nodes is checked on every call, cheaply: each
collective in one bucket, every bucket issued once and waited once after its issue, a merged
bucket of one kind of movable collectives, each bucket issued and waited inside its window
``[max ready, min needed]``, a collective that reads another's result issued after that one's
wait (:attr:`Problem.issue_after`). A schedule that fails is simulated instead, so the numbers
stay the simulator's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule, Step, order_gap
from solvers.core.memory import (ALLOC, DROP, FREE, REC, REL, WAIT, StaticMemory, copied_out, each_storage,
                                 static_memory)
from solvers.core.simulator import ScheduleInvalidError, SimResult, simulate
from solvers.core.streams import Streams, stream_of

logger = logging.getLogger(__name__)

# the micro-operations (``memory.ALLOC`` ...) as the evaluator reads them: a
# release by node name (REL) and by storage (DROP) both become _USE, one use of a storage
_ALLOC, _REC, _FREE, _USE = ALLOC, REC, FREE, max(ALLOC, REC, REL, DROP, FREE) + 1
_ISSUE, _WAIT = 0, 1
_MEM, _TRK = 0, 1
#: the storage a merged bucket's result becomes for the releases of member ``m``'s storage, where
#: the members are views of that result (``memory.merged_memory``): ``(_WAITB, m)``
_WAITB = ("wait",)
_ALONE, _MERGED = 0, 1
#: never: a storage that is not freed
_NEVER = None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What a search reads of one schedule under one cost model; each field means what the
    same field of :class:`~solvers.core.simulator.SimResult` means, with the same value
    (``compute_ms`` within float rounding: it is summed in another order)."""

    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    comm_ms: dict[str, float]
    peak_bytes: int
    tracker_peak_bytes: int
    n_collectives: int

    @property
    def max_peak_bytes(self) -> int:
        """The larger of the two counts: what a budget must hold on the written graph."""
        return max(self.peak_bytes, self.tracker_peak_bytes)

    @staticmethod
    def of(sim: SimResult) -> "Evaluation":
        return Evaluation(step_ms=sim.step_ms, compute_ms=sim.compute_ms, exposed_comm_ms=sim.exposed_comm_ms,
                          comm_ms=dict(sim.comm_ms), peak_bytes=sim.peak_bytes,
                          tracker_peak_bytes=sim.tracker_peak_bytes, n_collectives=sim.n_collectives)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule as the evaluator reads it: each bucket's members and the issue and wait
    steps in execution order, ``(is_issue, bucket index, gap)``. ``schedule`` is the schedule
    it was read from (None when built from entries, :meth:`Evaluator.plan_entries`); ``fast``
    False when the cheap validity checks failed and the simulator must judge it."""

    members: tuple[tuple[str, ...], ...]
    steps: tuple[tuple[bool, int, int], ...]
    fast: bool
    schedule: Schedule | None = None
    entries: tuple | None = None
    #: each bucket's template in the memory model that checked the plan
    templates: tuple = dataclasses.field(default=(), repr=False, compare=False)
    model: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: :attr:`Schedule.split_groups` of the schedule
    split_groups: tuple[str, ...] = ()

    def to_schedule(self, problem: Problem) -> Schedule:
        """The schedule itself (built from the entries when it was not given)."""
        if self.schedule is not None:
            return self.schedule
        n = problem.n
        order: list[list] = [[] for _ in range(n + 1)]
        for is_issue, b, gap in self.steps:
            order[gap].append(("issue" if is_issue else "wait", b))
        steps: list[Step] = []
        for g in range(n + 1):
            steps.extend(Step(k, b) for k, b in order[g])
            if g < n:
                steps.append(Step("node", problem.seq[g]))
        return Schedule(tuple(Bucket(m) for m in self.members), tuple(steps), self.split_groups)


@dataclasses.dataclass(frozen=True)
class _Template:
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
    #: effect with a free placed in it per plan (:func:`_place_floating`)
    raw: tuple = ()
    #: frees of this bucket's results that other collectives read, placed per plan as
    #: :attr:`_MemoryModel.floating` entries are (:meth:`_MemoryModel._chained_view`)
    floating: tuple = ()


class _MemoryModel:
    """Both memory counts of one problem: the static profile and the bucket templates."""

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
        except _Unsupported as e:
            self.reason = str(e)
        self.templates: dict[tuple[str, ...], _Template] = {}

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
                    raise _Unsupported(f"graph input {name!r} holds several storages")
                if size and key not in s_alloc[c]:
                    s_alloc[c][key] = (-1, size)
        for g, name in enumerate(p.seq):
            for c, ops in enumerate(_node_ops(st, name)):
                for _, code, key, amount in ops:
                    if code == _ALLOC:
                        if key in s_alloc[c]:
                            raise _Unsupported(f"storage {key!r} is allocated twice")
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
                                raise _Unsupported(f"storage {key!r} is allocated twice by {m!r}")
                            alloc[key] = ((anchor, sub), amount)
                            touching[c][key].add(m)
                        elif code == _USE:
                            rel[key].append((anchor, sub))
                            touching[c][key].add(m)
                        elif code == _FREE:
                            raise _Unsupported(f"collective {m!r} frees a storage of its own directly")
                        elif code != _REC:
                            raise _Unsupported(f"collective {m!r} makes a micro-operation the evaluator does not "
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
                    raise _Unsupported(f"collective {m!r} releases other uses alone than in a bucket")
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
                raise _Unsupported(f"the releases of {sorted(map(str, diff))[:3]} differ from the simulator's uses "
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
        self.contrib: dict[tuple[str, int, int], _Contrib] = {}
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
                        raise _Unsupported(f"storage {key!r} is freed at node {g} by another rule than its uses")
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
            raise _Unsupported(f"storage {key!r} is allocated by a node and by a collective")
        if not touch:
            a, size = s_alloc
            self._profile(c, a, size, _NEVER if never or not s_rel or max(s_rel) < a else max(s_rel))
            return
        if len(touch) > 1:
            # read by several collectives: static when a compute node frees it after all of them,
            # else freed by whichever runs last, placed per plan
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
                elif s_alloc is None:  # a compute node inside the window: whichever runs later
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
                        raise _Unsupported(f"storage {key!r}: allocated at node {a} inside {m!r}'s window")
                else:
                    site = ca[0]
                    if last[0] == "site":
                        last = last if last[1] > site else _NEVER
                    elif last[1] < lo:
                        last = _NEVER
                    elif last[1] < hi:
                        raise _Unsupported(f"storage {key!r}: freed at node {last[1]} inside {m!r}'s window")
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
        profile from its node on, its free placed per plan (:func:`_place_floating`)."""
        a, size = s_alloc
        if any(a >= self.colls[m].ready for m in touch):
            raise _Unsupported(f"storage {key!r}: made inside the window of a collective that uses it")
        self._profile(c, a, size, _NEVER)
        self.floating.append((c, size, max(s_rel) if s_rel else None, self._release_points(key, touch, c_rel)))

    def _made_by_one(self, c: int, key: Any, never: bool, s_rel: list[int], touch: set[str], c_alloc,
                     c_rel) -> None:
        """A storage made at one collective's step (its result) and read by other collectives
        (which read it after that step: the graph's data flow, which a valid schedule keeps):
        allocated in that collective's template, freed by whichever of its readers runs last."""
        makers = {m for m in touch for v in (_ALONE, _MERGED) if c_alloc.get((m, v), {}).get(key)}
        if len(makers) != 1:
            raise _Unsupported(f"storage {key!r} is made by several collectives {sorted(makers)[:3]}")
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
            raise _Unsupported(f"storage {key!r} is made with other bytes alone than in a bucket")
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
            raise _Unsupported(f"the result of {m!r} is read by other collectives and not made at its wait")
        self._contrib(m, _ALONE, c).add(*made)
        if never:
            self.view_frees[(c, m)] = None
            return
        own = c_rel[(m, _ALONE)].get(m)
        self.view_frees[(c, m)] = (made[1], max(s_rel) if s_rel else None, self._release_points(m, readers, c_rel),
                                   max(own) if own else None)

    def _view_floating(self, c: int, members: tuple[str, ...], result: tuple[int, int, int] | None) -> list:
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

    def _contrib(self, m: str, v: int, c: int) -> "_Contrib":
        k = (m, v, c)
        if k not in self.contrib:
            self.contrib[k] = _Contrib()
        return self.contrib[k]

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

    def template(self, members: tuple[str, ...]) -> _Template:
        t = self.templates.get(members)
        if t is None:
            t = self.templates[members] = self._template(members)
        return t

    def _template(self, members: tuple[str, ...]) -> _Template:
        colls = self.colls
        lo = max(colls[m].ready for m in members)
        hi = min(colls[m].needed for m in members)
        merged = len(members) > 1
        if merged and (len({colls[m].key for m in members}) > 1 or not all(colls[m].movable for m in members)):
            return _Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
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
                        return _Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
                    allocs[key] = (anchor, sub, amount)
                    deltas[anchor][sub] += amount
                elif member is None and code == _FREE:
                    if key in allocs:  # one of 0 bytes, or one never made, is never live
                        deltas[anchor][sub] -= allocs.pop(key)[2]
                elif member is None:  # a rule the templates do not know: the simulator judges
                    return _Template((0, 0, 0, 0), (0, 0, 0, 0), (), lo, hi, False)
            if any((c, m) in self.view_frees for m in members):
                # results that other collectives read: freed when the last reader runs, per plan
                floating += self._view_floating(c, members, allocs.get(WAIT) if merged else None)
            elif merged and members[0] in self.viewed and WAIT in allocs:
                # the result whose views the members are: freed after the last release of any
                # member's storage
                self._merged_wait_free(c, members, allocs[WAIT], deltas, node)
            per_count.append([_step_effect(deltas[a], recs[a]) for a in (_ISSUE, _WAIT)])
            raw.append(tuple((dict(deltas[a]), tuple(recs[a])) for a in (_ISSUE, _WAIT)))
        issue = (*per_count[_MEM][_ISSUE], *per_count[_TRK][_ISSUE])
        wait = (*per_count[_MEM][_WAIT], *per_count[_TRK][_WAIT])
        events = tuple(sorted((g, d[0], d[1]) for g, d in node.items() if d[0] or d[1]))
        return _Template(issue, wait, events, lo, hi, True, tuple(raw), tuple(floating))

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

    def peaks(self, plan: Plan, templates: Sequence[_Template]) -> tuple[int, int]:
        """(peak_bytes, tracker_peak_bytes) of a plan whose checks passed."""
        events = [e for t in templates if t.node for e in t.node]
        issue = [t.issue for t in templates]
        wait = [t.wait for t in templates]
        floating = self.floating
        if self.view_frees:
            floating = floating + [e for t in templates if t.floating for e in t.floating]
        if floating:
            _place_floating(floating, plan, templates, issue, wait, events)
        if events:
            events.sort()
        return self._sweep(plan, issue, wait, events)

    def _sweep(self, plan: Plan, issue: list, wait: list, events: list) -> tuple[int, int]:
        """The peaks: the issue and wait steps in order, each bucket's step effects, the
        static profile's range maxima between them, the changes after fixed nodes."""
        rec_m, rec_t = self.rec
        gap_m, gap_t = self.gap
        tab_m, tab_t = self.table
        peak_m, peak_t = self.init
        dm = dt = 0
        g_next = 0
        ei, ne = 0, len(events)
        for is_issue, b, gap in plan.steps:
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


class _Contrib:
    """One collective's share of its bucket's template in one count and variant: bytes changed
    at points of the issue and wait steps, and after fixed compute nodes."""

    __slots__ = ("at", "node")

    def __init__(self) -> None:
        self.at: tuple[dict[int, int], dict[int, int]] = (defaultdict(int), defaultdict(int))
        self.node: list[tuple[int, int]] = []

    def add(self, site: tuple[int, int], size: int) -> None:
        self.at[site[0]][site[1]] += size


class _Unsupported(Exception):
    """The evaluator cannot place a storage exactly; the simulator judges every schedule."""


def _place_floating(floating: Sequence[tuple], plan: Plan, templates: Sequence[_Template], issue: list,
                   wait: list, events: list) -> None:
    """Each floating free (:meth:`_MemoryModel._floating`) where it happens in this plan: after
    its last compute reader when that runs after every step that releases it (a step in a gap
    up to the node runs before it), else at its point in the last such step, whose effect is
    then redone."""
    bucket_of = {m: b for b, members in enumerate(plan.members) for m in members}
    at: dict[tuple[int, int], tuple[int, int]] = {}  # (bucket, anchor) -> (gap, index of the step)
    for k, (is_issue, b, gap) in enumerate(plan.steps):
        at[(b, _ISSUE if is_issue else _WAIT)] = (gap, k)
    extra: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (b, anchor) -> frees
    for c, size, q, sites in floating:
        last = (q, 1, 0, 0, None) if q is not None else None
        for m, by_variant in sites:
            b = bucket_of[m]
            site = by_variant[-1 if len(plan.members[b]) > 1 else 0]
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


def _node_ops(st: StaticMemory, name: str) -> tuple[list, list]:
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


# -- the timeline ----------------------------------------------------------------------------
class _Timeline:
    """The compute stream and the communication streams of one problem (its runtimes)."""

    def __init__(self, p: Problem):
        self.p = p
        self.compute_ms = p.compute_ms
        cached = _TIMES.get(p)
        if cached is None:
            cached = _TIMES[p] = (functools.reduce(operator.add, self.compute_ms, 0.0), {})
        #: members -> (copy-in ms, copy-out ms, communication ms, group), shared by the problem's evaluators
        self.total_compute_ms, self.costs = cached

    def cost(self, members: tuple[str, ...]) -> tuple[float, float, float, str]:
        c = self.costs.get(members)
        if c is None:
            p = self.p
            c = self.costs[members] = (p.copy_in_ms(members), p.copy_out_ms(members), p.bucket_comm_ms(members),
                                       p.colls[members[0]].group_name)
        return c

    def run(self, plan: Plan) -> tuple[float, float, float, dict[str, float]]:
        """(step_ms, compute_ms, exposed_comm_ms, comm_ms per stream), in the simulator's float
        operations and order."""
        if plan.split_groups or self.p.shares_links:
            return self._run_shared(plan)
        rts = self.compute_ms
        add = operator.add
        reduce = functools.reduce
        get = self.costs.get
        costs = [get(m) or self.cost(m) for m in plan.members]
        t = 0.0
        exposed = 0.0
        extra = 0.0
        g_prev = 0
        stream_free: dict[str, float] = {}
        comm: dict[str, float] = {}
        end = [0.0] * len(costs)
        for is_issue, b, gap in plan.steps:
            if gap != g_prev:
                if gap == g_prev + 1:
                    t += rts[g_prev]
                else:
                    t = reduce(add, rts[g_prev:gap], t)
                g_prev = gap
            if is_issue:
                cin, _, dur, group = costs[b]
                t += cin
                extra += cin
                free = stream_free.get(group, 0.0)
                e = (t if t >= free else free) + dur
                stream_free[group] = e
                comm[group] = comm.get(group, 0.0) + dur
                end[b] = e
            else:
                e = end[b]
                if e > t:
                    exposed += e - t
                    t = e
                cout = costs[b][1]
                t += cout
                extra += cout
        if g_prev < len(rts):
            t = reduce(add, rts[g_prev:], t)
        return t, self.total_compute_ms + extra, exposed, comm

    def _run_shared(self, plan: Plan) -> tuple[float, float, float, dict[str, float]]:
        """:meth:`run` where streams share a link (:class:`solvers.core.streams.Streams`): the
        same walk, each end asked of the link model; :meth:`run` keeps its own inline FIFO
        arithmetic because it prices almost every plan a search makes."""
        rts = self.compute_ms
        p = self.p
        split = frozenset(plan.split_groups)
        streams = Streams(p.stream_links(plan.split_groups))
        costs = [self.costs.get(m) or self.cost(m) for m in plan.members]
        kinds = [p.colls[m[0]].coll_type for m in plan.members]
        t = 0.0
        exposed = 0.0
        extra = 0.0
        g_prev = 0
        comm: dict[str, float] = {}
        for is_issue, b, gap in plan.steps:
            if gap != g_prev:
                t = functools.reduce(operator.add, rts[g_prev:gap], t)
                g_prev = gap
            if is_issue:
                cin, _, dur, group = costs[b]
                t += cin
                extra += cin
                stream = stream_of(kinds[b], group, split)
                streams.issue(b, stream, t, dur)
                comm[stream] = comm.get(stream, 0.0) + dur
            else:
                e = streams.end(b)
                if e > t:
                    exposed += e - t
                    t = e
                cout = costs[b][1]
                t += cout
                extra += cout
        if g_prev < len(rts):
            t = functools.reduce(operator.add, rts[g_prev:], t)
        return t, self.total_compute_ms + extra, exposed, comm


# -- the evaluators --------------------------------------------------------------------------
#: per problem (weak: the values hold no reference to it): both memory counts, and the compute
#: total with each bucket's costs
_MEMORY: "weakref.WeakKeyDictionary[Problem, _MemoryModel]" = weakref.WeakKeyDictionary()
_TIMES: "weakref.WeakKeyDictionary[Problem, tuple[float, dict]]" = weakref.WeakKeyDictionary()


#: memory models by everything they read (:func:`_fingerprint`): one graph priced by several
#: cost models shares one
_SHARED: "weakref.WeakValueDictionary[tuple, _MemoryModel]" = weakref.WeakValueDictionary()


def _memory_model(p: Problem) -> _MemoryModel:
    m = _MEMORY.get(p)
    if m is None:
        key = _fingerprint(p)
        m = _SHARED.get(key)
        if m is None:
            m = _MemoryModel(p)
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


class Evaluator:
    """Exact, fast evaluation of schedules of one problem (module docstring). The first one
    built for a problem analyses its memory (cached per problem); later ones are cheap.

    Attributes:
        fast: False when the evaluator cannot place every storage of the graph exactly; then
            every evaluation is the simulator's (``reason`` says why).
        fallbacks: schedules handed to the simulator so far (failed cheap checks or not fast).
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.memory = _memory_model(problem)
        self.timeline = _Timeline(problem)
        self.fallbacks = 0
        self.after = _collective_dependencies(problem)
        self.involved = {m for c, _, d in self.after for m in (c, d)}
        self.fast = self.memory.reason is None
        self.reason = self.memory.reason

    # -- plans ---------------------------------------------------------------------------
    def plan(self, schedule: Schedule) -> Plan:
        """``schedule`` read into a :class:`Plan` (one pass over its steps)."""
        steps = schedule.steps
        idx = [k for k, s in enumerate(steps) if s.kind != "node"]
        ops = tuple((steps[k].kind == "issue", steps[k].ref, k - j) for j, k in enumerate(idx))
        members = tuple(b.members for b in schedule.buckets)
        templates = self._check(members, ops) if len(steps) - len(idx) == self.problem.n else None
        if templates is not None and schedule.split_groups and \
                not set(schedule.split_groups) <= set(self.problem.splittable_groups()):
            templates = None  # the simulator says what is wrong with it
        return Plan(members, ops, templates is not None, schedule=schedule, templates=templates or (),
                    model=self.memory, split_groups=schedule.split_groups)

    def plan_entries(self, entries: Sequence[tuple[Bucket, int, int]], split_groups: tuple[str, ...] = ()) -> Plan:
        """The :class:`Plan` of the schedule :func:`solvers.entries.from_entries` builds from
        ``(bucket, issue gap, wait gap)`` entries, without building it: buckets sorted by
        (issue gap, need, ready, traced issue, members) of their first member; in a gap, the
        waits of buckets issued earlier, then the issues, then the waits of buckets issued
        there, but an issue that reads the result of a bucket waited in its gap after that
        wait (:meth:`Problem.schedule_at`, :meth:`Schedule.from_positions`).

        Raises:
            ValueError: a bucket's gaps are not ``0 <= issue <= wait <= n``.
        """
        colls = self.problem.colls
        n = self.problem.n

        def chain_key(e):
            c = colls[e[0].members[0]]
            return (e[1], c.needed, c.ready, c.traced_issue, e[0].members)

        ordered = sorted(entries, key=chain_key)
        # the buckets whose results each reads (only those that read one)
        after = {b: ds for b, ds in self.problem.bucket_reads([e[0].members for e in ordered]).items() if ds} \
            if self.after else {}
        if after:  # issues after the waits of the results they read, as schedule_at moves them
            ordered = self._clamped(ordered, after)
        keys = []
        for b, (bk, i, w) in enumerate(ordered):
            if not (0 <= i <= w <= n):
                raise ValueError(f"bucket {b}: need 0 <= issue_at ({i}) <= wait_at ({w}) <= {n}")
            keys.append((i, 1, b, True))
            keys.append((w, 0 if i < w else 2, b, False))
        keys.sort()
        if after:
            keys = self._after_waits(keys, after)
        ops = tuple((is_issue, b, gap) for gap, _, b, is_issue in keys)
        members = tuple(e[0].members for e in ordered)
        templates = self._check(members, ops)
        return Plan(members, ops, templates is not None, entries=tuple(ordered), templates=templates or (),
                    model=self.memory, split_groups=split_groups)

    def _clamped(self, ordered: list, after: Mapping[int, set[int]]) -> list:
        """``ordered`` entries with each issue no earlier than the waits of the buckets whose
        results it reads (``after``; :meth:`Problem.after_waits`, as :meth:`Problem.schedule_at`
        does)."""
        issue, wait = self.problem.after_waits([e[0] for e in ordered], after, [e[1] for e in ordered],
                                               [e[2] for e in ordered])
        return [e if (e[1], e[2]) == (i, w) else (e[0], i, w) for e, i, w in zip(ordered, issue, wait)]

    @staticmethod
    def _after_waits(keys: list, after: Mapping[int, set[int]]) -> list:
        """``keys`` (sorted ``(gap, phase, bucket, is_issue)``) with each gap that holds an issue
        reading the result of a bucket waited there (``after``: bucket -> the buckets whose
        results it reads) in :func:`order_gap`'s order, as :meth:`Problem.schedule_at` builds it."""
        out: list = []
        k = 0
        while k < len(keys):
            end = k
            while end < len(keys) and keys[end][0] == keys[k][0]:
                end += 1
            group = keys[k:end]
            if any(is_issue and b in after for _, _, b, is_issue in group):
                phase = {(is_issue, b): ph for _, ph, b, is_issue in group}
                steps = order_gap([("issue" if is_issue else "wait", b) for _, _, b, is_issue in group],
                                  lambda ev: (phase[(ev[0] == "issue", ev[1])], ev[1]), after)
                group = [(keys[k][0], 0, st.ref, st.kind == "issue") for st in steps]
            out.extend(group)
            k = end
        return out

    def _check(self, members: tuple[tuple[str, ...], ...], ops) -> tuple[_Template, ...] | None:
        """The cheap part of validity (module docstring): the buckets' templates, or None when
        the simulator must judge the schedule."""
        if not self.fast:
            return None
        colls = self.problem.colls
        names = set().union(*members) if members else set()
        if sum(map(len, members)) != len(colls) or len(names) != len(colls) or not names <= colls.keys():
            return None
        nb = len(members)
        issued = [-1] * nb
        waited = [-1] * nb
        for is_issue, b, gap in ops:
            if b.__class__ is not int or not 0 <= b < nb:
                return None
            if is_issue:
                if issued[b] >= 0:
                    return None
                issued[b] = gap
            else:
                if issued[b] < 0 or waited[b] >= 0:
                    return None
                waited[b] = gap
        if self.after and not self._ordered(members, ops):
            # it reads a result before it exists: no valid schedule, whatever the simulator's
            # clocks would say of it
            raise ScheduleInvalidError("a collective is issued before the wait of a collective whose result it reads")
        cache = self.memory.templates
        template = self.memory.template
        out = []
        for b, ms in enumerate(members):
            t = cache.get(ms) or template(ms)
            if not t.valid or waited[b] < 0 or issued[b] < t.lo or waited[b] > t.hi:
                return None
            out.append(t)
        return tuple(out)

    def _ordered(self, members: tuple[tuple[str, ...], ...], ops) -> bool:
        """A collective that reads another's result is issued (or waited) after that one's
        wait, in another bucket."""
        involved = self.involved
        bucket = {m: b for b, ms in enumerate(members) for m in ms if m in involved}
        step: dict[tuple[int, int], int] = {}
        for k, (is_issue, b, _) in enumerate(ops):
            step[(b, _ISSUE if is_issue else _WAIT)] = k
        for c, anchor, d in self.after:
            bc, bd = bucket.get(c), bucket.get(d)
            if bc is None or bd is None or bc == bd or step[(bc, anchor)] < step[(bd, _WAIT)]:
                return False
        return True

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, schedule: Schedule | Plan) -> Evaluation:
        """The :class:`Evaluation` of a schedule (or of a :class:`Plan` of it); the same numbers
        as :func:`simulate` for a valid schedule (module docstring).

        Raises:
            ScheduleInvalidError: as :func:`simulate` does (a bucket never waited, or waited
                before it is issued).
        """
        plan = schedule if isinstance(schedule, Plan) else self.plan(schedule)
        peaks = self.peaks(plan)
        if peaks is None:
            return self._simulated(plan)
        return self.timed(plan, peaks)

    def peaks(self, plan: Plan) -> tuple[int, int] | None:
        """(peak_bytes, tracker_peak_bytes) of the plan; None when the simulator must judge it."""
        if not (self.fast and plan.fast):
            return None
        if plan.model is self.memory:
            return self.memory.peaks(plan, plan.templates)
        template = self.memory.template
        return self.memory.peaks(plan, [template(m) for m in plan.members])

    def timed(self, plan: Plan, peaks: tuple[int, int]) -> Evaluation:
        """The evaluation of a plan whose peaks are known (they are the same under every cost
        model of one graph)."""
        step, compute, exposed, comm = self.timeline.run(plan)
        return Evaluation(step_ms=step, compute_ms=compute, exposed_comm_ms=exposed, comm_ms=comm,
                          peak_bytes=peaks[0], tracker_peak_bytes=peaks[1], n_collectives=len(plan.members))

    def _simulated(self, plan: Plan) -> Evaluation:
        self.fallbacks += 1
        p = self.problem
        return Evaluation.of(simulate(p.dag, plan.to_schedule(p), problem=p))


def _collective_dependencies(p: Problem) -> tuple[tuple[str, int, str], ...]:
    """``(c, _ISSUE, d)``: collective ``c``'s issue (its prologue, itself) reads the result of
    collective ``d`` (:attr:`Problem.issue_after`), so runs after ``d``'s wait. The windows do
    not say it (they count compute nodes only)."""
    return tuple((name, _ISSUE, d) for name in p.colls for d in sorted(p.issue_after[name]))


#: the evaluator of each problem (problems are not changed once built)
_EVALUATORS: "weakref.WeakKeyDictionary[Problem, Evaluator]" = weakref.WeakKeyDictionary()


def evaluator_of(problem: Problem) -> "Evaluator":
    """The :class:`Evaluator` of ``problem``, built once."""
    e = _EVALUATORS.get(problem)
    if e is None:
        e = _EVALUATORS[problem] = Evaluator(problem)
    return e


def evaluate(problem: Problem, schedule: Schedule) -> Evaluation:
    """``simulate(problem.dag, schedule, problem=problem)``'s numbers, fast (the problem's
    :class:`Evaluator`, built once)."""
    return evaluator_of(problem).evaluate(schedule)


class ModelEvaluator:
    """One graph priced by several cost models (same nodes, collectives and bytes, other
    runtimes): a schedule is read once, its memory counted once per distinct memory (once,
    when the problems share their bytes), its timeline run per model.

    Raises:
        ValueError: no problem, or problems of different graphs (other compute nodes or
            collectives, or other windows).
    """

    def __init__(self, problems: Mapping[str, Problem]):
        if not problems:
            raise ValueError("ModelEvaluator needs at least one cost model's problem")
        self.labels = list(problems)
        self.evaluators = {label: evaluator_of(p) for label, p in problems.items()}
        first = self.evaluators[self.labels[0]]
        self.first = first
        shape = _shape(first.problem)
        for label, e in self.evaluators.items():
            if _shape(e.problem) != shape:
                raise ValueError(f"problem {label!r} is not the same graph as {self.labels[0]!r}: every model must "
                                 "price the same export")
        # problems with equal memory share one memory model: its peaks are counted once, for the
        # first of them
        self.memory_of: dict[str, str] = {}
        first_of: dict[int, str] = {}
        for label, e in self.evaluators.items():
            self.memory_of[label] = first_of.setdefault(id(e.memory), label) if e.fast else label

    def plan(self, schedule: Schedule) -> Plan:
        return self.first.plan(schedule)

    def plan_entries(self, entries: Sequence[tuple[Bucket, int, int]], split_groups: tuple[str, ...] = ()) -> Plan:
        return self.first.plan_entries(entries, split_groups)

    def evaluate(self, schedule: Schedule | Plan, labels: Sequence[str] | None = None) -> dict[str, Evaluation]:
        """Label -> the :class:`Evaluation` of ``schedule`` under that model (``labels``: only
        those, in that order)."""
        plan = schedule if isinstance(schedule, Plan) else self.plan(schedule)
        evals = self.lazy(plan)
        return {label: evals(label) for label in (labels or self.labels)}

    def lazy(self, plan: Plan):
        """A function label -> the :class:`Evaluation` of ``plan`` under that model, each
        memory count made at most once (for a search that stops at the first model that rules
        a schedule out)."""
        peaks: dict[str, tuple[int, int] | None] = {}

        def one(label: str) -> Evaluation:
            e = self.evaluators[label]
            source = self.memory_of[label]
            if source not in peaks:
                peaks[source] = self.evaluators[source].peaks(plan)
            found = peaks[source]
            return e._simulated(plan) if found is None else e.timed(plan, found)

        return one


def _shape(p: Problem) -> tuple:
    """What makes two problems the same graph for one plan: the compute sequence and the
    collectives with their windows."""
    return (p.seq, tuple((m, c.ready, c.needed, c.movable, c.key, c.traced_issue) for m, c in p.colls.items()))
