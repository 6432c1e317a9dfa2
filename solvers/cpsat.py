"""Joint CP-SAT model: bucketing, all-gather prefetch, reduce-scatter interleaving, memory.

Compute order is fixed (as traced). Decisions are taken at *anchors*: a subset of gaps of the
compute sequence (gap 0, the end, every collective's ready / needed / traced positions, and the
gap before every FLOP-carrying node). Between two anchors lies a *segment* of compute whose
duration is fixed. Times are integers in microseconds, memory in bytes.

Sets and data
    a = 0..m         anchors (gap g_a), segment a = seq[g_a : g_{a+1}] lasting seg_a
    chains           per bucket key (type, group, dtype, reduce op), members k in need order
    d_k              beta * payload_k of member k (us); alpha_c the per-collective latency
    out_k, pay_k, grad_k   output / input / unreduced-gradient bytes
    [lo_k, hi_k]     issue window of k in anchors; reduce-scatters also a wait window

Variables
    brk_k  in {0,1}  member k starts a new bucket (brk_0 = 1)
    I_k    anchor    issue anchor of k's bucket;  y_{k,a} = [I_k <= a]
    W_k    anchor    wait anchor (reduce-scatters); z_{k,a} = [W_k <= a]
    R_k    us        duration accumulated in k's bucket up to k
    C_k, X_k us      start and end of k's bucket on its stream
    T_a, U_a us      compute stream arrives at / leaves anchor a
    mrg_k  in {0,1}  k's bucket has at least two members

Objective: minimise U_m (step time); a second phase then minimises peak memory and the number
of buckets with the step time held at its optimum.

Constraints (each group is one function)
    (1) timeline          T_0 = 0, U_a >= T_a + copy_a, T_{a+1} = U_a + seg_a
                          -> :func:`_add_timeline`
    (2) buckets           brk_k = 0 => I_k = I_{k-1}, W_k = W_{k-1}, C_k = C_{k-1};
                          R_k = d_k + (1 - brk_k) R_{k-1}; X_k = C_k + alpha + R_k when k is the
                          last member, else X_k = X_{k+1}; I_k >= I_{k-1}, W_k >= W_{k-1}
                          -> :func:`_add_buckets`
    (3) issue window      lo_k <= I_k <= hi_k; I_k >= a => C_k >= T_a
                          -> :func:`_add_issue`
    (4) waits             all-gather: U_{need(k)} >= X_k; reduce-scatter: W_k >= I_k,
                          W_k <= a => U_a >= X_k -> :func:`_add_waits`
    (5) streams           buckets of one process group do not overlap (NoOverlap over optional
                          intervals [C_k, X_k) present when k closes its bucket); a chain's buckets
                          run in chain order (brk_k => C_k >= X_{k-1}) -> :func:`_add_streams`
    (6) merge cost        copy_a = sum over members charged at a of mrg_k * copy_k (copy-in and,
                          for all-gathers, copy-out) -> :func:`_add_copy_costs`
    (7) memory            for every anchor a:
                          base_a + sum_AG out_k y_{k,a}
                                 + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} - z_{k,a}) + out_k y_{k,a}]
                                 + sum_RS grad_k e_{k,a}   (e = issued at a and merged: copy-in)
                          <= P (peak) <= budget -> :func:`_add_memory`
                          base_a is the traced run's simulated memory minus these terms at the
                          traced positions, so the model shares the simulator's memory model.

Scale: graphs with more movable collectives than ``full_model_max_members`` are solved by a
rolling-window neighbourhood search. Each window frees the incumbent's buckets that hold a run of
``lns_window_members`` consecutive collectives (in order of need) and is a small model of the same
constraint families over its anchor range only: every other bucket is a fixed interval at its
incumbent position (kept in the incumbent's stream order), the incumbent's simulated state fixes
the range's entry, and the objective is the range's exit state (its last departure and the end
of every bucket issued in it). A model's size then depends on the window, not on the graph.
Before the windows, graphs whose layers repeat (:mod:`solvers.periodic`) get a per-layer
template: a window over three blocks around the middle, with each block's decisions tied to the
previous block's shifted by one period (:meth:`_CpSatModel.tie`: a steady state), is solved and
its middle block copied onto every layer; a copy that exceeds the budget in simulation is tried
on the layers with the most memory headroom. The windows then repair the ends and the layers
where memory binds, most exposed first.

The solution is checked by the simulator; if its simulated peak exceeds the budget (the model
prices merge transients only approximately) the budget is tightened by the excess and the model
re-solved, so a schedule returned as feasible never simulates above its budget.
Determinism: one worker, fixed seed and a deterministic time limit (the same work on every
rank); a wall-clock cap far above it only guards against a stuck process and is reported.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from collections import defaultdict

from ortools.sat.python import cp_model

from solvers.dispatch import register
from solvers.problem import Problem
from solvers.schedule import (
    Bucket,
    InfeasibleBudgetError,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
)

logger = logging.getLogger(__name__)

_US_PER_MS = 1000.0
#: memory unit of the model, in bytes: 1 (exact), so that the model and the simulator agree to
#: the byte on schedules without merge transients (sums stay far below CP-SAT's int64 range)
_MEM_UNIT_BYTES = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpSatConfig:
    """Knobs of the CP-SAT model."""

    #: how many anchors before its first use an all-gather may be issued (and how far after
    #: its gradient a reduce-scatter may be issued); about two transformer blocks by default
    window_anchors: int = 64
    #: how many anchors after its issue a reduce-scatter may be waited
    wait_window_anchors: int = 64
    #: largest bucket payload in bytes (None: no cap beyond the windows)
    max_bucket_bytes: int | None = None
    #: run the second phase (peak memory, then fewer collectives, at the optimal step time)
    secondary_objective: bool = True
    #: fraction of the time limit given to the first phase
    primary_share: float = 0.75
    #: how many times to re-solve with a tighter budget when the simulated peak exceeds it
    memory_repair_rounds: int = 4
    #: CP-SAT deterministic time units per wall-clock second of the time limit. Its deterministic
    #: clock runs about 4x slower than wall time on the 2-core CI machine (measured: 6 units took
    #: 24 s on llama-like graphs), so a limit of T s becomes 0.25 T units: about T s here, and
    #: the same amount of search (hence the same schedule) on every rank and machine
    deterministic_units_per_second: float = 0.25
    #: wall-clock safety cap, as a multiple of the time limit (only against a stuck process;
    #: hitting it is logged, since it breaks cross-rank determinism)
    wall_clock_factor: float = 4.0
    #: graphs with at most this many movable collectives are solved as one model; larger ones
    #: by rolling-window neighbourhood search (exploits the per-layer repetition)
    full_model_max_members: int = 64
    #: collectives freed together in one window of the neighbourhood search (about 3 blocks)
    lns_window_members: int = 27
    #: at most this many sweeps over the graph
    lns_max_sweeps: int = 4
    #: anchors modelled on each side of a window's decisions (its model covers only that range;
    #: the incumbent fixes the state where the range starts)
    lns_range_margin_anchors: int = 8
    #: least time given to one window (s); windows are visited most-exposed first, so a short
    #: limit is spent where the incumbent waits longest on communication
    lns_min_window_s: float = 3.0
    #: rounds of the per-layer template (0: off): solve a window around the middle block of the
    #: repeating layers, copy its decisions onto every layer (see :func:`_template_search`)
    template_rounds: int = 6
    #: blocks in the template's window (the middle one is copied)
    template_window_blocks: int = 3
    #: time for one template window (s)
    template_window_s: float = 6.0
    #: fewest repeating blocks for the template to be tried
    template_min_blocks: int = 6

    def __post_init__(self) -> None:
        if self.window_anchors < 1 or self.wait_window_anchors < 0:
            raise ValueError("window_anchors must be >= 1 and wait_window_anchors >= 0")
        if self.lns_min_window_s <= 0:
            raise ValueError("lns_min_window_s must be > 0")
        if self.template_rounds < 0 or self.template_window_blocks < 1 or self.template_window_s <= 0:
            raise ValueError("template_rounds must be >= 0, template_window_blocks >= 1, template_window_s > 0")
        if not 0.1 <= self.primary_share <= 1.0:
            raise ValueError("primary_share must be in [0.1, 1]")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes <= 0:
            raise ValueError("max_bucket_bytes must be > 0 or None")
        if self.full_model_max_members < 0 or self.lns_window_members < 2:
            raise ValueError("full_model_max_members must be >= 0 and lns_window_members >= 2")


class _Anchors:
    """Anchor gaps and the segments between them."""

    def __init__(self, problem: Problem):
        n = problem.n
        gaps = {0, n}
        for c in problem.colls.values():
            gaps.update((c.ready, c.needed, c.traced_issue, c.traced_wait))
        dag = problem.dag
        for p, name in enumerate(problem.seq):
            if dag.nodes[name].get("flops", 0) > 0:
                gaps.add(p)
        self.gaps = sorted(gaps)
        self.m = len(self.gaps) - 1
        cm = problem.compute_ms
        prefix = [0.0]
        for v in cm:
            prefix.append(prefix[-1] + v)
        self.seg_us = [
            int(round((prefix[self.gaps[a + 1]] - prefix[self.gaps[a]]) * _US_PER_MS)) for a in range(self.m)
        ]

    def at_or_before(self, gap: int) -> int:
        """Index of the last anchor whose gap is <= gap."""
        return bisect.bisect_right(self.gaps, gap) - 1

    def exact(self, gap: int) -> int:
        a = self.at_or_before(gap)
        assert self.gaps[a] == gap, gap
        return a


@dataclasses.dataclass
class _Member:
    name: str
    chain: int
    idx: int
    coll_type: str
    lo: int
    hi: int  # issue window (anchors)
    need: int  # anchor of first use (all-gathers wait there)
    wlo: int = 0
    whi: int = 0  # wait window (reduce-scatters)
    d_us: int = 0
    # sizes in the model's memory unit (_MEM_UNIT_BYTES bytes)
    out_mem: int = 0
    pay_mem: int = 0
    grad_mem: int = 0
    copy_us: int = 0
    copy_fixed_us: int = 0  # per merged bucket (kernel overheads), charged at its first member
    prologue_us: int = 0  # casts run at issue whether merged or not
    charge: int = 0  # anchor charged with the merge copies


@dataclasses.dataclass(frozen=True)
class _FixedInterval:
    """A bucket kept at its reference position in a model: anchors of its issue and wait (None
    when waited outside the modelled range), its reference start and duration on its stream,
    and its compute-stream work at issue and wait (us)."""

    bucket: int
    group: str
    issue: int
    wait: int | None
    before_range: bool
    ref_start_us: int
    dur_us: int
    copy_in_us: int
    copy_out_us: int


class _CpSatModel:
    """The model of the module docstring.

    ``free`` (None: every movable collective) restricts the decisions to some collectives;
    every bucket of ``reference`` (default: the traced order) without a free member is then a
    fixed interval at its reference position, and memory is calibrated on the reference's
    simulation. Windows of the neighbourhood search are such small models.
    """

    def __init__(
        self,
        problem: Problem,
        cfg: CpSatConfig,
        budget_mem: int | None,
        *,
        free: set[str] | None = None,
        reference: Schedule | None = None,
        anchors: "_Anchors | None" = None,
    ):
        self.p = problem
        self.cfg = cfg
        self.budget_mem = budget_mem
        self.anchors = anchors or _Anchors(problem)
        self.free = free
        self.reference = reference or problem.traced_schedule()
        ref_issue, ref_wait = self.reference.positions()
        ref_bucket = self.reference.bucket_of()
        #: reference issue / wait gap of every collective
        self.ref_pos = {n: (ref_issue[b], ref_wait[b]) for n, b in ref_bucket.items()}
        from scheduler.simulator import simulate

        #: the reference run: memory calibration and the stream order of fixed buckets
        self.ref_sim = simulate(problem.dag, self.reference, problem=problem)
        #: reference buckets kept fixed (indices into reference.buckets)
        self.fixed_buckets = [
            b
            for b, bucket in enumerate(self.reference.buckets)
            if (free is not None and not (set(bucket.members) & free))
            or (free is None and not any(problem.colls[m].movable for m in bucket.members))
        ]
        #: anchors modelled: all of them, or a window's range (set in _build_members)
        self.a_lo, self.a_hi = 0, self.anchors.m
        self.model = cp_model.CpModel()
        self.horizon = int(
            (problem.total_compute_ms + sum(c.runtime_ms for c in problem.colls.values())) * _US_PER_MS * 2
            + 10 * _US_PER_MS
        )
        self._build_members()
        if free is not None:
            self._set_range()
        self._add_timeline()
        self._add_buckets()
        self._add_issue()
        self._add_waits()
        self._add_streams()
        self._add_copy_costs()
        self._add_memory()

    # -- data --------------------------------------------------------------------------------
    def _build_members(self) -> None:
        p, A, cfg = self.p, self.anchors, self.cfg
        self.chains: list[list[_Member]] = []
        self.alpha_us: list[int] = []
        dag = p.dag
        for ci, (key, names) in enumerate(sorted(p.chains.items(), key=lambda kv: str(kv[0]))):
            if self.free is not None:
                names = [n for n in names if n in self.free]
                if not names:
                    continue
            ci = len(self.chains)
            coll_type, group = key[0], key[1]
            cm = p.comm_model.get(f"{coll_type}|{group}", {"alpha_ms": 0.0, "beta_ms_per_byte": 0.0})
            self.alpha_us.append(int(round(cm["alpha_ms"] * _US_PER_MS)))
            members = []
            for k, name in enumerate(names):
                c = p.colls[name]
                ready_a = A.exact(c.ready)
                need_a = A.exact(c.needed)
                ti, tw = (A.at_or_before(g) for g in self.ref_pos[name])
                if coll_type == "all_gather":
                    lo = min(ti, max(ready_a, need_a - cfg.window_anchors))
                    hi = need_a
                else:
                    lo = ready_a
                    hi = max(ti, min(need_a, ready_a + cfg.window_anchors))
                mem = _Member(name=name, chain=ci, idx=k, coll_type=coll_type, lo=lo, hi=hi, need=need_a)
                if coll_type == "reduce_scatter":
                    mem.wlo = lo
                    mem.whi = max(tw, min(need_a, hi + cfg.wait_window_anchors))
                mem.d_us = int(round(cm["beta_ms_per_byte"] * c.payload_bytes * _US_PER_MS))
                mem.out_mem = -(-c.out_bytes // _MEM_UNIT_BYTES)
                mem.pay_mem = -(-c.payload_bytes // _MEM_UNIT_BYTES)
                head = c.prologue[0] if c.prologue else name
                grad = sum(dag.nodes[u]["size_bytes"] for u in dag.predecessors(head))
                mem.grad_mem = -(-grad // _MEM_UNIT_BYTES)
                copy_bytes = c.payload_bytes + (c.out_bytes if coll_type == "all_gather" else 0)
                mem.copy_us = int(round(p.copy_ms_per_byte * copy_bytes * _US_PER_MS))
                n_copies = 2 if coll_type == "all_gather" else 1
                mem.copy_fixed_us = int(round(p.copy_ms_fixed * n_copies * _US_PER_MS))
                mem.prologue_us = int(round(c.prologue_ms * _US_PER_MS))
                mem.charge = need_a if coll_type == "all_gather" else ready_a
                members.append(mem)
            self.chains.append(members)

    def _set_range(self) -> None:
        """A window models only the anchors around its free collectives."""
        A, margin = self.anchors, self.cfg.lns_range_margin_anchors
        mems = [mem for chain in self.chains for mem in chain]
        if not mems:
            return
        lo = min(x.lo for x in mems)
        # all-gathers are waited at their need; reduce-scatters by the end of their wait window
        hi = max(x.whi if x.coll_type == "reduce_scatter" else x.need for x in mems)
        for x in mems:
            gi, gw = self.ref_pos[x.name]
            lo, hi = min(lo, A.at_or_before(gi)), max(hi, A.at_or_before(gw))
        self.a_lo, self.a_hi = max(0, lo - margin), min(A.m, hi + margin)

    @property
    def anchor_range(self) -> range:
        return range(self.a_lo, self.a_hi + 1)

    @property
    def objective(self):
        """Step time for the whole model; for a window, its exit state (see _add_timeline)."""
        return self.U[self.anchors.m] if self.a_hi == self.anchors.m else self.Z

    def fixed_intervals(self) -> list["_FixedInterval"]:
        """The reference's fixed buckets that matter to the modelled anchor range: issued in it,
        or issued before it and still running when it starts (the model's fifth family)."""
        p, A = self.p, self.anchors
        t_lo = self._ref_arrival_us(self.a_lo)
        out = []
        for b in self.fixed_buckets:
            members = self.reference.buckets[b].members
            gi, gw = self.ref_pos[members[0]]
            ai, aw = A.at_or_before(gi), A.at_or_before(gw)
            ref_start, ref_end = self.ref_sim.bucket_times[b][1:3]
            if ai > self.a_hi or (ai < self.a_lo and ref_end * _US_PER_MS <= t_lo):
                continue  # outside the window's range, or done before it starts
            out.append(_FixedInterval(
                bucket=b, group=p.colls[members[0]].group_name, issue=ai,
                wait=aw if self.a_lo <= aw <= self.a_hi else None, before_range=ai < self.a_lo,
                ref_start_us=int(round(ref_start * _US_PER_MS)),
                dur_us=int(round(p.bucket_comm_ms(members) * _US_PER_MS)),
                copy_in_us=int(round(p.copy_in_ms(members) * _US_PER_MS)),
                copy_out_us=int(round(p.copy_out_ms(members) * _US_PER_MS)),
            ))
        return out

    def tie(self, pairs: list[tuple[str, str]], shift: int) -> None:
        """Make the decisions of each ``(k, k2)`` equal up to a shift of ``shift`` gaps: k2
        starts a bucket iff k does, and is issued (and waited) ``shift`` gaps after k. Used to
        solve one block of a repeating graph in its steady state (:func:`_template_search`)."""
        m, A = self.model, self.anchors
        index = {g: a for a, g in enumerate(A.gaps)}
        member = {x.name: x for chain in self.chains for x in chain}
        for k, k2 in pairs:
            m.Add(self.brk[k2] == self.brk[k])
            x, x2 = member[k], member[k2]
            windows = [(self.I, (x.lo, x.hi), (x2.lo, x2.hi))]
            if x.coll_type == "reduce_scatter":
                windows.append((self.W, (x.wlo, x.whi), (x2.wlo, x2.whi)))
            for var, (lo, hi), (lo2, hi2) in windows:
                allowed = [(a, index[A.gaps[a] + shift]) for a in range(lo, hi + 1)
                           if A.gaps[a] + shift in index and lo2 <= index[A.gaps[a] + shift] <= hi2]
                m.AddAllowedAssignments([var[k], var[k2]], allowed)

    # -- (1) ---------------------------------------------------------------------------------
    def _add_timeline(self) -> None:
        """(1) T_0 = 0; U_a >= T_a + copy_a; T_{a+1} = U_a + seg_a.

        A window models anchors a_lo..a_hi only: T_{a_lo} is the reference's arrival time there,
        and its objective Z is its exit state: Z >= U_{a_hi} and Z >= the end of every bucket
        issued in range (so that no work is pushed past the window unseen)."""
        m, H = self.model, self.horizon
        A = self.anchors
        self.T: dict[int, cp_model.IntVar] = {a: m.NewIntVar(0, H, f"T{a}") for a in self.anchor_range}
        self.U: dict[int, cp_model.IntVar] = {a: m.NewIntVar(0, H, f"U{a}") for a in self.anchor_range}
        if self.a_lo == 0:
            m.Add(self.T[0] == 0)
        else:
            m.Add(self.T[self.a_lo] == self._ref_arrival_us(self.a_lo))
        self.copy_terms: dict[int, list] = defaultdict(list)
        for a in range(self.a_lo, self.a_hi):
            m.Add(self.T[a + 1] == self.U[a] + A.seg_us[a])
        for a in self.anchor_range:
            m.Add(self.U[a] >= self.T[a])
        self.Z = m.NewIntVar(0, H, "Z")
        m.Add(self.Z >= self.U[self.a_hi])

    def _ref_arrival_us(self, a: int) -> int:
        """When the reference's compute stream reaches anchor a (end of the node before it)."""
        g = self.anchors.gaps[a]
        if g == 0:
            return 0
        return int(round(self.ref_sim.node_times[self.p.seq[g - 1]][1] * _US_PER_MS))

    # -- (2) ---------------------------------------------------------------------------------
    def _add_buckets(self) -> None:
        """(2) brk_k = 0 => k shares I, W, C with k-1; R_k accumulates durations; X_k is the end
        of k's bucket; issue and wait anchors never decrease along a chain."""
        m, H = self.model, self.horizon
        cap = self.cfg.max_bucket_bytes
        self.brk: dict[str, cp_model.IntVar] = {}
        self.I: dict[str, cp_model.IntVar] = {}
        self.W: dict[str, cp_model.IntVar] = {}
        self.C: dict[str, cp_model.IntVar] = {}
        self.X: dict[str, cp_model.IntVar] = {}
        self.R: dict[str, cp_model.IntVar] = {}
        self.last: dict[str, cp_model.IntVar] = {}
        for ci, chain in enumerate(self.chains):
            alpha = self.alpha_us[ci]
            total_d = sum(x.d_us for x in chain)
            Q = None
            for k, mem in enumerate(chain):
                n = mem.name
                self.brk[n] = m.NewBoolVar(f"brk_{n}")
                self.I[n] = m.NewIntVar(mem.lo, mem.hi, f"I_{n}")
                if mem.coll_type == "reduce_scatter":
                    self.W[n] = m.NewIntVar(mem.wlo, mem.whi, f"W_{n}")
                self.C[n] = m.NewIntVar(0, H, f"C_{n}")
                self.X[n] = m.NewIntVar(0, H, f"X_{n}")
                self.R[n] = m.NewIntVar(mem.d_us, total_d, f"R_{n}")
                if cap is not None:
                    q = m.NewIntVar(0, sum(self.p.colls[x.name].payload_bytes for x in chain), f"Q_{n}")
                    pay = self.p.colls[n].payload_bytes
                    m.Add(q <= max(cap, pay))
                if k == 0:
                    m.Add(self.brk[n] == 1)
                    m.Add(self.R[n] == mem.d_us)
                    if cap is not None:
                        m.Add(q == self.p.colls[n].payload_bytes)
                else:
                    prev = chain[k - 1].name
                    b = self.brk[n]
                    m.Add(self.R[n] == mem.d_us).OnlyEnforceIf(b)
                    m.Add(self.R[n] == self.R[prev] + mem.d_us).OnlyEnforceIf(b.Not())
                    m.Add(self.I[n] == self.I[prev]).OnlyEnforceIf(b.Not())
                    m.Add(self.C[n] == self.C[prev]).OnlyEnforceIf(b.Not())
                    m.Add(self.I[n] >= self.I[prev])
                    if mem.coll_type == "reduce_scatter":
                        m.Add(self.W[n] == self.W[prev]).OnlyEnforceIf(b.Not())
                        m.Add(self.W[n] >= self.W[prev])
                    if cap is not None:
                        m.Add(q == self.p.colls[n].payload_bytes).OnlyEnforceIf(b)
                        m.Add(q == Q + self.p.colls[n].payload_bytes).OnlyEnforceIf(b.Not())
                Q = q if cap is not None else None
            for k, mem in enumerate(chain):
                n = mem.name
                if k + 1 < len(chain):
                    nxt = chain[k + 1].name
                    last = self.brk[nxt]
                    m.Add(self.X[n] == self.C[n] + alpha + self.R[n]).OnlyEnforceIf(last)
                    m.Add(self.X[n] == self.X[nxt]).OnlyEnforceIf(last.Not())
                else:
                    last = m.NewConstant(1)
                    m.Add(self.X[n] == self.C[n] + alpha + self.R[n])
                self.last[n] = last

    # -- (3) ---------------------------------------------------------------------------------
    def _add_issue(self) -> None:
        """(3) y_{k,a} = [I_k <= a]; I_k >= a => C_k >= T_a (so C_k >= T_{I_k})."""
        m = self.model
        self.y: dict[str, dict[int, cp_model.IntVar]] = {}
        for chain in self.chains:
            for mem in chain:
                n = mem.name
                ys = _order_encoding(m, self.I[n], mem.lo, mem.hi, f"y_{n}")
                self.y[n] = ys
                m.Add(self.C[n] >= self.T[mem.lo])
                for a in range(mem.lo + 1, mem.hi + 1):
                    m.Add(self.C[n] >= self.T[a]).OnlyEnforceIf(ys[a - 1].Not())

    # -- (4) ---------------------------------------------------------------------------------
    def _add_waits(self) -> None:
        """(4) all-gathers are waited at their first use: U_{need(k)} >= X_k; reduce-scatters at
        W_k >= I_k with z_{k,a} = [W_k <= a] and z_{k,a} => U_a >= X_k."""
        m = self.model
        self.z: dict[str, dict[int, cp_model.IntVar]] = {}
        for chain in self.chains:
            for mem in chain:
                n = mem.name
                if mem.coll_type == "all_gather":
                    m.Add(self.U[mem.need] >= self.X[n])
                    continue
                m.Add(self.W[n] >= self.I[n])
                zs = _order_encoding(m, self.W[n], mem.wlo, mem.whi, f"z_{n}")
                self.z[n] = zs
                for a in range(mem.wlo, mem.whi):
                    m.Add(self.U[a] >= self.X[n]).OnlyEnforceIf(zs[a])
                m.Add(self.U[mem.whi] >= self.X[n])

    # -- (5) ---------------------------------------------------------------------------------
    def _add_streams(self) -> None:
        """(5) one stream per process group: bucket intervals do not overlap; a chain's buckets
        keep chain order; fixed collectives occupy their traced slots."""
        m, p, A = self.model, self.p, self.anchors
        per_group: dict[str, list] = defaultdict(list)
        for ci, chain in enumerate(self.chains):
            alpha = self.alpha_us[ci]
            for k, mem in enumerate(chain):
                n = mem.name
                end = m.NewIntVar(0, self.horizon, f"E_{n}")
                m.Add(end == self.C[n] + alpha + self.R[n])
                iv = m.NewOptionalIntervalVar(self.C[n], alpha + self.R[n], end, self.last[n], f"iv_{n}")
                m.Add(self.Z >= end)
                per_group[p.colls[n].group_name].append(iv)
                if k > 0:
                    m.Add(self.C[n] >= self.X[chain[k - 1].name]).OnlyEnforceIf(self.brk[n])
        fixed_by_group: dict[str, list] = defaultdict(list)
        pre_range: dict[str, list] = defaultdict(list)
        #: the reference buckets fixed in this model's range (the MILP twin reads them too)
        self.fixed = self.fixed_intervals()
        for f in self.fixed:
            start = m.NewIntVar(0, self.horizon, f"Cf_{f.bucket}")
            fixed_by_group[f.group].append((f.ref_start_us, start, f.dur_us))
            if f.before_range:
                # the reference's timing, or later if free work before it on the stream runs
                # longer (durations are rounded to microseconds)
                m.Add(start >= f.ref_start_us)
                pre_range[f.group].append((start, f.dur_us))
            else:
                m.Add(start >= self.T[f.issue])
                m.Add(self.Z >= start + f.dur_us)
            if f.wait is not None:
                m.Add(self.U[f.wait] >= start + f.dur_us)
            per_group[f.group].append(m.NewFixedSizeIntervalVar(start, f.dur_us, f"ivf_{f.bucket}"))
            # their compute-stream work (prologues, merge copies, epilogues) is fixed too
            if f.copy_in_us and not f.before_range:
                self.copy_terms[f.issue].append(f.copy_in_us)
            if f.copy_out_us and f.wait is not None:
                self.copy_terms[f.wait].append(f.copy_out_us)
        # FIFO: free buckets are issued in the range, after every fixed bucket issued before it
        for ci, chain in enumerate(self.chains):
            for mem in chain:
                for start, dur in pre_range.get(p.colls[mem.name].group_name, ()):
                    m.Add(self.C[mem.name] >= start + dur)
        # fixed buckets keep their reference order on each stream (no search among them)
        for items in fixed_by_group.values():
            items.sort(key=lambda t: t[0])
            for (_s0, st0, d0), (_s1, st1, _d1) in zip(items, items[1:]):
                m.Add(st1 >= st0 + d0)
        for ivs in per_group.values():
            if len(ivs) > 1:
                m.AddNoOverlap(ivs)

    # -- (6) ---------------------------------------------------------------------------------
    def _add_copy_costs(self) -> None:
        """(6) merged buckets copy their payload in (and all-gathers out) on the compute stream:
        mrg_k = [k's bucket has >= 2 members]; U_a >= T_a + sum_{k charged at a} mrg_k copy_k."""
        m = self.model
        self.mrg: dict[str, cp_model.IntVar] = {}
        for chain in self.chains:
            for k, mem in enumerate(chain):
                n = mem.name
                starts = self.brk[n]
                ends = self.last[n]
                mrg = m.NewBoolVar(f"mrg_{n}")
                # alone <=> starts a bucket and closes it
                m.AddBoolOr([starts.Not(), ends.Not()]).OnlyEnforceIf(mrg)
                m.AddBoolAnd([starts, ends]).OnlyEnforceIf(mrg.Not())
                self.mrg[n] = mrg
                if mem.copy_us > 0:
                    self.copy_terms[mem.charge].append(mem.copy_us * mrg)
                if mem.copy_fixed_us > 0:
                    lead = m.NewBoolVar(f"lead_{n}")  # first member of a merged bucket
                    m.AddBoolAnd([starts, mrg]).OnlyEnforceIf(lead)
                    m.AddBoolOr([starts.Not(), mrg.Not()]).OnlyEnforceIf(lead.Not())
                    self.copy_terms[mem.charge].append(mem.copy_fixed_us * lead)
                if mem.prologue_us > 0:
                    self.copy_terms[mem.charge].append(mem.prologue_us)
        for a, terms in self.copy_terms.items():
            m.Add(self.U[a] >= self.T[a] + sum(terms))

    # -- (7) ---------------------------------------------------------------------------------
    def _add_memory(self) -> None:
        """(7) live memory at every anchor <= budget and <= P (peak variable)."""
        from scheduler.simulator import simulate  # torch-free; shares the memory model

        m, p, A = self.model, self.p, self.anchors
        traced = self.reference
        sim = self.ref_sim
        # live bytes at node steps, max per segment
        seg_live = [0] * (A.m + 1)
        nodes_seen = 0
        for step, live in zip(traced.steps, sim.step_live_bytes):
            seg = A.at_or_before(nodes_seen)
            if step.kind != "node":
                continue  # issue / wait instants are transients, priced by their own terms
            nodes_seen += 1
            seg_live[seg] = max(seg_live[seg], live // _MEM_UNIT_BYTES)
        # the end anchor runs no node: what is live there is at most what the last node saw
        seg_live[A.m] = seg_live[A.m - 1] if A.m else seg_live[0]
        terms: dict[int, list] = defaultdict(list)
        traced_dep = [0] * (A.m + 1)
        for chain in self.chains:
            for mem in chain:
                ti, tw = (A.at_or_before(g) for g in self.ref_pos[mem.name])
                y = self.y[mem.name]
                if mem.coll_type == "all_gather":
                    for a in range(mem.lo, mem.need):
                        terms[a].append(mem.out_mem * y[a])
                        traced_dep[a] += mem.out_mem * (ti <= a)
                else:
                    z = self.z[mem.name]
                    for a in range(mem.lo, mem.whi):
                        ya = y[a] if a < mem.hi else 1
                        za = z[a]
                        terms[a].append(mem.grad_mem * (1 - ya) + mem.pay_mem * (ya - za) + mem.out_mem * ya)
                        traced_dep[a] += (
                            mem.grad_mem * (ti > a) + mem.pay_mem * ((ti <= a) - (tw <= a)) + mem.out_mem * (ti <= a)
                        )
        self.base_mem = [max(0, seg_live[a] - traced_dep[a]) for a in range(A.m + 1)]
        # merge transient of reduce-scatters: while a merged bucket copies in at its issue
        # anchor, the members' gradients and the new bucket buffer are alive together
        transient: dict[int, list] = defaultdict(list)
        for chain in self.chains:
            for mem in chain:
                if mem.coll_type != "reduce_scatter" or mem.grad_mem == 0:
                    continue
                y = self.y[mem.name]
                for a in range(mem.lo, mem.hi + 1):
                    e = m.NewBoolVar(f"e_{mem.name}_{a}")  # issued at a, merged
                    at_a = [y[a]] if a == mem.lo else [y[a], y[a - 1].Not()]
                    if isinstance(at_a[0], int):
                        at_a = at_a[1:]
                    m.AddBoolAnd(at_a + [self.mrg[mem.name]]).OnlyEnforceIf(e)
                    m.AddBoolOr([lit.Not() for lit in at_a] + [self.mrg[mem.name].Not(), e])
                    transient[a].append(mem.grad_mem * e)
        ub = max(seg_live) * 4 + sum(
            mem.out_mem + mem.pay_mem + mem.grad_mem for chain in self.chains for mem in chain
        )
        self.P = m.NewIntVar(0, ub, "peak_mem")
        self.mem_expr = {}
        for a in self.anchor_range:
            expr = self.base_mem[a] + sum(terms[a])
            self.mem_expr[a] = expr
            m.Add(self.P >= expr + sum(transient[a]))
        if self.budget_mem is not None:
            m.Add(self.P <= self.budget_mem)

    # -- hints and extraction ----------------------------------------------------------------
    def add_hint(self, schedule: Schedule) -> None:
        """Warm start: bucket breaks, issue and wait anchors of ``schedule`` (snapped into the
        model's windows)."""
        A = self.anchors
        bucket_of = schedule.bucket_of()
        issue, wait = schedule.positions()
        for chain in self.chains:
            prev_b = None
            for mem in chain:
                n = mem.name
                b = bucket_of.get(n)
                if b is None:
                    continue
                self.model.AddHint(self.brk[n], int(b != prev_b))
                prev_b = b
                self.model.AddHint(self.I[n], min(mem.hi, max(mem.lo, A.at_or_before(issue[b]))))
                if n in self.W:
                    self.model.AddHint(self.W[n], min(mem.whi, max(mem.wlo, A.at_or_before(wait[b]))))

    def hint_values(self, schedule: Schedule) -> dict[int, int]:
        """Values (by variable index) of ``schedule`` in the model: decisions snapped into the
        windows bucket by bucket (members of a bucket share anchors), plus the simulated
        start / end times of buckets and anchors as guidance for the times."""
        from scheduler.simulator import simulate

        A, p = self.anchors, self.p
        bucket_of = schedule.bucket_of()
        issue, wait = schedule.positions()
        mem_of = {mem.name: mem for chain in self.chains for mem in chain}
        vals: dict[int, int] = {}
        for b, bucket in enumerate(schedule.buckets):
            ms = [mem_of[n] for n in bucket.members if n in mem_of]
            if not ms:
                continue
            i = min(min(x.hi for x in ms), max(max(x.lo for x in ms), A.at_or_before(issue[b])))
            for x in ms:
                vals[self.I[x.name].Index()] = i
                if x.name in self.W:
                    w = min(min(y.whi for y in ms), max(max(y.wlo for y in ms), i, A.at_or_before(wait[b])))
                    vals[self.W[x.name].Index()] = w
        for chain in self.chains:
            prev_b = None
            for mem in chain:
                bb = bucket_of[mem.name]
                vals[self.brk[mem.name].Index()] = 1 if prev_b is None else int(bb != prev_b)
                prev_b = bb
        sim = simulate(p.dag, schedule, problem=p)
        for b, (_i, start, end, _d) in sim.bucket_times.items():
            for n in schedule.buckets[b].members:
                if n in self.C:
                    vals[self.C[n].Index()] = int(round(start * _US_PER_MS))
                    vals[self.X[n].Index()] = int(round(end * _US_PER_MS))
        node_start = {n: t0 for n, (t0, _t1) in sim.node_times.items()}
        for a, g in enumerate(A.gaps[:-1]):
            t = node_start.get(p.seq[g])
            if t is not None and a in self.U:
                vals[self.U[a].Index()] = int(round(t * _US_PER_MS))
        return vals

    def start_from(self, schedule: Schedule, limit_s: float, seed: int, num_workers: int) -> None:
        """Hint the model with ``schedule`` completed to a full solution (:meth:`complete`), or
        with its decisions alone when they cannot be completed."""
        values = self.complete(schedule, limit_s, seed, num_workers)
        if values is None:
            self.add_hint(schedule)
            return
        for idx, val in enumerate(values):
            self.model.add_hint(self.model.get_int_var_from_proto_index(idx), val)

    def complete(self, schedule: Schedule, limit_s: float, seed: int, num_workers: int) -> list[int] | None:
        """A full solution of the model (every variable) that takes ``schedule``'s decisions, or
        None when they do not fit the model (windows, budget)."""
        sub = self.model.clone()
        sub.clear_hints()
        decisions = {v.Index() for n in self.brk for v in self.decision_vars(n)}
        for idx, val in self.hint_values(schedule).items():
            var = sub.get_int_var_from_proto_index(idx)
            if idx in decisions:
                sub.add(var == val)
            else:
                sub.add_hint(var, val)
        solver = _make_solver(limit_s, seed, num_workers, self.cfg)
        status = solver.Solve(sub)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return list(solver.ResponseProto().solution)
        logger.debug("warm start does not fit the model: %s", _STATUS_NAMES.get(status))
        return None

    def decision_vars(self, name: str) -> list:
        vs = [self.brk[name], self.I[name]]
        if name in self.W:
            vs.append(self.W[name])
        return vs

    def extract(self, solver: cp_model.CpSolver) -> Schedule:
        p, A = self.p, self.anchors
        buckets: list[Bucket] = []
        issue_at: list[int] = []
        wait_at: list[int] = []
        for chain in self.chains:
            cur: list[str] = []
            for k, mem in enumerate(chain):
                if k > 0 and solver.Value(self.brk[mem.name]):
                    self._close(cur, solver, buckets, issue_at, wait_at)
                    cur = []
                cur.append(mem.name)
            if cur:
                self._close(cur, solver, buckets, issue_at, wait_at)
        for b in self.fixed_buckets:
            members = self.reference.buckets[b].members
            buckets.append(Bucket(tuple(members)))
            gi, gw = self.ref_pos[members[0]]
            issue_at.append(gi)
            wait_at.append(gw)
        # issue order on the streams: by issue gap, then by start time
        order = sorted(range(len(buckets)), key=lambda i: (issue_at[i], wait_at[i]))
        return Schedule.from_positions(
            p.seq, [buckets[i] for i in order], [issue_at[i] for i in order], [wait_at[i] for i in order]
        )

    def _close(self, members, solver, buckets, issue_at, wait_at) -> None:
        A, p = self.anchors, self.p
        first = members[0]
        gi = A.gaps[solver.Value(self.I[first])]
        if first in self.W:
            gw = A.gaps[solver.Value(self.W[first])]
        else:
            gw = min(p.colls[x].needed for x in members)
        buckets.append(Bucket(tuple(members)))
        issue_at.append(gi)
        wait_at.append(max(gi, gw))


def _order_encoding(m: cp_model.CpModel, var, lo: int, hi: int, name: str) -> dict[int, object]:
    """Booleans b_a = [var <= a] for a in [lo, hi); b_{hi} is the constant 1."""
    bs: dict[int, object] = {}
    prev = None
    for a in range(lo, hi):
        b = m.NewBoolVar(f"{name}_{a}")
        m.Add(var <= a).OnlyEnforceIf(b)
        m.Add(var >= a + 1).OnlyEnforceIf(b.Not())
        if prev is not None:
            m.AddImplication(prev, b)
        bs[a] = b
        prev = b
    bs[hi] = 1  # type: ignore[assignment]
    return bs


def _make_solver(time_limit_s: float, seed: int, num_workers: int, cfg: CpSatConfig) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_deterministic_time = float(time_limit_s) * cfg.deterministic_units_per_second
    prm.max_time_in_seconds = float(time_limit_s) * cfg.wall_clock_factor
    prm.random_seed = int(seed)
    prm.num_workers = int(num_workers)
    prm.log_search_progress = False
    # the root LP costs more than it helps on these models (measured: 84.8 vs 90.9 ms found on
    # a 32-layer graph for the same deterministic time)
    prm.linearization_level = 0
    return solver


_STATUS_NAMES = {
    cp_model.OPTIMAL: "OPTIMAL",
    cp_model.FEASIBLE: "FEASIBLE",
    cp_model.INFEASIBLE: "INFEASIBLE",
    cp_model.MODEL_INVALID: "MODEL_INVALID",
    cp_model.UNKNOWN: "UNKNOWN",
}


def solve_cpsat(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    time_limit_s: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: CpSatConfig | None = None,
) -> SolveResult:
    """Solve the joint model (see module docstring).

    Graphs with up to ``full_model_max_members`` movable collectives are solved as one model
    (proven optimal when the limit allows), starting from the best warm start completed inside
    the model. Larger graphs go straight to the rolling-window search (:func:`_window_search`)
    from the warm start. Every candidate is simulated; only simulated improvements that fit the
    budget are kept, and nothing slower than the warm start is returned. All of it is
    deterministic.

    Raises:
        InfeasibleBudgetError: no schedule fits the budget (proven, or none found in the limit);
            ``min_peak_bytes`` is the smallest simulated peak found.
        ScheduleError: the solver failed without a schedule.
    """
    from scheduler.simulator import simulate

    cfg = config or CpSatConfig()
    t0 = time.perf_counter()
    if not problem.chains:
        sched = problem.traced_schedule()
        sim = simulate(problem.dag, sched, problem=problem)
        return SolveResult(
            sched, SolveStatus.OPTIMAL, "cpsat", sim.step_ms, sim.step_ms, time.perf_counter() - t0, sim.peak_bytes,
            ("no movable collectives: traced order kept",),
        )
    warm = _best_warm_start(problem, hint, mem_budget_bytes, time_limit_s, seed, cfg)
    start_hint = warm.schedule if warm is not None else problem.traced_schedule()
    budget = mem_budget_bytes
    notes: list[str] = []
    n_members = sum(len(c) for c in problem.chains.values())
    deadline = t0 + time_limit_s
    for round_ in range(cfg.memory_repair_rounds + 1):
        remaining = max(0.5, deadline - time.perf_counter())
        budget_mem = None if budget is None else budget // _MEM_UNIT_BYTES
        if n_members > cfg.full_model_max_members:
            return decomposed_solve(problem, cfg, warm, start_hint, mem_budget_bytes, deadline, seed, num_workers,
                                    notes, t0)
        t_build = time.perf_counter()
        built = _CpSatModel(problem, cfg, budget_mem)
        built.model.Minimize(built.U[built.anchors.m])
        build_s = time.perf_counter() - t_build
        # a complete, feasible starting point: the warm start's decisions with the model's times
        built.start_from(start_hint, max(0.5, remaining * 0.1), seed, num_workers)
        phase1 = max(0.5, deadline - time.perf_counter()) * cfg.primary_share
        solver = _make_solver(phase1, seed, num_workers, cfg)
        status = solver.Solve(built.model)
        logger.info(
            "cpsat round %d (full model, %d collectives): %s, step %.3f ms, bound %.3f ms, %.1f s (build %.1f s)",
            round_,
            n_members,
            _STATUS_NAMES.get(status, status),
            solver.ObjectiveValue() / _US_PER_MS if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else float("nan"),
            solver.BestObjectiveBound() / _US_PER_MS,
            solver.WallTime(),
            build_s,
        )
        if status in (cp_model.INFEASIBLE, cp_model.UNKNOWN) and warm is not None:
            # the model restricts positions to anchors and prices memory conservatively, so its
            # infeasibility proves nothing while a heuristic schedule fits: return that
            why = "under the budget" if budget is not None else "within the time limit"
            notes.append(f"model {_STATUS_NAMES.get(status)} {why}; returned the best warm start ({warm.solver})")
            return _warm_result(problem, warm, notes, t0)
        if status in (cp_model.INFEASIBLE, cp_model.UNKNOWN):
            if budget is None:
                raise ScheduleError(f"CP-SAT found no schedule ({_STATUS_NAMES.get(status)}) within {phase1:.1f} s")
            min_peak = _min_peak(problem, cfg, seed, num_workers, max(1.0, phase1 / 2))
            raise InfeasibleBudgetError(
                f"no schedule keeps peak memory under {(mem_budget_bytes or budget) / 2**30:.3f} GiB "
                f"({'proven infeasible' if status == cp_model.INFEASIBLE else 'none found in the time limit'}); "
                f"the smallest peak found is {min_peak / 2**30:.3f} GiB: raise mem_budget to at least that",
                budget_bytes=mem_budget_bytes or budget,
                min_peak_bytes=min_peak,
            )
        if status == cp_model.MODEL_INVALID:
            raise ScheduleError(f"CP-SAT model invalid: {built.model.Validate()}")
        model_obj = solver.ObjectiveValue() / _US_PER_MS
        bound = solver.BestObjectiveBound() / _US_PER_MS
        proven = status == cp_model.OPTIMAL
        schedule = built.extract(solver)
        sim = simulate(problem.dag, schedule, problem=problem)
        left = deadline - time.perf_counter()
        if cfg.secondary_objective and left > 0.5:
            sched2 = _secondary(built, solver, schedule, left, seed, num_workers, cfg)
            if sched2 is not None:
                sim2 = simulate(problem.dag, sched2, problem=problem)
                if sim2.step_ms <= sim.step_ms + 1e-9:
                    schedule, sim = sched2, sim2
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            notes.append(
                f"model step {model_obj:.3f} ms, model bound {bound:.3f} ms (full model), "
                f"status {_STATUS_NAMES[status]}"
            )
            # the model's bound holds for schedules in its search space (anchors, windows); the
            # analytic bound holds for every schedule
            return _final(problem, schedule, sim, warm, proven, max(bound, problem.lower_bound_ms()), notes, t0, round_)
        excess = sim.peak_bytes - mem_budget_bytes
        budget = (budget or mem_budget_bytes) - excess - _MEM_UNIT_BYTES
        notes.append(f"simulated peak exceeded the budget by {excess} B; tightened the model budget")
        start_hint = schedule
        if deadline - time.perf_counter() <= 0.5 or budget <= 0:
            break
    if warm is not None:
        # the model's memory terms could not be repaired to the simulator's in time (merge
        # transients): the best heuristic that fits is the answer, and says so
        notes.append(f"memory repair did not converge; returned the best warm start ({warm.solver})")
        return _warm_result(problem, warm, notes, t0)
    min_peak = _min_peak(problem, cfg, seed, num_workers, max(1.0, time_limit_s / 4))
    raise InfeasibleBudgetError(
        f"no schedule found under {(mem_budget_bytes or 0) / 2**30:.3f} GiB: no heuristic fits and the model's "
        f"schedules exceeded it in simulation after {cfg.memory_repair_rounds} repair rounds; the smallest peak "
        f"found is {min_peak / 2**30:.3f} GiB: raise mem_budget to at least that",
        budget_bytes=mem_budget_bytes or 0,
        min_peak_bytes=min_peak,
    )


def decomposed_solve(problem: Problem, cfg: CpSatConfig, warm: SolveResult | None, start: Schedule,
                     mem_budget_bytes: int | None, deadline: float, seed: int, num_workers: int, notes: list[str],
                     t0: float, *, window_solver=None, solver: str = "cpsat") -> SolveResult:
    """Large graphs: per-layer template (:func:`_template_search`), then rolling windows
    (:func:`_window_search`) from ``start``, each window solved by ``window_solver`` (CP-SAT's
    :func:`_solve_window` by default; the MILP passes its own). Only simulated improvements that
    fit the budget replace the incumbent, so the result fits whenever ``start`` does; if it does
    not (no heuristic fit), the model budget is tightened by the simulated excess and the search
    repeated, as in :func:`solve_cpsat`."""
    from scheduler.simulator import simulate

    anchors = _Anchors(problem)
    budget = mem_budget_bytes
    schedule = start
    history: list[tuple[float, float]] = []  # (perf_counter, step ms) of every improvement
    for round_ in range(cfg.memory_repair_rounds + 1):
        budget_mem = None if budget is None else budget // _MEM_UNIT_BYTES
        sim = simulate(problem.dag, schedule, problem=problem)
        history.append((time.perf_counter(), sim.step_ms))
        if cfg.template_rounds and round_ == 0:
            schedule, sim, n_templates = _template_search(
                problem, cfg, budget_mem, schedule, sim, deadline, seed, num_workers, mem_budget_bytes, anchors,
                window_solver=window_solver, history=history,
            )
            if n_templates:
                notes.append(f"per-layer template: {n_templates} round(s) copied a solved block onto the others")
        schedule, sim, sweeps = _window_search(
            problem, cfg, budget_mem, schedule, sim, deadline, seed, num_workers, mem_budget_bytes, anchors,
            window_solver=window_solver, history=history,
        )
        notes.append(f"rolling-window search: {sweeps} sweep(s) of {cfg.lns_window_members}-collective windows")
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            res = _final(problem, schedule, sim, warm, False, problem.lower_bound_ms(), notes, t0, round_, solver)
            return dataclasses.replace(res, history=tuple((round(t - t0, 3), ms) for t, ms in history))
        excess = sim.peak_bytes - mem_budget_bytes
        budget = (budget or mem_budget_bytes) - excess - _MEM_UNIT_BYTES
        notes.append(f"simulated peak exceeded the budget by {excess} B; tightened the model budget")
        if deadline - time.perf_counter() <= 0.5 or budget <= 0:
            break
    if warm is not None:
        notes.append(f"memory repair did not converge; returned the best warm start ({warm.solver})")
        return _warm_result(problem, warm, notes, t0, solver)
    raise InfeasibleBudgetError(
        f"no schedule found under {(mem_budget_bytes or 0) / 2**30:.3f} GiB: no heuristic fits and the window "
        f"search stayed above it in simulation; the smallest peak found is {sim.peak_bytes / 2**30:.3f} GiB: "
        "raise mem_budget to at least that",
        budget_bytes=mem_budget_bytes or 0,
        min_peak_bytes=sim.peak_bytes,
    )


def _warm_result(problem: Problem, warm: SolveResult, notes: list[str], t0: float, solver: str = "cpsat") -> SolveResult:
    """The warm start returned as this solver's (flagged) answer, with the analytic bound."""
    from scheduler.simulator import simulate

    sim = simulate(problem.dag, warm.schedule, problem=problem)
    return SolveResult(
        schedule=warm.schedule,
        status=SolveStatus.FEASIBLE,
        solver=solver,
        objective_ms=sim.step_ms,
        best_bound_ms=min(problem.lower_bound_ms(), sim.step_ms),
        solve_time_s=time.perf_counter() - t0,
        peak_bytes=sim.peak_bytes,
        notes=tuple(notes),
    )


def _final(problem: Problem, schedule: Schedule, sim, warm, proven: bool, bound_ms: float, notes: list[str],
           t0: float, rounds: int, solver: str = "cpsat") -> SolveResult:
    """The result: never a schedule that simulates slower than the warm start."""
    from scheduler.simulator import simulate

    if rounds:
        notes.append(f"memory repaired in {rounds} round(s)")
    if warm is not None and warm.objective_ms < sim.step_ms - 1e-9:
        # the model prices copies and transients approximately; never return a schedule that
        # simulates worse than the warm start it was given
        schedule, sim = warm.schedule, simulate(problem.dag, warm.schedule, problem=problem)
        proven = False
        notes.append(f"kept the warm start ({warm.solver}): the model's schedule simulated slower")
    return SolveResult(
        schedule=schedule,
        status=SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE,
        solver=solver,
        objective_ms=sim.step_ms,
        best_bound_ms=min(bound_ms, sim.step_ms),
        solve_time_s=time.perf_counter() - t0,
        peak_bytes=sim.peak_bytes,
        notes=tuple(notes),
    )


def _best_warm_start(problem: Problem, hint: Schedule | None, budget: int | None, time_limit_s: float, seed: int,
                     cfg: CpSatConfig):
    """The best (simulated) schedule among the user's hint and the registered heuristics that
    fit the budget and the bucket cap; None when none fits."""
    from scheduler.simulator import simulate
    from solvers import heuristics
    from solvers.dispatch import _SOLVERS

    best = None
    if hint is not None:
        sim = simulate(problem.dag, hint, problem=problem)
        if budget is None or sim.peak_bytes <= budget:
            best = SolveResult(hint, SolveStatus.HEURISTIC, "hint", sim.step_ms, 0.0, 0.0, sim.peak_bytes)
    for name in heuristics.WARM_START_HEURISTICS:
        try:
            r = _SOLVERS[name](problem, mem_budget_bytes=budget, time_limit_s=time_limit_s, seed=seed, hint=None, num_workers=1)
        except InfeasibleBudgetError:
            continue
        if budget is not None and r.peak_bytes > budget:
            continue
        if cfg.max_bucket_bytes is not None and any(
            len(b.members) > 1 and sum(problem.colls[m].payload_bytes for m in b.members) > cfg.max_bucket_bytes
            for b in r.schedule.buckets
        ):
            continue
        if best is None or r.objective_ms < best.objective_ms:
            best = r
    if best is not None:
        logger.info("cpsat warm start: %s, %.3f ms", best.solver, best.objective_ms)
    return best


def _window_order(problem: Problem) -> list[str]:
    """Movable collectives in the order the graph needs them (need for all-gathers, gradient
    ready for reduce-scatters)."""
    names = [c.name for c in problem.colls.values() if c.movable]
    return sorted(
        names,
        key=lambda n: (
            problem.colls[n].needed if problem.colls[n].coll_type == "all_gather" else problem.colls[n].ready,
            problem.colls[n].traced_issue,
        ),
    )


def _solve_window(problem: Problem, cfg: CpSatConfig, budget_mem: int | None, schedule: Schedule, free: set[str],
                  limit: float, seed: int, num_workers: int, anchors: _Anchors,
                  ties: tuple[list[tuple[str, str]], int] | None = None) -> Schedule | None:
    """One window of the neighbourhood search: a small model where the collectives ``free``
    (whole buckets of ``schedule``) are decided and every other bucket is a fixed interval at its
    position in ``schedule`` (``_CpSatModel(free=..., reference=schedule)``), started from
    ``schedule`` itself. Returns the window's best schedule (not yet simulated) or None."""
    built = _CpSatModel(problem, cfg, budget_mem, free=free, reference=schedule, anchors=anchors)
    if ties is not None:
        built.tie(*ties)
    built.model.Minimize(built.objective)
    # complete the incumbent inside this small model (its decisions fixed, times free), then
    # start the window's search from that full solution
    built.start_from(schedule, max(0.2, limit * 0.3), seed, num_workers)
    solver = _make_solver(limit * 0.7, seed, num_workers, cfg)
    # presolve rewrites the model and loses the complete hint (measured: no solution in 5 s
    # with presolve, the hint improved to 194.5 ms without, on an 8b backward window)
    solver.parameters.cp_model_presolve = False
    status = solver.Solve(built.model)
    logger.debug(
        "window (%d free): %s obj %.3f ms in %.2f s (limit %.2f)", len(free), _STATUS_NAMES.get(status),
        solver.ObjectiveValue() / _US_PER_MS if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else float("nan"),
        solver.WallTime(), limit,
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return built.extract(solver)


def _better(csim, sim, budget_bytes: int | None) -> bool:
    """``csim`` fits the budget and is faster than ``sim`` (or as fast with a lower peak)."""
    if budget_bytes is not None and csim.peak_bytes > budget_bytes:
        return False
    return csim.step_ms < sim.step_ms - 1e-6 or (
        abs(csim.step_ms - sim.step_ms) <= 1e-6 and csim.peak_bytes < sim.peak_bytes
    )


def _bucket_free(schedule: Schedule, names) -> set[str]:
    """``names`` and every collective sharing a bucket with one of them in ``schedule``."""
    bucket_of = schedule.bucket_of()
    return {m for b in {bucket_of[n] for n in names} for m in schedule.buckets[b].members}


def _template_search(problem: Problem, cfg: CpSatConfig, budget_mem: int | None, schedule: Schedule, sim,
                     deadline: float, seed: int, num_workers: int, budget_bytes: int | None, anchors: _Anchors,
                     window_solver=None, history: list | None = None):
    """Exploit the per-layer repetition before the window search (see :mod:`solvers.periodic`).

    Each round solves one window over the ``template_window_blocks`` blocks around the middle of
    the repeating run, then copies the middle block's decisions onto every block of the run
    (:func:`solvers.periodic.replicate`); the copy is also tried on the blocks with the most
    memory headroom only (3/4, 1/2, 1/4 of them), and the fastest that fits is kept. The
    next round solves the middle window again with templated neighbours, so the pattern settles
    into a steady state; rounds stop when one does not improve the simulated step time. Under a
    memory budget, the unconstrained heuristics' middle blocks are tried first the same way (a
    budget often binds on a few layers only: the others can take the unconstrained pattern).
    Returns (schedule, simulation, number of templates accepted)."""
    from scheduler.simulator import simulate
    from solvers.periodic import at_traced, detect_periodicity, isolate, replicate

    per = detect_periodicity(problem, min_blocks=cfg.template_min_blocks)
    if per is None:
        return schedule, sim, 0
    mid = per.middle()
    half = cfg.template_window_blocks // 2
    window_blocks = [b for b in range(mid - half, mid + half + 1) if b in per.members]
    accepted = 0

    def copy_best(source: Schedule, label: str) -> bool:
        """Copy ``source``'s middle block onto the incumbent's blocks, all of them or those with
        the most memory headroom (3/4, 1/2, 1/4); keep the fastest copy that fits."""
        nonlocal schedule, sim
        order = sorted(per.blocks, key=lambda b: (_block_peak(problem, per, b, schedule, sim), b))
        improved = False
        for frac in (1.0, 0.75, 0.5, 0.25):
            targets = order[: max(1, int(len(order) * frac))]
            tmpl = replicate(problem, per, source, mid, targets, onto=schedule)
            if tmpl is None:
                break
            tsim = simulate(problem.dag, tmpl, problem=problem)
            logger.debug("%s template on %d blocks: step %.3f ms, peak %.3f GiB", label, len(targets), tsim.step_ms,
                         tsim.peak_bytes / 2**30)
            if _better(tsim, sim, budget_bytes):
                schedule, sim, improved = tmpl, tsim, True
                if history is not None:
                    history.append((time.perf_counter(), sim.step_ms))
        return improved

    # the unconstrained heuristics' steady state, on the layers with room for it
    if budget_bytes is not None:
        from solvers import heuristics
        from solvers.dispatch import _SOLVERS

        for name in heuristics.WARM_START_HEURISTICS:
            if deadline - time.perf_counter() <= 1.0:
                break
            free_run = _SOLVERS[name](problem, mem_budget_bytes=None, time_limit_s=1.0, seed=seed, hint=None,
                                      num_workers=1)
            accepted += copy_best(free_run.schedule, name)
    for round_ in range(cfg.template_rounds):
        left = deadline - time.perf_counter()
        if left <= 1.0:
            break
        limit = min(left * 0.5, cfg.template_window_s)
        # the window decides exactly its blocks' collectives: buckets reaching outside are split
        free = {n for b in window_blocks for n in per.members[b].values()}
        # start from the middle block's decisions on every window block, or else from the
        # traced positions there: both repeat exactly, so the tied model can complete them
        base = replicate(problem, per, isolate(problem, schedule, free), mid, window_blocks)
        if base is None or not _ties_hold(base, per, window_blocks):
            base = at_traced(problem, schedule, free) or isolate(problem, schedule, free)
        pairs = [(per.members[b][r], per.members[b + 1][r]) for b in window_blocks[:-1] for r in per.members[b]]
        cand = (window_solver or _solve_window)(problem, cfg, budget_mem, base, free, limit, seed, num_workers,
                                                anchors, ties=(pairs, per.period))
        if cand is None:
            break
        improved = copy_best(cand, "window")
        logger.info("template round %d (blocks %d..%d, period %d): step %.3f ms, peak %.3f GiB%s",
                    round_ + 1, per.blocks[0], per.blocks[-1], per.period, sim.step_ms, sim.peak_bytes / 2**30,
                    "" if improved else " (no gain)")
        if not improved:
            break
        accepted += 1
    return schedule, sim, accepted


def _ties_hold(schedule: Schedule, per, blocks: list[int]) -> bool:
    """Every role of ``blocks`` is issued (and waited) one period after the previous block's,
    in a bucket of the same size: the start satisfies the template window's ties."""
    issue, wait = schedule.positions()
    bucket_of = schedule.bucket_of()
    for b in blocks[:-1]:
        for role, n in per.members[b].items():
            x, y = bucket_of[n], bucket_of[per.members[b + 1][role]]
            if (issue[y] - issue[x] != per.period or wait[y] - wait[x] != per.period
                    or len(schedule.buckets[x].members) != len(schedule.buckets[y].members)):
                return False
    return True


def _block_peak(problem: Problem, per, block: int, schedule: Schedule, sim) -> int:
    """Highest simulated live bytes of ``schedule`` between the first and the last need of
    ``block``'s collectives (the graph's end excluded)."""
    needs = [problem.colls[n].needed for n in per.members[block].values() if problem.colls[n].needed < problem.n]
    if not needs or not sim.step_live_bytes:
        return 0
    lo, hi = min(needs), max(needs)
    gap, peak = 0, 0
    for s, live in zip(schedule.steps, sim.step_live_bytes):
        if lo <= gap <= hi:
            peak = max(peak, live)
        if s.kind == "node":
            gap += 1
    return peak


def _window_search(problem: Problem, cfg: CpSatConfig, budget_mem: int | None, schedule: Schedule, sim,
                   deadline: float, seed: int, num_workers: int, budget_bytes: int | None,
                   anchors: _Anchors | None = None, window_solver=None, history: list | None = None):
    """Rolling-window neighbourhood search (see :func:`solve_cpsat`).

    Each window frees the incumbent's buckets that hold one of ``lns_window_members``
    consecutive collectives (in order of need) and solves the small model of
    :func:`_solve_window` (or ``window_solver``, same signature: the MILP's). Windows are
    visited most-exposed first; a window whose simulated
    result fits the budget and is faster replaces the incumbent. Returns the best schedule, its
    simulation and the number of sweeps."""
    from scheduler.simulator import simulate

    anchors = anchors or _Anchors(problem)
    order = _window_order(problem)
    k = cfg.lns_window_members
    stride = max(1, k // 2)
    starts = list(range(0, max(1, len(order) - k + stride), stride))
    sweeps = 0
    for sweep in range(cfg.lns_max_sweeps):
        improved = False
        sweeps += 1
        # most exposed communication first (ties: graph order), from the incumbent's run
        bucket_of = schedule.bucket_of()
        exposed = {n: sim.bucket_exposed_ms.get(b, 0.0) for n, b in bucket_of.items()}
        visit = sorted(starts, key=lambda s0: (-sum(exposed.get(n, 0.0) for n in order[s0 : s0 + k]), s0))
        for i, s0 in enumerate(visit):
            left = deadline - time.perf_counter()
            if left <= 0.2:
                return schedule, sim, sweeps
            limit = min(left, max(cfg.lns_min_window_s, left / (len(visit) - i) * 0.8))
            free = _bucket_free(schedule, order[s0 : s0 + k])
            cand = (window_solver or _solve_window)(problem, cfg, budget_mem, schedule, free, limit, seed,
                                                    num_workers, anchors)
            if cand is None:
                continue
            csim = simulate(problem.dag, cand, problem=problem)
            if _better(csim, sim, budget_bytes):
                schedule, sim = cand, csim
                improved = True
                if history is not None:
                    history.append((time.perf_counter(), sim.step_ms))
        logger.info("window sweep %d: step %.3f ms, peak %.3f GiB", sweep + 1, sim.step_ms, sim.peak_bytes / 2**30)
        if not improved:
            break
    return schedule, sim, sweeps


def _secondary(built: _CpSatModel, solver1, schedule1: Schedule, limit_s: float, seed, num_workers, cfg):
    """Phase 2: keep the step time, minimise peak memory then the number of buckets."""
    m = built.model
    best = int(round(solver1.ObjectiveValue()))
    # hint the phase-1 solution
    m.ClearHints()
    for v in list(built.brk.values()) + list(built.I.values()) + list(built.W.values()):
        m.AddHint(v, solver1.Value(v))
    m.Add(built.U[built.anchors.m] <= best)
    n_buckets = sum(built.brk.values())
    m.Minimize(built.P * (len(built.brk) + 1) + n_buckets)
    solver = _make_solver(max(0.5, limit_s), seed, num_workers, cfg)
    status = solver.Solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return built.extract(solver)
    return None


def _min_peak(problem: Problem, cfg: CpSatConfig, seed: int, num_workers: int, limit_s: float) -> int | None:
    """Smallest simulated peak the model finds without a budget (for infeasibility errors)."""
    from scheduler.simulator import simulate

    traced_peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
    if sum(len(c) for c in problem.chains.values()) > cfg.full_model_max_members:
        return traced_peak  # too large to minimise as one model; the traced order is the floor found
    built = _CpSatModel(problem, cfg, None)
    built.add_hint(problem.traced_schedule())
    built.model.Minimize(built.P)
    solver = _make_solver(limit_s, seed, num_workers, cfg)
    status = solver.Solve(built.model)
    peaks = [traced_peak]
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        peaks.append(simulate(problem.dag, built.extract(solver), problem=problem).peak_bytes)
    return min(peaks)


@register("cpsat")
def _cpsat_entry(problem: Problem, **kw) -> SolveResult:
    return solve_cpsat(problem, **kw)


del math
