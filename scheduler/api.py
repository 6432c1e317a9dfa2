"""The entry points: :func:`optimize_schedule` on an FX graph, :func:`solve_dag` on a saved DAG.

One :func:`optimize_schedule` call is a straight line:

1. **check** every argument (options are checked when built), alike on every rank;
2. **export** the graph once and price it under the cost model, or, when none is given, under
   the family of plausible models (:func:`scheduler.costs.family.cost_models`);
3. **solve** (:mod:`solvers.search`: starts, CP-SAT windows, polish), or take the answer from
   the schedule cache (:mod:`scheduler.integrate.cache`) when the identical graph, budget and options
   were solved before; torch's overlap scheduler, run on copies of the graph and read back
   (:mod:`scheduler.torch_overlap`, ``SolverOptions.torch_starts``), is among the starts and
   the baselines, so that the answer is no slower than torch's under the models judged by;
4. **choose**: write the best schedule back on a copy and judge the written graph by three
   memory counts; the next best start if it does not hold the budget
   (:func:`scheduler.check.written.choose`);
5. **agree** with the other ranks on the schedule, or on the failure of any of them
   (:mod:`scheduler.integrate.consensus`);
6. **install** it into ``gm`` (the ranks agree that every rank did, or all restore their graph).

The report (:class:`scheduler.report.ScheduleReport`) is stored at ``gm.meta[REPORT_KEY]``:
before and after, the written graph's figures, the candidates and the stages of the plan.

Failure policy: a budget that no schedule reaches raises
:class:`solvers.core.schedule.InfeasibleBudgetError` naming the smallest peak found (a budget
that large admits that schedule); a solver that fails is replaced by the best start that fits
(``SolverOptions.fallback``), reported as status ``"fallback"``; on a group of ranks, a failure
on some ranks leaves every rank's graph as traced, and a failure on all raises on all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.integrate import cache, consensus
from scheduler.check.written import choose
from scheduler.costs.family import cost_models
from scheduler.export.dag import export_problems
from scheduler.costs.models import Cluster, resolve_cost_model
from scheduler.export.dag import DagError, graph_has_collectives
from scheduler.options import AgreementOptions, SolverOptions, WriteBackOptions
from scheduler.report import ScheduleReport, make_report
from scheduler.torch_overlap import TorchStart, torch_starts
from scheduler.writeback import apply_schedule, copy_graph
from solvers.core import (
    InfeasibleBudgetError,
    Problem,
    Schedule,
    ScheduleError,
    SolveResult,
    SolveStatus,
    StageRecord,
    fmt_bytes,
    parse_bytes,
    simulate,
    validate_schedule,
)
from solvers.core.evaluate import ModelEvaluator
from solvers.registry import BACKENDS, solve_problems
from solvers.search import search

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: key of the report in ``gm.meta``
REPORT_KEY = "fsdp_sched_report"
#: ``gm.meta`` key of the installed schedule over the traced graph's problem: a start for another
#: solve of the same graph (``SolverOptions(extra_starts=...)``)
SCHEDULE_KEY = "fsdp_sched_schedule"
#: the digest every rank with a graph that has no collectives agrees on (nothing is written)
_NOTHING = hashlib.sha256(b"fsdp-sched: a graph without collectives").hexdigest()


@dataclasses.dataclass
class _Answer:
    """What one rank decided: the schedule to install (None: leave the graph as it is) and the
    report. ``digest`` is what the ranks compare."""

    schedule: Schedule | None
    report: ScheduleReport

    def digest(self) -> str:
        return self.schedule.digest() if self.schedule is not None else _NOTHING

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_json() if self.schedule is not None else None,
                "report": self.report.to_json()}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "_Answer":
        schedule = Schedule.from_json(data["schedule"]) if data["schedule"] is not None else None
        return _Answer(schedule, ScheduleReport.from_json(data["report"]))


# --------------------------------------------------------------------------------------------
# optimize_schedule
# --------------------------------------------------------------------------------------------
def optimize_schedule(
    gm: "torch.fx.GraphModule",
    mem_budget: int | str | None = None,
    *,
    cost_model: Any = None,
    cluster: Cluster | None = None,
    solver: SolverOptions = SolverOptions(),
    agreement: AgreementOptions = AgreementOptions(),
    writeback: WriteBackOptions = WriteBackOptions(),
) -> "torch.fx.GraphModule":
    """Schedule the collectives of an FSDP graph and rewrite it in place (module docstring).

    Args:
        gm: a forward, backward or joint graph whose nodes carry FakeTensor ``meta['val']`` (as
            aot_autograd or make_fx with fake tensors produce); merging buckets needs an
            initialised process group in which its groups resolve (a fake one is enough).
        mem_budget: peak-memory budget, bytes or a string like ``"40GiB"``; None: no limit.
            The written graph holds it by the execution model's count and a liveness count
            (torch's MemoryTracker rules are reported: :mod:`scheduler.check.written`).
        cost_model: a cost model or its name (``"analytic"``, ``"torch"``, ...); that model
            alone decides. None (default): the schedule with the least worst-case regret over
            the family of plausible models (:func:`scheduler.costs.family.cost_models`).
        cluster: the topology (:class:`scheduler.Cluster`; default 64 H100, 8 per node).
        solver: how to solve (:class:`scheduler.options.SolverOptions`).
        agreement: how ranks agree (:class:`scheduler.options.AgreementOptions`).
        writeback: how to write back (:class:`scheduler.options.WriteBackOptions`).

    Returns:
        ``gm``, rewritten (unchanged when it has no collectives).

    Raises:
        TypeError, ValueError: a bad argument (the message names it and what is accepted).
        InfeasibleBudgetError: no schedule fits ``mem_budget`` (states the smallest peak).
        ScheduleError: the solve failed and ``solver.fallback`` is False. On a group of ranks
            these are raised only when the pass failed on every rank; otherwise every rank
            keeps its graph as traced.
    """
    t0 = time.perf_counter()
    group = consensus.agreement_group(agreement.group) if _is_options(agreement, AgreementOptions) and \
        agreement.enabled else None
    src = _source_rank(group, agreement)
    answer: _Answer | None = None
    problem: Problem | None = None
    exported: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        budget = check_arguments(gm, mem_budget, cost_model=cost_model, cluster=cluster, solver=solver,
                                 agreement=agreement, writeback=writeback)
        t_export = time.perf_counter()
        problems = _export(gm, cost_model, cluster, solver)
        exported = StageRecord(name="export", wall_s=time.perf_counter() - t_export).to_json()
        problem = next(iter(problems.values())) if problems else None
        if group is None or agreement.broadcast_from is None or _rank(group) == src:
            answer = _solve_and_choose(gm, problems, budget, cost_model=cost_model, cluster=cluster, solver=solver,
                                       writeback=writeback, t0=t0)
    except Exception as e:
        if group is None:
            raise
        error = e  # every rank must learn of it, or the others wait in the agreement forever
        logger.warning("fsdp-sched: the pass failed on this rank (%s: %s)", type(e).__name__, e)
    if group is not None:
        answer = _agree(group, src, answer, error, problem)
    assert answer is not None
    t_install = time.perf_counter()
    _install(gm, problem, answer, writeback, group)
    # what this call spent around the answer: a cache hit costs its export and its write-back
    answer.report.stages = [*([exported] if exported is not None else []), *answer.report.stages,
                            StageRecord(name="write-back", wall_s=time.perf_counter() - t_install).to_json()]
    answer.report.compile_id = _compile_id()
    gm.meta[REPORT_KEY] = answer.report
    gm.meta[SCHEDULE_KEY] = answer.schedule
    logger.info("%s", answer.report.summary_line())
    return gm


def check_arguments(gm: Any, mem_budget: Any, *, cost_model: Any, cluster: Any, solver: Any, agreement: Any,
                    writeback: Any) -> int | None:
    """Check :func:`optimize_schedule`'s arguments (a function of them alone, so alike on every
    rank) and return the budget in bytes.

    Raises:
        TypeError: an argument of the wrong type (the message names it, its value and what is
            accepted).
        ValueError: a value out of range, named the same way.
    """
    import torch.fx

    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"gm={type(gm).__name__} must be a torch.fx.GraphModule (an FX graph of the training step)")
    budget = parse_bytes(mem_budget)
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r} must be a scheduler.Cluster or None")
    for name, value, cls in (("solver", solver, SolverOptions), ("agreement", agreement, AgreementOptions),
                             ("writeback", writeback, WriteBackOptions)):
        if not _is_options(value, cls):
            raise TypeError(f"{name}={value!r} must be a scheduler.{cls.__name__}")
    if cost_model is not None:
        resolve_cost_model(cost_model, cluster)  # raises ValueError naming a bad cost model
    if agreement.broadcast_from is not None and agreement.broadcast_from >= _world_size():
        raise ValueError(f"broadcast_from={agreement.broadcast_from} must be a rank of the world (< {_world_size()})")
    return budget


def _export(gm: "torch.fx.GraphModule", cost_model: Any, cluster: Cluster | None, solver: SolverOptions
            ) -> dict[str, Problem]:
    """The graph priced by every model the search judges under; empty for a graph without
    collectives whose metadata cannot be exported (nothing to schedule: never fail on it)."""
    try:
        return export_problems(gm, cost_models(cost_model, cluster, solver.bandwidth_scales), cluster,
                               merge_all_reduces=solver.merge_all_reduces)
    except DagError as e:
        if graph_has_collectives(gm):
            raise
        logger.info("graph has no collectives: left unchanged (not exported: %s)", e)
        return {}


def _solve_and_choose(gm: "torch.fx.GraphModule", problems: dict[str, Problem], budget: int | None, *,
                      cost_model: Any, cluster: Any, solver: SolverOptions, writeback: WriteBackOptions,
                      t0: float) -> _Answer:
    """Steps 3 and 4 of the module docstring on this rank: the schedule to install and its
    report (from the cache when it holds this solve)."""
    if not problems:
        return _Answer(None, _unchanged_report(None, budget=budget, requested=solver.solver_name,
                                               notes=["the graph has no collectives: left unchanged"]))
    problem = next(iter(problems.values()))
    if not problem.colls:
        _check_traced_fits(problem, budget)
        return _Answer(None, _unchanged_report(problem, budget=budget, requested=solver.solver_name,
                                               notes=["the graph has no collectives: left unchanged"]))
    graph_key = _graph_key(problems, solver, writeback)
    key = _cache_key(graph_key, budget)
    hit = _cached(problem, key, budget)
    if hit is not None:
        return hit
    # what was installed for this graph at a budget as small or smaller fits this one: a start,
    # so that more memory never gives a slower step
    smaller = tuple(s for b, s in _INSTALLED.get(graph_key, []) if budget is None or (b is not None and b <= budget))
    t_torch = time.perf_counter()
    torch_runs = _torch_starts(gm, problem, cluster, solver)
    torch_stage = [StageRecord(name="torch", wall_s=time.perf_counter() - t_torch)] if torch_runs else []
    result, notes = _solve(problems, budget, dataclasses.replace(solver, extra_starts=solver.extra_starts + smaller),
                           baselines=[(s.name, s.schedule) for s in torch_runs if s.schedule is not None])
    notes += _torch_notes(torch_runs)
    ranked = [(result.solver, result.schedule)] + [(f"{result.solver} [next start {i + 1}]", s)
                                                     for i, s in enumerate(result.alternatives)]
    t_choose = time.perf_counter()
    chosen, judged = choose(gm, problem, ranked, budget, cost_model=cost_model, cluster=cluster,
                            payload_order=writeback.payload_order, control_deps=writeback.control_deps)
    if chosen.name != ranked[0][0]:
        notes.append(f"the search's schedule did not hold the budget on its written graph; installed {chosen.name}")
    stages = torch_stage + list(result.stages) + [StageRecord(name="judge", wall_s=time.perf_counter() - t_choose,
                                                simulations=len(judged), step_ms=chosen.figures.step_ms)]
    sim = validate_schedule(problem, chosen.schedule)
    report = make_report(problem, simulate(problem.dag, problem.traced_schedule(), problem=problem), sim,
                         graph_name=str(problem.dag.graph.get("name", "graph")), mem_budget_bytes=budget, t0=t0,
                         solver=result.solver, requested=solver.solver_name, status=result.status.value,
                         best_bound=result.best_bound_ms, notes=notes, fell_back=result.status == SolveStatus.FALLBACK,
                         stages=tuple(stages))
    f = chosen.figures
    report = dataclasses.replace(
        report, criterion=_criterion(problems, solver), cost_models=list(problems), verified=True,
        chosen_candidate=chosen.name, reexported_step_ms=f.step_ms, reexported_peak_bytes=f.peak_bytes,
        liveness_peak_bytes=f.liveness_peak_bytes, tracker_peak_bytes=f.tracker_peak_bytes,
        verify_time_s=time.perf_counter() - t_choose, candidates=[c.summary() for c in judged],
        start=result.start, start_step_ms=dict(result.start_step_ms), search_step_ms=dict(result.step_ms_by_model),
        torch_starts=_torch_rows(problems, torch_runs))
    answer = _Answer(chosen.schedule, report)
    if key is not None:
        cache.store(key, answer.to_json())
    if graph_key is not None:
        _INSTALLED.setdefault(graph_key, []).append((budget, chosen.schedule))
        del _INSTALLED[graph_key][:-_INSTALLED_PER_GRAPH]
    return answer


def _solve(problems: dict[str, Problem], budget: int | None, solver: SolverOptions,
           baselines: Sequence[tuple[str, Schedule]] = ()) -> tuple[SolveResult, list[str]]:
    """The search (or the solver asked for), its hook applied, and the report's notes. A solver
    that fails falls back to the best start that fits (``solver.fallback``). ``baselines``:
    named starts that are baselines too (torch's pass read back)."""
    problem = next(iter(problems.values()))
    notes = _fixed_collective_notes(problem)
    try:
        result = solve_problems(problems, solver=solver.solver, mem_budget_bytes=budget,
                                time_limit_s=solver.time_limit_s, seed=solver.seed, num_workers=solver.num_workers,
                                extra_starts=solver.extra_starts, config=solver.search,
                                all_gather_stream=solver.all_gather_stream, baselines=baselines)
        validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
    except Exception as e:  # a failed solve must not fail training when a valid schedule exists
        # the plan's own refusal names the smallest peak of every start: nothing to fall back to.
        # A heuristic that cannot reach the budget is not a failure to hide but a question the
        # plan's starts answer (the traced order among them), whatever ``fallback`` says: a
        # budget the graph itself holds is never refused
        infeasible = isinstance(e, InfeasibleBudgetError)
        if (infeasible and solver.solver in BACKENDS) or (not solver.fallback and not infeasible):
            raise
        logger.warning("fsdp-sched: %s failed (%s: %s); falling back to the best start", solver.solver_name,
                       type(e).__name__, e)
        notes.append(f"{solver.solver_name} failed ({type(e).__name__}: {e}); fell back to the best start that fits")
        starts = search(problems, budget, backend=None, time_limit_s=1e-9, extra_starts=solver.extra_starts,
                        config=solver.search, all_gather_stream=solver.all_gather_stream, baselines=baselines)
        result = dataclasses.replace(starts, status=SolveStatus.FALLBACK, solver="fallback")
    notes += list(result.notes)
    if solver.schedule_hook is not None:
        new = solver.schedule_hook(problem, result.schedule)
        if new is not None and new.digest() != result.schedule.digest():
            sim = validate_schedule(problem, new, mem_budget_bytes=budget)
            result = dataclasses.replace(result, schedule=new, objective_ms=sim.step_ms, alternatives=())
            notes.append("schedule replaced by schedule_hook")
    return result, notes


def _torch_starts(gm: "torch.fx.GraphModule", problem: Problem, cluster: Cluster | None, solver: SolverOptions
                  ) -> list[TorchStart]:
    """torch's pass in each variant of ``solver.torch_starts``, read back over ``problem``; none
    for a solver that takes no starts (a heuristic, a callable)."""
    if not solver.torch_starts or not (isinstance(solver.solver, str) and solver.solver in BACKENDS):
        return []
    return torch_starts(gm, problem, solver.torch_starts, cluster=cluster)


def _torch_notes(runs: Sequence[TorchStart]) -> list[str]:
    """The report's notes on torch's starts: each skipped one and each repair, with its reason."""
    notes = []
    for run in runs:
        if run.skipped is not None:
            notes.append(f"{run.name} is no start: {run.skipped}")
        notes += [f"{run.name} read back: {repair}" for repair in run.repairs]
    return notes


def _torch_rows(problems: dict[str, Problem], runs: Sequence[TorchStart]) -> list[dict[str, Any]]:
    """The report's rows of torch's starts (:meth:`TorchStart.to_json`), each with its simulated
    step time under every cost model (ms) and its peak (bytes)."""
    rows = []
    evaluator = ModelEvaluator(problems) if any(r.schedule is not None for r in runs) else None
    for run in runs:
        row = run.to_json()
        if run.schedule is not None and evaluator is not None:
            sims = evaluator.evaluate(run.schedule)
            row["step_ms"] = {label: sims[label].step_ms for label in problems}
            row["peak_bytes"] = max(e.peak_bytes for e in sims.values())
        rows.append(row)
    return rows


def _criterion(problems: dict[str, Problem], solver: SolverOptions) -> str:
    labels = list(problems)
    if len(labels) == 1:
        return f"fastest under {labels[0]}"
    strict = [label for label in labels if label in solver.search.strict_models]
    first = f"no slower than the best baseline under {' and '.join(strict)}, then " if strict else ""
    return f"{first}least worst-case regret over {len(labels)} cost models ({', '.join(labels)})"


def _check_traced_fits(problem: Problem, budget: int | None) -> None:
    """A graph without collectives has one schedule: it must fit the budget too."""
    peak = simulate(problem.dag, problem.traced_schedule(), problem=problem).peak_bytes
    if budget is not None and peak > budget:
        raise InfeasibleBudgetError(
            f"the graph has no collectives to schedule and peaks at {fmt_bytes(peak)} ({peak} B), over mem_budget "
            f"{fmt_bytes(budget)} ({budget} B): raise mem_budget to at least {peak} B", budget_bytes=budget,
            min_peak_bytes=peak)


def _fixed_collective_notes(problem: Problem) -> list[str]:
    """A note naming the collectives left where traced (unmodelled types such as all_to_all,
    or ones pinned by a dependency on another collective)."""
    fixed = [c for c in problem.colls.values() if not c.movable]
    if not fixed:
        return []
    names = ", ".join(f"{c.name} ({c.coll_type})" for c in fixed[:5]) + (", ..." if len(fixed) > 5 else "")
    logger.info("fsdp-sched: %d collective(s) left in place, not scheduled: %s", len(fixed), names)
    return [f"{len(fixed)} collective(s) left in place, not scheduled (unmodelled or pinned): {names}"]


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------
def _graph_key(problems: dict[str, Problem], solver: SolverOptions, writeback: WriteBackOptions) -> str | None:
    """What decides the schedule besides the budget: the graph (its export under the primary
    cost model), the models judged, the options; None when the solve is not a function of data
    alone (a hook, a solver given as a callable)."""
    if solver.schedule_hook is not None or not isinstance(solver.solver, str):
        return None
    options = {"solver": solver.solver, "time_limit_s": solver.time_limit_s, "seed": solver.seed,
               "num_workers": solver.num_workers, "fallback": solver.fallback,
               "all_gather_stream": solver.all_gather_stream, "merge_all_reduces": solver.merge_all_reduces,
               "torch_starts": list(solver.torch_starts),
               "extra_starts": [s.digest() for s in solver.extra_starts], "search": dataclasses.asdict(solver.search),
               "payload_order": writeback.payload_order, "control_deps": writeback.control_deps,
               "cost_models": list(problems), "graph": cache.dag_fingerprint(next(iter(problems.values())).dag)}
    return cache.cache_key("", mem_budget_bytes=None, options=options)


def _cache_key(graph_key: str | None, budget: int | None) -> str | None:
    """The schedule cache's key of this solve (:mod:`scheduler.integrate.cache`), None when caching is off
    or the solve is not a function of data alone."""
    if cache.cache_dir() is None or graph_key is None:
        return None
    return cache.cache_key(graph_key, mem_budget_bytes=budget, options={})


#: graph key (:func:`_graph_key`) -> (budget, schedule) installed in this process, newest last
_INSTALLED: dict[str, list[tuple[int | None, Schedule]]] = {}
#: schedules kept per graph
_INSTALLED_PER_GRAPH = 8


def _cached(problem: Problem, key: str | None, budget: int | None) -> _Answer | None:
    """The cached answer under ``key``; None on a miss or on an entry that does not fit
    ``problem`` (ignored with a warning)."""
    t0 = time.perf_counter()
    entry = cache.load(key) if key is not None else None
    if entry is None:
        return None
    try:
        answer = _Answer.from_json(entry)
        if answer.schedule is not None:
            validate_schedule(problem, answer.schedule, mem_budget_bytes=budget)
    except (KeyError, TypeError, ValueError, ScheduleError) as e:
        logger.warning("fsdp-sched: schedule cache entry %s ignored: it does not fit this graph (%s: %s)", key[:16],
                       type(e).__name__, e)
        return None
    answer.report.cache_hit = True
    answer.report.stages = [StageRecord(name="cache", wall_s=time.perf_counter() - t0).to_json()]
    logger.info("fsdp-sched: schedule of %s taken from the cache (%s)", answer.report.graph_name, key[:16])
    return answer


# --------------------------------------------------------------------------------------------
# agreement and install
# --------------------------------------------------------------------------------------------
def _agree(group: Any, src: int, answer: _Answer | None, error: BaseException | None,
           problem: Problem | None) -> _Answer:
    """One answer on every rank of ``group`` (:func:`scheduler.integrate.consensus.agree_on_schedule`):
    this rank's, the source rank's, or the graph left as traced when any rank failed."""
    agreed = consensus.agree_on_schedule(answer, answer.report.to_json() if answer else None, error, group=group,
                                         src=src, decode=_Answer.from_json)
    if agreed.action == "raise":
        if error is not None:
            raise error
        raise ScheduleError(f"rank {src} failed to solve the schedule: {agreed.failures.get(src)}")
    if agreed.action == "skip":
        return _Answer(None, _unchanged_report(problem, budget=None, requested="-", notes=agreed.notes))
    chosen: _Answer = agreed.schedule
    chosen.report.notes += agreed.notes
    return chosen


def _install(gm: "torch.fx.GraphModule", problem: Problem | None, answer: _Answer, writeback: WriteBackOptions,
             group: Any) -> None:
    """Write ``answer`` into ``gm``'s own graph (an inductor pass must change the graph it was
    given); on a group, every rank restores its graph when any rank's write-back failed."""
    write = answer.schedule is not None and problem is not None and \
        answer.schedule.digest() != problem.traced_schedule().digest()
    backup = copy_graph(gm.graph) if write and group is not None else None
    error: BaseException | None = None
    try:
        if answer.schedule is not None and problem is None:
            raise ScheduleError("a schedule was agreed on but this rank's graph has no collectives to schedule; "
                                "every rank must trace the identical graph")
        if write:
            apply_schedule(gm, problem, answer.schedule, payload_order=writeback.payload_order,
                           control_deps=writeback.control_deps)
    except Exception as e:
        if group is None:
            raise
        error = e
        logger.warning("fsdp-sched: writing the schedule back failed on this rank (%s: %s)", type(e).__name__, e)
    if group is None:
        return
    failures = consensus.agree_on_outcome(error, group=group)
    if not failures:
        return
    if backup is not None:
        gm.graph = backup  # the graph as it was, on every rank (names and meta kept)
    rank = min(failures)
    note = (f"the schedule was not written back on any rank: writing it back failed on rank(s) {sorted(failures)} "
            f"(rank {rank}: {failures[rank]}); every rank keeps the graph as traced")
    logger.warning("fsdp-sched: %s", note)
    answer.schedule = None
    answer.report = _unchanged_report(problem, budget=answer.report.mem_budget_bytes, requested=answer.report.solver,
                                      notes=[note])


def _unchanged_report(problem: Problem | None, *, budget: int | None, requested: str, notes: list[str]
                      ) -> ScheduleReport:
    """The report of a graph left as traced."""
    if problem is not None:
        before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
        return make_report(problem, before, before, graph_name=str(problem.dag.graph.get("name", "graph")),
                           mem_budget_bytes=budget, t0=time.perf_counter(), solver="none", requested=requested,
                           status="unchanged", best_bound=None, notes=notes, fell_back=False)
    nan = float("nan")  # this rank could not even export its graph
    return ScheduleReport(graph_name="graph", solver="none", requested_solver=requested, status="unchanged",
                          solve_time_s=0.0, mem_budget_bytes=budget, step_ms_before=nan, step_ms_after=nan,
                          peak_bytes_before=0, peak_bytes_after=0, exposed_comm_ms_before=nan,
                          exposed_comm_ms_after=nan, n_collectives_before=0, n_collectives_after=0,
                          lower_bound_ms=nan, best_bound_ms=nan, gap=0.0, notes=list(notes))


def _is_options(value: Any, cls: type) -> bool:
    return isinstance(value, cls)


def _source_rank(group: Any, agreement: Any) -> int:
    """The group rank whose schedule wins: ``broadcast_from``'s, else 0 (a bad value falls back
    to 0 here: its check's error reaches every rank through the agreement)."""
    if group is None or not _is_options(agreement, AgreementOptions) or agreement.broadcast_from is None:
        return 0
    import torch.distributed as dist

    if not 0 <= agreement.broadcast_from < dist.get_world_size():
        return 0
    return dist.get_group_rank(group, agreement.broadcast_from)


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _compile_id() -> str | None:
    """torch's id of the compile in progress ("0/0"), None outside ``torch.compile``."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --------------------------------------------------------------------------------------------
# solve_dag (torch-free)
# --------------------------------------------------------------------------------------------
def solve_dag(dag: nx.DiGraph, mem_budget: int | str | None = None, *, solver: SolverOptions = SolverOptions()
              ) -> tuple[Schedule, ScheduleReport]:
    """Find and validate a schedule of a cost-annotated DAG (no torch graph needed: notebooks,
    the CLI). The DAG's own cost model decides.

    Returns:
        The validated schedule and its :class:`ScheduleReport`.

    Raises:
        TypeError, ValueError: a bad argument.
        InfeasibleBudgetError: no schedule found keeps peak memory under the budget.
        ScheduleError: the solver failed and ``solver.fallback`` is False.
    """
    if not isinstance(dag, nx.DiGraph):
        raise TypeError(f"dag={type(dag).__name__} must be a networkx DiGraph (scheduler.export_dag / load_dag)")
    if not isinstance(solver, SolverOptions):
        raise TypeError(f"solver={solver!r} must be a scheduler.SolverOptions")
    budget = parse_bytes(mem_budget)
    t0 = time.perf_counter()
    problem = Problem.from_dag(dag)
    before = simulate(problem.dag, problem.traced_schedule(), problem=problem)
    if not problem.colls:
        _check_traced_fits(problem, budget)
        return before.schedule, _unchanged_report(problem, budget=budget, requested=solver.solver_name,
                                                  notes=["the graph has no collectives: left unchanged"])
    label = str(dag.graph.get("cost_model", "model"))
    result, notes = _solve({label: problem}, budget, solver)
    sim = validate_schedule(problem, result.schedule, mem_budget_bytes=budget)
    report = make_report(problem, before, sim, graph_name=str(dag.graph.get("name", "graph")), mem_budget_bytes=budget,
                         t0=t0, solver=result.solver, requested=solver.solver_name, status=result.status.value,
                         best_bound=result.best_bound_ms, notes=notes,
                         fell_back=result.status == SolveStatus.FALLBACK, stages=result.stages)
    report.criterion = f"fastest under {label}"
    return result.schedule, report
