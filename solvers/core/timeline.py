"""The execution model's time: one walk of the compute stream and the communication streams.

- One compute stream runs the schedule's node steps in order, each for its ``runtime_ms``.
- Each process group has one FIFO communication stream (a group the schedule splits has a
  second one for its all-gathers, :func:`~solvers.core.streams.stream_of`). An issue step first
  spends the bucket's copy-in time on the compute stream (:meth:`Problem.copy_in_ms`: prologue
  casts, plus the copy into the bucket buffer when merged); the collective then starts at
  ``max(compute time, stream free)`` and lasts :meth:`Problem.bucket_comm_ms`, or longer where
  another stream of the same ranks moves data at the same time: streams of one link share its
  bandwidth (:class:`~solvers.core.streams.Link`). A wait step blocks the compute stream until
  the bucket completes, then spends the copy-out time (:meth:`Problem.copy_out_ms`: merged
  all-gathers).
- Step time is when the compute stream finishes (every collective is waited on).

:class:`Clock` is that walk, the only one: the simulator runs it recording every step's times
(:mod:`solvers.core.simulator`; several ranks in lockstep, :meth:`Clock.hold`), the fast
evaluator without records, once per schedule read and cost model (:meth:`Timeline.run`). A schedule is
walked as its issue and wait steps ``(is_issue, bucket, gap)``, ``gap`` the number of compute
nodes before the step (:func:`bucket_steps`): the compute runtimes between two such steps are
added one by one in order (``functools.reduce`` in C where nothing is recorded), so every
walk of one schedule makes the same float operations.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from solvers.core.streams import Link, shared_links, stream_of

if TYPE_CHECKING:
    from solvers.core.problem import Problem
    from solvers.core.schedule import Schedule

_NAN = float("nan")
#: one issue or wait step of a walk: (is_issue, bucket index, compute nodes before it)
BucketStep = tuple[bool, int, int]
#: what a walk needs of a bucket: (copy-in ms, copy-out ms, communication ms alone, stream)
BucketCost = tuple[float, float, float, str]


def bucket_steps(schedule: "Schedule") -> tuple[BucketStep, ...]:
    """The issue and wait steps of ``schedule`` in order, each with its gap (the compute node
    steps before it)."""
    steps = schedule.steps
    idx = [k for k, s in enumerate(steps) if s.kind != "node"]
    return tuple((steps[k].kind == "issue", steps[k].ref, k - j) for j, k in enumerate(idx))


class Clock:
    """One run's compute stream and communication streams (module docstring).

    Args:
        rts: runtime of each compute node, in the order the run executes them (ms).
        costs: per bucket, its :data:`BucketCost`.
        links: stream -> the :class:`~solvers.core.streams.Link` it shares with other streams
            (:func:`~solvers.core.streams.shared_links`); streams left out run alone, FIFO.
        record: keep each step's times (the simulator's trace) and count the compute stream's
            busy time node by node; without, :attr:`busy` counts the copies only.

    After :meth:`finish`: :attr:`t` the step time, :attr:`exposed` the time the compute stream
    waited, :attr:`comm` each stream's busy time, :attr:`busy` as said above. With ``record``:
    :attr:`times` the time after every step (nodes, issues and waits, in the run's order),
    :attr:`node_times` (start, end) per compute node, :attr:`bucket_times` per bucket (issue,
    start, end, wait done), :attr:`bucket_exposed` the wait of each bucket that blocked.
    """

    def __init__(self, rts: Sequence[float], costs: Sequence[BucketCost], links: dict[str, Link] | None = None,
                 record: bool = False):
        self.rts = rts
        self.costs = costs
        self.links = links or None
        self.record = record
        self.t = 0.0
        self.busy = 0.0
        self.exposed = 0.0
        #: compute nodes run so far
        self.g = 0
        self.comm: dict[str, float] = {}
        #: stream -> when it is free (streams alone on their link)
        self.free: dict[str, float] = {}
        nb = len(costs)
        self.start = [0.0] * nb
        #: bucket -> when it ends; None: on a shared link, not asked yet
        self.end: list[float | None] = [0.0] * nb
        if record:
            self.times: list[float] = []
            self.node_times: list[tuple[float, float]] = []
            self.bucket_times: dict[int, tuple[float, float, float, float]] = {}
            self.bucket_exposed: dict[int, float] = {}

    def advance(self, steps: Sequence[BucketStep], lo: int = 0, hi: int | None = None) -> None:
        """Run ``steps[lo:hi]`` (and the compute nodes before each)."""
        rts, costs, links, record = self.rts, self.costs, self.links, self.record
        t, busy, exposed, g_prev = self.t, self.busy, self.exposed, self.g
        free, comm, start, end = self.free, self.comm, self.start, self.end
        for is_issue, b, gap in (steps if lo == 0 and hi is None else steps[lo:hi]):
            if gap != g_prev:
                if record:
                    t, busy = self._nodes(g_prev, gap, t, busy)
                elif gap == g_prev + 1:
                    t += rts[g_prev]
                else:
                    t = functools.reduce(operator.add, rts[g_prev:gap], t)
                g_prev = gap
            if is_issue:
                cin, _, dur, stream = costs[b]
                if record:
                    self.bucket_times[b] = (t, _NAN, _NAN, _NAN)
                t += cin
                busy += cin
                link = links.get(stream) if links else None
                if link is None:
                    f = free.get(stream, 0.0)
                    s = t if t >= f else f
                    start[b] = s
                    end[b] = free[stream] = s + dur
                else:
                    link.add(b, stream, t, dur)
                    end[b] = None
                comm[stream] = comm.get(stream, 0.0) + dur
            else:
                e = end[b]
                if e is None:
                    start[b], e = links[costs[b][3]].span(b)  # type: ignore[index]
                    end[b] = e
                if e > t:
                    exposed += e - t
                    if record:
                        self.bucket_exposed[b] = e - t
                    t = e
                cout = costs[b][1]
                t += cout
                busy += cout
                if record:
                    self.bucket_times[b] = (self.bucket_times[b][0], start[b], e, t)
            if record:
                self.times.append(t)
        self.t, self.busy, self.exposed, self.g = t, busy, exposed, g_prev

    def finish(self) -> None:
        """Run the compute nodes after the last step."""
        n = len(self.rts)
        if self.g < n:
            if self.record:
                self.t, self.busy = self._nodes(self.g, n, self.t, self.busy)
            else:
                self.t = functools.reduce(operator.add, self.rts[self.g:], self.t)
            self.g = n

    def _nodes(self, lo: int, hi: int, t: float, busy: float) -> tuple[float, float]:
        """Compute nodes ``lo`` to ``hi - 1``, one by one, recorded."""
        for rt in self.rts[lo:hi]:
            self.node_times.append((t, t + rt))
            t += rt
            busy += rt
            self.times.append(t)
        return t, busy

    def hold(self, b: int, start: float) -> None:
        """Start bucket ``b``, the last issued, no earlier than ``start`` (its stream alone on
        its link): when the other ranks of its group are ready later (lockstep ranks). It keeps
        its duration, and its stream stays busy until it ends."""
        stream = self.costs[b][3]
        if self.links and stream in self.links:
            raise ValueError(f"bucket {b} runs on a shared link; it cannot be held")
        if start > self.start[b]:
            self.end[b] = self.free[stream] = start + (self.end[b] - self.start[b])  # type: ignore[operator]
            self.start[b] = start


#: per problem (weak: the values hold no reference to it): the compute total and each bucket's
#: costs, shared by the problem's evaluators
_TIMES: "weakref.WeakKeyDictionary[Problem, tuple[float, dict]]" = weakref.WeakKeyDictionary()


class Timeline:
    """One problem's runtimes for walks of its schedules: the compute nodes in ``problem.seq``
    order, their total, and each bucket's costs (cached per problem)."""

    def __init__(self, p: "Problem"):
        self.p = p
        self.compute_ms = p.compute_ms
        cached = _TIMES.get(p)
        if cached is None:
            cached = _TIMES[p] = (functools.reduce(operator.add, self.compute_ms, 0.0), {})
        #: members -> (copy-in ms, copy-out ms, communication ms, group)
        self.total_compute_ms, self.costs = cached
        #: split groups -> (stream -> its link; (members -> cost on its stream))
        self.by_split: dict[frozenset, tuple[dict, dict]] = {}

    def cost(self, members: tuple[str, ...]) -> BucketCost:
        """The :data:`BucketCost` of a bucket of ``members`` on its group's own stream."""
        c = self.costs.get(members)
        if c is None:
            p = self.p
            c = self.costs[members] = (p.copy_in_ms(members), p.copy_out_ms(members), p.bucket_comm_ms(members),
                                       p.colls[members[0]].group_name)
        return c

    def _on_stream(self, members: tuple[str, ...], split: frozenset, on_stream: dict) -> BucketCost:
        """:meth:`cost` with the stream the bucket runs on where ``split`` groups are split,
        kept in ``on_stream``."""
        cin, cout, dur, group = self.cost(members)
        c = on_stream[members] = (cin, cout, dur, stream_of(self.p.colls[members[0]].coll_type, group, split))
        return c

    def run(self, steps: Sequence[BucketStep], members: Sequence[tuple[str, ...]],
            split_groups: tuple[str, ...] = ()) -> tuple[float, float, float, dict[str, float]]:
        """(step_ms, compute_ms, exposed_comm_ms, comm_ms per stream) of the schedule whose
        issue and wait steps are ``steps`` and buckets ``members``, walked by a :class:`Clock`
        without records (``compute_ms`` is the nodes' total plus the copies: the simulator's sum
        up to rounding)."""
        p = self.p
        links = None
        if split_groups or p.shares_links:
            split = frozenset(split_groups)
            if split not in self.by_split:
                self.by_split[split] = (p.stream_links(split_groups), {})
            link_of, on_stream = self.by_split[split]
            costs = [on_stream.get(m) or self._on_stream(m, split, on_stream) for m in members]
            links = shared_links(link_of)  # fresh links: they hold a run's state
        else:
            get = self.costs.get
            costs = [get(m) or self.cost(m) for m in members]
        clock = Clock(self.compute_ms, costs, links)
        clock.advance(steps)
        clock.finish()
        return clock.t, self.total_compute_ms + clock.busy, clock.exposed, clock.comm
