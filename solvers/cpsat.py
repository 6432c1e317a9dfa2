"""CP-SAT backend: the model of :mod:`solvers.model`, written with OR-tools CP-SAT.

Each constraint family of the formulation is one method of :class:`CpSatModel` with the
family's name (``add_timeline`` ... ``add_memory``); the data is a :class:`ModelData`.
Specific to CP-SAT: the issue and wait anchors are integer variables with order encodings
y / z, stream exclusivity is ``AddNoOverlap`` over optional intervals, and a solved model gets
a second phase (peak memory, then fewer buckets, at the optimal step time).

:class:`CpSatBackend` is the window solver that :mod:`solvers.search` runs between the starts
and the polish (:mod:`solvers.registry` builds it); :func:`complete_solution` completes a
schedule to a full solution of the model, the MILP's warm start.
Determinism: one worker, fixed seed and a deterministic time limit for every solve (phases of
the whole-graph model and windows alike get fixed shares of the solve's deterministic budget,
never what the wall clock leaves), so every rank does the same work; a wall-clock cap far above
it only guards against a stuck process, and a solve it stops is counted in
``CpSatBackend.wall_cap_hits`` and logged (the rank agreement then catches a schedule that
differs).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from ortools.sat.python import cp_model

from solvers.config import CpSatConfig
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule
from solvers.core.units import US_PER_MS
from solvers.model import Anchors, Decisions, ModelData, Solution

logger = logging.getLogger(__name__)

STATUS_NAMES = {
    cp_model.OPTIMAL: "optimal",
    cp_model.FEASIBLE: "feasible",
    cp_model.INFEASIBLE: "infeasible",
    cp_model.MODEL_INVALID: "invalid",
    cp_model.UNKNOWN: "unknown",
}


class CpSatModel:
    """The CP-SAT model of ``data`` (every family of :mod:`solvers.model`)."""

    def __init__(self, data: ModelData):
        self.data = data
        self.model = cp_model.CpModel()
        self.add_timeline()
        self.add_buckets()
        self.add_issue()
        self.add_waits()
        self.add_streams()
        self.add_copy_costs()
        self.add_memory()

    @property
    def objective(self):
        """U_m for the whole graph; for a window, its exit state Z."""
        return self.Z if self.data.is_window else self.U[self.data.anchors.m]

    # -- (1) ---------------------------------------------------------------------------------
    def add_timeline(self) -> None:
        """(1) T_lo = t_in; T_{a+1} = U_a + seg_a; U_a >= T_a; Z >= U_hi."""
        m, d, H = self.model, self.data, self.data.horizon_us
        self.T = {a: m.NewIntVar(0, H, f"T{a}") for a in d.anchor_range}
        self.U = {a: m.NewIntVar(0, H, f"U{a}") for a in d.anchor_range}
        m.Add(self.T[d.a_lo] == d.t_in_us)
        for a in range(d.a_lo, d.a_hi):
            m.Add(self.T[a + 1] == self.U[a] + d.anchors.seg_us[a])
        for a in d.anchor_range:
            m.Add(self.U[a] >= self.T[a])
        self.Z = m.NewIntVar(0, H, "Z")
        m.Add(self.Z >= self.U[d.a_hi])

    # -- (2) ---------------------------------------------------------------------------------
    def add_buckets(self) -> None:
        """(2) brk_k = 0 => k shares I, W, C with k-1; I, W never decrease along a chain;
        R_k = d_k + (1 - brk_k) R_{k-1}; X_k = E_k when last_k, else X_{k+1}; with a cap,
        Q_k = pay_k + (1 - brk_k) Q_{k-1} <= max(cap, pay_k)."""
        m, d, H = self.model, self.data, self.data.horizon_us
        cap = d.cfg.max_bucket_bytes
        self.brk: dict[str, cp_model.IntVar] = {}
        self.I: dict[str, cp_model.IntVar] = {}
        self.W: dict[str, cp_model.IntVar] = {}
        self.C: dict[str, cp_model.IntVar] = {}
        self.X: dict[str, cp_model.IntVar] = {}
        self.R: dict[str, cp_model.IntVar] = {}
        self.last: dict[str, object] = {}
        for ci, chain in enumerate(d.chains):
            alpha = d.alpha_us[ci]
            total_d = sum(x.d_us for x in chain)
            total_pay = sum(x.pay_bytes for x in chain)
            Q = None
            for k, x in enumerate(chain):
                n = x.name
                self.brk[n] = m.NewBoolVar(f"brk_{n}")
                self.I[n] = m.NewIntVar(x.lo, x.hi, f"I_{n}")
                if not x.waited_at_need:
                    self.W[n] = m.NewIntVar(x.wlo, x.whi, f"W_{n}")
                self.C[n] = m.NewIntVar(0, H, f"C_{n}")
                self.X[n] = m.NewIntVar(0, H, f"X_{n}")
                self.R[n] = m.NewIntVar(x.d_us, total_d, f"R_{n}")
                q = None
                if cap is not None:
                    q = m.NewIntVar(0, total_pay, f"Q_{n}")
                    m.Add(q <= max(cap, x.pay_bytes))
                if k == 0:
                    m.Add(self.brk[n] == 1)
                    m.Add(self.R[n] == x.d_us)
                    if q is not None:
                        m.Add(q == x.pay_bytes)
                else:
                    prev, b = chain[k - 1].name, self.brk[n]
                    m.Add(self.R[n] == x.d_us).OnlyEnforceIf(b)
                    m.Add(self.R[n] == self.R[prev] + x.d_us).OnlyEnforceIf(b.Not())
                    m.Add(self.I[n] == self.I[prev]).OnlyEnforceIf(b.Not())
                    m.Add(self.C[n] == self.C[prev]).OnlyEnforceIf(b.Not())
                    m.Add(self.I[n] >= self.I[prev])
                    if not x.waited_at_need:
                        m.Add(self.W[n] == self.W[prev]).OnlyEnforceIf(b.Not())
                        m.Add(self.W[n] >= self.W[prev])
                    if q is not None:
                        m.Add(q == x.pay_bytes).OnlyEnforceIf(b)
                        m.Add(q == Q + x.pay_bytes).OnlyEnforceIf(b.Not())
                Q = q
            for k, x in enumerate(chain):
                n = x.name
                if k + 1 < len(chain):
                    last = self.brk[chain[k + 1].name]
                    m.Add(self.X[n] == self.C[n] + alpha + self.R[n]).OnlyEnforceIf(last)
                    m.Add(self.X[n] == self.X[chain[k + 1].name]).OnlyEnforceIf(last.Not())
                else:
                    last = m.NewConstant(1)
                    m.Add(self.X[n] == self.C[n] + alpha + self.R[n])
                self.last[n] = last

    # -- (3) ---------------------------------------------------------------------------------
    def add_issue(self) -> None:
        """(3) y_{k,a} = [I_k <= a]; I_k >= a => C_k >= T_a (so C_k >= T_{I_k})."""
        m = self.model
        self.y: dict[str, dict[int, object]] = {}
        for x in self.data.member.values():
            n = x.name
            self.y[n] = ys = _order_encoding(m, self.I[n], x.lo, x.hi, f"y_{n}")
            m.Add(self.C[n] >= self.T[x.lo])
            for a in range(x.lo + 1, x.hi + 1):
                m.Add(self.C[n] >= self.T[a]).OnlyEnforceIf(ys[a - 1].Not())

    # -- (4) ---------------------------------------------------------------------------------
    def add_waits(self) -> None:
        """(4) all-gathers: U_{need_k} >= X_k; reduce-scatters: W_k >= I_k, z_{k,a} = [W_k <= a],
        z_{k,a} => U_a >= X_k, U_{whi_k} >= X_k."""
        m = self.model
        self.z: dict[str, dict[int, object]] = {}
        for x in self.data.member.values():
            n = x.name
            if x.waited_at_need:
                m.Add(self.U[x.need] >= self.X[n])
                continue
            m.Add(self.W[n] >= self.I[n])
            self.z[n] = zs = _order_encoding(m, self.W[n], x.wlo, x.whi, f"z_{n}")
            for a in range(x.wlo, x.whi):
                m.Add(self.U[a] >= self.X[n]).OnlyEnforceIf(zs[a])
            m.Add(self.U[x.whi] >= self.X[n])

    # -- (5) ---------------------------------------------------------------------------------
    def add_streams(self) -> None:
        """(5) per process group, NoOverlap over [C_k, E_k) (present when last_k) and the fixed
        intervals; brk_k => C_k >= X_{k-1}; fixed intervals in reference order, issued in range
        after T_issue, before range from ref_f on with every decided bucket after them (FIFO);
        waited in range: U_wait >= end; Z >= every end."""
        m, d = self.model, self.data
        per_group: dict[str, list] = defaultdict(list)
        self.E: dict[str, cp_model.IntVar] = {}
        for ci, chain in enumerate(d.chains):
            alpha = d.alpha_us[ci]
            for k, x in enumerate(chain):
                n = x.name
                self.E[n] = end = m.NewIntVar(0, d.horizon_us, f"E_{n}")
                m.Add(end == self.C[n] + alpha + self.R[n])
                per_group[d.p.colls[n].group_name].append(
                    m.NewOptionalIntervalVar(self.C[n], alpha + self.R[n], end, self.last[n], f"iv_{n}"))
                m.Add(self.Z >= end)
                if k > 0:
                    m.Add(self.C[n] >= self.X[chain[k - 1].name]).OnlyEnforceIf(self.brk[n])
        fixed_by_group: dict[str, list] = defaultdict(list)
        pre_range: dict[str, list] = defaultdict(list)
        self.Cf: dict[int, cp_model.IntVar] = {}
        for f in d.fixed:
            self.Cf[f.bucket] = start = m.NewIntVar(0, d.horizon_us, f"Cf_{f.bucket}")
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
        for x in d.member.values():
            for start, dur in pre_range.get(d.p.colls[x.name].group_name, ()):
                m.Add(self.C[x.name] >= start + dur)
        for items in fixed_by_group.values():
            items.sort(key=lambda t: t[0])
            for (_s0, st0, d0), (_s1, st1, _d1) in zip(items, items[1:]):
                m.Add(st1 >= st0 + d0)
        for ivs in per_group.values():
            if len(ivs) > 1:
                m.AddNoOverlap(ivs)

    # -- (6) ---------------------------------------------------------------------------------
    def add_copy_costs(self) -> None:
        """(6) mrg_k = NOT (brk_k AND last_k), lead_k = brk_k AND mrg_k;
        U_a >= T_a + cfix_a + sum_{k charged at a} (copy_k mrg_k + fix_k lead_k)."""
        m, d = self.model, self.data
        terms: dict[int, list] = defaultdict(list)
        self.mrg: dict[str, cp_model.IntVar] = {}
        for x in d.member.values():
            n = x.name
            starts, ends = self.brk[n], self.last[n]
            self.mrg[n] = mrg = m.NewBoolVar(f"mrg_{n}")
            m.AddBoolOr([starts.Not(), ends.Not()]).OnlyEnforceIf(mrg)
            m.AddBoolAnd([starts, ends]).OnlyEnforceIf(mrg.Not())
            if x.copy_us != 0:  # negative where a folded cast costs more than its copy
                terms[x.charge].append(x.copy_us * mrg)
            if x.copy_fixed_us > 0:
                lead = m.NewBoolVar(f"lead_{n}")
                m.AddBoolAnd([starts, mrg]).OnlyEnforceIf(lead)
                m.AddBoolOr([starts.Not(), mrg.Not()]).OnlyEnforceIf(lead.Not())
                terms[x.charge].append(x.copy_fixed_us * lead)
        for a in sorted(set(terms) | set(d.fixed_copy_us)):
            m.Add(self.U[a] >= self.T[a] + d.fixed_copy_us.get(a, 0) + sum(terms[a]))

    # -- (7) ---------------------------------------------------------------------------------
    def add_memory(self) -> None:
        """(7) base_a + sum_AG out_k y_{k,a} + sum_RS [grad_k (1 - y_{k,a}) + pay_k (y_{k,a} -
        z_{k,a}) + out_k y_{k,a}] + sum_RS grad_k e_{k,a} <= P <= mem_budget_bytes."""
        m, d = self.model, self.data
        terms: dict[int, list] = defaultdict(list)
        transient: dict[int, list] = defaultdict(list)
        for x in d.member.values():
            y = self.y[x.name]
            if x.waited_at_need:
                for a in range(x.lo, x.need):
                    terms[a].append(x.out_bytes * y[a])
                continue
            z = self.z[x.name]
            for a in range(x.lo, x.whi):
                ya = y[a] if a < x.hi else 1
                terms[a].append(x.grad_bytes * (1 - ya) + x.pay_bytes * (ya - z[a]) + x.out_bytes * ya)
            if x.grad_bytes == 0:
                continue
            for a in range(x.lo, x.hi + 1):
                e = m.NewBoolVar(f"e_{x.name}_{a}")  # issued at a, merged
                at_a = [y[a]] if a == x.lo else [y[a], y[a - 1].Not()]
                at_a = [lit for lit in at_a if not isinstance(lit, int)]
                m.AddBoolAnd(at_a + [self.mrg[x.name]]).OnlyEnforceIf(e)
                m.AddBoolOr([lit.Not() for lit in at_a] + [self.mrg[x.name].Not(), e])
                transient[a].append(x.grad_bytes * e)
        self.P = m.NewIntVar(0, d.peak_upper_bytes, "peak_bytes")
        for a in d.anchor_range:
            m.Add(self.P >= d.base_mem[a] + sum(terms[a]) + sum(transient[a]))
        if d.mem_budget_bytes is not None:
            m.Add(self.P <= d.mem_budget_bytes)

    # -- hints, completion, extraction -------------------------------------------------------
    def decision_vars(self) -> list:
        return [*self.brk.values(), *self.I.values(), *self.W.values()]

    def _hint_decisions(self, dec: Decisions) -> None:
        for n, v in dec.brk.items():
            self.model.AddHint(self.brk[n], v)
        for n, v in dec.issue.items():
            self.model.AddHint(self.I[n], v)
        for n, v in dec.wait.items():
            self.model.AddHint(self.W[n], v)

    def hint_all(self, schedule: Schedule) -> None:
        """Hint every decision of ``schedule`` and the times derived from it (the timeline from
        its simulated departures, stream starts and ends, bucket durations, order encodings,
        merge flags): a near-complete solution that CP-SAT's search starts from, instead of a
        separate completion solve (``repair_hint`` is not used: it aborts in this OR-tools
        without presolve)."""
        d, m = self.data, self.model
        dec, guide = d.decisions_of(schedule), d.times_of(schedule)
        values: list[tuple[object, int]] = []
        t = d.t_in_us
        for a in d.anchor_range:
            u = max(t, guide.U.get(a, t))
            values += [(self.T[a], t), (self.U[a], u)]
            if a < d.a_hi:
                t = u + d.anchors.seg_us[a]
        for ci, chain in enumerate(d.chains):
            r = 0
            for k, x in enumerate(chain):
                n = x.name
                brk = dec.brk[n]
                r = x.d_us + (0 if brk else r)
                last = 1 if k + 1 == len(chain) else dec.brk[chain[k + 1].name]
                c = guide.C.get(n, 0)
                values += [(self.brk[n], brk), (self.I[n], dec.issue[n]), (self.R[n], r), (self.C[n], c),
                           (self.E[n], c + d.alpha_us[ci] + r), (self.mrg[n], int(not (brk and last)))]
                if n in guide.X:
                    values.append((self.X[n], guide.X[n]))
                for a, lit in self.y[n].items():
                    if not isinstance(lit, int):
                        values.append((lit, int(dec.issue[n] <= a)))
                if n in self.W:
                    values.append((self.W[n], dec.wait[n]))
                    for a, lit in self.z[n].items():
                        if not isinstance(lit, int):
                            values.append((lit, int(dec.wait[n] <= a)))
        m.ClearHints()
        for var, v in values:
            m.AddHint(var, v)

    def complete(self, schedule: Schedule, work_limit: float, seed: int, num_workers: int,
                 cfg: CpSatConfig) -> cp_model.CpSolver | None:
        """A solver holding a full solution of this model (every variable) that takes
        ``schedule``'s decisions, or None when they do not fit the model (issue and wait ranges, budget)."""
        d = self.data
        sub = self.model.clone()
        sub.clear_hints()
        dec = d.decisions_of(schedule)
        guide = d.times_of(schedule)
        for n, v in dec.brk.items():
            sub.Add(sub.get_int_var_from_proto_index(self.brk[n].Index()) == v)
        for n, v in dec.issue.items():
            sub.Add(sub.get_int_var_from_proto_index(self.I[n].Index()) == v)
        for n, v in dec.wait.items():
            sub.Add(sub.get_int_var_from_proto_index(self.W[n].Index()) == v)
        for var, vals in ((self.C, guide.C), (self.X, guide.X), (self.U, guide.U)):
            for key, v in vals.items():
                if key in var:
                    sub.add_hint(sub.get_int_var_from_proto_index(var[key].Index()), v)
        solver = make_solver(work_limit, seed, num_workers, cfg)
        status = solver.Solve(sub)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return solver
        logger.debug("warm start does not fit the model: %s", STATUS_NAMES.get(status))
        return None

    def start_from(self, schedule: Schedule, work_limit: float, seed: int, num_workers: int, cfg: CpSatConfig) -> None:
        """Hint the model with ``schedule`` completed to a full solution (:meth:`complete`), or
        with its decisions alone (member by member) when they cannot be completed."""
        solver = self.complete(schedule, work_limit, seed, num_workers, cfg)
        if solver is None:
            self._hint_decisions(self.data.decisions_of(schedule, per_bucket=False))
            return
        for idx, val in enumerate(solver.ResponseProto().solution):
            self.model.add_hint(self.model.get_int_var_from_proto_index(idx), val)

    def decisions(self, solver: cp_model.CpSolver) -> Decisions:
        return Decisions(
            brk={n: solver.Value(v) for n, v in self.brk.items()},
            issue={n: solver.Value(v) for n, v in self.I.items()},
            wait={n: solver.Value(v) for n, v in self.W.items()},
        )

    def solution(self, solver: cp_model.CpSolver) -> Solution:
        """Every variable family's values (what the MILP starts from)."""
        dec = self.decisions(solver)

        def values(vs: dict) -> dict:
            return {k: solver.Value(v) for k, v in vs.items()}

        return Solution(
            brk=dec.brk, issue=dec.issue, wait=dec.wait, C=values(self.C), X=values(self.X), R=values(self.R),
            T=values(self.T), U=values(self.U), Z=solver.Value(self.Z), fixed_start=values(self.Cf),
            objective_us=solver.Value(self.objective),
        )

    def extract(self, solver: cp_model.CpSolver) -> Schedule:
        return self.data.extract(self.decisions(solver))


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
    bs[hi] = 1
    return bs


def make_solver(work_limit: float, seed: int, num_workers: int, cfg: CpSatConfig) -> cp_model.CpSolver:
    """A CP-SAT solver with a deterministic limit of ``work_limit`` (see :class:`CpSatConfig`)."""
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_deterministic_time = float(work_limit) * cfg.deterministic_units_per_second
    prm.max_time_in_seconds = float(work_limit) * cfg.wall_clock_factor + cfg.wall_clock_slack_s
    prm.random_seed = int(seed)
    prm.num_workers = int(num_workers)
    prm.log_search_progress = False
    # the root LP costs more than it helps on these models: the big-M timeline relaxes to
    # almost nothing, and its time is taken from the search
    prm.linearization_level = 0
    return solver


def complete_solution(data: ModelData, schedule: Schedule, work_limit: float, seed: int, num_workers: int,
                      cfg: CpSatConfig | None = None) -> Solution | None:
    """``schedule`` completed to a full solution of ``data``'s model with the tightest times
    (the objective minimised with the decisions fixed), or None when its decisions do not fit.
    The MILP starts from this."""
    model = CpSatModel(data)
    model.model.Minimize(model.objective)
    solver = model.complete(schedule, work_limit, seed, num_workers, cfg or CpSatConfig())
    return None if solver is None else model.solution(solver)


class CpSatBackend:
    """The CP-SAT backend as :mod:`solvers.search` runs it (windows)."""

    name = "cpsat"

    def __init__(self, config: CpSatConfig | None = None):
        self.config = config or CpSatConfig()
        self.wall_cap_hits = 0

    def _run(self, solver: cp_model.CpSolver, model: cp_model.CpModel) -> str:
        """Solve; a solve stopped by the wall-clock cap before its deterministic limit is
        counted (the driver reports it: the result is no longer rank-deterministic)."""
        status = STATUS_NAMES.get(solver.Solve(model), "unknown")
        prm = solver.parameters
        if (status not in ("optimal", "infeasible") and solver.WallTime() >= prm.max_time_in_seconds * 0.99
                and solver.response_proto.deterministic_time < prm.max_deterministic_time * 0.99):
            self.wall_cap_hits += 1
            logger.warning("a CP-SAT solve hit its wall-clock cap (%.1f s) before its deterministic limit",
                           prm.max_time_in_seconds)
        return status

    def solve_window(self, problem: Problem, mem_budget_bytes: int | None, schedule: Schedule, free: set[str],
                     work_limit: float, seed: int, num_workers: int, anchors: Anchors) -> Schedule | None:
        """One window of the decomposition: ``free`` decided, the rest of ``schedule`` fixed,
        hinted with ``schedule`` (:meth:`CpSatModel.hint_all`; no separate completion solve: the
        hint already starts the search from the incumbent, and a completion would spend the
        window's small deterministic budget before the search starts)."""
        cfg = self.config
        built = CpSatModel(ModelData(problem, cfg, mem_budget_bytes, free=free, reference=schedule, anchors=anchors))
        built.model.Minimize(built.objective)
        built.hint_all(schedule)
        solver = make_solver(work_limit, seed, num_workers, cfg)
        prm = solver.parameters
        prm.max_deterministic_time = float(work_limit) * cfg.window_units_per_second
        # presolve rewrites the model and loses the hint, which is most of what a window
        # knows; probing and SAT inprocessing spend most of a window's small deterministic
        # budget before the search starts, and the search finds better windows without them
        prm.cp_model_presolve = False
        prm.cp_model_probing_level = 0
        prm.use_sat_inprocessing = False
        status = self._run(solver, built.model)
        logger.debug("window (%d free): %s obj %.3f ms in %.2f s (limit %.2f)", len(free), status,
                     solver.ObjectiveValue() / US_PER_MS if status in ("optimal", "feasible") else float("nan"),
                     solver.WallTime(), work_limit)
        if status not in ("optimal", "feasible"):
            return None
        return built.extract(solver)
