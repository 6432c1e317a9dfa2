"""The entry point: :func:`optimize_schedule` on an FX graph (:func:`scheduler.solving.solve_dag` on a saved DAG).

One :func:`optimize_schedule` call is a straight line:

1. **check** every argument (options are checked when built), alike on every rank; on a group
   of ranks, agree on the budget: every rank solves with the smallest of the ranks' budgets
   (:func:`scheduler.integrate.consensus.agree_on_budget`);
2. **export** the graph once and price it under the family of the cost model: what a given file
   measured is fixed, the rest priced by each plausible model (:func:`scheduler.costs.family.cost_models`;
   a model that fixes every component alone);
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

An answer this rank did not solve, a cache entry or the schedule another rank sent, is taken as
a fresh candidate of this graph (:func:`_given`): validated on this graph's problem, within this
rank's own budget and these options, written and judged, its report made on this graph; a cache
entry that does not hold is a miss with a warning, a received schedule that does not hold
keeps every rank's graph as traced.

The report (:class:`scheduler.report.ScheduleReport`) is stored at ``gm.meta[REPORT_KEY]``:
before and after, the written graph's figures, the candidates and the search's stages.

Failure policy: a budget that no schedule reaches raises
:class:`solvers.core.schedule.InfeasibleBudgetError` naming the smallest peak found (a budget
that large admits that schedule), unless the graph as traced holds it by the counts that judge
every candidate: then that graph is the answer, left unchanged with a note; a solver that fails is replaced by the best start that fits
(``SolverOptions.fallback``), reported as status ``"fallback"``; on a group of ranks, a failure
on some ranks leaves every rank's graph as traced, and a failure on all raises on all.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from scheduler.integrate import cache, consensus
from scheduler.check.written import Candidate, choose, write_and_judge, written_and_judged
from scheduler.costs.family import cost_models, merged_cost_sources
from scheduler.costs.pricing import export_problems
from scheduler.costs.hardware import Cluster, cluster_disagreement, graph_topology
from scheduler.costs.spec import resolve_cost_model
from scheduler.export.dag import DagError, graph_has_collectives
from scheduler.options import AgreementOptions, SolverOptions, WriteBackOptions
from scheduler.report import ScheduleReport, fixed_collective_notes, make_report, read_provenance, unchanged_report
from scheduler.orders import torch_notes, torch_rows, torch_starts_for
from scheduler.solving import check_traced_fits, criterion_of, search_in_orders
from scheduler.writeback import copy_graph, install_schedule, refill_graph
from solvers.core import (
    InfeasibleBudgetError,
    Problem,
    Schedule,
    ScheduleError,
    ScheduleInvalidError,
    SolveStatus,
    StageRecord,
    fmt_bytes,
    parse_bytes,
    simulate,
    validate_schedule,
)
from solvers.core.order import problem_of

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: key of the report in ``gm.meta``
REPORT_KEY = "fsdp_sched_report"
#: ``gm.meta`` key of the installed schedule: a start for another solve (``SolverOptions(extra_starts=...)``)
SCHEDULE_KEY = "fsdp_sched_schedule"
#: the digest every rank with a graph that has no collectives agrees on (nothing is written)
_NOTHING = hashlib.sha256(b"fsdp-sched: a graph without collectives").hexdigest()


@dataclasses.dataclass
class _Answer:
    """What one rank decided: the schedule to install (None: leave the graph as it is) and the
    report. ``digest`` is what the ranks compare."""

    schedule: Schedule | None
    report: ScheduleReport
    #: the written graph's figures and what they were judged on (``cache.judged_record``)
    judged: dict[str, Any] | None = None
    #: the copy of the graph ``schedule`` was written on and judged on, installed as it is
    #: (:func:`scheduler.writeback.install_schedule`); None: written at install
    written: "torch.fx.GraphModule | None" = None

    def digest(self) -> str:
        return self.schedule.digest() if self.schedule is not None else _NOTHING

    def to_json(self) -> dict[str, Any]:
        """What the cache stores and the source rank sends; read back by :func:`_given`, which
        keeps only the schedule, how it was found (:data:`scheduler.report.PROVENANCE_FIELDS`)
        and the judged figures where they are this graph's."""
        return {"schedule": self.schedule.to_json() if self.schedule is not None else None,
                "report": self.report.to_json(), **({"judged": self.judged} if self.judged is not None else {})}


# --------------------------------------------------------------------------------------------
# optimize_schedule
# --------------------------------------------------------------------------------------------
def _collect_only_what_the_pass_makes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the cyclic garbage collector kept to young objects for the call, its
    settings restored after:

    - older objects frozen (``gc.freeze``, then ``gc.unfreeze``): every full collection during
      a pass would scan again everything the process already holds (the model, its traced
      graphs: millions of objects), over and over. Left alone when something is frozen
      already, so that another owner's freeze is never undone;
    - no full collection (the oldest generation's threshold out of reach): what the pass
      itself makes (exports, problems under every cost model, copies of the graph) lives for
      the call, and a full collection scans it all again each time it grows by a quarter, so
      that on a large graph the collector's rescans cost a good part of the call. Young
      collections go on and free most of the pass's garbage; what outlives them waits for the
      first full collection after the call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        thresholds = gc.get_threshold()
        freeze = not gc.get_freeze_count()
        if freeze:
            gc.freeze()
        gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(*thresholds)
            if freeze:
                gc.unfreeze()

    return wrapper


#: a collection threshold no count reaches
_NEVER = 2**31 - 1


@_collect_only_what_the_pass_makes
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
        cost_model: None (default), a name or spec (:class:`scheduler.costs.spec.CostSpec`:
            ``"torch"``, ``"table:PATH"``, ``"compute:torch+table:PATH"``, ...), or a cost
            model object. The schedule has the least worst-case regret over the family of the
            spec (:mod:`scheduler.costs.family`): what a file measured is fixed in every member,
            a component the spec names no model for is priced by each plausible model (None:
            nothing is fixed). A spec that fixes every component, and an object, is one model
            that alone decides.
        cluster: the hardware (:class:`scheduler.Cluster`; default H100s, 8 per node). The
            world and each group's ranks are the graph's own (its process groups); a cluster
            whose ``n_gpus`` differs from the graph's world is used as given, with a warning
            and a note in the report (``n_gpus`` prices nothing).
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
    group = consensus.agreement_group(agreement.group) if isinstance(agreement, AgreementOptions) and \
        agreement.enabled else None
    src = 0
    answer: _Answer | None = None
    problem: Problem | None = None
    exported: dict[str, Any] | None = None
    error: BaseException | None = None
    mem_budget_bytes: int | None = None
    own_mem_budget_bytes: int | None = None
    notes: list[str] = []
    problems: Mapping[str, Problem] = {}
    try:
        mem_budget_bytes = own_mem_budget_bytes = check_arguments(
            gm, mem_budget, cost_model=cost_model, cluster=cluster, solver=solver, agreement=agreement,
            writeback=writeback)
        src = consensus.source_rank(group, agreement if isinstance(agreement, AgreementOptions) else None)
    except Exception as e:
        if group is None:
            raise
        error = e  # every rank must learn of it, or the others wait in the agreement forever
    if group is not None:
        # the first collective of the agreement: from here to the last, a failure on this rank
        # is told to every rank, never raised on this rank alone
        try:
            agreed = consensus.agree_on_budget(mem_budget_bytes, failed=error is not None, src=src, group=group)
            mem_budget_bytes, notes = agreed.mem_budget_bytes, agreed.notes
            if agreed.problem is not None and error is None:
                error = ValueError(agreed.problem)
        except Exception as e:
            error = error or e
    if error is None:
        try:
            t_export = time.perf_counter()
            problems = _export(gm, cost_model, cluster, solver)
            exported = StageRecord(name="export", wall_s=time.perf_counter() - t_export).to_json()
            problem = next(iter(problems.values())) if problems else None
            topology_note = cluster_disagreement(graph_topology(problem.dag), cluster) if problem is not None else None
            if topology_note is not None:
                logger.warning("fsdp-sched: %s", topology_note)
                notes = [*notes, topology_note]
            if group is None or agreement.broadcast_from is None or consensus.group_rank(group) == src:
                answer = _solve_and_choose(gm, problems, mem_budget_bytes, cost_model=cost_model, cluster=cluster,
                                           solver=solver, writeback=writeback, t0=t0)
                answer.report.notes += notes
        except Exception as e:
            if group is None:
                raise
            error = e
    if error is not None:
        logger.warning("fsdp-sched: the pass failed on this rank (%s: %s)", type(error).__name__, error)
    t_install = time.perf_counter()
    if group is None:
        assert answer is not None
        _install(gm, problem, answer, writeback)
    else:
        answer = _agree_and_install(gm, group, src, answer, error, problems, own_mem_budget_bytes,
                                    cost_model=cost_model, cluster=cluster, solver=solver, writeback=writeback, t0=t0)
    # what this call spent around the answer: a cache hit costs its export and its write-back
    answer.report.stages = [*([exported] if exported is not None else []), *answer.report.stages,
                            StageRecord(name="write-back", wall_s=time.perf_counter() - t_install).to_json()]
    answer.report.compile_id = current_compile_id()
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
    mem_budget_bytes = parse_bytes(mem_budget)
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r} must be a scheduler.Cluster or None")
    for name, value, cls in (("solver", solver, SolverOptions), ("agreement", agreement, AgreementOptions),
                             ("writeback", writeback, WriteBackOptions)):
        if not isinstance(value, cls):
            raise TypeError(f"{name}={value!r} must be a scheduler.{cls.__name__}")
    if cost_model is not None:
        resolve_cost_model(cost_model, cluster)  # raises ValueError naming a bad cost model
    if agreement.broadcast_from is not None and agreement.broadcast_from >= consensus.world_size():
        raise ValueError(f"broadcast_from={agreement.broadcast_from} must be a rank of the world "
                         f"(< {consensus.world_size()})")
    return mem_budget_bytes


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


def _solve_and_choose(gm: "torch.fx.GraphModule", problems: Mapping[str, Problem], mem_budget_bytes: int | None, *,
                      cost_model: Any, cluster: Any, solver: SolverOptions, writeback: WriteBackOptions,
                      t0: float) -> _Answer:
    """Steps 3 and 4 of the module docstring on this rank: the schedule to install and its
    report (from the cache when it holds this solve)."""
    if not problems:
        return _Answer(None, unchanged_report(None, mem_budget_bytes=mem_budget_bytes, requested=solver.solver_name,
                                               notes=["the graph has no collectives: left unchanged"]))
    problem = next(iter(problems.values()))
    if not problem.colls:
        check_traced_fits(problem, mem_budget_bytes)
        return _Answer(None, unchanged_report(problem, mem_budget_bytes=mem_budget_bytes, requested=solver.solver_name,
                                               notes=["the graph has no collectives: left unchanged"]))
    graph_key = cache.graph_key(problems, solver, writeback)
    key = cache.entry_key(graph_key, mem_budget_bytes)
    hit = _cached(gm, problems, key, graph_key, mem_budget_bytes, cost_model=cost_model, cluster=cluster, solver=solver,
                  writeback=writeback)
    if hit is not None:
        return hit
    t_torch = time.perf_counter()
    torch_runs = torch_starts_for(gm, problem, cluster, solver)
    torch_stage = [StageRecord(name="torch", wall_s=time.perf_counter() - t_torch)] if torch_runs else []
    try:
        (_, base, _, result), notes, other_stages = search_in_orders(problems, mem_budget_bytes, solver, torch_runs)
        notes += torch_notes(torch_runs)
        torch_stage += other_stages
        ranked = [(result.solver, result.schedule)] + [(f"{result.solver} [next start {i + 1}]", s)
                                                         for i, s in enumerate(result.alternatives)]
        t_choose = time.perf_counter()
        chosen, judged = choose(gm, next(iter(base.values())), ranked, mem_budget_bytes, cost_model=cost_model,
                                cluster=cluster, payload_order=writeback.payload_order,
                                control_deps=writeback.control_deps)
    except InfeasibleBudgetError as e:
        return _traced_answer(gm, problems, mem_budget_bytes, e, cost_model=cost_model, cluster=cluster, solver=solver,
                              writeback=writeback, t0=t0)
    if chosen.name != ranked[0][0]:
        notes.append(f"the search's schedule did not hold the budget on its written graph; installed {chosen.name}")
    stages = torch_stage + list(result.stages) + [StageRecord(name="judge", wall_s=time.perf_counter() - t_choose,
                                                evaluations=len(judged), step_ms=chosen.figures.step_ms)]
    report = _report(problems, chosen, judged, mem_budget_bytes, solver=solver, found_by=result.solver,
                     status=result.status.value, best_bound=result.best_bound_ms, notes=notes,
                     fell_back=result.status == SolveStatus.FALLBACK, stages=stages, t0=t0, t_judge=t_choose,
                     cost_model=cost_model)
    report = dataclasses.replace(report, start=result.start, start_step_ms=dict(result.start_step_ms),
                                 search_step_ms=dict(result.step_ms_by_model),
                                 torch_starts=torch_rows(problems, torch_runs))
    answer = _Answer(chosen.schedule, report, judged=cache.judged_record(graph_key, chosen), written=chosen.written)
    if key is not None:
        cache.store(key, answer.to_json())
    return answer


def _traced_answer(gm: "torch.fx.GraphModule", problems: Mapping[str, Problem], mem_budget_bytes: int | None,
                   refusal: InfeasibleBudgetError, *, cost_model: Any, cluster: Any, solver: SolverOptions,
                   writeback: WriteBackOptions, t0: float) -> _Answer:
    """The graph as traced, when no schedule was found within ``mem_budget_bytes`` but the traced graph
    holds it by the counts that judge every candidate (:attr:`Figures.max_peak_bytes` of the
    graph itself): a budget the graph itself holds is never refused, whatever count the search
    or a written copy disagreed by. Else ``refusal`` is raised again."""
    problem = next(iter(problems.values()))
    t_judge = time.perf_counter()
    traced = Candidate(name="traced", schedule=problem.traced_schedule())
    try:
        traced.figures = write_and_judge(gm, problem, traced.schedule, cost_model=cost_model, cluster=cluster,
                                         payload_order=writeback.payload_order, control_deps=writeback.control_deps)
    except (ScheduleError, ValueError, RuntimeError) as e:  # its peak unknown: the refusal stands
        raise refusal from e
    if mem_budget_bytes is not None and traced.figures.max_peak_bytes > mem_budget_bytes:
        raise refusal
    note = (f"no rewritten schedule was found within the budget ({refusal}); the graph as traced holds it (peak "
            f"{fmt_bytes(traced.figures.max_peak_bytes)} by {traced.figures.decided_by}) and is left unchanged")
    logger.warning("fsdp-sched: %s", note)
    stages = [StageRecord(name="judge", wall_s=time.perf_counter() - t_judge, evaluations=1,
                          step_ms=traced.figures.step_ms)]
    report = _report(problems, traced, [traced], mem_budget_bytes, solver=solver, found_by="traced",
                     status=SolveStatus.FALLBACK.value, best_bound=None, notes=[*fixed_collective_notes(problem), note],
                     fell_back=True, stages=stages, t0=t0, t_judge=t_judge, cost_model=cost_model)
    return _Answer(traced.schedule, report)


def _report(problems: Mapping[str, Problem], chosen: Candidate, judged: list[Candidate],
            mem_budget_bytes: int | None, *, solver: SolverOptions, found_by: str, status: str,
            best_bound: float | None, notes: list[str], fell_back: bool, stages: list[StageRecord], t0: float,
            t_judge: float, criterion: str | None = None, cost_model: Any = None) -> ScheduleReport:
    """The report of ``chosen`` (judged on its written graph) on this graph: every figure
    computed here, from the schedule on this graph's problem and from its written graph."""
    problem = next(iter(problems.values()))
    own = problem_of(problem, chosen.schedule)
    sim = validate_schedule(own, chosen.schedule)
    report = make_report(own, simulate(problem.dag, problem.traced_schedule(), problem=problem), sim,
                         graph_name=str(problem.dag.graph.get("name", "graph")),
                         mem_budget_bytes=mem_budget_bytes, t0=t0, solver=found_by, requested=solver.solver_name,
                         status=status, best_bound=best_bound, notes=notes, fell_back=fell_back, stages=tuple(stages))
    f = chosen.figures
    return dataclasses.replace(
        report, criterion=criterion if criterion is not None else criterion_of(problems, solver, cost_model),
        cost_models=list(problems), cost_sources=merged_cost_sources({label: problems[label].dag for label in problems}),
        compute_order="traced" if own is problem else "torch",
        verified=True, chosen_candidate=chosen.name, reexported_step_ms=f.step_ms,
        reexported_peak_bytes=f.peak_bytes, liveness_peak_bytes=f.liveness_peak_bytes,
        tracker_peak_bytes=f.tracker_peak_bytes, verify_time_s=time.perf_counter() - t_judge,
        candidates=[c.summary() for c in judged])


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------
def _cached(gm: "torch.fx.GraphModule", problems: Mapping[str, Problem], key: str | None, graph_key: str | None,
            mem_budget_bytes: int | None, *, cost_model: Any, cluster: Any, solver: SolverOptions,
            writeback: WriteBackOptions) -> _Answer | None:
    """The cached answer under ``key``, checked on this graph like a fresh candidate
    (:func:`_given`, its written graph's figures read from the entry where they were judged on
    this graph, ``graph_key``); None on a miss, and with a warning naming the entry when it cannot
    be read or does not hold on this graph, budget and options. Never raises: an entry is data
    from disk, perhaps stale, edited by hand or of another graph."""
    t0 = time.perf_counter()
    entry = cache.load(key) if key is not None else None
    if entry is None:
        return None
    try:
        answer = _given(gm, problems, entry, mem_budget_bytes, cost_model=cost_model, cluster=cluster, solver=solver,
                        writeback=writeback, source=f"schedule cache entry {key[:16]}", t0=t0, graph_key=graph_key)
    except Exception as e:  # a bad entry is a miss: the graph is solved and the entry overwritten
        logger.warning("fsdp-sched: schedule cache entry %s ignored: it does not hold on this graph (%s: %s)",
                       cache.entry_path(key), type(e).__name__, e)
        return None
    answer.report.cache_hit = True
    answer.report.stages = [StageRecord(name="cache", wall_s=time.perf_counter() - t0).to_json()]
    logger.info("fsdp-sched: schedule of %s taken from the cache (%s)", answer.report.graph_name, key[:16])
    return answer


def _given(gm: "torch.fx.GraphModule", problems: Mapping[str, Problem], data: Any, mem_budget_bytes: int | None, *,
           cost_model: Any, cluster: Any, solver: SolverOptions, writeback: WriteBackOptions, source: str,
           t0: float, graph_key: str | None = None) -> _Answer:
    """An answer this rank did not solve (a cache entry, another rank's: :meth:`_Answer.to_json`)
    taken as a fresh candidate of this graph: its schedule validated on this graph's problem
    within ``mem_budget_bytes`` and these options, written on a copy and judged there, and its report made
    here from those figures. Only how the schedule was found
    (:data:`scheduler.report.PROVENANCE_FIELDS`, each checked) is kept from the stored report.

    The written graph's figures are a function of the graph, the schedule, the options and the
    code: an answer that records them for this very graph (``graph_key``, :func:`scheduler.integrate.cache.graph_key`:
    the DAG's fingerprint, the options and the versions, the library's source included) and this
    schedule, sealed (:func:`_recorded_figures`), is not written and judged again; they are held
    against ``mem_budget_bytes`` all the same. Any other answer (no key given: another rank's; a record of
    another graph or schedule, or one edited) is written and judged here.

    Raises:
        ValueError, ScheduleError (and whatever a bad ``data`` makes fail): the answer does not
        hold on this graph; the message says why.
    """
    problem = next(iter(problems.values()), None)
    if not isinstance(data, dict):
        raise ValueError(f"{source} is {type(data).__name__}, not a JSON object with 'schedule' and 'report'")
    said = read_provenance(data.get("report"))
    raw = data.get("schedule")
    if problem is None or not problem.colls:
        if raw is not None:
            raise ScheduleError(f"{source} holds a schedule, and this rank's graph has no collectives to schedule; "
                                "every rank must trace the identical graph")
        return _Answer(None, unchanged_report(problem, mem_budget_bytes=mem_budget_bytes,
                                               requested=said["requested_solver"], notes=said["notes"]))
    if raw is None:
        raise ScheduleError(f"{source} holds no schedule, and this graph has {len(problem.colls)} collectives to "
                            "schedule")
    schedule = Schedule.from_json(raw)
    if schedule.split_groups and solver.all_gather_stream == "shared":
        raise ScheduleError(f"{source} puts the all-gathers of group(s) {list(schedule.split_groups)} on a second "
                            "process group, and all_gather_stream='shared' keeps every collective on its own group")
    try:
        own = problem_of(problem, schedule)
        validate_schedule(own, schedule, mem_budget_bytes=mem_budget_bytes)
    except ScheduleInvalidError as e:
        raise ScheduleInvalidError(f"{source} does not hold on this graph: {e}") from None
    except ScheduleError as e:  # its order of the graph's nodes is not one the graph can run
        raise ScheduleInvalidError(f"{source} does not hold on this graph: {e}") from None
    t_judge = time.perf_counter()
    chosen = Candidate(name=said["chosen_candidate"] or said["solver"], schedule=schedule)
    chosen.figures = cache.recorded_figures(data.get("judged"), graph_key, schedule)
    notes = list(said["notes"])
    if chosen.figures is None:
        chosen.figures, chosen.written = written_and_judged(gm, own, schedule, cost_model=cost_model, cluster=cluster,
                                                            payload_order=writeback.payload_order,
                                                            control_deps=writeback.control_deps)
    else:
        notes.append(f"the written graph's figures are those of {source}, judged on this graph when it was stored")
    if mem_budget_bytes is not None and chosen.figures.max_peak_bytes > mem_budget_bytes:
        raise ScheduleError(f"{source}: its written graph peaks at {fmt_bytes(chosen.figures.max_peak_bytes)} "
                            f"({chosen.figures.max_peak_bytes} B) by {chosen.figures.decided_by}, over the budget "
                            f"{fmt_bytes(mem_budget_bytes)} ({mem_budget_bytes} B)")
    stages = [StageRecord(name="judge", wall_s=time.perf_counter() - t_judge, evaluations=1,
                          step_ms=chosen.figures.step_ms)]
    report = _report(problems, chosen, [chosen], mem_budget_bytes, solver=solver, found_by=said["solver"],
                     status=said["status"], best_bound=said["best_bound_ms"], notes=notes,
                     fell_back=said["fell_back"], stages=stages, t0=t0, t_judge=t_judge, criterion=said["criterion"])
    report.requested_solver = said["requested_solver"]
    return _Answer(schedule, report, written=chosen.written)


# --------------------------------------------------------------------------------------------
# agreement and install
# --------------------------------------------------------------------------------------------
def _agree_and_install(gm: "torch.fx.GraphModule", group: Any, src: int, answer: _Answer | None,
                       error: BaseException | None, problems: Mapping[str, Problem],
                       own_mem_budget_bytes: int | None, *, cost_model: Any, cluster: Any, solver: Any,
                       writeback: Any, t0: float) -> _Answer:
    """Rounds 1 and 2 of :mod:`scheduler.integrate.consensus` around the write-back: one
    answer on every rank of ``group`` (this rank's, or the source rank's checked on this graph
    within this rank's own budget ``own_mem_budget_bytes``), written back on every rank, or on none.

    Everything between the two rounds runs under one guard: a failure on this rank (decoding or
    checking the received answer, writing back) is told to every rank in round 2, and every
    rank keeps its graph as traced."""
    problem = next(iter(problems.values()), None)
    agreed = consensus.agree_on_schedule(answer, error, group=group, src=src)
    if agreed.action == "raise":  # every rank failed: each raises, none waits
        if error is not None:
            raise error
        raise ScheduleError(f"rank {src} failed to solve the schedule: {agreed.failures.get(src)}")
    backup = None
    failure: BaseException | None = agreed.error
    chosen: _Answer | None = None
    try:
        if failure is not None:
            raise failure
        if agreed.action == "skip":
            chosen = _Answer(None, unchanged_report(problem, mem_budget_bytes=own_mem_budget_bytes, requested="-",
                                                    notes=agreed.notes))
        else:
            if agreed.adopted_from is None:
                chosen = agreed.schedule
            else:
                chosen = _given(gm, problems, json.loads(agreed.received), own_mem_budget_bytes, cost_model=cost_model,
                                cluster=cluster, solver=solver, writeback=writeback,
                                source=f"the schedule of rank {agreed.adopted_from}", t0=t0)
            chosen.report.notes += agreed.notes
            if _writes(problem, chosen):
                backup = copy_graph(gm.graph)
                install_schedule(gm, problem_of(problem, chosen.schedule), chosen.schedule, written=chosen.written,
                                 payload_order=writeback.payload_order, control_deps=writeback.control_deps)
    except Exception as e:
        failure = e
        logger.warning("fsdp-sched: taking or writing back the agreed schedule failed on this rank (%s: %s)",
                       type(e).__name__, e)
    failures = consensus.agree_on_outcome(failure, group=group)
    if not failures:
        assert chosen is not None
        return chosen
    if backup is not None:  # the graph as it was, on every rank (names and meta kept)
        refill_graph(gm.graph, backup)
        gm.recompile()
    rank = min(failures)
    note = (f"the schedule was not written back on any rank: taking or writing it back failed on rank(s) "
            f"{sorted(failures)} (rank {rank}: {failures[rank]}); every rank keeps the graph as traced")
    logger.warning("fsdp-sched: %s", note)
    requested = solver.solver_name if isinstance(solver, SolverOptions) else "-"
    try:
        return _Answer(None, unchanged_report(problem, mem_budget_bytes=own_mem_budget_bytes, requested=requested,
                                              notes=[note]))
    except Exception:  # after the last round: this rank must return as the others do
        return _Answer(None, unchanged_report(None, mem_budget_bytes=own_mem_budget_bytes, requested=requested,
                                              notes=[note]))


def _install(gm: "torch.fx.GraphModule", problem: Problem | None, answer: _Answer, writeback: WriteBackOptions
             ) -> None:
    """Write ``answer`` into ``gm``'s own graph (an inductor pass must change the graph it was
    given), without a process group to agree with."""
    if _writes(problem, answer):
        install_schedule(gm, problem_of(problem, answer.schedule), answer.schedule, written=answer.written,
                         payload_order=writeback.payload_order, control_deps=writeback.control_deps)


def _writes(problem: Problem | None, answer: _Answer) -> bool:
    """Whether installing ``answer`` changes the graph.

    Raises:
        ScheduleError: a schedule for a graph without collectives (the ranks traced different
            graphs).
    """
    if answer.schedule is None:
        return False
    if problem is None:
        raise ScheduleError("a schedule was agreed on but this rank's graph has no collectives to schedule; "
                            "every rank must trace the identical graph")
    return answer.schedule.digest() != problem.traced_schedule().digest()


def current_compile_id() -> str | None:
    """torch's id of the compile in progress ("0/0"), None outside ``torch.compile``."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)
