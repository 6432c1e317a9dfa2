"""The analytic lower bound on the step time of any valid schedule of a problem
(:meth:`solvers.core.problem.Problem.lower_bound_ms`, which computes it once per problem)."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import TYPE_CHECKING

from solvers.core.units import interpolate

if TYPE_CHECKING:
    from solvers.core.problem import Collective, Problem


def lower_bound_ms(p: Problem) -> float:
    """Analytic lower bound on the simulated step time of *any* valid schedule (ms).

    ``P[g]`` is the compute of the nodes before gap ``g``; a collective adds at least its
    least copy-in (:func:`_least_copy_in_ms`) to the compute stream at its bucket's issue
    and its epilogue at the wait. The largest of:

    - compute: ``P[n]`` plus every collective's least work (waits only add);
    - per collective ``c``: its bucket is issued no earlier than the compute stream reaches
      gap ``ready_c`` (the earliest start, below), takes its copy-in and at least
      :func:`_least_comm_ms`; the compute stream then runs ``c``'s epilogue, the nodes from
      ``needed_c`` on and the work of every collective that cannot be issued before ``c``'s
      wait (``ready > needed_c``);
    - per stream (process group) and ``k``: its ``k`` collectives needed first are all
      waited before the node at the latest of their ``needed``; their transfers run one
      after another, each at least its share (:func:`_least_stream_ms`), from the earliest
      start of any of them; then a wait's epilogue, the nodes from that ``needed`` on and
      the work of the collectives issued only after it.

    The earliest start: the compute stream reaches gap ``g`` no earlier than ``P[g]``, nor
    than the end of a collective (or of a stream's first ``k``, as above) needed before
    ``g`` plus its epilogue and the nodes from that ``needed`` to ``g``. Work that may run
    while a collective is in flight (the prologue casts of other all-gathers) is counted
    after it only where it must follow its wait.
    """
    n = p.n
    prefix = [0.0]
    for v in p.compute_ms:
        prefix.append(prefix[-1] + v)
    colls = list(p.colls.values())
    if not colls:
        return prefix[n]
    chains = _chain_payload_range(p)
    least_in = {c.name: _least_copy_in_ms(p, c) for c in colls}
    work = {c.name: _least_work_ms(p, c) for c in colls}
    # the work of the collectives issued only after gap g: suffix sums over their ready gaps
    by_ready = sorted(colls, key=lambda c: (c.ready, c.needed, c.traced_issue))
    readies = [c.ready for c in by_ready]
    suffix = [0.0] * (len(by_ready) + 1)
    for k in range(len(by_ready) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + work[by_ready[k].name]

    def forced(gap: int) -> float:
        return suffix[bisect.bisect_right(readies, gap)]

    # per stream, its collectives in the order they are needed, and the least transfer
    # time of the first k of them
    streams: dict[str, list[Collective]] = {}
    for c in sorted(colls, key=lambda c: (c.needed, c.ready, c.traced_issue)):
        streams.setdefault(c.group_name, []).append(c)
    busy = {g: list(itertools.accumulate(_least_stream_ms(p, c, chains) for c in cs)) for g, cs in streams.items()}
    # what ends before a node: (needed, collective or (stream, k)), activated in needed order
    events = sorted([(c.needed, 0, c.name) for c in colls]
                    + [(cs[k].needed, 1, (g, k)) for g, cs in streams.items() for k in range(len(cs))],
                    key=lambda e: (e[0], e[1], str(e[2])))
    start: dict[str, float] = {}  # collective -> least start of its transfer (set once)
    # per stream, the running minima of its collectives' starts and epilogues, extended as
    # far as asked (a start is set once, before any first k holding it is asked for)
    least: dict[str, list[tuple[float, float]]] = {g: [] for g in streams}

    def first_k(g: str, k: int) -> tuple[float, float]:
        """(least end of the transfers of stream g's first k + 1, least epilogue among them)."""
        mins = least[g]
        while len(mins) <= k:
            c = streams[g][len(mins)]
            s0, e0 = mins[-1] if mins else (math.inf, math.inf)
            mins.append((min(s0, start[c.name]), min(e0, c.epilogue_ms)))
        return mins[k][0] + busy[g][k], mins[k][1]

    bounds = [prefix[n] + sum(work.values())]
    delay, e = 0.0, 0
    for c in by_ready:
        while e < len(events) and events[e][0] < c.ready:
            needed, kind, ref = events[e]
            if kind == 0:  # its copy-in and copy-out together at least its work
                d = p.colls[ref]
                end, epi = start[ref] - least_in[ref] + _least_comm_ms(p, d, chains), work[ref]
            else:
                end, epi = first_k(*ref)
            delay = max(delay, end + epi - prefix[needed])
            e += 1
        start[c.name] = prefix[c.ready] + delay + least_in[c.name]
        end = prefix[c.ready] + delay + _least_comm_ms(p, c, chains) + work[c.name]
        bounds.append(end + prefix[n] - prefix[c.needed] + forced(c.needed))
    for g, cs in streams.items():
        for k, c in enumerate(cs):
            end, epi = first_k(g, k)
            bounds.append(end + epi + prefix[n] - prefix[c.needed] + forced(c.needed))
    return max(bounds)


def _mergeable(p: Problem, c: Collective) -> bool:
    """Whether ``c`` may share a bucket: movable, with another collective of its key."""
    return c.movable and len(p.chains.get(c.key, ())) > 1


def _least_work_ms(p: Problem, c: Collective) -> float:
    """The least compute-stream time ``c`` adds at its issue and wait together (ms): its
    prologue and epilogue, and when it may be merged its shares of the copy-in and copy-out
    where they add up to less than nothing (folded casts taken back)."""
    t = c.prologue_ms + c.epilogue_ms
    if _mergeable(p, c):
        t += min(0.0, sum(p.merge_copy_ms(c)))
    return t


def _least_copy_in_ms(p: Problem, c: Collective) -> float:
    """The least compute-stream time ``c`` adds at its bucket's issue (ms): its prologue,
    and when it may be merged its share of the copy-in where that is negative (a folded
    cast taken back); a bucket's fixed part is never negative."""
    t = c.prologue_ms
    if _mergeable(p, c):
        t += min(0.0, p.merge_copy_ms(c)[0])
    return t


def _chain_payload_range(p: Problem) -> dict[tuple, tuple[int, int]]:
    """Chain key -> (smallest positive payload, total payload) of its members: the range of a
    merged bucket's payload (one of all-zero payloads aside)."""
    out = {}
    for key, members in p.chains.items():
        pays = [p.colls[m].payload_bytes for m in members]
        out[key] = (min((x for x in pays if x > 0), default=0), sum(pays))
    return out


def _least_comm_ms(p: Problem, c: Collective, chains: dict[tuple, tuple[int, int]]) -> float:
    """The least communication time of a bucket holding ``c`` (ms): its own time alone, or
    the least time of a merged bucket whose payload lies between ``c``'s and its chain's
    (``chains``: :func:`_chain_payload_range`; :meth:`Problem.bucket_comm_ms`)."""
    if not _mergeable(p, c):
        return c.runtime_ms
    m = p.comm_model.get(f"{c.coll_type}|{c.group_name}")
    if m is None:  # merged buckets cost the sum of their members' times
        return c.runtime_ms
    return min(c.runtime_ms, _merged_inf(m, c.payload_bytes, chains[c.key][1], per_byte=False))


def _least_stream_ms(p: Problem, c: Collective, chains: dict[tuple, tuple[int, int]]) -> float:
    """``c``'s least share of its stream's busy time (ms): its own time alone, or its
    payload at the least per-byte time of a merged bucket of its chain. Any bucketing's
    transfers take at least the sum of these shares."""
    if not _mergeable(p, c):
        return c.runtime_ms
    m = p.comm_model.get(f"{c.coll_type}|{c.group_name}")
    if m is None or c.payload_bytes == 0:
        return c.runtime_ms if m is None else 0.0
    lo, hi = chains[c.key]
    return min(c.runtime_ms, _merged_inf(m, lo, hi, per_byte=True) * c.payload_bytes)


def _merged_inf(model: dict, lo: float, hi: float, *, per_byte: bool) -> float:
    """The least time (``per_byte``: time per byte) of a merged bucket of payload in
    ``[lo, hi]`` under ``model`` (a ``comm_model`` entry, priced as
    :meth:`Problem.bucket_comm_ms` prices more than one member: the table within its range, the
    line outside it). Both are piecewise linear (per byte: monotone on each piece), so the least
    is at a range end, a table point inside the range, or a one-sided limit at a table end."""
    alpha, beta = float(model["alpha_ms"]), float(model["beta_ms_per_byte"])
    table = model.get("table") or []
    values: list[tuple[float, float]] = []  # (payload, ms)
    line = lambda x: alpha + beta * x  # noqa: E731
    if table:
        x0, x1 = table[0][0], table[-1][0]
        if lo < x0:
            values += [(lo, line(lo)), (min(hi, x0), line(min(hi, x0)))]
        if hi > x1:
            values += [(max(lo, x1), line(max(lo, x1))), (hi, line(hi))]
        a, b = max(lo, x0), min(hi, x1)
        if a <= b:
            values += [(a, interpolate(table, a)), (b, interpolate(table, b))]
            values += [(float(x), float(y)) for x, y in table if a < x < b]
    else:
        values += [(lo, line(lo)), (hi, line(hi))]
    if per_byte:
        return max(0.0, min(ms / x for x, ms in values if x > 0)) if any(x > 0 for x, _ in values) else 0.0
    return max(0.0, min(ms for _, ms in values))
