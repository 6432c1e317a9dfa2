"""The execution model's memory rules: what every step of a schedule does to live bytes.

One rule set, run by the simulator (:mod:`solvers.core.simulator`) and analysed once per graph by
the fast evaluator (:mod:`solvers.core.evaluate`): a change to what a step allocates or frees is
made here, in :meth:`StaticMemory.node_ops` and :meth:`StaticMemory.bucket_ops`, and both follow.

- A node's output is allocated when it runs and freed after its last reader (views
  share their base's storage); a collective's output is allocated at issue; a collective's
  input stays alive until its wait (until the copy-in when merged: the bucket buffer then
  holds the data until the wait); epilogue casts of a collective's result run at its wait;
  graph inputs named ``primals*`` and graph outputs are never
  freed. Merged buckets follow torch's ``merge_all_gather_bucket`` /
  ``merge_reduce_scatter_bucket``: an all-gather allocates its bucket buffer (the members'
  outputs), copies a ``cat`` of the members' inputs into it (a single-use dtype cast feeding
  a member is folded into that copy and never runs: the cat reads the cast's input) and holds
  the buffer until the wait, where members are copied out one by one; a reduce-scatter's
  ``cat`` of its inputs is its buffer, held until the wait, and the inputs are freed before
  the output is allocated: one storage whose views the members' results are, freed after the
  last reader of any of them.
- A multi-output node's results are storages of their own (``output_bytes``): one that only
  the node's getitems read is freed after them while its siblings live on; a result the op
  writes into an argument is that argument's storage. A storage nothing reads is freed right
  after the node that made it (FX's generated code drops it).
- Step time is when the compute stream finishes (every collective is waited on).

torch's count (``tracker_peak_bytes``): the same run is also counted by the rules of torch's
``memory_estimator.MemoryTracker`` on the graph the schedule writes back
(:func:`scheduler.check.judge.torch_tracker_peak`), reported beside the execution model's:

- a collective's input is freed at the collective (issue), not at its wait;
- a collective's result and its wait's result are two storages (the wait's fake tensor is
  fresh): the result lives from the issue to the wait, the wait's from the wait to its last
  reader, both during the wait. A merged reduce-scatter's members are views of one wait
  result, freed after the last reader of any of them;
- a merged all-gather's ``out=`` result is a storage of its own beside the bucket buffer
  (torch's meta kernel returns a fresh tensor): both are counted at the collective, then the
  buffer is freed. A collective the graph already writes into a buffer (an
  ``all_gather_into_tensor_out`` of a re-exported graph, which the export gives no bytes of
  its own) counts its result at the buffer's size;
- a storage nothing reads is never freed.

Both counts equal the reference liveness count and torch's tracker on the written graph, to
the byte, on every graph checked (``tests/test_judge.py``).

What each step does to memory is data built once per problem (:func:`static_memory`): a compute
node's step (:meth:`StaticMemory.node_ops`) and a bucket's issue and wait
(:meth:`StaticMemory.bucket_ops`) as micro-operations (:data:`Op`) on the storages each count
knows (owners, uses, those never freed), which :class:`LiveMemory` counts.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict
from typing import Any

import networkx as nx

from solvers.core.problem import Collective, Problem, merge_cat_bytes

#: the storage a node's output is counted as: a name, or the names of a multi-output node's
#: results (a node that holds them all, such as the node itself, which its getitems read)
Owner = str | tuple[str, ...]


class LiveMemory:
    """Live storages of one run: allocation at first write, release after the last of the
    counted uses, and the peak. ``owner`` maps a node to the storage its output is counted as
    (default: its own; several for a node holding every result of a multi-output node);
    ``uses`` (storage -> release events, this run's own copy) and ``never_free`` name
    storages."""

    def __init__(self, uses: dict[str, int], never_free: "set[str] | frozenset[str]", owner: dict[str, Owner]):
        self.owner = owner
        self.uses = uses
        self.never_free = never_free
        self.live: dict[str, int] = {}
        self.total = 0
        self.peak = 0

    def record(self) -> None:
        """The live bytes now count towards the peak."""
        self.peak = max(self.peak, self.total)

    def alloc(self, owner: str, nbytes: int) -> None:
        if nbytes and owner not in self.live:
            self.live[owner] = nbytes
            self.total += nbytes

    def free(self, owner: str) -> None:
        if owner in self.live and owner not in self.never_free:
            self.total -= self.live.pop(owner)

    def release(self, name: str) -> None:
        """One use of ``name``'s storage is done; free it after the last one."""
        owner = self.owner.get(name, name)
        if owner.__class__ is tuple:
            for o in owner:
                self.drop(o)
        else:
            self.drop(owner)  # type: ignore[arg-type]

    def drop(self, owner: str) -> None:
        """One use of storage ``owner`` is done; free it after the last one."""
        left = self.uses.get(owner, 0) - 1
        self.uses[owner] = left
        if left <= 0:
            self.free(owner)

    def alloc_node(self, name: str, nbytes: int) -> None:
        """``name``'s storage, allocated once whatever the node (several may share it); a
        single-output node only (a multi-output node allocates each of its results,
        :attr:`StaticMemory.steps`)."""
        self.alloc(self.owner.get(name, name), nbytes)  # type: ignore[arg-type]


#: codes of a micro-operation of a bucket's step (:meth:`StaticMemory.bucket_ops`)
ALLOC, REC, REL, DROP, FREE = range(5)
#: the bucket's own storages, named per run after the bucket's index (``bucket:<b>``: the
#: buffer of a merged bucket's copy-in; ``result:<b>``: torch's tracker's ``out=`` result of a
#: merged collective; ``wait:<b>``: a merged bucket's result)
BUCKET, RESULT, WAIT = "bucket", "result", "wait"
#: one micro-operation: ``(sub, code, key, amount, member)``. ``sub`` numbers its point in the
#: step (operations of one point are simultaneous for what a record sees; a record at ``sub``
#: sees every change at a smaller one); ``code`` one of ALLOC (storage ``key`` of ``amount``
#: bytes, none when it is live), REC (the live bytes plus ``amount`` transient bytes count
#: towards the peak), REL (one use of node ``key``'s storage is done), DROP (one use of storage
#: ``key`` is done), FREE (storage ``key`` is freed); ``member`` the collective whose operation
#: it is, None for the bucket's own (``key`` then BUCKET, RESULT or WAIT)
Op = tuple[int, int, Any, int, "str | None"]
#: a bucket's steps: ``ops[count][anchor]``, count 0 the execution model's and 1 torch's
#: tracker's, anchor 0 the issue and 1 the wait
BucketOps = tuple[tuple[tuple[Op, ...], tuple[Op, ...]], tuple[tuple[Op, ...], tuple[Op, ...]]]


@dataclasses.dataclass(frozen=True)
class StaticMemory:
    """What every run over one problem shares (built once per problem, :func:`static_memory`): each
    node's inputs, and for each count the owner of every node's storage, the release events
    per owner and the owners never freed; what each step does to memory (node steps:
    ``steps``; a bucket's issue and wait: :meth:`bucket_ops`)."""

    preds: dict[str, tuple[str, ...]]
    inputs: tuple[tuple[str, int], ...]
    mem_owner: dict[str, Owner]
    mem_uses: dict[str, int]
    mem_never_free: frozenset[str]
    trk_owner: dict[str, Owner]
    trk_uses: dict[str, int]
    trk_never_free: frozenset[str]
    #: per count, owner -> the nodes it owns (a merged reduce-scatter's members move under
    #: their bucket's result)
    mem_nodes: dict[Owner, tuple[str, ...]]
    trk_nodes: dict[Owner, tuple[str, ...]]
    #: node step -> (runtime_ms, the storages it allocates with their bytes by the execution
    #: model's count (several results of a multi-output node are several storages) and by
    #: torch's tracker (where a wait on no collective of the graph gets a fresh one), the
    #: storages the execution model's count frees right after it: those nothing reads)
    steps: dict[str, tuple[float, tuple[tuple[str, int], ...], tuple[tuple[str, int], ...], tuple[str, ...]]]
    #: the problem's collectives and the DAG's node attributes (what :meth:`bucket_ops` reads)
    colls: dict[str, Collective] = dataclasses.field(repr=False, default_factory=dict)
    nodes: Any = dataclasses.field(repr=False, default=None)
    #: (members, merged) -> :meth:`bucket_ops`, filled as buckets are met
    ops: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)
    #: node -> :meth:`node_ops`, filled as nodes are met
    node_cache: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)

    def node_ops(self, name: str) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
        """What compute node ``name``'s step does to memory, per count (0: the execution
        model's, 1: torch's tracker's), as micro-operations (:data:`Op`, ``member`` the node):
        its storages allocated (:attr:`steps`), a record, those nothing reads freed (the
        execution model's count only: FX's code drops them, torch's tracker does not), then one
        use of each input's storage done."""
        ops = self.node_cache.get(name)
        if ops is None:
            _, allocs, trk_allocs, unread = self.steps[name]
            out: list[list[Op]] = [[], []]
            for c, made in enumerate((allocs, trk_allocs)):
                out[c].extend((0, ALLOC, key, nbytes, name) for key, nbytes in made if nbytes)
                out[c].append((1, REC, None, 0, name))
                if c == 0:
                    out[c].extend((2, FREE, key, 0, name) for key in unread)
                out[c].extend((3, REL, u, 0, name) for u in self.preds[name])
            ops = self.node_cache[name] = (tuple(out[0]), tuple(out[1]))
        return ops

    def bucket_ops(self, members: tuple[str, ...], merged: bool | None = None) -> BucketOps:
        """What the issue and the wait of a bucket of ``members`` do to memory, by each count,
        as micro-operations (:data:`Op`) in the order the simulator runs them. ``merged``
        (default: more than one member): as a merged bucket; the operations a collective makes
        as a member (``member`` set) are the same in every merged bucket it joins.

        The issue: the prologue casts run (allocated, a record, their inputs released; a merged
        all-gather skips the casts it folds into its copy-in). Alone: the output, a record;
        torch's tracker counts the result ``result:<collective>`` and frees the input here.
        A merged all-gather: its bucket buffer (the members' storage where they are views of
        it, :func:`copied_out`), a record with the ``cat`` of the inputs as transient bytes
        (:func:`~solvers.core.problem.merge_cat_bytes`), the inputs and folded casts
        released; torch's tracker counts the ``out=`` result beside the buffer, then frees the
        buffer. A merged reduce-scatter: its ``cat`` (the bucket buffer), a record, the inputs
        released, then the result whose views the members are; torch's tracker frees the
        buffer after the result.

        The wait: a merged all-gather's members copied out of its buffer (when they are not
        views), the epilogue casts, a record; the buffer freed (merged) or the input released
        (alone). torch's tracker: the wait's fresh result beside the collective's, whose use
        is then done (merged: the ``out=`` result freed, and the members copied out of the
        wait's result, which is freed after them), the epilogue casts, a record. Then the
        epilogues' inputs released.
        """
        merged = len(members) > 1 if merged is None else merged
        key = (members, merged)
        ops = self.ops.get(key)
        if ops is None:
            ops = self.ops[key] = _bucket_ops(self, members, merged)
        return ops

_STATIC: "weakref.WeakKeyDictionary[Problem, StaticMemory]" = weakref.WeakKeyDictionary()


def static_memory(problem: Problem) -> StaticMemory:
    """The :class:`StaticMemory` of ``problem`` (cached: problems are not changed once built)."""
    st = _STATIC.get(problem)
    if st is None:
        st = _STATIC[problem] = _build_static(problem)
    return st


def _build_static(p: Problem) -> StaticMemory:
    dag = p.dag
    preds = {n: tuple(dag.predecessors(n)) for n in dag.nodes}
    # release events of each node's output: one per reading node step, one per prologue read
    # at issue, one per collective input (released at its wait, or at the issue when merged)
    uses: dict[str, int] = defaultdict(int)
    for name in p.seq:
        for u in preds[name]:
            uses[u] += 1
    for cname, c in p.colls.items():
        for reader in (*c.prologue, cname, *c.epilogue):
            for u in preds[reader]:
                uses[u] += 1
    # graph inputs the graph cannot free, and whatever the graph returns
    never_free: set[str] = set()
    for n, a in dag.nodes(data=True):
        if a["kind"] == "input" and not a.get("releasable", True):
            never_free.add(n)
        if a["kind"] == "output":
            never_free.update(preds[n])
    root, results = _storages(dag)
    trk_owner = _tracker_owners(p, root, preds)

    def by_owner(owner: dict[str, Owner]) -> tuple[dict[str, int], frozenset[str]]:
        counts: dict[str, int] = defaultdict(int)
        for name, n in uses.items():
            for o in each_storage(owner.get(name, name)):
                counts[o] += n
        return dict(counts), frozenset(o for name in never_free for o in each_storage(owner.get(name, name)))

    mem_uses, mem_never_free = by_owner(root)
    trk_uses, trk_never_free = by_owner(trk_owner)
    for m in p.colls:  # the wait reads the collective's result (its DROP in _bucket_ops)
        trk_uses[f"result:{m}"] = trk_uses.get(f"result:{m}", 0) + 1

    def by_storage(owner: dict[str, Owner]) -> dict[Owner, tuple[str, ...]]:
        out: dict[Owner, list[str]] = defaultdict(list)
        for name, o in owner.items():
            out[o].append(name)
        return {o: tuple(ns) for o, ns in out.items()}

    inputs = tuple((n, int(a["size_bytes"])) for n, a in dag.nodes(data=True) if a["kind"] == "input")
    steps = {}
    for name in p.seq:
        a = dag.nodes[name]
        allocs = results.get(name) or (((name, int(a["size_bytes"])),) if a["alias_of"] is None else ())
        # the execution model's count drops what nothing reads at once (FX's code does)
        unread = tuple(o for o, nbytes in allocs if nbytes and not mem_uses.get(o) and o not in mem_never_free)
        trk_allocs = ((name, int(a["size_bytes"])),) if trk_owner[name] == name and a["alias_of"] is not None else allocs
        steps[name] = (float(a["runtime_ms"]), allocs, trk_allocs, unread)
    return StaticMemory(preds=preds, inputs=inputs, mem_owner=root, mem_uses=mem_uses, mem_never_free=mem_never_free,
                   trk_owner=trk_owner, trk_uses=trk_uses, trk_never_free=trk_never_free,
                   mem_nodes=by_storage(root), trk_nodes=by_storage(trk_owner), steps=steps, colls=p.colls,
                   nodes=dag.nodes)


def _bucket_ops(st: StaticMemory, members: tuple[str, ...], merged: bool) -> BucketOps:
    """:meth:`StaticMemory.bucket_ops`, built."""
    colls, nodes, preds, trk_owner = st.colls, st.nodes, st.preds, st.trk_owner
    gather = colls[members[0]].coll_type == "all_gather"
    copied = merged and copied_out(colls, members)
    mem_i: list[Op] = []
    trk_i: list[Op] = []
    mem_w: list[Op] = []
    trk_w: list[Op] = []

    def alloc(ops: list[Op], sub: int, key: str, nbytes: int, member: str | None) -> None:
        if nbytes:
            ops.append((sub, ALLOC, key, nbytes, member))

    def release(ops: list[Op], sub: int, name: str, member: str) -> None:
        ops.extend((sub, REL, u, 0, member) for u in preds[name])

    def own_bytes(name: str) -> int:
        return int(nodes[name]["size_bytes"]) if nodes[name]["alias_of"] is None else 0

    def tracker_out_bytes(m: str) -> int:
        # a collective writing into a buffer of the graph (the export gives it no bytes of its
        # own) counts its result at the buffer's size
        alias = nodes[m]["alias_of"]
        return colls[m].out_bytes if alias is None else int(nodes[alias]["size_bytes"])

    # the issue: prologue casts (a merged all-gather folds its single-use casts into the copy)
    folded = {colls[m].folded_cast: m for m in members if colls[m].folded_cast} if merged and gather else {}
    prologue = [(pn, m) for m in members for pn in colls[m].prologue if pn not in folded]
    for pn, m in prologue:
        alloc(mem_i, 0, pn, own_bytes(pn), m)
        alloc(trk_i, 0, trk_owner.get(pn, pn), own_bytes(pn), m)  # type: ignore[arg-type]
    for ops in (mem_i, trk_i):
        ops.append((1, REC, None, 0, None))
    for pn, m in prologue:
        release(mem_i, 2, pn, m)
        release(trk_i, 2, pn, m)
    size = sum(colls[m].out_bytes for m in members)
    if not merged:
        (m,) = members
        alloc(mem_i, 3, m, colls[m].out_bytes, m)
        mem_i.append((4, REC, None, 0, None))
        alloc(trk_i, 3, f"result:{m}", tracker_out_bytes(m), m)
        trk_i.append((4, REC, None, 0, None))
        release(trk_i, 5, m, m)  # torch's tracker frees the input at the collective
    elif gather:
        read = merge_cat_bytes([colls[m] for m in members])
        alloc(mem_i, 3, BUCKET if copied else WAIT, size, None)
        alloc(trk_i, 3, BUCKET, size, None)
        for ops in (mem_i, trk_i):
            ops.append((4, REC, None, read, None))
        for name, m in (*((m, m) for m in members), *folded.items()):
            release(mem_i, 5, name, m)
            release(trk_i, 5, name, m)
        alloc(trk_i, 5, RESULT, size, None)
        trk_i.append((6, REC, None, 0, None))
        trk_i.append((7, FREE, BUCKET, 0, None))
    else:
        payload = sum(colls[m].payload_bytes for m in members)
        alloc(mem_i, 3, BUCKET, payload, None)
        alloc(trk_i, 3, BUCKET, payload, None)
        for ops in (mem_i, trk_i):
            ops.append((4, REC, None, 0, None))
        for m in members:
            release(mem_i, 5, m, m)
            release(trk_i, 5, m, m)
        alloc(mem_i, 5, WAIT, size, None)
        mem_i.append((6, REC, None, 0, None))
        alloc(trk_i, 5, RESULT, size, None)
        trk_i.append((6, REC, None, 0, None))
        trk_i.append((7, FREE, BUCKET, 0, None))
    # the wait, the execution model's count
    if copied:
        for m in members:
            alloc(mem_w, 0, m, colls[m].out_bytes, m)
    epilogue = [(e, m) for m in members for e in colls[m].epilogue]
    for e, m in epilogue:
        alloc(mem_w, 0, e, own_bytes(e), m)
    mem_w.append((1, REC, None, 0, None))
    if merged:
        mem_w.append((2, FREE, BUCKET, 0, None))
    else:
        release(mem_w, 2, members[0], members[0])  # the input lives until the wait
    # the wait, torch's tracker
    if not merged:
        (m,) = members
        alloc(trk_w, 0, m, tracker_out_bytes(m), m)
        trk_w.append((1, REC, None, 0, None))
        trk_w.append((2, DROP, f"result:{m}", 0, m))
    else:
        alloc(trk_w, 0, WAIT, size, None)
        trk_w.append((1, REC, None, 0, None))
        trk_w.append((2, FREE, RESULT, 0, None))
        if copied:
            for m in members:
                alloc(trk_w, 2, m, colls[m].out_bytes, m)
            trk_w.append((3, REC, None, 0, None))
            trk_w.append((4, FREE, WAIT, 0, None))
    for e, m in epilogue:
        alloc(trk_w, 4, trk_owner.get(e, e), own_bytes(e), m)  # type: ignore[arg-type]
    trk_w.append((5, REC, None, 0, None))
    for e, m in epilogue:
        release(mem_w, 6, e, m)
        release(trk_w, 6, e, m)
    return (tuple(mem_i), tuple(mem_w)), (tuple(trk_i), tuple(trk_w))


def each_storage(owner: Owner) -> tuple[str, ...]:
    return owner if isinstance(owner, tuple) else (owner,)


def _storages(dag: nx.DiGraph) -> tuple[dict[str, Owner], dict[str, tuple[tuple[str, int], ...]]]:
    """The storage each node's output is (the node owning it, ``alias_of``; the result
    ``<node>#<index>`` of a multi-output node that a getitem holds, ``output_index``; every
    result for a node that holds them all), and per multi-output node the storages it
    allocates with their bytes. A result written into an argument is that argument's."""
    nodes = dag.nodes
    key: dict[str, Owner] = {}
    results: dict[str, tuple[tuple[str, int], ...]] = {}
    for n in dag.graph["order"]:
        a = nodes[n]
        alias = a["alias_of"]
        if alias is not None:
            index = a.get("output_index")
            key[n] = f"{alias}#{index}" if index is not None else key.get(alias, alias)
            continue
        sizes = a.get("output_bytes")
        if sizes is None:
            key[n] = n
            continue
        written = a.get("output_alias") or [None] * len(sizes)
        fresh = tuple((f"{n}#{j}", int(b)) for j, (b, w) in enumerate(zip(sizes, written)) if w is None and b)
        held = [o for o, _ in fresh] + [o for w in written if w is not None for o in each_storage(key.get(w, w))]
        held = list(dict.fromkeys(held))
        key[n] = held[0] if len(held) == 1 else tuple(held)
        results[n] = fresh
    for n in dag.nodes:  # nodes outside the order (none expected) own their storage
        key.setdefault(n, nodes[n]["alias_of"] or n)
    return key, results


def _tracker_owners(p: Problem, root: dict[str, Owner], preds: dict[str, tuple[str, ...]]) -> dict[str, Owner]:
    """Node -> its storage by torch's tracker: a collective's result is ``result:<name>``,
    freed after its last reader (its wait, a further wait, a read of its size before the
    wait); a wait's result is a storage of its own, owned by the collective's name (also when the collective
    writes into a buffer, ``all_gather_into_tensor_out`` already in the graph, whose views the
    export roots at the buffer), and so is a wait on anything else (a further wait, a wait on a
    graph input), owned by its own name; views follow the node they view; a multi-output node's
    results are storages of their own, as in the execution model's count (``root``)."""
    dag = p.dag
    waits = {c.wait: name for name, c in p.colls.items()}
    owner: dict[str, Owner] = {}
    for n in dag.graph["order"]:
        if n in p.colls:
            owner[n] = f"result:{n}"
        elif n in waits:
            owner[n] = waits[n]
        elif dag.nodes[n].get("external_wait"):
            owner[n] = n  # every wait_tensor's fake result is fresh, a further wait's too
        elif dag.nodes[n]["alias_of"] is None:
            owner[n] = root[n]
        else:
            viewed = [owner[u] for u in preds[n] if root.get(u) == root[n] and u in owner]
            owner[n] = viewed[0] if viewed else root[n]
    for n in dag.nodes:  # nodes outside the order (none expected): as the export roots them
        owner.setdefault(n, root[n])
    return owner


def copied_out(colls: dict[str, Collective], members: tuple[str, ...]) -> bool:
    """Whether a merged bucket's members are copied out of its result at the wait: torch's merge
    reshapes an all-gather's ``(group_size, -1)`` slices to each member's shape, which copies
    unless the group has one rank. Otherwise (a reduce-scatter, or an all-gather on one rank)
    the members are views of the bucket's result."""
    c0 = colls[members[0]]
    return c0.coll_type == "all_gather" and c0.group_size > 1


def merged_memory(owner: dict[str, Owner], uses: dict[str, int], never_free: frozenset[str],
                   nodes: dict[Owner, tuple[str, ...]], merged: list[tuple[int, tuple[str, ...]]]) -> LiveMemory:
    """One count's memory for a run (``owner``, ``uses``, ``never_free`` and ``nodes`` of
    :class:`StaticMemory`) where the members of each merged bucket ``(bucket, members)`` that are not
    copied out (:func:`copied_out`) are views of one result, ``wait:<bucket>`` (torch's merge
    splits the bucket's output into views), freed after the last reader of any of them."""
    if not merged:
        return LiveMemory(dict(uses), never_free, owner)
    owner, uses, never_free = dict(owner), dict(uses), set(never_free)
    for b, members in merged:
        result = f"wait:{b}"
        for m in members:
            for name in nodes.get(m, ()):
                owner[name] = result
            uses[result] = uses.get(result, 0) + uses.pop(m, 0)
            if m in never_free:
                never_free.discard(m)
                never_free.add(result)
    return LiveMemory(uses, never_free, owner)

