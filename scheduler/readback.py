"""torch's written graph read back as a schedule over the traced graph's problem.

:func:`read_back` reads torch's overlap scheduler's written graph into a
:class:`solvers.core.schedule.Schedule` over the traced graph's
:class:`solvers.core.problem.Problem` (what it repairs, and why, is in
:mod:`scheduler.torch_overlap`'s docstring); :func:`torch_order` gives the traced graph's nodes
in the order torch's graph runs them, over which the read-back needs no repair of torch's order
of compute. Only names, provenance and order are read: nothing rank-dependent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx

from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule, ScheduleError, Step
from solvers.core.simulator import ScheduleInvalidError
from solvers.core.validator import validate_schedule

if TYPE_CHECKING:
    import torch.fx

#: the pass name torch's merge functions record in a merged node's provenance
_BUCKETING_PASS = "bucketing_pass"


class TorchPassError(ScheduleError):
    """torch's overlap scheduler gives no schedule for this graph; the message says why."""


def read_back(written: "torch.fx.GraphModule", problem: Problem) -> tuple[Schedule, list[str]]:
    """torch's written graph ``written`` as a schedule of ``problem`` (the traced graph's), and
    the repairs that made it one our model represents (module docstring). The schedule is
    validated on ``problem`` (not against a budget).

    Where torch runs the traced compute and view nodes in their traced order, the schedule is
    torch's step for step. torch keeps only its compute nodes (matmuls and the like) in order and
    lets views and pointwise ops run where they are ready, while our schedules keep every node
    where traced: each issue and wait then stays between the same two *anchors* as in torch's
    graph (traced nodes that torch runs in their traced order, chosen to hold the most compute
    time: the heaviest increasing subsequence of traced positions in torch's order, weighted by
    the problem's node times), after as many traced nodes as in torch's graph where that lies
    between them. A bucket placed outside its issue range
    so is moved into it (issued once its members' inputs exist, waited before their first
    reader: the nearest gaps that are).

    Raises:
        TorchPassError: the graph's collectives are not the traced graph's (a member read twice
            or missing, a name the problem does not know), or the schedule is invalid after the
            repairs (the validator's reason).
    """
    graph = written.graph
    bucket_of: dict[Any, int] = {}  # torch's collective node -> bucket
    members: list[tuple[str, ...]] = []
    # (kind, bucket, traced nodes before it in torch's graph), in torch's order
    events: list[tuple[str, int, int]] = []
    seq_order: list[str] = []
    for node in graph.nodes:
        if node.name in problem.pos and node.op == "call_function":
            seq_order.append(node.name)
        elif is_collective(node):
            bucket_of[node] = len(members)
            members.append(_members(node, problem, id(graph)))
            events.append(("issue", bucket_of[node], len(seq_order)))
        elif is_wait(node) and node.args and node.args[0] in bucket_of:
            b = bucket_of[node.args[0]]
            # the bucket's own wait: a further wait on an unmerged collective reads its result
            if len(members[b]) > 1 or problem.colls[members[b][0]].wait == node.name:
                events.append(("wait", b, len(seq_order)))
    _check_coverage(members, problem)
    repairs: list[str] = []
    if len(seq_order) < problem.n:
        # casts torch folded into its merged buckets: they run where traced in our schedules
        present = set(seq_order)
        folded = [name for name in problem.seq if name not in present]
        repairs.append(f"{len(folded)} traced node(s) torch folded into its buckets kept where traced: "
                       f"{', '.join(folded[:3])}{', ...' if len(folded) > 3 else ''}")
    gap_of = anchored_gaps(problem, seq_order)
    delayed = _delayed(problem, seq_order)
    if delayed:
        repairs.append(f"torch runs {delayed} of the {problem.n} traced compute and view nodes after a node traced "
                       "after them (it keeps only its compute nodes in order): kept as traced, each issue and wait "
                       "between the same anchors as in torch's graph")
    issue_at, wait_at, issue_idx, wait_idx = [-1] * len(members), [-1] * len(members), [0] * len(members), \
        [0] * len(members)
    for idx, (kind, b, k) in enumerate(events):
        if kind == "issue":
            issue_at[b], issue_idx[b] = gap_of[k], idx
        else:
            wait_at[b], wait_idx[b] = gap_of[k], idx
    unwaited = [members[b][0] for b in range(len(members)) if wait_at[b] < 0]
    if unwaited:
        raise TorchPassError(f"torch's graph leaves {len(unwaited)} bucket(s) without a wait: {unwaited[:3]}")
    buckets, issue_at, wait_at, order, more = _repaired(problem, members, issue_at, wait_at, issue_idx, wait_idx)
    repairs += more
    schedule = _in_torch_order(problem, buckets, issue_at, wait_at, order)
    try:
        validate_schedule(problem, schedule)
        return schedule, repairs
    except ScheduleInvalidError as e:
        first = str(e)
    # torch's order inside a gap may not survive the moves: ours (waits first, readers of a
    # collective's result after its wait)
    schedule = problem.schedule_at(buckets, issue_at, wait_at)
    repairs.append(f"torch's order of issues and waits within a gap is not valid after the moves ({first}): "
                   "ordered as ours")
    try:
        validate_schedule(problem, schedule)
    except ScheduleInvalidError as e:
        raise TorchPassError(f"torch's schedule is not a valid schedule of the traced graph after the repairs "
                             f"({'; '.join(repairs)}): {e}") from e
    return schedule, repairs


def torch_order(written: "torch.fx.GraphModule", problem: Problem) -> tuple[str, ...] | None:
    """The traced graph's DAG nodes (``problem.dag``) in the order torch's written graph
    ``written`` runs them, or None where torch runs the traced compute and view nodes in their
    traced order. Each collective runs where torch issues its bucket and its wait where torch
    waits it, a collective's prologue and epilogue with them; a node torch folded into its
    buckets (a cast) right after its inputs; the order is a topological sort of the DAG that
    follows torch's where its dependencies allow, the same on every rank.

    Over this order (:func:`solvers.core.order.in_order`) torch's schedule is read back exactly:
    what :func:`read_back` must repair over the traced order is torch's order of compute there.

    Raises:
        TorchPassError: as :func:`read_back`, for collectives torch's graph does not run once.
    """
    rank: dict[str, int] = {}
    seq_order: list[str] = []
    bucket_members: dict[Any, tuple[str, ...]] = {}
    members_seen: list[tuple[str, ...]] = []
    for i, node in enumerate(written.graph.nodes):
        if node.name in problem.pos and node.op == "call_function":
            seq_order.append(node.name)
            rank[node.name] = i
        elif is_collective(node):
            bucket_members[node] = _members(node, problem, id(written.graph))
            members_seen.append(bucket_members[node])
            for m in bucket_members[node]:
                rank[m] = i
                for p in problem.colls[m].prologue:
                    rank.setdefault(p, i)
        elif is_wait(node) and node.args and node.args[0] in bucket_members:
            for m in bucket_members[node.args[0]]:
                if len(bucket_members[node.args[0]]) > 1 or problem.colls[m].wait == node.name:
                    rank[problem.colls[m].wait] = i
                    for e in problem.colls[m].epilogue:
                        rank.setdefault(e, i)
    _check_coverage(members_seen, problem)
    if not _delayed(problem, seq_order):
        return None
    dag = problem.dag
    traced = {name: k for k, name in enumerate(dag.graph["order"])}
    for name in dag.graph["order"]:  # topological: a node's inputs are ranked before it
        if name not in rank:
            rank[name] = max((rank[u] for u in dag.predecessors(name)), default=-1)
    return tuple(nx.lexicographical_topological_sort(dag, key=lambda n: (rank[n], traced[n])))


def _members(node: "torch.fx.Node", problem: Problem, graph_id: int) -> tuple[str, ...]:
    """The traced collectives ``node`` of torch's graph runs: those its bucketing provenance
    names (followed down through a bucket merged again), or itself when torch did not merge it.

    Raises:
        TorchPassError: a member the traced problem does not know.
    """
    sources = [s for s in node.meta.get("from_node") or () if s.pass_name == _BUCKETING_PASS and
               s.graph_id == graph_id]
    if not sources:
        if node.name not in problem.colls:
            raise TorchPassError(f"collective {node.name!r} of torch's graph is not one of the traced graph and "
                                 "carries no bucketing provenance")
        return (node.name,)
    out: list[str] = []

    def walk(srcs: Sequence[Any]) -> None:
        for s in srcs:
            if s.name in problem.colls:
                out.append(s.name)
                continue
            deeper = [d for d in s.from_node if d.pass_name == _BUCKETING_PASS and d.graph_id == graph_id]
            if not deeper:
                raise TorchPassError(f"bucket {node.name!r} of torch's graph merges {s.name!r}, which is no collective "
                                     "of the traced graph")
            walk(deeper)

    walk(sources)
    return tuple(out)


def _check_coverage(members: Sequence[tuple[str, ...]], problem: Problem) -> None:
    seen: dict[str, int] = {}
    for ms in members:
        for m in ms:
            seen[m] = seen.get(m, 0) + 1
    twice = [m for m, k in seen.items() if k > 1]
    missing = [c for c in problem.colls if c not in seen]
    if twice or missing:
        raise TorchPassError(f"torch's graph does not run each traced collective once: read twice {twice[:3]}, "
                             f"missing {missing[:3]}")


def anchored_gaps(problem: Problem, seq_order: Sequence[str]) -> list[int]:
    """``k`` (traced nodes before an event in torch's graph, ``seq_order`` the traced nodes in
    torch's order) -> the traced gap of the event (:func:`read_back`): ``k`` where that lies
    between the anchors around it, else the nearer end of that range."""
    traced = [problem.pos[name] for name in seq_order]
    anchors = _heaviest_increasing(traced, [problem.compute_ms[t] for t in traced])
    n = len(traced)
    low = [0] * (n + 1)  # the gap after the last anchor among the first k
    for k in range(1, n + 1):
        low[k] = traced[k - 1] + 1 if k - 1 in anchors else low[k - 1]
    high = [problem.n] * (n + 1)  # the gap before the first anchor from the k-th on
    for k in range(n - 1, -1, -1):
        high[k] = traced[k] if k in anchors else high[k + 1]
    return [min(max(k, low[k]), high[k]) for k in range(n + 1)]


def _heaviest_increasing(values: Sequence[int], weights: Sequence[float]) -> set[int]:
    """Indices of the increasing subsequence of ``values`` (distinct ints in ``[0, bound)``) of
    the largest total weight, then the most elements; of equals, the one found first (the same
    on every rank). A Fenwick tree over the values keeps, for each prefix of values, the best
    subsequence ending below it."""
    size = max(values, default=-1) + 1
    tree: list[tuple[float, int, int]] = [(0.0, 0, -1)] * (size + 1)  # (weight, count, last index)
    prev = [-1] * len(values)
    best: tuple[float, int, int] = (0.0, 0, -1)
    for i, (v, w) in enumerate(zip(values, weights)):
        below, j = (0.0, 0, -1), v  # the best ending at a value < v
        while j > 0:
            if tree[j][:2] > below[:2]:
                below = tree[j]
            j -= j & -j
        prev[i] = below[2]
        mine = (below[0] + w, below[1] + 1, i)
        if mine[:2] > best[:2]:
            best = mine
        j = v + 1
        while j <= size:
            if mine[:2] > tree[j][:2]:
                tree[j] = mine
            j += j & -j
    out: set[int] = set()
    i = best[2]
    while i >= 0:
        out.add(i)
        i = prev[i]
    return out


def _delayed(problem: Problem, seq_order: Sequence[str]) -> int:
    """Traced nodes torch runs after a node traced after them."""
    latest, count = -1, 0
    for name in seq_order:
        pos = problem.pos[name]
        count += pos < latest
        latest = max(latest, pos)
    return count


def _chain_sorted(problem: Problem, members: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(members, key=lambda m: (problem.colls[m].needed, problem.colls[m].ready,
                                                problem.colls[m].traced_issue, m)))


def _repaired(problem: Problem, members: Sequence[tuple[str, ...]], issue_at: Sequence[int],
              wait_at: Sequence[int], issue_idx: Sequence[int], wait_idx: Sequence[int]):
    """torch's buckets as our model represents them (module docstring and :func:`read_back`):
    (buckets, issue gaps, wait gaps, each bucket's (issue, wait) place in torch's order of
    events, what changed, counted per kind of repair)."""
    split: list[str] = []  # buckets split: members not one bucket of our model
    apart: list[str] = []  # buckets split: no gap in every member's issue range
    pinned: list[str] = []  # collectives our model keeps where traced, moved back
    moved: list[str] = []  # buckets moved into their issue ranges
    buckets: list[Bucket] = []
    issue, wait, order = [], [], []

    def place(part: tuple[str, ...], i: int, w: int, at: tuple[int, int]) -> None:
        lo = max(problem.colls[m].ready for m in part)
        hi = min(problem.colls[m].needed for m in part)
        ii = min(max(i, lo), hi)
        ww = min(max(w, ii), hi)
        if (ii, ww) != (i, w):
            moved.append(part[0])
        buckets.append(Bucket(part))
        issue.append(ii)
        wait.append(ww)
        order.append(at)

    for b, ms in enumerate(members):
        i, w, at = issue_at[b], wait_at[b], (issue_idx[b], wait_idx[b])
        parts = _legal_parts(problem, ms)
        if len(parts) > 1:
            split.append(ms[0])
        for part in parts:
            c = problem.colls[part[0]]
            if not c.movable:
                if (i, w) != (c.traced_issue, c.traced_wait):
                    pinned.append(c.name)
                buckets.append(Bucket(part))
                issue.append(c.traced_issue)
                wait.append(c.traced_wait)
                order.append(at)
            elif max(problem.colls[m].ready for m in part) > min(problem.colls[m].needed for m in part):
                apart.append(part[0])
                for m in part:
                    place((m,), i, w, at)
            else:
                place(part, i, w, at)
    repairs = [f"{len(names)} {what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
               for names, what in ((split, "bucket(s) split, their members not one bucket of our model"),
                                   (apart, "bucket(s) split, no gap in every member's issue range in the traced order"),
                                   (pinned, "collective(s) our model keeps where traced moved back there"),
                                   (moved, "bucket(s) moved into their issue ranges")) if names]
    return buckets, issue, wait, order, repairs


def _in_torch_order(problem: Problem, buckets: Sequence[Bucket], issue_at: Sequence[int], wait_at: Sequence[int],
                    order: Sequence[tuple[int, int]]) -> Schedule:
    """The schedule of ``buckets`` at these gaps, the issues and waits of one gap in torch's
    order (``order``: each bucket's issue and wait place in torch's graph)."""
    events = sorted([(issue_at[b], order[b][0], 0, b) for b in range(len(buckets))]
                    + [(wait_at[b], order[b][1], 1, b) for b in range(len(buckets))])
    steps: list[Step] = []
    at = 0
    for gap, _, kind, b in events:
        steps.extend(Step("node", problem.seq[g]) for g in range(at, gap))
        at = max(at, gap)
        steps.append(Step("issue" if kind == 0 else "wait", b))
    steps.extend(Step("node", problem.seq[g]) for g in range(at, problem.n))
    return Schedule(tuple(buckets), tuple(steps))


def _legal_parts(problem: Problem, members: Sequence[str]) -> list[tuple[str, ...]]:
    """``members`` in groups our model may merge: one bucket key each, a collective kept where
    traced alone; in chain order."""
    ordered = _chain_sorted(problem, members)
    groups: dict[Any, list[str]] = {}
    for m in ordered:
        c = problem.colls[m]
        groups.setdefault(c.key if c.movable else ("alone", m), []).append(m)
    return [tuple(g) for g in groups.values()]


def is_collective(node: "torch.fx.Node") -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "_c10d_functional" and \
        "wait_tensor" not in str(node.target)


def is_wait(node: "torch.fx.Node") -> bool:
    return node.op == "call_function" and "wait_tensor" in str(node.target)


# --------------------------------------------------------------------------------------------
# starts
# --------------------------------------------------------------------------------------------
