"""The report of one optimisation: what the model predicts before and after, and why.

:class:`ScheduleReport` is stored at ``gm.meta["fsdp_sched_report"]`` by
:func:`scheduler.optimize_schedule` and returned by :func:`scheduler.solve_dag`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from scheduler.costs.family import merged_cost_sources
from scheduler.costs.hardware import graph_topology, topology_line
from solvers.core.problem import Problem
from solvers.core.schedule import Schedule, SolveStatus
from solvers.core.simulator import SimResult, simulate
from solvers.core.units import fmt_bytes, fmt_ms

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class ScheduleReport:
    """What one optimisation predicts and did. Times in ms, memory in bytes, distances in
    compute nodes; "before" is the graph as traced, "after" the chosen schedule, both
    simulated on the same cost model (:mod:`solvers.core.simulator`)."""

    #: name of the graph ("forward", "backward", ...)
    graph_name: str
    #: solver or heuristic that produced the schedule (after any fallback)
    solver: str
    #: the solver asked for
    requested_solver: str
    #: a :class:`solvers.core.schedule.SolveStatus` value, or "unchanged" for a graph without collectives
    status: str
    #: wall time of the whole solve, heuristics and validation included (s)
    solve_time_s: float
    #: the memory budget (bytes), None for none
    mem_budget_bytes: int | None
    step_ms_before: float
    step_ms_after: float
    peak_bytes_before: int
    peak_bytes_after: int
    exposed_comm_ms_before: float
    exposed_comm_ms_after: float
    n_collectives_before: int
    n_collectives_after: int
    #: analytic lower bound on step time (DESIGN.md), valid for every schedule
    lower_bound_ms: float
    #: the best proven bound on step time (solver bound, else the analytic one)
    best_bound_ms: float
    #: (step_ms_after - best_bound_ms) / step_ms_after, 0 when proven optimal
    gap: float
    #: per bucket, the parameter FQNs of its members (collective names where FQNs are unknown)
    buckets: list[list[str]] = dataclasses.field(default_factory=list)
    #: per bucket, its collective type ("all_gather", "reduce_scatter", ...)
    bucket_types: list[str] = dataclasses.field(default_factory=list)
    #: per all-gather bucket, compute nodes between its issue and the first use of its result
    ag_prefetch: list[int] = dataclasses.field(default_factory=list)
    #: per reduce-scatter bucket, compute nodes between its last gradient and its issue
    rs_issue_delay: list[int] = dataclasses.field(default_factory=list)
    #: per reduce-scatter bucket, compute nodes between its issue and its wait
    rs_wait_distance: list[int] = dataclasses.field(default_factory=list)
    #: :meth:`solvers.core.schedule.Schedule.digest` of the schedule (equal on every rank)
    digest: str = ""
    #: process groups whose all-gathers the schedule moved to a second group of the same ranks,
    #: a stream of their own (:attr:`solvers.core.schedule.Schedule.split_groups`)
    split_groups: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: the schedule is not the requested solver's (it failed, timed out, or a heuristic was better)
    fell_back: bool = False
    #: ``"forward"``, ``"backward"``, ``"inference"``, ``"joint"`` (forward, loss and backward in
    #: one graph) or ``"unknown"`` (a graph given by hand)
    graph_kind: str = "unknown"
    #: torch's compile id of the graph (``"0/0"``: frame 0, first compile; the forward and the
    #: backward of one compile share it), None outside ``torch.compile``
    compile_id: str | None = None
    #: the candidates were judged on their written-back graphs (:mod:`scheduler.check.written`); the
    #: fields below are set only then
    verified: bool = False
    #: the candidate written back ("cpsat", a heuristic, "traced", "torch-overlap", ...)
    chosen_candidate: str | None = None
    #: the chosen graph re-exported and simulated as written (same cost model), ms and bytes
    reexported_step_ms: float | None = None
    reexported_peak_bytes: int | None = None
    #: the chosen graph's peak by the reference liveness count and by torch's MemoryTracker
    liveness_peak_bytes: int | None = None
    tracker_peak_bytes: int | None = None
    #: per candidate: name, the model's prediction (predicted_step_ms, predicted_peak_bytes;
    #: None for torch's), its re-exported step_ms (per cost model), peak_bytes,
    #: liveness_peak_bytes, tracker_peak_bytes, error, and outcome ("chosen: ..." or
    #: "dropped: <why>")
    candidates: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: wall time of the verification (included in solve_time_s), s
    verify_time_s: float = 0.0
    #: what chose among the candidates that fit ("fastest re-exported under analytic", or the
    #: worst-case regret over the family, the default without a cost model); rows of ``candidates`` then
    #: carry ``worst_regret`` over the cost models that judged them (None: not compared)
    criterion: str = ""
    #: the stages of the call, in order: the export, the solve's (:attr:`SolveResult.stages`)
    #: or the cache's lookup, the choice's (:mod:`scheduler.check.written`), the write-back; each a
    #: :meth:`solvers.core.schedule.StageRecord.to_json` dict (name, wall_s, work,
    #: evaluations, step_ms, gained_ms)
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: labels of the cost models the schedule was judged under (the first is the report's)
    cost_models: list[str] = dataclasses.field(default_factory=list)
    #: the answer came from the schedule cache (:mod:`scheduler.integrate.cache`), not from a solve
    cache_hit: bool = False
    #: what the cost model priced from its own data (a profile, a measured table) and what
    #: it left to its fallback (:func:`scheduler.costs.annotate.annotate_costs`): ``compute_ms``,
    #: ``compute_matched_ms``, ``compute_matched_share``, ``fallback_groups`` (group_name,
    #: coll_type, group_size, nodes per group priced by the fallback); empty for a model that
    #: does not say (analytic, torch)
    cost_coverage: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: where each cost component's prices came from over the cost models judged
    #: (:func:`scheduler.costs.family.merged_cost_sources`): per component (``part``:
    #: ``"compute"``, ``"collectives"`` of one ``group_name`` and ``coll_type``, ``"copies"``),
    #: its ``items``, the ``measured`` sources (``source``, ``items``, ``share`` of the time) and
    #: the ``rest`` (``items``, ``sources``: one name fixed, several the models hedged over)
    cost_sources: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the topology the graph was priced on (:func:`scheduler.costs.hardware.graph_topology`):
    #: ``world_size``, ``gpus_per_node``, ``n_gpus`` and per group its ranks and the nodes they span
    topology: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the start the search's schedule was found from: the one that won ("torch-overlap",
    #: "regular head 1, 2 per bucket, ...", "traced", a heuristic's name; "" when no search ran).
    #: ``chosen_candidate`` says whether the search's schedule is the one installed
    start: str = ""
    #: that start's simulated step time under each cost model, ms
    start_step_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    #: the search's schedule's simulated step time under each cost model, ms: equal to
    #: ``start_step_ms`` where the start won unchanged
    search_step_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    #: torch's overlap scheduler read back as starts (:mod:`scheduler.torch_overlap`), per
    #: variant: ``name``, ``digest``, ``repairs`` (what was changed for our model to represent
    #: it), ``skipped`` (why it is no start, None when it is one), ``wall_s``, ``n_collectives``
    #: of torch's graph, and where read back its simulated ``step_ms`` per cost model and
    #: ``peak_bytes``
    torch_starts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the order of the compute nodes in the installed schedule: ``"traced"``, or ``"torch"``,
    #: another order of the same graph (torch's pass's: ``SolverOptions.compute_order``)
    compute_order: str = "traced"

    def start_gain_ms(self) -> dict[str, float]:
        """Per cost model, how much the search improved on the start that won (ms; 0: it won
        unchanged)."""
        return {label: t - self.search_step_ms[label] for label, t in self.start_step_ms.items()
                if label in self.search_step_ms}

    def stage_wall_s(self) -> dict[str, float]:
        """Stage name -> wall time (s), stages of one name summed."""
        out: dict[str, float] = {}
        for st in self.stages:
            out[st["name"]] = out.get(st["name"], 0.0) + st["wall_s"]
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "ScheduleReport":
        return ScheduleReport(**data)

    def summary_line(self) -> str:
        """One line for logs."""
        return (
            f"fsdp-sched {self._title()}: step {fmt_ms(self.step_ms_before)} -> {fmt_ms(self.step_ms_after)}, "
            f"peak {fmt_bytes(self.peak_bytes_before)} -> {fmt_bytes(self.peak_bytes_after)}, "
            f"collectives {self.n_collectives_before} -> {self.n_collectives_after}"
            + (f", written {fmt_ms(self.reexported_step_ms)} by {self.chosen_candidate}" if self.verified else "")
            + " "
            f"({self.solver}, {self.status}, gap {self.gap:.1%}{', fell back' if self.fell_back else ''})"
        )

    def _title(self) -> str:
        title = self.graph_name
        if self.graph_kind not in ("unknown", self.graph_name):
            title += f" ({self.graph_kind})"
        return title + (f" [compile {self.compile_id}]" if self.compile_id else "")

    def __str__(self) -> str:
        budget = fmt_bytes(self.mem_budget_bytes) if self.mem_budget_bytes else "none"
        rows = [
            ("step time", fmt_ms(self.step_ms_before), fmt_ms(self.step_ms_after)),
            ("peak memory", fmt_bytes(self.peak_bytes_before), fmt_bytes(self.peak_bytes_after)),
            ("exposed comm", fmt_ms(self.exposed_comm_ms_before), fmt_ms(self.exposed_comm_ms_after)),
            ("collectives", str(self.n_collectives_before), str(self.n_collectives_after)),
        ]
        lines = [
            f"fsdp-sched report: {self._title()} (solver {self.solver}, status {self.status}, "
            f"{self.solve_time_s:.2f} s, budget {budget})",
            f"  {'':<14}{'traced':>14}{'scheduled':>14}",
        ]
        lines += [f"  {name:<14}{a:>14}{b:>14}" for name, a, b in rows]
        lines.append(
            f"  lower bound {fmt_ms(self.lower_bound_ms)}, best bound {fmt_ms(self.best_bound_ms)}, "
            f"gap {self.gap:.1%}"
        )
        n_ag = self.bucket_types.count("all_gather")
        n_rs = self.bucket_types.count("reduce_scatter")
        lines.append(f"  buckets: {len(self.buckets)} (all-gather {n_ag}, reduce-scatter {n_rs})")
        if self.split_groups:
            lines.append(f"  all-gathers of groups {', '.join(self.split_groups)} on a second group of the same ranks")
        if self.ag_prefetch:
            lines.append(f"  all-gather prefetch (compute nodes): {_spread(self.ag_prefetch)}")
        if self.rs_wait_distance:
            lines.append(
                f"  reduce-scatter issue delay: {_spread(self.rs_issue_delay)}; "
                f"issue-to-wait: {_spread(self.rs_wait_distance)}"
            )
        lines += self._start_lines()
        lines += self._verification_lines()
        if self.topology:
            lines.append(f"  topology: {topology_line(self.topology)}")
        lines += self._coverage_lines()
        if self.fell_back:
            lines.append(f"  fell back from {self.requested_solver} to {self.solver}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.digest:
            lines.append(f"  schedule digest {self.digest[:16]}")
        return "\n".join(lines)


    def _start_lines(self) -> list[str]:
        """The start that won and what the search made of it; torch's starts."""
        lines = []
        if self.start:
            gains = self.start_gain_ms()
            made = "won unchanged" if not any(g > 0 for g in gains.values()) else "improved by " + ", ".join(
                f"{fmt_ms(g)} under {label}" for label, g in gains.items())
            order = "" if self.compute_order == "traced" else ", compute in torch's order"
            lines.append(f"  start: {self.start}, {made}{order}")
        for t in self.torch_starts:
            if t.get("skipped"):
                lines.append(f"  {t['name']}: no start ({t['skipped']})")
            elif t.get("step_ms"):
                steps = ", ".join(f"{fmt_ms(v)} under {label}" for label, v in t["step_ms"].items())
                lines.append(f"  {t['name']}: a start, {steps}, {t['wall_s']:.1f} s")
        return lines

    def _verification_lines(self) -> list[str]:
        """The chosen graph as written back, and every candidate's outcome."""
        if not self.verified:
            return []
        lines = [
            f"  written graph ({self.chosen_candidate}, {self.verify_time_s:.2f} s to verify): step "
            f"{fmt_ms(self.reexported_step_ms)} re-exported (model {fmt_ms(self.step_ms_after)}); peak "
            f"{_fmt_opt_bytes(self.reexported_peak_bytes)} re-exported, {_fmt_opt_bytes(self.liveness_peak_bytes)} "
            f"liveness, {_fmt_opt_bytes(self.tracker_peak_bytes)} by torch's tracker rules"
        ]
        if self.criterion:
            lines.append(f"  chosen by: {self.criterion}")
        for c in self.candidates:
            f = c.get("figures") or {}
            written = "-" if not f else f"{fmt_ms(f['step_ms'])}, peak {fmt_bytes(max(f['peak_bytes'], f['liveness_peak_bytes']))}"
            outcome = "chosen" if c.get("dropped") is None else f"dropped: {c['dropped']}"
            lines.append(f"    candidate {c['name']:<40} written {written}: {outcome}")
        return lines


    def _coverage_lines(self) -> list[str]:
        """Where each cost component came from (:attr:`cost_sources`; for reports without
        them, what the cost model priced from its data and what its fallback priced)."""
        if self.cost_sources:
            return [f"  costs: {_source_line(r)}" for r in self.cost_sources]
        cov = self.cost_coverage
        lines = []
        if cov.get("compute_matched_share") is not None:
            lines.append(f"  costs: {cov['compute_matched_share']:.1%} of compute time from the cost model's data "
                         f"({fmt_ms(cov['compute_matched_ms'])} of {fmt_ms(cov['compute_ms'])}), the rest from its fallback")
        for g in cov.get("fallback_groups") or ():
            lines.append(f"  costs: {g['coll_type']} on group {g['group_name']} ({g['group_size']} ranks, "
                         f"{g['nodes']} node(s)) has no measured row: priced by the fallback model")
        return lines


#: report fields that say how a schedule was found, kept when the schedule is taken from the
#: schedule cache or from another rank (:func:`read_provenance`); every other field describes a
#: graph and is computed again on the graph the schedule is installed in
PROVENANCE_FIELDS = ("solver", "requested_solver", "status", "best_bound_ms", "fell_back", "notes", "criterion",
                     "chosen_candidate")


def read_provenance(data: Any) -> dict[str, Any]:
    """The :data:`PROVENANCE_FIELDS` of a report read back as JSON (a cache entry's, another
    rank's), each checked: what is read here is later formatted and compared.

    Raises:
        ValueError: ``data`` is not a JSON object, or a field is missing or of the wrong type
            (the message names it).
    """
    if not isinstance(data, dict):
        raise ValueError(f"the report is {type(data).__name__}, not a JSON object")
    checks = {
        "solver": ("a string", lambda v: isinstance(v, str)),
        "requested_solver": ("a string", lambda v: isinstance(v, str)),
        "status": (f"one of {[s.value for s in SolveStatus]}", lambda v: v in {s.value for s in SolveStatus}),
        "best_bound_ms": ("a finite number >= 0 (ms)", lambda v: isinstance(v, (int, float))
                          and not isinstance(v, bool) and math.isfinite(v) and v >= 0),
        "fell_back": ("true or false", lambda v: isinstance(v, bool)),
        "notes": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)),
        "criterion": ("a string", lambda v: isinstance(v, str)),
        "chosen_candidate": ("a string or null", lambda v: v is None or isinstance(v, str)),
    }
    out = {}
    for name in PROVENANCE_FIELDS:
        accepted, valid = checks[name]
        if name not in data:
            raise ValueError(f"the report has no field {name!r} ({accepted})")
        if not valid(data[name]):
            raise ValueError(f"the report's field {name!r} is {data[name]!r:.60}; expected {accepted}")
        out[name] = list(data[name]) if name == "notes" else data[name]
    return out


def _source_line(r: dict[str, Any]) -> str:
    """One :attr:`ScheduleReport.cost_sources` record: ``"compute (120 nodes): profile:p.json
    priced 100 (93.1% of the time); 20 by analytic | torch"``; names joined by ``|`` are the
    models the family hedges over, a single name is the one that priced all of it."""
    if r["part"] == "copies":
        return f"bucket copies: {' | '.join(r['rest']['sources'])}"
    if r["part"] == "compute":
        what = f"compute ({r['items']} nodes)"
    else:
        what = (f"{r['coll_type']} on group {r['group_name']!r} ({r['group_size']} ranks on {r['nodes']} "
                f"node{'s' if r['nodes'] != 1 else ''}, {r['items']} collectives)")
    rest = r["rest"]
    parts = [f"{m['source']} priced " + (f"all {m['items']}" if len(r["measured"]) == 1 and not rest["items"] else
                                         f"{m['items']}" + ("" if m["share"] is None else
                                                            f" ({m['share']:.1%} of the time)"))
             for m in r["measured"]]
    if rest["items"]:
        by = " | ".join(rest["sources"])
        parts.append(f"{rest['items']} by {by}" if r["measured"] else by)
    return f"{what}: {'; '.join(parts)}"


def _fmt_opt_bytes(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def _spread(xs: list[int]) -> str:
    s = sorted(xs)
    return f"min {s[0]}, median {s[len(s) // 2]}, max {s[-1]}"



def make_report(
    problem: Problem,
    before: SimResult,
    after: SimResult,
    *,
    graph_name: str,
    mem_budget_bytes: int | None,
    t0: float,
    solver: str,
    requested: str,
    status: str,
    best_bound: float | None,
    notes: list[str],
    fell_back: bool,
    stages: tuple = (),
) -> ScheduleReport:
    """The report of ``after`` (the simulation of the chosen schedule) against ``before`` (the
    traced order); ``t0`` is ``time.perf_counter()`` when the solve started; ``stages`` the
    solve's :class:`solvers.core.schedule.StageRecord` s."""
    lower = problem.lower_bound_ms()
    bound = max(lower, best_bound) if best_bound is not None else lower
    bound = min(bound, after.step_ms)
    return ScheduleReport(
        graph_name=graph_name,
        solver=solver,
        requested_solver=requested,
        status=status,
        solve_time_s=time.perf_counter() - t0,
        mem_budget_bytes=mem_budget_bytes,
        step_ms_before=before.step_ms,
        peak_bytes_before=before.peak_bytes,
        exposed_comm_ms_before=before.exposed_comm_ms,
        n_collectives_before=before.n_collectives,
        lower_bound_ms=lower,
        best_bound_ms=bound,
        digest=after.schedule.digest(),
        notes=list(notes),
        fell_back=fell_back,
        graph_kind=str(problem.dag.graph.get("graph_kind", "unknown")),
        stages=[st.to_json() for st in stages],
        cost_coverage=dict(problem.dag.graph.get("cost_coverage") or {}),
        cost_sources=merged_cost_sources({"model": problem.dag}),
        topology=graph_topology(problem.dag),
        **after_fields(problem, after, bound),
    )


def after_fields(problem: Problem, after: SimResult, best_bound_ms: float) -> dict[str, Any]:
    """The report's "after" figures of ``after`` (a simulation of a schedule over
    ``problem``): step, peak, exposed communication, collectives, gap to ``best_bound_ms``
    and the bucket statistics. For :func:`make_report` and for reports whose schedule is
    replaced later (``dataclasses.replace(report, **after_fields(...))``)."""
    step = after.step_ms
    buckets, types, prefetch, rs_delay, rs_wait = bucket_stats(problem, after.schedule)
    return dict(
        step_ms_after=step,
        peak_bytes_after=after.peak_bytes,
        exposed_comm_ms_after=after.exposed_comm_ms,
        n_collectives_after=after.n_collectives,
        gap=max(0.0, (step - best_bound_ms) / step) if step > 0 else 0.0,
        buckets=buckets,
        bucket_types=types,
        ag_prefetch=prefetch,
        rs_issue_delay=rs_delay,
        rs_wait_distance=rs_wait,
        split_groups=list(after.schedule.split_groups),
    )


def bucket_stats(problem: Problem, schedule: Schedule):
    """Per bucket: member FQNs, type, all-gather prefetch, reduce-scatter issue delay and
    issue-to-wait distance (compute nodes), as in :class:`ScheduleReport`."""
    # computes[p] = number of compute nodes in seq[:p]
    computes = [0]
    for name in problem.seq:
        computes.append(computes[-1] + (problem.dag.nodes[name]["kind"] == "compute"))
    issue, wait = schedule.positions()
    buckets, types, prefetch, rs_delay, rs_wait = [], [], [], [], []
    for b, bucket in enumerate(schedule.buckets):
        colls = [problem.colls[m] for m in bucket.members]
        buckets.append([f for c in colls for f in (c.fqns or (c.name,))])
        ctype = colls[0].coll_type
        types.append(ctype)
        if ctype == "all_gather":
            needed = min(c.needed for c in colls)
            prefetch.append(computes[needed] - computes[issue[b]])
        elif ctype == "reduce_scatter":
            ready = max(c.ready for c in colls)
            rs_delay.append(computes[issue[b]] - computes[min(ready, issue[b])])
            rs_wait.append(computes[wait[b]] - computes[issue[b]])
    return buckets, types, prefetch, rs_delay, rs_wait


def fixed_collective_notes(problem: Problem) -> list[str]:
    """A note per reason some collectives keep their traced place (their names, the first few
    of each)."""
    by_reason: dict[str, list[str]] = {}
    for c in problem.colls.values():
        if not c.movable:
            by_reason.setdefault(c.fixed_reason or "not movable", []).append(c.name)
    notes = []
    for reason, names in by_reason.items():
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        notes.append(f"{len(names)} collective(s) left in place ({shown}): {reason}")
        logger.info("fsdp-sched: %s", notes[-1])
    return notes


def unchanged_report(problem: Problem | None, *, mem_budget_bytes: int | None, requested: str, notes: list[str]
                      ) -> ScheduleReport:
    """The report of a graph left as traced."""
    if problem is not None:
        before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
        return make_report(problem, before, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                           mem_budget_bytes=mem_budget_bytes, t0=time.perf_counter(), solver="none",
                           requested=requested, status="unchanged", best_bound=None, notes=notes, fell_back=False)
    nan = float("nan")  # this rank could not even export its graph
    return ScheduleReport(graph_name="graph", solver="none", requested_solver=requested, status="unchanged",
                          solve_time_s=0.0, mem_budget_bytes=mem_budget_bytes, step_ms_before=nan, step_ms_after=nan,
                          peak_bytes_before=0, peak_bytes_after=0, exposed_comm_ms_before=nan,
                          exposed_comm_ms_after=nan, n_collectives_before=0, n_collectives_after=0,
                          lower_bound_ms=nan, best_bound_ms=nan, gap=0.0, notes=list(notes))
