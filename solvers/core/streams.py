"""Communication streams, and the network links they share.

Each stream is FIFO: a collective starts when it is issued and the collective before it on the
same stream has ended. A stream is a process group, or, for the all-gathers of a group that a
schedule *splits* (:attr:`solvers.core.schedule.Schedule.split_groups`), a second process group
of the same ranks (:func:`stream_of`): all-gathers then run beside that group's reduce-scatters
instead of queueing behind them.

Streams whose groups have the same ranks share one network link
(:attr:`~solvers.core.problem.Problem.group_links`, :meth:`~solvers.core.problem.Problem.stream_links`). The model of a shared link is processor sharing:
while ``k`` of its streams each have a collective in flight, each progresses at ``1 / k`` of the
speed it has alone (its time alone is the cost model's). Two streams never move more data per
second than one; what a second stream buys is that a short collective needed soon no longer
waits for a long one queued before it, and what it costs is that the long one ends later. The
last of them ends when it would on one stream, so total link time is conserved: a model that
gives two streams double the bandwidth would make splitting look free, and a model that charges
contention (NCCL kernels of two streams competing for SMs) would need a measurement of it.

A stream alone on its link is priced exactly as before any link existed: ``end = max(issue,
stream free) + duration``, in those float operations (:class:`solvers.core.timeline.Clock`, the
one walk of the execution model's time, which asks a :class:`Link` only for the streams that
share one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping

_INF = float("inf")

#: suffix of the stream (and of the second process group the write-back creates) that carries a
#: split group's all-gathers
SPLIT_SUFFIX = "+ag"


def stream_of(coll_type: str, group_name: str, split_groups: frozenset[str] | tuple[str, ...]) -> str:
    """The stream a collective of ``group_name`` runs on: the group's own, or its second stream
    when it is an all-gather of a split group."""
    if coll_type == "all_gather" and group_name in split_groups:
        return group_name + SPLIT_SUFFIX
    return group_name


def shared_links(link_of: Mapping[str, Hashable] | None) -> dict[str, "Link"]:
    """Stream -> the :class:`Link` it shares with other streams, for the streams of ``link_of``
    (stream -> its link) that share one; a stream alone on its link is left out: it is priced
    alone, FIFO (:class:`solvers.core.timeline.Clock`)."""
    by_link: dict[Hashable, list[str]] = {}
    for stream, link in (link_of or {}).items():
        by_link.setdefault(link, []).append(stream)
    out: dict[str, Link] = {}
    for streams in by_link.values():
        if len(streams) > 1:
            link = Link()
            for stream in streams:
                out[stream] = link
    return out


class Link:
    """Processor sharing among the FIFO streams of one link, simulated as far as asked: a run
    :meth:`add` s each bucket at its issue and asks for its :meth:`span` at its wait; every
    bucket issued after that wait starts after the wait returns, so the answer is final."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queues: dict[str, deque[tuple[int, float, float]]] = {}
        #: stream -> [bucket, start, work left (ms alone)]
        self.active: dict[str, list] = {}
        self.idle_since: dict[str, float] = {}
        self.done: dict[int, tuple[float, float]] = {}

    def add(self, b: int, stream: str, t: float, duration: float) -> None:
        self.queues.setdefault(stream, deque()).append((b, t, duration))

    def span(self, b: int) -> tuple[float, float]:
        """(start, end) of bucket ``b`` on the link, ms."""
        self.resolve(b)
        return self.done[b]

    def resolve(self, b: int) -> None:
        """Advance until bucket ``b`` has ended: event by event, each the end of the active
        bucket with least work left (it and any within rounding of none end) or the start of
        a queued one, every active bucket progressing at ``1 / k`` in between. (The walk's
        inner loop, run for every wait on a shared link: written with locals, one pass each.)"""
        done = self.done
        if b in done:
            return
        queues, active, idle_since = self.queues, self.active, self.idle_since
        now = self.now
        while b not in done:
            # start the head of every idle stream whose bucket is issued and whose stream is free
            for s, q in queues.items():
                if q and s not in active:
                    head, issued, duration = q[0]
                    idle = idle_since.get(s, 0.0)
                    if max(issued, idle) <= now:
                        q.popleft()
                        active[s] = [head, now, duration]
            k = len(active)
            if k:
                ending = next(iter(active)) if k == 1 else min(active, key=lambda s: (active[s][2], s))
                t = now + active[ending][2] * k
            else:
                ending, t = None, _INF
            for s, q in queues.items():
                if q and s not in active:
                    ready = max(q[0][1], idle_since.get(s, 0.0))
                    if ready < t:
                        t, ending = ready, None
            if t == _INF:
                self.now = now
                raise RuntimeError(f"bucket {b} is waited but was never issued on this link")
            if k:
                progress = (t - now) / k
                for entry in active.values():
                    entry[2] -= progress
                for s in [s for s, entry in active.items() if s == ending or entry[2] <= 1e-12]:
                    head, start, _ = active.pop(s)
                    done[head] = (start, t)
                    idle_since[s] = t
            now = t
        self.now = now
