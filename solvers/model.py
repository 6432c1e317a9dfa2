"""The joint model, solver-neutral: its formulation and the data both backends write down.

Compute order is fixed (as traced). Decisions are taken at *anchors*: a subset of gaps of the
compute sequence (gap 0, the end, every collective's ready / needed / traced positions, and the
gap before every FLOP-carrying node). Between two anchors lies a *segment* of compute whose
duration is fixed. Times are integers in microseconds, memory in bytes. :class:`ModelData`
holds every datum below; :mod:`solvers.cpsat` writes the families in CP-SAT and
:mod:`solvers.milp` as a MILP, one function per family with the same name in both
(``add_timeline`` ... ``add_memory``).

Sets and data (:class:`ModelData`)
    a = lo..hi       modelled anchors (gap g_a): all of them, or a window's range;
                     segment a = seq[g_a : g_{a+1}] lasts seg_a                  (:class:`Anchors`)
    chains           per bucket key (type, group, dtype, reduce op), members k in need order
    d_k              beta * payload_k of member k (us); alpha_c the per-collective latency of k's
                     chain c; (alpha, beta): Problem.merged_line, the cost model's times
                     fitted over the payloads a merged bucket takes           (:class:`Member`)
    out_k, pay_k, grad_k   output / input / unreduced-gradient bytes
    copy_k           k's share of its bucket's copies when merged (us), as torch's merge
                     functions emit them (Problem.merge_copy_ms; f, c the fixed and per-byte
                     copy costs, P_k payload, Q_k bytes read: the input of the dtype cast the
                     merge folds, else P_k; cast_k that cast's time, taken back):
                       all-gather      c Q_k + c (Q_k + P_k) / 2 - cast_k   (copy-in)
                                       + f + c out_k                         (copy-out, per member)
                       reduce-scatter  c P_k
    fix_k            fixed copy cost of a merged bucket, charged at its first member
                     (Problem.merge_copy_fixed_ms): 2 f for all-gathers, f for reduce-scatters;
                     so that for any bucket B, sum_{k in B} (copy_k + pro_k + epi_k) + fix_k =
                     Problem.copy_in_ms(B) + Problem.copy_out_ms(B), up to rounding to us
    pro_k, epi_k     k's prologue casts (at issue) and epilogue casts (at the wait), run whether
                     merged or not (us)
    ch_k             anchor charged with k's copies: need_k (all-gathers), ready_k (reduce-scatters)
    [lo_k, hi_k]     issue range of k (anchors); reduce-scatters also a wait range [wlo_k, whi_k];
                     in a window of the search, within ``lns_radius_anchors`` of the reference
                     (the incumbent's) positions, or up to the position of the member it could
                     merge with (the chain's previous all-gather, next reduce-scatter): a trust
                     region
    F                fixed intervals: the reference's buckets without a decided member, each with
                     its group, issue and wait anchors, reference start ref_f, duration dur_f and
                     compute-stream copies cin_f (at issue) and cout_f (at wait)
                                                                           (:class:`FixedInterval`)
    cfix_a           constant compute-stream work at anchor a: sum of pro_k + epi_k charged at a, cin_f
                     of fixed intervals issued at a, cout_f of those waited at a
    base_a           memory at anchor a that no decision moves: the reference run's simulated
                     live bytes there minus the decided members' terms at their reference
                     positions (so the model shares the simulator's memory model)
    t_in             a window's entry: when the reference's compute stream reaches anchor lo
    cap              max_bucket_bytes (optional)

Variables
    brk_k  in {0,1}  k starts a new bucket (brk_k = 1 for a chain's first member)
    last_k in {0,1}  k closes its bucket: last_k = brk_{k+1} (1 at the chain's end)
    I_k    anchor    issue anchor of k's bucket; y_{k,a} = [I_k <= a]
    W_k    anchor    wait anchor (reduce-scatters); z_{k,a} = [W_k <= a]
    R_k    us        duration accumulated in k's bucket up to k
    Q_k    bytes     payload accumulated in k's bucket up to k (only with a cap)
    C_k, X_k us      start and end of k's bucket on its stream; E_k = C_k + alpha_c + R_k
    Cf_f   us        start of fixed interval f
    T_a, U_a us      compute stream arrives at / leaves anchor a
    mrg_k  in {0,1}  k's bucket has at least two members (mrg_k = 1 - brk_k last_k)
    lead_k in {0,1}  k is the first member of a merged bucket (lead_k = brk_k mrg_k)
    e_{k,a} in {0,1} reduce-scatter k is issued at a and merged (its merge transient)
    P      bytes     peak memory
    Z      us        a window's exit state

Objective: minimise U_hi (the step time; for a window, its exit state Z).

Constraints (family: CP-SAT function / MILP function, the same name in both modules)
    (1) timeline   T_lo = 0 (a window: T_lo = t_in); T_{a+1} = U_a + seg_a; U_a >= T_a;
                   a window: Z >= U_hi                                          -> add_timeline
    (2) buckets    brk_k = 0 => I_k = I_{k-1}, W_k = W_{k-1}, C_k = C_{k-1};
                   I_k >= I_{k-1}, W_k >= W_{k-1};
                   R_k = d_k + (1 - brk_k) R_{k-1};
                   X_k = E_k when last_k, else X_k = X_{k+1};
                   (cap) Q_k = pay_k + (1 - brk_k) Q_{k-1} <= max(cap, pay_k)  -> add_buckets
    (3) issue      lo_k <= I_k <= hi_k; I_k >= a => C_k >= T_a                  -> add_issue
    (4) waits      all-gather: U_{need_k} >= X_k; reduce-scatter: W_k >= I_k,
                   W_k <= a => U_a >= X_k, U_{whi_k} >= X_k                      -> add_waits
    (5) streams    one FIFO stream per process group: the intervals [C_k, E_k) present when
                   last_k, and [Cf_f, Cf_f + dur_f) of fixed intervals, do not overlap;
                   a chain's buckets run in chain order: brk_k => C_k >= X_{k-1};
                   fixed intervals keep their reference order; one issued before the range
                   starts at or after ref_f and every decided bucket of its group starts after
                   it ends (FIFO); one issued in range at anchor i: Cf_f >= T_i; one waited at
                   anchor w: U_w >= Cf_f + dur_f; a window: Z >= E_k and Z >= Cf_f + dur_f
                   (no work pushed past the window unseen)                      -> add_streams
    (6) compute    U_a >= T_a + cfix_a + sum_{k: ch_k = a} (copy_k mrg_k + fix_k lead_k)
        stream                                                                  -> add_copy_costs
    (7) memory     for every anchor a:
                   base_a + sum_AG out_k y_{k,a}                           (a < need_k)
                          + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} - z_{k,a}) + out_k y_{k,a}]
                          + sum_RS grad_k e_{k,a}   (merge transient: the members' gradients
                                                     and the new bucket buffer at once)
                   <= P <= mem_budget_bytes                                      -> add_memory

The MILP writes (2)-(4) with big-Ms from the time bounds of a known solution, and (5) with one
order binary per pair of buckets of one group whose time bounds overlap (see :mod:`solvers.milp`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Callable

from solvers.config import ModelConfig
from solvers.core.plan import PlannedBucket
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, Schedule
from solvers.core.simulator import simulate
from solvers.core.units import US_PER_MS


def us(ms: float) -> int:
    """Milliseconds as the model's integer microseconds."""
    return int(round(ms * US_PER_MS))


class Anchors:
    """Anchor gaps and the segments between them (see the module docstring)."""

    def __init__(self, problem: Problem):
        gaps = {0, problem.n}
        for c in problem.colls.values():
            gaps.update((c.ready, c.needed, c.traced_issue, c.traced_wait))
        dag = problem.dag
        for p, name in enumerate(problem.seq):
            if dag.nodes[name].get("flops", 0) > 0:
                gaps.add(p)
        self.gaps = sorted(gaps)
        self.m = len(self.gaps) - 1
        self.index = {g: a for a, g in enumerate(self.gaps)}
        prefix = [0.0]
        for v in problem.compute_ms:
            prefix.append(prefix[-1] + v)
        self.seg_us = [us(prefix[self.gaps[a + 1]] - prefix[self.gaps[a]]) for a in range(self.m)]

    def at_or_before(self, gap: int) -> int:
        """Index of the last anchor whose gap is <= gap."""
        return bisect.bisect_right(self.gaps, gap) - 1

    def exact(self, gap: int) -> int:
        a = self.at_or_before(gap)
        assert self.gaps[a] == gap, gap
        return a


@dataclasses.dataclass
class Member:
    """One decided collective: its chain, issue and wait ranges (anchors), durations (us) and bytes."""

    name: str
    chain: int
    idx: int
    coll_type: str
    lo: int
    hi: int  #: issue range [lo, hi]
    need: int  #: anchor of first use (all-gathers wait there)
    wlo: int = 0
    whi: int = 0  #: wait range [wlo, whi] (reduce-scatters)
    d_us: int = 0
    out_bytes: int = 0
    pay_bytes: int = 0
    grad_bytes: int = 0
    copy_us: int = 0
    copy_fixed_us: int = 0  #: per merged bucket (kernel overheads), charged at its first member
    prologue_us: int = 0  #: casts run at issue whether merged or not
    epilogue_us: int = 0  #: casts run at the wait whether merged or not
    charge: int = 0  #: anchor charged with the merge copies

    @property
    def waited_at_need(self) -> bool:
        """An all-gather is waited where it is first needed; every other collective (a
        reduce-scatter, an all-reduce, an all-to-all) has a wait range of its own."""
        return self.coll_type == "all_gather"

    @property
    def wait_end(self) -> int:
        """The last anchor at which k's bucket may be waited."""
        return self.need if self.waited_at_need else self.whi


@dataclasses.dataclass(frozen=True)
class FixedInterval:
    """A bucket kept at its reference position: anchors of its issue and wait (None when
    waited outside the modelled range), its reference start and duration on its stream, and
    its compute-stream work at issue and wait (us)."""

    bucket: int
    group: str
    issue: int
    wait: int | None
    before_range: bool
    ref_start_us: int
    dur_us: int
    copy_in_us: int
    copy_out_us: int


@dataclasses.dataclass(frozen=True)
class Decisions:
    """Values of the decision variables: bucket breaks, issue anchors, wait anchors (reduce-
    scatters). Every backend's solution is read into this, and a schedule out of it
    (:meth:`ModelData.extract`, through a plan): the model's variables, not a schedule."""

    brk: dict[str, int]
    issue: dict[str, int]
    wait: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Solution(Decisions):
    """A complete solution: the decisions and every time variable (us), by family."""

    C: dict[str, int]
    X: dict[str, int]
    R: dict[str, int]
    T: dict[int, int]
    U: dict[int, int]
    Z: int
    fixed_start: dict[int, int]  #: Cf_f by reference bucket index
    objective_us: int


#: ``complete(data, schedule, work_limit, seed, num_workers) -> Solution | None``: ``schedule``
#: completed to a full solution of ``data``'s model (its decisions fixed, the tightest times),
#: None when its decisions do not fit; a backend that needs a warm start is given one
#: (:func:`solvers.cpsat.complete_solution`), never imports another backend
Completion = Callable[["ModelData", Schedule, float, int, int], "Solution | None"]


@dataclasses.dataclass(frozen=True)
class TimeGuide:
    """Times of a schedule's simulated run, as guidance for a model's time variables (us)."""

    C: dict[str, int]
    X: dict[str, int]
    U: dict[int, int]


class ModelData:
    """Every datum of the model of the module docstring, for one problem and budget.

    ``free`` (None: every movable collective) restricts the decisions to some collectives;
    every bucket of ``reference`` (default: the traced order) without a free member is then a
    fixed interval at its reference position, the modelled anchors shrink to the range around
    the free collectives, and memory is calibrated on the reference's simulation. Windows of
    the neighbourhood search are such small models.
    """

    def __init__(
        self,
        problem: Problem,
        cfg: ModelConfig,
        mem_budget_bytes: int | None,
        *,
        free: set[str] | None = None,
        reference: Schedule | None = None,
        anchors: Anchors | None = None,
    ):
        self.p = problem
        self.cfg = cfg
        self.mem_budget_bytes = mem_budget_bytes
        self.anchors = anchors or Anchors(problem)
        self.free = free
        self.reference = reference or problem.traced_schedule()
        ref_issue, ref_wait = self.reference.positions()
        #: reference issue / wait gap of every collective
        self.ref_pos = {n: (ref_issue[b], ref_wait[b]) for n, b in self.reference.bucket_of().items()}
        #: the reference run: memory calibration, a window's entry, the fixed intervals
        self.ref_sim = simulate(problem.dag, self.reference, problem=problem)
        #: reference buckets kept fixed (indices into reference.buckets)
        self.fixed_buckets = [
            b
            for b, bucket in enumerate(self.reference.buckets)
            if (free is not None and not (set(bucket.members) & free))
            or (free is None and not any(problem.colls[m].movable for m in bucket.members))
        ]
        self.horizon_us = us((problem.total_compute_ms + sum(c.runtime_ms for c in problem.colls.values())) * 2 + 10)
        self.chains, self.alpha_us = self._members()
        self.member = {x.name: x for chain in self.chains for x in chain}
        #: modelled anchors: all of them, or a window's range
        self.a_lo, self.a_hi = self._range() if free is not None else (0, self.anchors.m)
        self.t_in_us = self.ref_arrival_us(self.a_lo)
        self.fixed = self._fixed_intervals()
        self.fixed_copy_us = self._fixed_copy_us()
        self.base_mem, self.peak_upper_bytes = self._calibrate_memory()

    # -- shape -------------------------------------------------------------------------------
    @property
    def anchor_range(self) -> range:
        return range(self.a_lo, self.a_hi + 1)

    @property
    def is_window(self) -> bool:
        """The model ends before the graph does: its objective is the exit state Z."""
        return self.a_hi != self.anchors.m

    def ref_arrival_us(self, a: int) -> int:
        """When the reference's compute stream reaches anchor a (end of the node before it)."""
        g = self.anchors.gaps[a]
        if g == 0:
            return 0
        return us(self.ref_sim.node_times[self.p.seq[g - 1]][1])

    # -- data --------------------------------------------------------------------------------
    def _members(self) -> tuple[list[list[Member]], list[int]]:
        p, A, cfg, dag = self.p, self.anchors, self.cfg, self.p.dag
        radius = cfg.lns_radius_anchors if self.free is not None else None
        chains: list[list[Member]] = []
        alpha_us: list[int] = []
        for key, names in sorted(p.chains.items(), key=lambda kv: str(kv[0])):
            if self.free is not None:
                names = [n for n in names if n in self.free]
                if not names:
                    continue
            ci = len(chains)
            coll_type, group = key[0], key[1]
            alpha_ms, beta = p.merged_line(coll_type, group)
            alpha_us.append(us(alpha_ms))
            members = []
            for k, name in enumerate(names):
                c = p.colls[name]
                ready_a, need_a = A.exact(c.ready), A.exact(c.needed)
                ti, tw = (A.at_or_before(g) for g in self.ref_pos[name])
                if coll_type == "all_gather":
                    lo, hi = min(ti, max(ready_a, need_a - cfg.issue_reach_anchors)), need_a
                else:
                    lo, hi = ready_a, max(ti, min(need_a, ready_a + cfg.issue_reach_anchors))
                if radius is not None:
                    # trust region around the incumbent (an all-gather is still waited at its
                    # need), reaching the position of the chain's neighbour it could merge with
                    # (the previous all-gather, the next reduce-scatter)
                    if coll_type == "all_gather":
                        neighbour = A.at_or_before(self.ref_pos[names[k - 1]][0]) if k else ti
                        lo = max(lo, min(ti - radius, neighbour, hi))
                    else:
                        neighbour = A.at_or_before(self.ref_pos[names[k + 1]][0]) if k + 1 < len(names) else ti
                        lo = max(lo, min(ti, hi) - radius)
                        hi = min(hi, max(ti + radius, neighbour, lo))
                x = Member(name=name, chain=ci, idx=k, coll_type=coll_type, lo=lo, hi=hi, need=need_a)
                if not x.waited_at_need:
                    x.wlo = lo
                    x.whi = max(tw, min(need_a, hi + cfg.wait_reach_anchors))
                    if radius is not None:
                        x.whi = max(hi, min(x.whi, max(tw, lo) + radius))
                x.d_us = us(beta * c.payload_bytes)
                x.out_bytes = c.out_bytes
                x.pay_bytes = c.payload_bytes
                head = c.prologue[0] if c.prologue else name
                x.grad_bytes = sum(dag.nodes[u]["size_bytes"] for u in dag.predecessors(head))
                x.copy_us = us(sum(p.merge_copy_ms(c)))
                x.copy_fixed_us = us(sum(p.merge_copy_fixed_ms(coll_type)))
                x.prologue_us = us(c.prologue_ms)
                x.epilogue_us = us(c.epilogue_ms)
                x.charge = need_a if coll_type == "all_gather" else ready_a
                members.append(x)
            chains.append(members)
        return chains, alpha_us

    def _range(self) -> tuple[int, int]:
        """A window models only the anchors around its free collectives."""
        A, margin = self.anchors, self.cfg.lns_range_margin_anchors
        if not self.member:
            return 0, A.m
        lo = min(min(x.lo, x.charge) for x in self.member.values())
        # all-gathers are waited at their need; reduce-scatters by the end of their wait range
        hi = max(x.wait_end for x in self.member.values())
        for x in self.member.values():
            gi, gw = self.ref_pos[x.name]
            lo, hi = min(lo, A.at_or_before(gi)), max(hi, A.at_or_before(gw))
        return max(0, lo - margin), min(A.m, hi + margin)

    def _fixed_intervals(self) -> list[FixedInterval]:
        """The reference's fixed buckets that matter to the modelled range: issued in it, or
        issued before it and still running when it starts."""
        p, A = self.p, self.anchors
        out = []
        for b in self.fixed_buckets:
            members = self.reference.buckets[b].members
            gi, gw = self.ref_pos[members[0]]
            ai, aw = A.at_or_before(gi), A.at_or_before(gw)
            ref_start, ref_end = self.ref_sim.bucket_times[b][1:3]
            if ai > self.a_hi or (ai < self.a_lo and us(ref_end) <= self.t_in_us):
                continue  # outside the range, or done before it starts
            out.append(FixedInterval(
                bucket=b, group=p.colls[members[0]].group_name, issue=ai,
                wait=aw if self.a_lo <= aw <= self.a_hi else None, before_range=ai < self.a_lo,
                ref_start_us=us(ref_start),
                dur_us=us(p.bucket_comm_ms(members)),
                copy_in_us=us(p.copy_in_ms(members)),
                copy_out_us=us(p.copy_out_ms(members)),
            ))
        return out

    def _fixed_copy_us(self) -> dict[int, int]:
        """cfix_a: prologues of decided members and copies of fixed intervals, per anchor."""
        out: dict[int, int] = defaultdict(int)
        for x in self.member.values():
            if x.prologue_us or x.epilogue_us:
                out[x.charge] += x.prologue_us + x.epilogue_us
        for f in self.fixed:
            if f.copy_in_us and not f.before_range:
                out[f.issue] += f.copy_in_us
            if f.copy_out_us and f.wait is not None:
                out[f.wait] += f.copy_out_us
        return dict(out)

    def _calibrate_memory(self) -> tuple[list[int], int]:
        """base_a (see the module docstring) and an upper bound of the peak."""
        A = self.anchors
        seg_live = [0] * (A.m + 1)  # live bytes at node steps, max per segment
        nodes_seen = 0
        for step, live in zip(self.reference.steps, self.ref_sim.step_live_bytes):
            seg = A.at_or_before(nodes_seen)
            if step.kind != "node":
                continue  # issue / wait instants are transients, priced by their own terms
            nodes_seen += 1
            seg_live[seg] = max(seg_live[seg], live)
        # the end anchor runs no node: what is live there is at most what the last node saw
        seg_live[A.m] = seg_live[A.m - 1] if A.m else seg_live[0]
        at_ref = [0] * (A.m + 1)
        for x in self.member.values():
            ti, tw = (A.at_or_before(g) for g in self.ref_pos[x.name])
            if x.coll_type == "all_gather":
                for a in range(x.lo, x.need):
                    at_ref[a] += x.out_bytes * (ti <= a)
            else:
                for a in range(x.lo, x.whi):
                    at_ref[a] += x.grad_bytes * (ti > a) + x.pay_bytes * ((ti <= a) - (tw <= a)) + x.out_bytes * (ti <= a)
        base = [max(0, seg_live[a] - at_ref[a]) for a in range(A.m + 1)]
        upper = max(seg_live) * 4 + sum(x.out_bytes + x.pay_bytes + x.grad_bytes for x in self.member.values())
        return base, upper

    # -- hints -------------------------------------------------------------------------------
    def decisions_of(self, schedule: Schedule, *, per_bucket: bool = True) -> Decisions:
        """``schedule``'s decisions snapped into the members' issue and wait ranges: bucket by bucket (members of a
        bucket share anchors), or member by member (``per_bucket=False``, a looser hint)."""
        A = self.anchors
        bucket_of = schedule.bucket_of()
        issue_gap, wait_gap = schedule.positions()
        issue: dict[str, int] = {}
        wait: dict[str, int] = {}
        if per_bucket:
            for b, bucket in enumerate(schedule.buckets):
                ms = [self.member[n] for n in bucket.members if n in self.member]
                if not ms:
                    continue
                i = min(min(x.hi for x in ms), max(max(x.lo for x in ms), A.at_or_before(issue_gap[b])))
                for x in ms:
                    issue[x.name] = i
                    if not x.waited_at_need:
                        wait[x.name] = min(min(y.whi for y in ms), max(max(y.wlo for y in ms), i,
                                                                        A.at_or_before(wait_gap[b])))
        else:
            for x in self.member.values():
                b = bucket_of[x.name]
                issue[x.name] = min(x.hi, max(x.lo, A.at_or_before(issue_gap[b])))
                if not x.waited_at_need:
                    wait[x.name] = min(x.whi, max(x.wlo, A.at_or_before(wait_gap[b])))
        brk: dict[str, int] = {}
        for chain in self.chains:
            prev_b = None
            for x in chain:
                b = bucket_of[x.name]
                brk[x.name] = 1 if prev_b is None else int(b != prev_b)
                prev_b = b
        return Decisions(brk=brk, issue=issue, wait=wait)

    def times_of(self, schedule: Schedule) -> TimeGuide:
        """Simulated start / end of ``schedule``'s buckets and departures from anchors."""
        p, A = self.p, self.anchors
        sim = self.ref_sim if schedule is self.reference else simulate(p.dag, schedule, problem=p)
        C: dict[str, int] = {}
        X: dict[str, int] = {}
        for b, (_i, start, end, _d) in sim.bucket_times.items():
            for n in schedule.buckets[b].members:
                if n in self.member:
                    C[n], X[n] = us(start), us(end)
        U: dict[int, int] = {}
        node_start = {n: t0 for n, (t0, _t1) in sim.node_times.items()}
        for a, g in enumerate(A.gaps[:-1]):
            t = node_start.get(p.seq[g])
            if t is not None and self.a_lo <= a <= self.a_hi:
                U[a] = us(t)
        return TimeGuide(C=C, X=X, U=U)

    # -- extraction --------------------------------------------------------------------------
    def extract(self, d: Decisions) -> Schedule:
        """The schedule of decision values ``d``, with every fixed bucket at its reference
        position; buckets issue in order of issue gap, then wait gap."""
        p = self.p
        plan: list[PlannedBucket] = []
        for chain in self.chains:
            cur: list[str] = []
            for k, x in enumerate(chain):
                if k > 0 and d.brk[x.name]:
                    plan.append(self._close(cur, d))
                    cur = []
                cur.append(x.name)
            if cur:
                plan.append(self._close(cur, d))
        for b in self.fixed_buckets:
            members = self.reference.buckets[b].members
            gi, gw = self.ref_pos[members[0]]
            plan.append(PlannedBucket(Bucket(tuple(members)), gi, gw))
        order = sorted(range(len(plan)), key=lambda i: (plan[i].issue_at, plan[i].wait_at))
        return p.schedule_at([plan[i].bucket for i in order], [plan[i].issue_at for i in order],
                             [plan[i].wait_at for i in order])

    def _close(self, members: list[str], d: Decisions) -> PlannedBucket:
        A, p = self.anchors, self.p
        first = members[0]
        gi = A.gaps[d.issue[first]]
        gw = A.gaps[d.wait[first]] if first in d.wait else min(p.colls[x].needed for x in members)
        return PlannedBucket(Bucket(tuple(members)), gi, max(gi, gw))
