"""MILP backend: the model of :mod:`solvers.model`, written as a MILP in PuLP (CBC, or HiGHS if
installed).

Same data and decision space as CP-SAT (:class:`solvers.model.ModelData`): the two backends
differ only in how the families are written down. Each family is one method of
:class:`MilpModel` with the family's name. Times are in microseconds (continuous; every datum
is an integer, so optimal times are integers), memory in bytes (memory rows are scaled by
1/1024, exactly, to keep coefficients moderate for CBC).

How the MILP writes the families (see :mod:`solvers.model` for the formulation; "k-1" is k's
predecessor in its chain, M are big-Ms from the time bounds below)
    variables  y_{k,a} in {0,1} = [I_k <= a] on [lo_k, hi_k) (0 below, 1 from hi_k on),
               y_{k,a} <= y_{k,a+1}, so I_k = lo_k + sum_a (1 - y_{k,a}); z likewise for W;
               s_k in [0,1] = brk_k AND last_k (integral when brk is): mrg_k = 1 - s_k,
               lead_k = brk_k - s_k; o_{k,l} in {0,1}: k's bucket runs before l's (pairs on
               one stream); e_{k,a} in [0,1] (three inequalities)
    bounds     C, X in [ES_k, LF_k], T_a >= est_a, U_a <= UB - tail_a, where est / tail are the
               fixed compute before / after an anchor and UB the model step time of the warm
               start (the horizon without one): they cut off only solutions worse than it
    (1) add_timeline   as written in the formulation
    (2) add_buckets    y_{k,a} <= y_{k-1,a}, y_{k-1,a} - y_{k,a} <= brk_k (equal issue when
                       merged), the same for z; |C_k - C_{k-1}| <= M brk_k;
                       R_k = d_k + (1 - brk_k) R_{k-1} and X_k = E_k / X_{k+1} as big-M pairs;
                       Q_k likewise with a cap
    (3) add_issue      C_k >= T_lo; C_k >= T_a - M y_{k,a-1} for a in (lo, hi]
    (4) add_waits      all-gather: U_need >= X_k; reduce-scatter: z_{k,a} <= y_{k,a},
                       U_a >= X_k - M (1 - z_{k,a}), U_whi >= X_k
    (5) add_streams    chain order: C_k >= X_{k-1} - M (1 - brk_k); for each pair of buckets of
                       one group (other chains and fixed intervals) whose time bounds [ES, LF)
                       overlap, with p = 2 - last_k - last_l:
                       C_l >= E_k - M (1 - o_kl) - M p  and  C_k >= E_l - M o_kl - M p;
                       pairs whose time bounds do not overlap cannot overlap in time at all
    (6) add_copy_costs U_a >= T_a + cfix_a + sum (copy_k (1 - s_k) + fix_k (brk_k - s_k))
    (7) add_memory     as written, with e_{k,a} >= at_a + mrg_k - 1, e <= at_a, e <= mrg_k
                       where at_a = y_{k,a} - y_{k,a-1}

Differences from CP-SAT (the optimum of the step time is the same): continuous times;
pairwise order binaries instead of NoOverlap, only for pairs that can overlap under UB; the
warm start's objective UB is a constraint (CP-SAT only hints it); no second phase (among
equally fast schedules the MILP returns whichever the solver finds). The warm start is
completed to a full solution by the completion :class:`MilpBackend` is given (a
:data:`solvers.model.Completion`; :mod:`solvers.registry` gives it CP-SAT's,
:func:`solvers.cpsat.complete_solution`: decisions fixed, times minimised) and handed to the
MILP solver as its start.

The search's other stages (starts, polish, never worse than the best start) are shared with
CP-SAT (:mod:`solvers.search`, driven by :mod:`solvers.registry`).
Determinism: one thread and a fixed seed; CBC's time limit is wall-clock, so set
``MilpConfig.max_nodes`` for the same schedule on every rank under time pressure.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tempfile
import warnings
from collections import defaultdict

import pulp

from solvers.config import MilpConfig
from solvers.core.problem import Problem
from solvers.core.schedule import InfeasibleBudgetError, Schedule
from solvers.core.units import US_PER_MS
from solvers.model import Anchors, Completion, Decisions, ModelData, Solution

logger = logging.getLogger(__name__)

#: memory rows are divided by this (a power of two: exact) to keep coefficients moderate for CBC
_MEM_ROW_SCALE = 1024.0


@dataclasses.dataclass(frozen=True)
class LpOutcome:
    """One MILP (or LP) solve: status "optimal", "feasible", "infeasible" or "unknown"."""

    status: str
    objective_us: float | None
    bound_us: float | None


class MilpModel:
    """The MILP of ``data`` (every family of :mod:`solvers.model`, written as in the module
    docstring).

    Args:
        data: the model's data (problem, budget, issue and wait ranges, fixed intervals, memory base).
        upper_us: model step time of a known solution (the warm start): U_m <= upper_us.
        relax: continuous binaries (the LP relaxation).
        peak_objective: minimise the peak memory instead of the step time (for error messages).
    """

    def __init__(self, data: ModelData, upper_us: int | None = None, *, relax: bool = False,
                 peak_objective: bool = False):
        self.data = data
        self.p = data.p
        self.A = data.anchors
        self.cat = pulp.LpContinuous if relax else pulp.LpBinary
        self.lp = pulp.LpProblem("fsdp_sched", pulp.LpMinimize)
        self.infeasible: list[str] = []  # constant constraints that fail: the model is infeasible
        self.upper_us = int(data.horizon_us if upper_us is None else min(upper_us, data.horizon_us))
        #: modelled anchors: all of them, or a window's range (``d.a_lo..d.a_hi``)
        self.rng = data.anchor_range
        self.window = data.is_window
        self._time_bounds()
        self._add_variables()
        self.add_timeline()
        self.add_buckets()
        self.add_issue()
        self.add_waits()
        self.add_streams()
        self.add_copy_costs()
        self.add_memory(peak_objective)
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
        A, d, lo, hi = self.A, self.data, self.data.a_lo, self.data.a_hi
        fixed_copy = defaultdict(int, d.fixed_copy_us)  # cfix_a: charged whatever is decided
        self.fixed = d.fixed
        self.t_start = d.t_in_us
        self.est = {lo: self.t_start}
        for a in range(lo, hi):
            self.est[a + 1] = self.est[a] + fixed_copy[a] + A.seg_us[a]
        tail_u = {hi: 0}  # objective - U_a >= tail_u[a]
        for a in range(hi - 1, lo - 1, -1):
            tail_u[a] = tail_u[a + 1] + A.seg_us[a] + fixed_copy[a + 1]
        ub = self.upper_us
        self.ub_U = {a: max(self.est[a], ub - tail_u[a]) for a in self.rng}
        self.ub_T = {a: max(self.est[a], self.ub_U[a] - fixed_copy[a]) for a in self.rng}
        self.member = d.member
        self.ES: dict[str, int] = {}
        self.LF: dict[str, int] = {}
        for n, mem in self.member.items():
            self.ES[n] = self.est[mem.lo]
            self.LF[n] = self.ub_U[mem.wait_end]

    def _add_variables(self) -> None:
        d, B = self.data, self.cat
        self.T = {a: self._var(f"T{a}", self.est[a], self.ub_T[a]) for a in self.rng}
        self.U = {a: self._var(f"U{a}", self.est[a], self.ub_U[a]) for a in self.rng}
        self.Z = self._var("Z", self.est[d.a_hi], self.upper_us) if self.window else None
        self.brk, self.C, self.X, self.R, self.s = {}, {}, {}, {}, {}
        self.y: dict[str, dict[int, pulp.LpVariable]] = {}
        self.z: dict[str, dict[int, pulp.LpVariable]] = {}
        for ci, chain in enumerate(d.chains):
            total_d = sum(x.d_us for x in chain)
            for k, mem in enumerate(chain):
                n = mem.name
                self.brk[n] = 1 if k == 0 else self._var(f"brk_{n}", 0, 1, B)
                lf = max(self.LF[n], self.ES[n])
                self.C[n] = self._var(f"C_{n}", self.ES[n], lf)
                self.X[n] = self._var(f"X_{n}", self.ES[n], lf)
                self.R[n] = self._var(f"R_{n}", mem.d_us, max(mem.d_us, total_d))
                self.y[n] = {a: self._var(f"y_{n}_{a}", 0, 1, B) for a in range(mem.lo, mem.hi)}
                if not mem.waited_at_need:
                    self.z[n] = {a: self._var(f"z_{n}_{a}", 0, 1, B) for a in range(mem.wlo, mem.whi)}
                for a in range(mem.lo, mem.hi - 1):
                    self.lp += (self.y[n][a] <= self.y[n][a + 1], f"ymono_{n}_{a}")
                for a in range(mem.wlo, mem.whi - 1):
                    self.lp += (self.z[n][a] <= self.z[n][a + 1], f"zmono_{n}_{a}")
        self.last = {}
        self._next: dict[str, str] = {}
        for chain in d.chains:
            for k, mem in enumerate(chain):
                if k + 1 < len(chain):
                    self._next[mem.name] = chain[k + 1].name
                self.last[mem.name] = self.brk[chain[k + 1].name] if k + 1 < len(chain) else 1

    # -- (1) ---------------------------------------------------------------------------------
    def add_timeline(self) -> None:
        """(1) T_0 = 0 (a window: T_lo = the reference's arrival); T_{a+1} = U_a + seg_a;
        U_a >= T_a; a window's exit state Z >= U_hi."""
        A, lo, hi = self.A, self.data.a_lo, self.data.a_hi
        self._add(self.T[lo], "==", self.t_start, "T0")
        for a in range(lo, hi):
            self._add(self.T[a + 1], "==", self.U[a] + A.seg_us[a], f"seg_{a}")
        for a in self.rng:
            self._add(self.U[a], ">=", self.T[a], f"dwell_{a}")
        if self.window:
            self._add(self.Z, ">=", self.U[hi], "Z_exit")

    # -- (2) ---------------------------------------------------------------------------------
    def add_buckets(self) -> None:
        """(2) y_{k,a} <= y_{k-1,a} and y_{k-1,a} - y_{k,a} <= brk_k (so brk_k = 0 => I_k =
        I_{k-1}), likewise z; brk_k = 0 => C_k = C_{k-1}; R_k = d_k + (1 - brk_k) R_{k-1};
        X_k = C_k + alpha + R_k when last_k, else X_k = X_{k+1}; bucket payload cap."""
        d = self.data
        cap = d.cfg.max_bucket_bytes
        for ci, chain in enumerate(d.chains):
            alpha = d.alpha_us[ci]
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
                    if not mem.waited_at_need:
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
    def add_issue(self) -> None:
        """(3) C_k >= T_{lo}; C_k >= T_a - M y_{k,a-1} for a in (lo, hi] (I_k >= a <=> y_{k,a-1} = 0)."""
        for n, mem in self.member.items():
            self._add(self.C[n], ">=", self.T[mem.lo], f"issue_{n}_{mem.lo}")
            for a in range(mem.lo + 1, mem.hi + 1):
                self._add(self.C[n], ">=", self.T[a] - self.ub_T[a] * self.y[n][a - 1], f"issue_{n}_{a}")

    # -- (4) ---------------------------------------------------------------------------------
    def add_waits(self) -> None:
        """(4) all-gathers: U_{need} >= X_k; reduce-scatters: z_{k,a} <= y_{k,a} (W_k >= I_k),
        U_a >= X_k - M (1 - z_{k,a}) for a in [wlo, whi), U_{whi} >= X_k."""
        for n, mem in self.member.items():
            if mem.waited_at_need:
                self._add(self.U[mem.need], ">=", self.X[n], f"wait_{n}")
                continue
            for a in range(min(mem.lo, mem.wlo), max(mem.hi, mem.whi)):
                self._add(self.zv(n, a), "<=", self.yv(n, a), f"w_after_i_{n}_{a}")
            M = max(self.LF[n], self.ES[n])
            for a in range(mem.wlo, mem.whi):
                self._add(self.U[a], ">=", self.X[n] - M * (1 - self.z[n][a]), f"wait_{n}_{a}")
            self._add(self.U[mem.whi], ">=", self.X[n], f"wait_{n}_{mem.whi}")

    # -- (5) ---------------------------------------------------------------------------------
    def add_streams(self) -> None:
        """(5) a chain's buckets in chain order: C_k >= X_{k-1} - M (1 - brk_k); buckets of other
        chains and fixed collectives of the same process group do not overlap: one order binary
        per pair whose time bounds [ES, LF) overlap, active when both close their buckets."""
        p, d = self.p, self.data
        # stream items: (name, start, end expr, presence, ES, LF, chain)
        per_group: dict[str, list] = defaultdict(list)
        for ci, chain in enumerate(d.chains):
            alpha = d.alpha_us[ci]
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
                alpha = d.alpha_us[self.member[n].chain]
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
    def add_copy_costs(self) -> None:
        """(6) s_k = brk_k AND last_k (alone: mrg_k = 1 - s_k, lead_k = brk_k - s_k);
        U_a >= T_a + cfix_a + sum_{k charged at a} (copy_k (1 - s_k) + fix_k (brk_k - s_k))."""
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
            if mem.copy_us != 0:  # negative where a folded cast costs more than its copy
                terms[mem.charge].append(mem.copy_us * (1 - s))
            if mem.copy_fixed_us > 0:
                terms[mem.charge].append(mem.copy_fixed_us * (b - s))
        for a in sorted(set(terms) | set(self.data.fixed_copy_us)):
            self._add(self.U[a], ">=", self.T[a] + self.data.fixed_copy_us.get(a, 0) + pulp.lpSum(terms[a]),
                      f"copy_{a}")

    # -- (7) ---------------------------------------------------------------------------------
    def add_memory(self, peak_objective: bool) -> None:
        """(7) base_a + sum_AG out_k y_{k,a} + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} -
        z_{k,a}) + out_k y_{k,a}] + sum_RS grad_k e_{k,a} (merge transient) <= budget (and <= P
        when minimising the peak); base_a is the data's calibration on the reference run."""
        d = self.data
        terms: dict[int, list] = defaultdict(list)
        for n, mem in self.member.items():
            if mem.waited_at_need:
                for a in range(mem.lo, mem.need):
                    terms[a].append(mem.out_bytes * self.yv(n, a))
            else:
                for a in range(mem.lo, mem.whi):
                    ya, za = self.yv(n, a), self.zv(n, a)
                    terms[a].append(mem.grad_bytes * (1 - ya) + mem.pay_bytes * (ya - za) + mem.out_bytes * ya)
        # merge transient of reduce-scatters (as CP-SAT): e_{k,a} = [issued at a] AND mrg_k adds
        # grad_k at a; [issued at a] = y_{k,a} - y_{k,a-1}
        for n, mem in self.member.items():
            if mem.coll_type != "reduce_scatter" or mem.grad_bytes == 0:
                continue
            mrg = 1 - self.s[n]
            for a in range(mem.lo, mem.hi + 1):
                at_a = self.yv(n, a) - (self.yv(n, a - 1) if a > mem.lo else 0)
                e = self._var(f"e_{n}_{a}", 0, 1)
                self._add(e, ">=", at_a + mrg - 1, f"e_and_{n}_{a}")
                self._add(e, "<=", at_a, f"e_at_{n}_{a}")
                self._add(e, "<=", mrg, f"e_mrg_{n}_{a}")
                terms[a].append(mem.grad_bytes * e)
        self.P = self._var("peak_scaled", 0) if peak_objective else None
        for a in self.rng:
            expr = (d.base_mem[a] + pulp.lpSum(terms[a])) * (1.0 / _MEM_ROW_SCALE)
            if d.mem_budget_bytes is not None:
                self._add(expr, "<=", d.mem_budget_bytes / _MEM_ROW_SCALE, f"mem_{a}")
            if self.P is not None:
                self._add(self.P, ">=", expr, f"peak_{a}")

    # -- warm start and extraction -----------------------------------------------------------
    def set_initial(self, sol: Solution) -> None:
        """Initial values from a complete solution of the same model (CP-SAT's completion of
        the warm start, :func:`solvers.cpsat.complete_solution`): times as given; y, z, s and
        the order binaries derived from the decisions and the start times."""
        for a in self.rng:
            self.T[a].setInitialValue(sol.T[a])
            self.U[a].setInitialValue(sol.U[a])
        if self.window:
            self.Z.setInitialValue(sol.Z)
        start: dict[str, tuple[int, int]] = {}
        for n, mem in self.member.items():
            self.C[n].setInitialValue(sol.C[n])
            self.X[n].setInitialValue(sol.X[n])
            self.R[n].setInitialValue(sol.R[n])
            if not isinstance(self.brk[n], int):
                self.brk[n].setInitialValue(sol.brk[n])
            for a, var in self.y[n].items():
                var.setInitialValue(int(sol.issue[n] <= a))
            for a, var in self.z.get(n, {}).items():
                var.setInitialValue(int(sol.wait[n] <= a))
            if isinstance(self.s[n], pulp.LpVariable):
                last = self.last[n]
                last_v = last if isinstance(last, int) else sol.brk[self._next[n]]
                self.s[n].setInitialValue(int(sol.brk[n] == 1 and last_v == 1))
            # order pairs by (start, end): NoOverlap makes that the order on the stream
            start[n] = (sol.C[n], sol.C[n] + self.data.alpha_us[mem.chain] + sol.R[n])
        for f in self.fixed:
            val = sol.fixed_start[f.bucket]
            self.Cf[f.bucket].setInitialValue(val)
            start[f"f{f.bucket}"] = (val, val + f.dur_us)
        for (k, l), o in self.order.items():
            o.setInitialValue(int(start[k] <= start[l]))

    def decisions(self) -> Decisions:
        """The decisions of the current solution: I_k = lo_k + sum_a (1 - y_{k,a}), likewise W."""
        brk, issue, wait = {}, {}, {}
        for n, mem in self.member.items():
            b = self.brk[n]
            brk[n] = 1 if isinstance(b, int) else int(round(b.value()))
            issue[n] = mem.lo + sum(1 - int(round(y.value())) for y in self.y[n].values())
            if n in self.z:
                wait[n] = mem.wlo + sum(1 - int(round(z.value())) for z in self.z[n].values())
        return Decisions(brk=brk, issue=issue, wait=wait)

    def extract(self) -> Schedule:
        return self.data.extract(self.decisions())



# -- solving ----------------------------------------------------------------------------------
def _highs_available() -> bool:
    try:
        return bool(pulp.HiGHS(msg=False).available())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def solve_lp(model: MilpModel, work_limit: float, seed: int, cfg: MilpConfig, *, mip: bool = True,
              warm: bool = False) -> LpOutcome:
    """Solve ``model.lp`` with the configured backend; the best bound comes from the solver
    (CBC: its log; HiGHS: the dual bound) when it reports one."""
    if model.infeasible:
        return LpOutcome("infeasible", None, None)
    limit = max(0.1, float(work_limit))
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
        return LpOutcome("optimal", obj, obj)
    if st == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return LpOutcome("infeasible", None, None)
    if obj is not None:
        return LpOutcome("feasible", obj, bound)
    if "infeasible" in log_text.lower() and "Result - " in log_text and "nfeasible" in log_text.split("Result - ")[-1][:40]:
        return LpOutcome("infeasible", None, None)
    return LpOutcome("unknown", None, bound)


def _cbc_bound(log_text: str) -> float | None:
    m = re.search(r"Lower bound:\s*([-+0-9.eE]+)", log_text)
    if m:
        return float(m.group(1))
    m = re.search(r"Objective value:\s*([-+0-9.eE]+)", log_text)
    if m and "Optimal solution found" in log_text:
        return float(m.group(1))
    return None


def lp_relaxation_bound_ms(problem: Problem, *, mem_budget_bytes: int | None = None, work_limit: float = 30.0,
                           config: MilpConfig | None = None) -> float:
    """Optimum of the MILP's LP relaxation (every binary in [0, 1]), in ms: a lower bound on
    the model's step time within its search space (anchors, issue and wait ranges). No warm start: the
    model's horizon bounds the times. ``nan`` when the LP could not be solved in the limit.

    Raises:
        InfeasibleBudgetError: even the relaxation does not fit ``mem_budget_bytes``.
    """
    cfg = config or MilpConfig()
    if not problem.chains:
        return problem.lower_bound_ms()
    out = solve_lp(MilpModel(ModelData(problem, cfg, mem_budget_bytes), relax=True), work_limit, 0, cfg, mip=False)
    if out.status == "infeasible":
        raise InfeasibleBudgetError(
            f"the LP relaxation is infeasible under {mem_budget_bytes} B; raise mem_budget",
            mem_budget_bytes=mem_budget_bytes or 0, min_peak_bytes=None,
        )
    return out.objective_us / US_PER_MS if out.objective_us is not None else math.nan


def build(data: ModelData, start: Schedule | None, work_limit: float, seed: int, num_workers: int,
          complete: Completion) -> tuple[MilpModel, Solution | None]:
    """The MILP of ``data`` bounded by ``start``'s model step time, and ``start`` completed to
    a full solution by ``complete`` (None when it does not fit the model)."""
    sol = complete(data, start, work_limit, seed, num_workers) if start is not None else None
    return MilpModel(data, sol.objective_us if sol is not None else None), sol


class MilpBackend:
    """The MILP backend as :mod:`solvers.search` runs it (windows)."""

    name = "milp"

    def __init__(self, config: MilpConfig | None = None, *, complete: Completion):
        self.config = config or MilpConfig()
        #: completes the incumbent to a full solution of a window's model, the warm start
        #: (:mod:`solvers.registry` hands it CP-SAT's, :func:`solvers.cpsat.complete_solution`)
        self.complete = complete
        #: the MILP solver's limits are wall-clock (CBC/HiGHS through PuLP): not counted here
        self.wall_cap_hits = 0

    def solve_window(self, problem: Problem, mem_budget_bytes: int | None, schedule: Schedule, free: set[str],
                     work_limit: float, seed: int, num_workers: int, anchors: Anchors) -> Schedule | None:
        """One window of the decomposition as a MILP: started from the incumbent completed
        inside the window, bounded by its exit state."""
        cfg = self.config
        data = ModelData(problem, cfg, mem_budget_bytes, free=free, reference=schedule, anchors=anchors)
        model, sol = build(data, schedule, max(0.2, work_limit * cfg.warm_start_share), seed, num_workers,
                           self.complete)
        if sol is not None:
            model.set_initial(sol)
        try:
            out = solve_lp(model, max(0.2, work_limit * (1 - cfg.warm_start_share)), seed, cfg, warm=sol is not None)
        except pulp.PulpSolverError as e:  # one window failing must not end the search
            logger.warning("milp window (%d free): the solver failed (%s); window skipped", len(free), e)
            return None
        logger.debug("milp window (%d free): %s obj %s us", len(free), out.status, out.objective_us)
        if out.status not in ("optimal", "feasible"):
            return None
        return model.extract()
