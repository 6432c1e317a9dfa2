"""ILP twin of the joint CP-SAT model (:mod:`solvers.cpsat`), in PuLP (CBC, or HiGHS if installed).

Same data and decision space as CP-SAT: the anchors, segments, chains, members, issue and wait
windows, durations, copy costs and the calibrated memory base are read from a
:class:`solvers.cpsat._CpSatModel` built for the same problem (its CP model is only used as a data
container, to complete the warm start and to extract the schedule), so both models can only
differ in how they are written down. Times are in microseconds (continuous; every datum is an
integer, so optimal times are integers), memory in the CP-SAT model's unit (``cpsat._MEM_UNIT_BYTES`` bytes).

Variables (k a chain member, a an anchor; "k-1" is k's predecessor in its chain)
    brk_k      in {0,1}  k starts a new bucket (brk_0 = 1); last_k = brk_{k+1} (1 at the chain end)
    y_{k,a}    in {0,1}  [I_k <= a] for a in [lo_k, hi_k); 0 below lo_k, 1 from hi_k on;
                         y_{k,a} <= y_{k,a+1}; the issue anchor is I_k = lo_k + sum_a (1 - y_{k,a})
    z_{k,a}    in {0,1}  [W_k <= a] for reduce-scatters, on [wlo_k, whi_k), likewise
    s_k        in [0,1]  k is alone in its bucket: s_k = brk_k AND last_k (integral when brk is);
                         mrg_k = 1 - s_k, lead_k = brk_k - s_k (first member of a merged bucket)
    o_{k,l}    in {0,1}  bucket of k runs before bucket of l (pairs on one stream, see (5))
    R_k, C_k, X_k, T_a, U_a   as in CP-SAT; E_k = C_k + alpha + R_k (end if k closed its bucket)

Objective: minimise U_m (step time). Bounds: C, X in [ES_k, LF_k], T_a >= est_a, U_a <= UB - tail_a
where est/tail are the fixed compute before / after an anchor and UB is the model step time of the
warm start (the horizon without one); they cut off only solutions worse than the warm start.

Constraints (each group is one method of :class:`_MilpModel`; M are big-Ms from those bounds)
    (1) timeline      T_0 = 0, T_{a+1} = U_a + seg_a, U_a >= T_a            -> ``_add_timeline``
    (2) buckets       y_{k,a} <= y_{k-1,a} (I monotone), y_{k-1,a} - y_{k,a} <= brk_k (equal
                      issue when merged); the same for z; |C_k - C_{k-1}| <= M brk_k;
                      R_k = d_k + (1 - brk_k) R_{k-1} (four big-M inequalities);
                      X_k = E_k when last_k, X_k = X_{k+1} otherwise (big-M both ways)
                                                                          -> ``_add_buckets``
    (3) issue         C_k >= T_{lo}; C_k >= T_a - M y_{k,a-1} for a in (lo, hi]
                                                                          -> ``_add_issue``
    (4) waits         all-gather: U_{need} >= X_k; reduce-scatter: z_{k,a} <= y_{k,a} (W >= I),
                      U_a >= X_k - M (1 - z_{k,a}), U_{whi} >= X_k       -> ``_add_waits``
    (5) streams       same chain: C_k >= X_{k-1} - M (1 - brk_k) (FIFO chain order, as CP-SAT);
                      different chains (and fixed collectives) of one process group: for each
                      pair whose time windows [ES, LF) overlap, with p = 2 - last_k - last_l,
                      C_l >= E_k - M (1 - o_kl) - M p  and  C_k >= E_l - M o_kl - M p;
                      pairs whose windows do not overlap cannot overlap in time at all
                      (same as CP-SAT's NoOverlap for every solution at most UB) -> ``_add_streams``
    (6) merge cost    U_a >= T_a + sum_{k charged at a} (copy_k (1 - s_k) + fixed_k (brk_k - s_k)
                      + prologue_k); s_k <= brk_k, s_k <= last_k, s_k >= brk_k + last_k - 1
                                                                          -> ``_add_copy_costs``
    (7) memory        for every anchor a, base_a + sum_AG out_k y_{k,a}
                      + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} - z_{k,a}) + out_k y_{k,a}]
                      + sum_RS grad_k e_{k,a} <= budget, e_{k,a} = [issued at a] AND mrg_k
                      (merge transient; e continuous, three inequalities) (base_a calibrated on the traced simulation by CP-SAT's model)
                                                                          -> ``_add_memory``
    (cap) bucket size Q_k = pay_k + (1 - brk_k) Q_{k-1} <= max(cap, pay_k) when max_bucket_bytes
                                                                          -> ``_add_buckets``

Differences from CP-SAT (the optimum of U_m is the same):
- times are continuous instead of integer (the optimum is integral anyway);
- NoOverlap becomes pairwise order binaries, only for pairs that can overlap under UB;
- the warm start's objective UB is a constraint (CP-SAT only hints it);
- no second phase (peak memory, then fewer buckets, at the optimal step time): among equally
  fast schedules the MILP returns whichever the solver finds;
- windows: CP-SAT's window models (``_CpSatModel(free=..., reference=...)``: an anchor range,
  the incumbent's other buckets as fixed intervals, the exit state Z as objective) are written
  down the same way (:meth:`_MilpModel.objective`), and so is the per-layer template's tie
  (:meth:`_MilpModel.tie`). Graphs with more than ``full_model_max_members`` movable collectives
  go through the same decomposition as CP-SAT (:func:`solvers.cpsat.decomposed_solve`: template,
  then rolling windows), each window solved by :func:`_solve_window_milp`.

The memory repair loop (re-solve with a tighter budget when the simulated peak exceeds it), the
fallback to the best heuristic when the model is infeasible, and "never return a schedule that
simulates slower than the warm start" are those of :func:`solvers.cpsat.solve_cpsat`.
Determinism: one thread and a fixed seed; CBC's time limit is wall-clock, so set
``MilpConfig.max_nodes`` for the same schedule on every rank under time pressure.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import tempfile
import time
import warnings
from collections import defaultdict

import pulp

from solvers.cpsat import _MEM_UNIT_BYTES  # the CP-SAT model's memory unit
from solvers.cpsat import CpSatConfig, _best_warm_start, _CpSatModel, _final, _warm_result, decomposed_solve
from solvers.dispatch import register
from solvers.problem import Problem
from solvers.schedule import InfeasibleBudgetError, Schedule, ScheduleError, SolveResult, SolveStatus

logger = logging.getLogger(__name__)

_US_PER_MS = 1000.0
#: memory rows are divided by this (a power of two: exact) to keep coefficients moderate for CBC
_MEM_ROW_SCALE = 1024.0


def model_budget(mem_budget_bytes: int | None) -> int | None:
    """A budget in bytes in the memory unit of the (shared) model, rounded down."""
    return None if mem_budget_bytes is None else mem_budget_bytes // _MEM_UNIT_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class MilpConfig:
    """Knobs of the MILP solve. The model's data (windows, bucket cap) come from ``model``."""

    #: windows, bucket cap and repair rounds shared with CP-SAT (the same decision space)
    model: CpSatConfig = dataclasses.field(default_factory=CpSatConfig)
    #: "auto" (HiGHS when installed, else CBC), "cbc" or "highs"
    backend: str = "auto"
    #: absolute optimality gap in microseconds; every objective value is an integer number of
    #: microseconds, so any gap below 1 still proves optimality
    abs_gap_us: float = 0.5
    #: branch-and-bound node limit (None: none); unlike the wall-clock limit it is deterministic
    max_nodes: int | None = None
    #: fraction of the time limit for completing the warm start (times for its decisions)
    warm_start_share: float = 0.1
    #: solve the LP relaxation too and report its bound in the notes
    lp_bound: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "cbc", "highs"):
            raise ValueError(f"backend must be 'auto', 'cbc' or 'highs', got {self.backend!r}")
        if not 0.0 <= self.abs_gap_us < 1.0:
            raise ValueError("abs_gap_us must be in [0, 1): a gap of 1 us may cut off the optimum")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError("max_nodes must be >= 1 or None")
        if not 0.0 < self.warm_start_share < 1.0:
            raise ValueError("warm_start_share must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One MILP (or LP) solve: status "optimal", "feasible", "infeasible" or "unknown"."""

    status: str
    objective_us: float | None
    bound_us: float | None


class _Values:
    """Looks like a CP-SAT solver to :meth:`_CpSatModel.extract`: ``Value(var)`` by CP index."""

    def __init__(self, by_index: dict[int, int]):
        self._v = by_index

    def Value(self, var) -> int:  # noqa: N802 (CP-SAT's name)
        return self._v[var.Index()]


class _MilpModel:
    """The MILP over the data of a CP-SAT model ``cp`` (see module docstring).

    Args:
        cp: the CP-SAT model of the same problem and budget, used as data.
        upper_us: model step time of a known solution (the warm start): U_m <= upper_us.
        relax: continuous binaries (the LP relaxation).
        peak_objective: minimise the peak memory instead of the step time (for error messages).
    """

    def __init__(self, cp: _CpSatModel, upper_us: int | None = None, *, relax: bool = False,
                 peak_objective: bool = False):
        self.cp = cp
        self.p = cp.p
        self.A = cp.anchors
        self.cat = pulp.LpContinuous if relax else pulp.LpBinary
        self.lp = pulp.LpProblem("fsdp_sched", pulp.LpMinimize)
        self.infeasible: list[str] = []  # constant constraints that fail: the model is infeasible
        self.upper_us = int(cp.horizon if upper_us is None else min(upper_us, cp.horizon))
        #: modelled anchors: all of them, or a window's range (``cp.a_lo..cp.a_hi``)
        self.rng = cp.anchor_range
        self.window = cp.a_hi != self.A.m
        self._time_bounds()
        self._add_variables()
        self._add_timeline()
        self._add_buckets()
        self._add_issue()
        self._add_waits()
        self._add_streams()
        self._add_copy_costs()
        self._add_memory(peak_objective)
        self.lp += self.P if peak_objective else self.objective

    @property
    def objective(self):
        """U_m for the whole model; for a window, its exit state Z (as CP-SAT's)."""
        return self.Z if self.window else self.U[self.A.m]

    # -- helpers -----------------------------------------------------------------------------
    def _var(self, name: str, lo: float | None = None, hi: float | None = None, cat: str = pulp.LpContinuous):
        """A variable of this problem (PuLP >= 3.3 attaches variables to their problem)."""
        if hasattr(self.lp, "add_variable"):
            return self.lp.add_variable(name, lo, hi, cat=cat)
        return pulp.LpVariable(name, lo, hi, cat)

    def _add(self, lhs, sense: str, rhs, name: str) -> None:
        """Add ``lhs <sense> rhs``; constant sides are checked here (PuLP rejects empty rows)."""
        expr = pulp.lpSum([lhs]) - pulp.lpSum([rhs])
        if not expr.keys():
            c = expr.constant
            ok = c <= 1e-9 if sense == "<=" else c >= -1e-9 if sense == ">=" else abs(c) <= 1e-9
            if not ok:
                self.infeasible.append(name)
            return
        if sense == "<=":
            self.lp += (expr <= 0, name)
        elif sense == ">=":
            self.lp += (expr >= 0, name)
        else:
            self.lp += (expr == 0, name)

    def yv(self, n: str, a: int):
        """[I_n <= a] as a variable or a constant."""
        mem = self.member[n]
        if a < mem.lo:
            return 0
        if a >= mem.hi:
            return 1
        return self.y[n][a]

    def zv(self, n: str, a: int):
        """[W_n <= a] as a variable or a constant."""
        mem = self.member[n]
        if a < mem.wlo:
            return 0
        if a >= mem.whi:
            return 1
        return self.z[n][a]

    def _time_bounds(self) -> None:
        """est_a (earliest T_a), ub_T / ub_U (latest T_a / U_a under objective <= UB) and every
        member's [ES, LF): its bucket runs inside it in every solution at most UB."""
        A, cp, lo, hi = self.A, self.cp, self.cp.a_lo, self.cp.a_hi
        fixed_copy = defaultdict(int)  # prologues: charged whether merged or not
        for chain in cp.chains:
            for mem in chain:
                fixed_copy[mem.charge] += mem.prologue_us
        self.fixed = cp.fixed
        for f in self.fixed:
            if f.copy_in_us and not f.before_range:
                fixed_copy[f.issue] += f.copy_in_us
            if f.copy_out_us and f.wait is not None:
                fixed_copy[f.wait] += f.copy_out_us
        self.t_start = cp._ref_arrival_us(lo) if lo > 0 else 0
        self.est = {lo: self.t_start}
        for a in range(lo, hi):
            self.est[a + 1] = self.est[a] + fixed_copy[a] + A.seg_us[a]
        tail_u = {hi: 0}  # objective - U_a >= tail_u[a]
        for a in range(hi - 1, lo - 1, -1):
            tail_u[a] = tail_u[a + 1] + A.seg_us[a] + fixed_copy[a + 1]
        ub = self.upper_us
        self.ub_U = {a: max(self.est[a], ub - tail_u[a]) for a in self.rng}
        self.ub_T = {a: max(self.est[a], self.ub_U[a] - fixed_copy[a]) for a in self.rng}
        self.member = {mem.name: mem for chain in cp.chains for mem in chain}
        self.ES: dict[str, int] = {}
        self.LF: dict[str, int] = {}
        for n, mem in self.member.items():
            self.ES[n] = self.est[mem.lo]
            self.LF[n] = self.ub_U[mem.need if mem.coll_type == "all_gather" else mem.whi]

    def _add_variables(self) -> None:
        A, cp, B = self.A, self.cp, self.cat
        self.T = {a: self._var(f"T{a}", self.est[a], self.ub_T[a]) for a in self.rng}
        self.U = {a: self._var(f"U{a}", self.est[a], self.ub_U[a]) for a in self.rng}
        self.Z = self._var("Z", self.est[cp.a_hi], self.upper_us) if self.window else None
        self.brk, self.C, self.X, self.R, self.s = {}, {}, {}, {}, {}
        self.y: dict[str, dict[int, pulp.LpVariable]] = {}
        self.z: dict[str, dict[int, pulp.LpVariable]] = {}
        for ci, chain in enumerate(cp.chains):
            total_d = sum(x.d_us for x in chain)
            for k, mem in enumerate(chain):
                n = mem.name
                self.brk[n] = 1 if k == 0 else self._var(f"brk_{n}", 0, 1, B)
                lf = max(self.LF[n], self.ES[n])
                self.C[n] = self._var(f"C_{n}", self.ES[n], lf)
                self.X[n] = self._var(f"X_{n}", self.ES[n], lf)
                self.R[n] = self._var(f"R_{n}", mem.d_us, max(mem.d_us, total_d))
                self.y[n] = {a: self._var(f"y_{n}_{a}", 0, 1, B) for a in range(mem.lo, mem.hi)}
                if mem.coll_type == "reduce_scatter":
                    self.z[n] = {a: self._var(f"z_{n}_{a}", 0, 1, B) for a in range(mem.wlo, mem.whi)}
                for a in range(mem.lo, mem.hi - 1):
                    self.lp += (self.y[n][a] <= self.y[n][a + 1], f"ymono_{n}_{a}")
                for a in range(mem.wlo, mem.whi - 1):
                    self.lp += (self.z[n][a] <= self.z[n][a + 1], f"zmono_{n}_{a}")
        self.last = {}
        for chain in cp.chains:
            for k, mem in enumerate(chain):
                self.last[mem.name] = self.brk[chain[k + 1].name] if k + 1 < len(chain) else 1

    # -- (1) ---------------------------------------------------------------------------------
    def _add_timeline(self) -> None:
        """(1) T_0 = 0 (a window: T_lo = the reference's arrival); T_{a+1} = U_a + seg_a;
        U_a >= T_a; a window's exit state Z >= U_hi."""
        A, lo, hi = self.A, self.cp.a_lo, self.cp.a_hi
        self._add(self.T[lo], "==", self.t_start, "T0")
        for a in range(lo, hi):
            self._add(self.T[a + 1], "==", self.U[a] + A.seg_us[a], f"seg_{a}")
        for a in self.rng:
            self._add(self.U[a], ">=", self.T[a], f"dwell_{a}")
        if self.window:
            self._add(self.Z, ">=", self.U[hi], "Z_exit")

    # -- (2) ---------------------------------------------------------------------------------
    def _add_buckets(self) -> None:
        """(2) y_{k,a} <= y_{k-1,a} and y_{k-1,a} - y_{k,a} <= brk_k (so brk_k = 0 => I_k =
        I_{k-1}), likewise z; brk_k = 0 => C_k = C_{k-1}; R_k = d_k + (1 - brk_k) R_{k-1};
        X_k = C_k + alpha + R_k when last_k, else X_k = X_{k+1}; bucket payload cap."""
        cp = self.cp
        cap = cp.cfg.max_bucket_bytes
        for ci, chain in enumerate(cp.chains):
            alpha = cp.alpha_us[ci]
            total_d = sum(x.d_us for x in chain)
            total_pay = sum(self.p.colls[x.name].payload_bytes for x in chain)
            Q = None
            for k, mem in enumerate(chain):
                n, b = mem.name, self.brk[mem.name]
                pay = self.p.colls[n].payload_bytes
                q = None
                if cap is not None:
                    q = self._var(f"Q_{n}", pay, max(pay, total_pay))
                    self._add(q, "<=", max(cap, pay), f"cap_{n}")
                if k == 0:
                    self._add(self.R[n], "==", mem.d_us, f"R0_{n}")
                    if q is not None:
                        self._add(q, "==", pay, f"Q0_{n}")
                else:
                    prev = chain[k - 1]
                    pn = prev.name
                    for a in range(min(prev.lo, mem.lo), max(prev.hi, mem.hi)):
                        self._add(self.yv(n, a), "<=", self.yv(pn, a), f"imono_{n}_{a}")
                        self._add(self.yv(pn, a) - self.yv(n, a), "<=", b, f"isame_{n}_{a}")
                    if mem.coll_type == "reduce_scatter":
                        for a in range(min(prev.wlo, mem.wlo), max(prev.whi, mem.whi)):
                            self._add(self.zv(n, a), "<=", self.zv(pn, a), f"wmono_{n}_{a}")
                            self._add(self.zv(pn, a) - self.zv(n, a), "<=", b, f"wsame_{n}_{a}")
                    mc = max(self.LF[n], self.LF[pn]) - min(self.ES[n], self.ES[pn])
                    self._add(self.C[n] - self.C[pn], "<=", mc * b, f"csame_u_{n}")
                    self._add(self.C[pn] - self.C[n], "<=", mc * b, f"csame_l_{n}")
                    # R_k = d_k when brk_k, R_{k-1} + d_k otherwise
                    self._add(self.R[n], "<=", mem.d_us + total_d * (1 - b), f"R_brk_{n}")
                    self._add(self.R[n], ">=", self.R[pn] + mem.d_us - total_d * b, f"R_acc_l_{n}")
                    self._add(self.R[n], "<=", self.R[pn] + mem.d_us + total_d * b, f"R_acc_u_{n}")
                    if q is not None:
                        self._add(q, "<=", pay + total_pay * (1 - b), f"Q_brk_{n}")
                        self._add(q, ">=", Q + pay - total_pay * b, f"Q_acc_{n}")
                Q = q
            for k, mem in enumerate(chain):
                n = mem.name
                end = self.C[n] + alpha + self.R[n]
                if k + 1 < len(chain):
                    nx_ = chain[k + 1].name
                    last = self.last[n]
                    mx = max(self.LF[n], self.LF[nx_]) + alpha + total_d
                    self._add(self.X[n] - end, "<=", mx * (1 - last), f"X_end_u_{n}")
                    self._add(end - self.X[n], "<=", mx * (1 - last), f"X_end_l_{n}")
                    self._add(self.X[n] - self.X[nx_], "<=", mx * last, f"X_same_u_{n}")
                    self._add(self.X[nx_] - self.X[n], "<=", mx * last, f"X_same_l_{n}")
                else:
                    self._add(self.X[n], "==", end, f"X_end_{n}")

    # -- (3) ---------------------------------------------------------------------------------
    def _add_issue(self) -> None:
        """(3) C_k >= T_{lo}; C_k >= T_a - M y_{k,a-1} for a in (lo, hi] (I_k >= a <=> y_{k,a-1} = 0)."""
        for n, mem in self.member.items():
            self._add(self.C[n], ">=", self.T[mem.lo], f"issue_{n}_{mem.lo}")
            for a in range(mem.lo + 1, mem.hi + 1):
                self._add(self.C[n], ">=", self.T[a] - self.ub_T[a] * self.y[n][a - 1], f"issue_{n}_{a}")

    # -- (4) ---------------------------------------------------------------------------------
    def _add_waits(self) -> None:
        """(4) all-gathers: U_{need} >= X_k; reduce-scatters: z_{k,a} <= y_{k,a} (W_k >= I_k),
        U_a >= X_k - M (1 - z_{k,a}) for a in [wlo, whi), U_{whi} >= X_k."""
        for n, mem in self.member.items():
            if mem.coll_type == "all_gather":
                self._add(self.U[mem.need], ">=", self.X[n], f"wait_{n}")
                continue
            for a in range(min(mem.lo, mem.wlo), max(mem.hi, mem.whi)):
                self._add(self.zv(n, a), "<=", self.yv(n, a), f"w_after_i_{n}_{a}")
            M = max(self.LF[n], self.ES[n])
            for a in range(mem.wlo, mem.whi):
                self._add(self.U[a], ">=", self.X[n] - M * (1 - self.z[n][a]), f"wait_{n}_{a}")
            self._add(self.U[mem.whi], ">=", self.X[n], f"wait_{n}_{mem.whi}")

    # -- (5) ---------------------------------------------------------------------------------
    def _add_streams(self) -> None:
        """(5) a chain's buckets in chain order: C_k >= X_{k-1} - M (1 - brk_k); buckets of other
        chains and fixed collectives of the same process group do not overlap: one order binary
        per pair whose windows [ES, LF) overlap, active when both close their buckets."""
        p, A, cp = self.p, self.A, self.cp
        # stream items: (name, start, end expr, presence, ES, LF, chain)
        per_group: dict[str, list] = defaultdict(list)
        for ci, chain in enumerate(cp.chains):
            alpha = cp.alpha_us[ci]
            for k, mem in enumerate(chain):
                n = mem.name
                if k > 0:
                    pn = chain[k - 1].name
                    M = max(0, self.LF[pn] - self.ES[n])
                    self._add(self.C[n], ">=", self.X[pn] - M * (1 - self.brk[n]), f"fifo_{n}")
                per_group[p.colls[n].group_name].append(
                    (n, self.C[n], self.C[n] + alpha + self.R[n], self.last[n], self.ES[n], self.LF[n], ci)
                )
        if self.window:
            for n in self.member:  # nothing issued in the window ends unseen
                alpha = cp.alpha_us[self.member[n].chain]
                self._add(self.Z, ">=", self.C[n] + alpha + self.R[n], f"Z_end_{n}")
        # fixed buckets (CP-SAT's fixed_intervals): in reference order among themselves
        self.Cf: dict[int, pulp.LpVariable] = {}
        fixed_by_group: dict[str, list] = defaultdict(list)
        for f in self.fixed:
            if f.before_range:
                es = f.ref_start_us
                lf = max(es + f.dur_us, self.ub_U[f.wait] if f.wait is not None else self.upper_us)
            else:
                es = self.est[f.issue]
                lf = max(es + f.dur_us, self.ub_U[f.wait] if f.wait is not None else self.upper_us)
            self.Cf[f.bucket] = start = self._var(f"Cf_{f.bucket}", es, max(es, lf - f.dur_us))
            if not f.before_range:
                self._add(start, ">=", self.T[f.issue], f"fix_issue_{f.bucket}")
                if self.window:
                    self._add(self.Z, ">=", start + f.dur_us, f"Z_fix_{f.bucket}")
            if f.wait is not None:
                self._add(self.U[f.wait], ">=", start + f.dur_us, f"fix_wait_{f.bucket}")
            fixed_by_group[f.group].append((f.ref_start_us, start, f.dur_us))
            if f.before_range:
                # FIFO: every free bucket is issued after it, so it runs after it
                for n in self.member:
                    if p.colls[n].group_name == f.group:
                        self._add(self.C[n], ">=", start + f.dur_us, f"fifo_pre_{f.bucket}_{n}")
            else:
                per_group[f.group].append((f"f{f.bucket}", start, start + f.dur_us, 1, es, lf, -1 - f.bucket))
        for group, items in fixed_by_group.items():
            items.sort(key=lambda t: t[0])
            for i, ((_r0, st0, d0), (_r1, st1, _d1)) in enumerate(zip(items, items[1:])):
                self._add(st1, ">=", st0 + d0, f"fix_order_{group}_{i}")
        self.order: dict[tuple[str, str], pulp.LpVariable] = {}
        self.n_pairs_skipped = 0
        for items in per_group.values():
            for i, (k, Ck, Ek, pk, esk, lfk, chk) in enumerate(items):
                for (l, Cl, El, pl, esl, lfl, chl) in items[i + 1 :]:
                    if chk == chl or (chk < 0 and chl < 0):
                        continue  # same chain: FIFO order above; fixed pairs: reference order
                    if lfk <= esl or lfl <= esk:
                        self.n_pairs_skipped += 1
                        continue
                    o = self._var(f"o_{k}__{l}", 0, 1, self.cat)
                    self.order[(k, l)] = o
                    absent = 2 - pk - pl
                    mkl, mlk = max(0, lfk - esl), max(0, lfl - esk)
                    self._add(Cl, ">=", Ek - mkl * (1 - o) - mkl * absent, f"kl_{k}__{l}")
                    self._add(Ck, ">=", El - mlk * o - mlk * absent, f"lk_{k}__{l}")

    # -- (6) ---------------------------------------------------------------------------------
    def _add_copy_costs(self) -> None:
        """(6) s_k = brk_k AND last_k (alone); U_a >= T_a + sum_{k charged at a}
        (copy_k (1 - s_k) + fixed_k (brk_k - s_k) + prologue_k)."""
        terms: dict[int, list] = defaultdict(list)
        for n, mem in self.member.items():
            b, last = self.brk[n], self.last[n]
            if isinstance(b, int) and isinstance(last, int):
                s = b * last
            else:
                s = self._var(f"s_{n}", 0, 1)
                self._add(s, "<=", b, f"s_b_{n}")
                self._add(s, "<=", last, f"s_l_{n}")
                self._add(s, ">=", b + last - 1, f"s_and_{n}")
            self.s[n] = s
            if mem.copy_us > 0:
                terms[mem.charge].append(mem.copy_us * (1 - s))
            if mem.copy_fixed_us > 0:
                terms[mem.charge].append(mem.copy_fixed_us * (b - s))
            if mem.prologue_us > 0:
                terms[mem.charge].append(mem.prologue_us)
        for f in self.fixed:
            if f.copy_in_us and not f.before_range:
                terms[f.issue].append(f.copy_in_us)
            if f.copy_out_us and f.wait is not None:
                terms[f.wait].append(f.copy_out_us)
        for a, ts in terms.items():
            self._add(self.U[a], ">=", self.T[a] + pulp.lpSum(ts), f"copy_{a}")

    # -- (7) ---------------------------------------------------------------------------------
    def _add_memory(self, peak_objective: bool) -> None:
        """(7) base_a + sum_AG out_k y_{k,a} + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} -
        z_{k,a}) + out_k y_{k,a}] + sum_RS grad_k e_{k,a} (merge transient) <= budget (and <= P
        when minimising the peak). base_a is the
        CP-SAT model's calibration on the traced simulation."""
        cp, A = self.cp, self.A
        terms: dict[int, list] = defaultdict(list)
        for n, mem in self.member.items():
            if mem.coll_type == "all_gather":
                for a in range(mem.lo, mem.need):
                    terms[a].append(mem.out_mem * self.yv(n, a))
            else:
                for a in range(mem.lo, mem.whi):
                    ya, za = self.yv(n, a), self.zv(n, a)
                    terms[a].append(mem.grad_mem * (1 - ya) + mem.pay_mem * (ya - za) + mem.out_mem * ya)
        # merge transient of reduce-scatters (as CP-SAT): e_{k,a} = [issued at a] AND mrg_k adds
        # grad_k at a; [issued at a] = y_{k,a} - y_{k,a-1}
        for n, mem in self.member.items():
            if mem.coll_type != "reduce_scatter" or mem.grad_mem == 0:
                continue
            mrg = 1 - self.s[n]
            for a in range(mem.lo, mem.hi + 1):
                at_a = self.yv(n, a) - (self.yv(n, a - 1) if a > mem.lo else 0)
                e = self._var(f"e_{n}_{a}", 0, 1)
                self._add(e, ">=", at_a + mrg - 1, f"e_and_{n}_{a}")
                self._add(e, "<=", at_a, f"e_at_{n}_{a}")
                self._add(e, "<=", mrg, f"e_mrg_{n}_{a}")
                terms[a].append(mem.grad_mem * e)
        self.P = self._var("peak_scaled", 0) if peak_objective else None
        for a in self.rng:
            expr = (cp.base_mem[a] + pulp.lpSum(terms[a])) * (1.0 / _MEM_ROW_SCALE)
            if cp.budget_mem is not None:
                self._add(expr, "<=", cp.budget_mem / _MEM_ROW_SCALE, f"mem_{a}")
            if self.P is not None:
                self._add(self.P, ">=", expr, f"peak_{a}")

    # -- steady state (per-layer template) ----------------------------------------------------
    def tie(self, pairs: list[tuple[str, str]], shift: int) -> bool:
        """CP-SAT's :meth:`_CpSatModel.tie` in linear form: brk_k2 = brk_k and, when the anchors
        of k's windows map to k2's by one constant offset d (``shift`` gaps later),
        y_{k2,a+d} = y_{k,a} (and z likewise). False when an offset is not constant there
        (the caller then solves the window untied)."""
        A = self.A
        index = {g: a for a, g in enumerate(A.gaps)}
        rows = []
        for k, k2 in pairs:
            x, x2 = self.member[k], self.member[k2]
            rows.append((self.brk[k2], self.brk[k], f"tie_brk_{k2}"))
            spans = [(self.yv, x.lo, x.hi, x2.lo, x2.hi)]
            if x.coll_type == "reduce_scatter":
                spans.append((self.zv, x.wlo, x.whi, x2.wlo, x2.whi))
            for vfun, lo, hi, lo2, hi2 in spans:
                offsets = {index.get(A.gaps[a] + shift, -10**9) - a for a in range(lo, hi + 1)}
                if len(offsets) != 1 or next(iter(offsets)) < -10**8:
                    return False
                d = offsets.pop()
                for a in range(min(lo, lo2 - d) - 1, max(hi, hi2 - d) + 1):
                    rows.append((vfun(k2, a + d), vfun(k, a), f"tie_{vfun.__name__}_{k2}_{a}"))
        for lhs, rhs, name in rows:
            self._add(lhs, "==", rhs, name)
        return True

    # -- warm start and extraction -----------------------------------------------------------
    def set_initial(self, values: list[int]) -> None:
        """Initial values from a complete CP-SAT solution (by CP variable index)."""
        cp = self.cp

        def v(var) -> int:
            return values[var.Index()]

        for a in self.rng:
            self.T[a].setInitialValue(v(cp.T[a]))
            self.U[a].setInitialValue(v(cp.U[a]))
        if self.window:
            self.Z.setInitialValue(v(cp.Z))
        start: dict[str, tuple[int, int]] = {}
        for n, mem in self.member.items():
            for var, cvar in ((self.C[n], cp.C[n]), (self.X[n], cp.X[n]), (self.R[n], cp.R[n])):
                var.setInitialValue(v(cvar))
            if not isinstance(self.brk[n], int):
                self.brk[n].setInitialValue(v(cp.brk[n]))
            for a, var in self.y[n].items():
                var.setInitialValue(int(v(cp.I[n]) <= a))
            for a, var in self.z.get(n, {}).items():
                var.setInitialValue(int(v(cp.W[n]) <= a))
            if isinstance(self.s[n], pulp.LpVariable):
                self.s[n].setInitialValue(1 - v(cp.mrg[n]))
            # order pairs by (start, end): NoOverlap makes that the order on the stream
            start[n] = (v(cp.C[n]), v(cp.C[n]) + cp.alpha_us[mem.chain] + v(cp.R[n]))
        proto = cp.model.Proto()
        by_name = {proto.variables[i].name: i for i in range(len(proto.variables))}
        for f in self.fixed:
            val = values[by_name[f"Cf_{f.bucket}"]]
            self.Cf[f.bucket].setInitialValue(val)
            start[f"f{f.bucket}"] = (val, val + f.dur_us)
        for (k, l), o in self.order.items():
            o.setInitialValue(int(start[k] <= start[l]))

    def extract(self) -> Schedule:
        """The schedule of the current solution, built by CP-SAT's extraction (same code path)."""
        cp = self.cp
        vals: dict[int, int] = {}
        for n, mem in self.member.items():
            b = self.brk[n]
            vals[cp.brk[n].Index()] = 1 if isinstance(b, int) else int(round(b.value()))
            vals[cp.I[n].Index()] = mem.lo + sum(1 - int(round(y.value())) for y in self.y[n].values())
            if n in self.z:
                vals[cp.W[n].Index()] = mem.wlo + sum(1 - int(round(z.value())) for z in self.z[n].values())
        return cp.extract(_Values(vals))


# -- solving ----------------------------------------------------------------------------------
def _highs_available() -> bool:
    try:
        return bool(pulp.HiGHS(msg=False).available())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def _solve_lp(model: _MilpModel, time_limit_s: float, seed: int, cfg: MilpConfig, *, mip: bool = True,
              warm: bool = False) -> _Outcome:
    """Solve ``model.lp`` with the configured backend; the best bound comes from the solver
    (CBC: its log; HiGHS: the dual bound) when it reports one."""
    if model.infeasible:
        return _Outcome("infeasible", None, None)
    limit = max(0.1, float(time_limit_s))
    use_highs = cfg.backend == "highs" or (cfg.backend == "auto" and _highs_available())
    lp = model.lp
    if use_highs:
        solver = pulp.HiGHS(msg=False, mip=mip, timeLimit=limit, threads=1, gapAbs=cfg.abs_gap_us,
                            warmStart=warm, random_seed=int(seed))
        if cfg.max_nodes is not None:
            solver.optionsDict["mip_max_nodes"] = cfg.max_nodes
        lp.solve(solver)
        bound = None
        try:
            bound = float(lp.solverModel.getInfo().mip_dual_bound) if mip else None
        except Exception:  # noqa: BLE001 - the bound is optional
            bound = None
        log_text = ""
    else:
        fd, log_path = tempfile.mkstemp(prefix="milp_cbc_", suffix=".log")
        os.close(fd)
        try:
            # the bundled CBC 2.10 can crash in its preprocessing when a warm start meets a
            # model it post-processes as infeasible (seen on MILP windows, with its elapsed-time
            # limit); the retry turns preprocessing off
            for extra in ([], ["preprocess off"]):
                with warnings.catch_warnings():
                    # PuLP 3.3 deprecates the bundled CBC for 4.0; it is the one CBC we can rely on
                    warnings.simplefilter("ignore", DeprecationWarning)
                    solver = pulp.PULP_CBC_CMD(
                        mip=mip, msg=False, timeLimit=limit, threads=1, gapAbs=cfg.abs_gap_us, gapRel=0.0,
                        warmStart=warm, maxNodes=cfg.max_nodes, logPath=log_path,
                        options=[f"randomSeed {int(seed)}", f"randomCbcSeed {int(seed)}", *extra],
                    )
                try:
                    lp.solve(solver)
                    break
                except pulp.PulpSolverError:
                    if extra:
                        raise
                    logger.warning("CBC failed on this model; retrying without preprocessing")
            with open(log_path) as f:
                log_text = f.read()
        finally:
            os.unlink(log_path)
        bound = _cbc_bound(log_text) if mip else None
    st, sol = lp.status, lp.sol_status
    obj = pulp.value(lp.objective) if sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) else None
    if st == pulp.LpStatusOptimal and sol == pulp.LpSolutionOptimal:
        return _Outcome("optimal", obj, obj)
    if st == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return _Outcome("infeasible", None, None)
    if obj is not None:
        return _Outcome("feasible", obj, bound)
    if "infeasible" in log_text.lower() and "Result - " in log_text and "nfeasible" in log_text.split("Result - ")[-1][:40]:
        return _Outcome("infeasible", None, None)
    return _Outcome("unknown", None, bound)


def _cbc_bound(log_text: str) -> float | None:
    m = re.search(r"Lower bound:\s*([-+0-9.eE]+)", log_text)
    if m:
        return float(m.group(1))
    m = re.search(r"Objective value:\s*([-+0-9.eE]+)", log_text)
    if m and "Optimal solution found" in log_text:
        return float(m.group(1))
    return None


def _build(problem: Problem, cfg: MilpConfig, budget_units: int | None, start: Schedule | None,
           limit_s: float, seed: int, num_workers: int):
    """CP-SAT data for ``problem``, the warm start completed to a full solution (or None),
    and the MILP bounded by its step time."""
    cp = _CpSatModel(problem, cfg.model, budget_units)
    cp.model.Minimize(cp.U[cp.anchors.m])  # the completion gets the tightest times
    values = cp.complete(start, limit_s, seed, num_workers) if start is not None else None
    upper = values[cp.U[cp.anchors.m].Index()] if values is not None else None
    return cp, values, _MilpModel(cp, upper)


def _solve_window_milp(problem: Problem, cfg: CpSatConfig, budget_mem: int | None, schedule: Schedule,
                       free: set[str], limit: float, seed: int, num_workers: int, anchors,
                       ties: tuple[list[tuple[str, str]], int] | None = None, *,
                       milp_cfg: MilpConfig | None = None) -> Schedule | None:
    """One window of the shared neighbourhood search (:func:`solvers.cpsat.decomposed_solve`),
    solved as a MILP: CP-SAT's window model as data, the incumbent completed inside it as the
    MILP's start and its exit state as the MILP's upper bound."""
    mcfg = milp_cfg or MilpConfig(model=cfg)
    cp = _CpSatModel(problem, cfg, budget_mem, free=free, reference=schedule, anchors=anchors)
    if ties is not None:
        cp.tie(*ties)  # the completion must respect the ties too
    cp.model.Minimize(cp.objective)
    values = cp.complete(schedule, max(0.2, limit * mcfg.warm_start_share), seed, num_workers)
    upper = values[cp.objective.Index()] if values is not None else None
    model = _MilpModel(cp, upper)
    if ties is not None and not model.tie(*ties):
        return None
    if values is not None:
        model.set_initial(values)
    try:
        out = _solve_lp(model, max(0.2, limit * (1 - mcfg.warm_start_share)), seed, mcfg, warm=values is not None)
    except pulp.PulpSolverError as e:  # one window failing must not end the search
        logger.warning("milp window (%d free): the solver failed (%s); window skipped", len(free), e)
        return None
    logger.debug("milp window (%d free): %s obj %s us", len(free), out.status, out.objective_us)
    if out.status not in ("optimal", "feasible"):
        return None
    return model.extract()


def lp_relaxation_bound_ms(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    time_limit_s: float = 30.0,
    config: MilpConfig | None = None,
) -> float:
    """Optimum of the MILP's LP relaxation (every binary in [0, 1]), in ms: a lower bound on
    the model's step time within its search space (anchors, windows). No warm start: the
    model's horizon bounds the times. ``nan`` when the LP could not be solved in the limit.

    Raises:
        InfeasibleBudgetError: even the relaxation does not fit ``mem_budget_bytes``.
    """
    cfg = config or MilpConfig()
    if not problem.chains:
        return problem.lower_bound_ms()
    budget_units = model_budget(mem_budget_bytes)
    cp = _CpSatModel(problem, cfg.model, budget_units)
    out = _solve_lp(_MilpModel(cp, relax=True), time_limit_s, 0, cfg, mip=False)
    if out.status == "infeasible":
        raise InfeasibleBudgetError(
            f"the LP relaxation is infeasible under {mem_budget_bytes} B; raise mem_budget",
            budget_bytes=mem_budget_bytes or 0, min_peak_bytes=None,
        )
    return out.objective_us / _US_PER_MS if out.objective_us is not None else math.nan


def _relaxed_bound_us(model: _MilpModel, limit_s: float, cfg: MilpConfig) -> float | None:
    """LP relaxation of ``model`` itself (binaries relaxed in place, then restored)."""
    ints = [v for v in model.lp.variables() if v.cat == pulp.LpInteger]
    for v in ints:
        v.cat = pulp.LpContinuous
    try:
        out = _solve_lp(model, limit_s, 0, cfg, mip=False)
    finally:
        for v in ints:
            v.cat = pulp.LpInteger
    return out.objective_us if out.status == "optimal" else None


def solve_milp(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    time_limit_s: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: MilpConfig | None = None,
) -> SolveResult:
    """Solve the MILP twin of the CP-SAT model (see module docstring).

    Flow, as :func:`solvers.cpsat.solve_cpsat`: the best warm start (hint or heuristics that fit
    the budget) is completed to a full model solution and given to the solver; the schedule is
    extracted and simulated; a simulated peak above the budget tightens the model's budget and
    re-solves. ``objective_ms`` is the simulated step time; ``best_bound_ms`` the solver's bound
    (only when the whole model was searched) and the analytic bound, at most the objective.
    ``num_workers`` only affects the warm-start completion (the MILP runs on one thread).

    Raises:
        InfeasibleBudgetError: no schedule fits the budget (the model is infeasible or none was
            found in the limit, and no heuristic fits); ``min_peak_bytes`` is the smallest
            simulated peak found.
        ScheduleError: the solver failed without a schedule.
    """
    from scheduler.simulator import simulate

    cfg = config or MilpConfig()
    t0 = time.perf_counter()
    if not problem.chains:
        sched = problem.traced_schedule()
        sim = simulate(problem.dag, sched, problem=problem)
        return SolveResult(sched, SolveStatus.OPTIMAL, "milp", sim.step_ms, sim.step_ms, time.perf_counter() - t0,
                           sim.peak_bytes, ("no movable collectives: traced order kept",))
    warm = _best_warm_start(problem, hint, mem_budget_bytes, time_limit_s, seed, cfg.model)
    start_hint = warm.schedule if warm is not None else problem.traced_schedule()
    deadline = t0 + time_limit_s
    budget = mem_budget_bytes
    notes: list[str] = []
    if sum(len(c) for c in problem.chains.values()) > cfg.model.full_model_max_members:
        # the same decomposition as CP-SAT (template, rolling windows), each window a MILP
        return decomposed_solve(
            problem, cfg.model, warm, start_hint, mem_budget_bytes, deadline, seed, num_workers, notes, t0,
            window_solver=functools.partial(_solve_window_milp, milp_cfg=cfg), solver="milp",
        )
    analytic = problem.lower_bound_ms()
    for round_ in range(cfg.model.memory_repair_rounds + 1):
        remaining = max(0.5, deadline - time.perf_counter())
        budget_units = model_budget(budget)
        t_build = time.perf_counter()
        cp, values, model = _build(problem, cfg, budget_units, start_hint, remaining * cfg.warm_start_share, seed,
                                   num_workers)
        build_s = time.perf_counter() - t_build
        lp_bound = None
        if cfg.lp_bound and round_ == 0:
            lp_bound = _relaxed_bound_us(model, max(0.5, (deadline - time.perf_counter()) * 0.2), cfg)
        if values is not None:
            model.set_initial(values)
        limit = max(0.5, deadline - time.perf_counter())
        out = _solve_lp(model, limit, seed, cfg, warm=values is not None)
        logger.info(
            "milp round %d (%d collectives, %d binaries, %d order pairs, %d skipped): %s, step %s us, bound %s us, "
            "build %.1f s",
            round_, len(model.member), sum(1 for v in model.lp.variables() if v.cat == pulp.LpInteger),
            len(model.order), model.n_pairs_skipped, out.status, out.objective_us, out.bound_us, build_s,
        )
        if lp_bound is not None:
            notes.append(f"LP relaxation bound {lp_bound / _US_PER_MS:.3f} ms, analytic bound {analytic:.3f} ms")
        if out.status in ("infeasible", "unknown") and warm is not None:
            # the model restricts positions to anchors and prices memory conservatively, so its
            # infeasibility proves nothing while a heuristic schedule fits: return that
            notes.append(f"model {out.status} under the budget; returned the best warm start ({warm.solver})")
            return _warm_result(problem, warm, notes, t0, "milp")
        if out.status in ("infeasible", "unknown"):
            if budget is None:
                raise ScheduleError(f"the MILP found no schedule ({out.status}) within {limit:.1f} s; "
                                    "raise time_limit_s")
            min_peak = _min_peak(problem, cfg, seed, max(1.0, limit / 2))
            raise InfeasibleBudgetError(
                f"no schedule keeps peak memory under {(mem_budget_bytes or budget) / 2**30:.3f} GiB "
                f"({'proven infeasible' if out.status == 'infeasible' else 'none found in the time limit'}); "
                f"the smallest peak found is {min_peak / 2**30:.3f} GiB: raise mem_budget to at least that",
                budget_bytes=mem_budget_bytes or budget,
                min_peak_bytes=min_peak,
            )
        proven = out.status == "optimal"
        schedule = model.extract()
        sim = simulate(problem.dag, schedule, problem=problem)
        if mem_budget_bytes is None or sim.peak_bytes <= mem_budget_bytes:
            bound_txt = f"{out.bound_us / _US_PER_MS:.3f} ms" if out.bound_us is not None else "n/a"
            notes.append(f"model step {out.objective_us / _US_PER_MS:.3f} ms, model bound {bound_txt}, "
                         f"status {out.status.upper()}")
            model_bound = (out.bound_us / _US_PER_MS) if out.bound_us is not None else -math.inf
            return _final(problem, schedule, sim, warm, proven, max(model_bound, analytic), notes, t0, round_,
                          "milp")
        excess = sim.peak_bytes - mem_budget_bytes
        budget = (budget or mem_budget_bytes) - excess - _MEM_UNIT_BYTES
        notes.append(f"simulated peak exceeded the budget by {excess} B; tightened the model budget")
        start_hint = schedule
        if deadline - time.perf_counter() <= 0.5 or budget <= 0:
            break
    raise InfeasibleBudgetError(
        f"MILP schedules kept exceeding the memory budget in simulation after {cfg.model.memory_repair_rounds} "
        "repair rounds; raise mem_budget or the time limit",
        budget_bytes=mem_budget_bytes or 0,
        min_peak_bytes=None,
    )


def _min_peak(problem: Problem, cfg: MilpConfig, seed: int, limit_s: float) -> int:
    """Smallest simulated peak (bytes) of the traced schedule and of the MILP's minimum-peak
    solution (for infeasibility errors)."""
    from scheduler.simulator import simulate

    traced = problem.traced_schedule()
    peaks = [simulate(problem.dag, traced, problem=problem).peak_bytes]
    model = _MilpModel(_CpSatModel(problem, cfg.model, None), peak_objective=True)
    out = _solve_lp(model, limit_s, seed, cfg)
    if out.status in ("optimal", "feasible"):
        peaks.append(simulate(problem.dag, model.extract(), problem=problem).peak_bytes)
    return min(peaks)


@register("milp")
def _milp_entry(problem: Problem, **kw) -> SolveResult:
    return solve_milp(problem, **kw)
