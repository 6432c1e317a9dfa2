"""The baselines and the product as candidates judged on their rewritten graphs, and the
robust choice among them.

What is written back is what counts (issue 13). Judging is :mod:`scheduler.verify`'s, the one
way to judge a rewritten graph: a :class:`scheduler.verify.Candidate` is written back on a copy
(:func:`scheduler.verify.rewrite`) and its :class:`scheduler.verify.Figures` taken by
:func:`scheduler.verify.judge_graph` (re-exported step time under every cost model given, and
the re-export, liveness and torch tracker peaks; a budget must hold all three). This module
adds the candidates :func:`scheduler.optimize_schedule` does not make for itself, for
comparisons (:mod:`scheduler.equal_memory`, ``benchmarks/cross_model.py``):

- :func:`judge_baselines`: each baseline as a candidate, judged: the graph as traced, a
  heuristic of :data:`solvers.heuristics.HEURISTICS` written back, or torch's overlap
  scheduler (:data:`TORCH_BASELINE`, one of :data:`scheduler.verify.TORCH_CANDIDATES`);
- :func:`product_candidate`: a copy rewritten by :func:`scheduler.optimize_schedule`, judged;
- :func:`solver_candidates`: the schedules its solver returned, where another was installed;
- :func:`robust_schedule`: the candidate best in the worst case across cost models
  (:func:`scheduler.robust.choice_key`), among fsdp-sched solved under each base model and the
  baselines, chosen by :func:`scheduler.verify.choose`.

Merging buckets needs an initialised process group in which the graph's groups resolve (a fake
one is enough, e.g. ``models.capture.fake_process_group``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.api import SCHEDULE_KEY, SOLVED_KEY, optimize_schedule
from scheduler.costs import Cluster
from scheduler.dag import export_dag
from scheduler.robust import (
    BASE_COST_MODELS,
    ROBUST,
    blends,
    choice_key,
    cost_model_family,
    minimax_config,
    worst_regret,
)
from scheduler.verify import (
    TORCH_CANDIDATES,
    Candidate,
    choose,
    judge_candidates,
    judge_graph,
    minimax_candidates,
    none_fits_error,
    rewrite,
    schedule_candidate,
)
from solvers.core import InfeasibleBudgetError, Problem, ScheduleError, parse_bytes
from solvers.heuristics import HEURISTICS
from solvers.minimax import MinimaxConfig
from solvers.registry import solve

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: torch's overlap scheduler (with its FSDP pre-bucketing) as a baseline: the name of its
#: candidate in :data:`scheduler.verify.TORCH_CANDIDATES`
TORCH_BASELINE = "torch-overlap"
#: baselines :func:`robust_schedule` considers besides its own solves
ROBUST_BASELINES = ("fsdp2", "simplefsdp", "autoparallel", "traced", TORCH_BASELINE)
#: name of :func:`robust_schedule`'s candidate polished on the worst case
MINIMAX = "fsdp-sched[minimax]"


def baseline_candidate(problem: Problem, name: str) -> Candidate:
    """Baseline ``name`` as a candidate over ``problem``: a heuristic of
    :data:`solvers.heuristics.HEURISTICS` (``"traced"``, ``"fsdp2"``, ``"simplefsdp"``,
    ``"autoparallel"``; solved without a budget: they do not read costs) or one of torch's
    (:data:`scheduler.verify.TORCH_CANDIDATES`, rewritten by torch's pass).

    Raises:
        ValueError: an unknown name.
    """
    if name in TORCH_CANDIDATES:
        return Candidate(name=name)
    if name not in HEURISTICS:
        raise ValueError(f"unknown baseline {name!r}; choose one of {sorted(HEURISTICS) + sorted(TORCH_CANDIDATES)}")
    return Candidate(name=name, schedule=solve(problem, solver=name).schedule)


def rewrite_baseline(gm: "torch.fx.GraphModule", name: str, *, cluster: Any = None) -> "torch.fx.GraphModule":
    """A copy of ``gm`` rewritten by baseline ``name`` (:func:`baseline_candidate`; ``gm`` is
    not modified).

    Raises:
        ValueError: an unknown name.
        scheduler.baselines.TorchBaselineError: torch's pass failed on this graph.
    """
    problem = Problem.from_dag(export_dag(gm, cluster=cluster))
    out = rewrite(gm, problem, baseline_candidate(problem, name), cluster=cluster)
    return copy.deepcopy(gm) if out is gm else out


def judge_baselines(gm: "torch.fx.GraphModule", names: Sequence[str], cost_models: Mapping[str, Any], *,
                    cluster: Any = None, keep_graphs: bool = False) -> list[Candidate]:
    """Each baseline of ``names`` written back on a copy of ``gm`` and judged under every model
    of ``cost_models`` (label -> a cost model or its name; the first is the primary). One that
    cannot be made (torch's pass fails on some graphs) keeps the reason in ``error``. The
    rewritten copies are kept on ``graph`` only if asked."""
    label, model, others = _primary(cost_models)
    problem = Problem.from_dag(export_dag(gm, cost_model=model, cluster=cluster))
    candidates = []
    for name in names:
        try:
            candidates.append(baseline_candidate(problem, name))
        except (ValueError, ScheduleError) as e:
            candidates.append(Candidate(name=name, error=f"{type(e).__name__}: {e}"))
    todo = [c for c in candidates if c.error is None]
    logger.info("judging baselines %s under %d cost models", [c.name for c in todo], len(cost_models))
    judge_candidates(gm, problem, todo, cost_model=model, cluster=cluster, other_cost_models=others, label=label)
    if not keep_graphs:
        for c in candidates:
            c.graph = None
    return candidates


def product_candidate(gm: "torch.fx.GraphModule", mem_budget_bytes: int | None, cost_models: Mapping[str, Any], *,
                      solve_under: str | None = None, cluster: Any = None, time_limit_s: float = 15.0,
                      name: str = "fsdp-sched", solve_model: Any = None, **options: Any) -> Candidate:
    """fsdp-sched's candidate: :func:`scheduler.optimize_schedule` on a copy of ``gm`` at
    ``mem_budget_bytes`` under ``cost_models[solve_under]`` (default: the first) or under
    ``solve_model`` when given (a model that only solves, such as a
    :class:`scheduler.costs.BlendCostModel`), one rank's view (no agreement); ``options`` are
    further keywords of ``optimize_schedule``. The rewritten copy (``graph``, its report at
    ``meta["fsdp_sched_report"]``) is judged under every model of ``cost_models``; when no
    schedule fits, the candidate keeps the reason in ``error``."""
    label, model, others = _primary(cost_models, solve_under)
    logger.info("%s: solving under %s (limit %g s)", name, getattr(solve_model, "name", label), time_limit_s)
    try:
        out = optimize_schedule(copy.deepcopy(gm), mem_budget_bytes, cost_model=solve_model or model,
                                cluster=cluster, time_limit_s=time_limit_s, agree=False, **options)
    except (InfeasibleBudgetError, ScheduleError) as e:
        return Candidate(name=name, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    figures = judge_graph(out, model, cluster, other_cost_models=others, label=label)
    return Candidate(name=name, schedule=out.meta.get(SCHEDULE_KEY), graph=out, figures=figures)


def solver_candidates(gm: "torch.fx.GraphModule", problem: Problem, products: Sequence[Candidate],
                      cost_models: Mapping[str, Any], *, cluster: Any = None) -> list[tuple[Candidate, Candidate]]:
    """The schedules each product candidate's solver returned itself (``SOLVED_KEY`` of its
    rewritten graph: the result, then the one before the solver's final polish) that no
    candidate of ``products`` has, as candidates over ``problem`` named ``"<product>:solved"``
    and ``"<product>:unpolished"``, judged under every model of ``cost_models``: (product, its
    new candidate) pairs.

    Verification installs the fastest written graph under the model solved under, which can
    be a polished neighbour of the solver's schedule: better under that model, a worse start
    for the polish on the worst case. On llama3-8b's 8-layer backward at the FSDP2-like peak
    the polish across the family reaches 1.1 % worst regret from the analytic solver's own
    schedule and 3.4 % from the graph verification installed (BENCHMARKS.md section 10)."""
    known = {c.digest() for c in products if c.schedule is not None}
    out: list[tuple[Candidate, Candidate]] = []
    for c in products:
        solved = c.graph.meta.get(SOLVED_KEY, ()) if c.graph is not None else ()
        for suffix, schedule in zip(("solved", "unpolished"), solved):
            if schedule.digest() not in known:  # before simulating it for the prediction
                known.add(schedule.digest())
                out.append((c, schedule_candidate(problem, f"{c.name}:{suffix}", schedule)))
    if out:
        label, model, others = _primary(cost_models)
        logger.info("judging the solvers' own schedules %s", [own.name for _, own in out])
        judge_candidates(gm, problem, [own for _, own in out], cost_model=model, cluster=cluster,
                         other_cost_models=others, label=label)
    return out


def _primary(cost_models: Mapping[str, Any], label: str | None = None) -> tuple[str, Any, dict[str, Any]]:
    """(label, model) of the primary cost model (``label``, default the first) and the others."""
    if not cost_models:
        raise ValueError("judging needs at least one cost model")
    label = label or next(iter(cost_models))
    if label not in cost_models:
        raise ValueError(f"cost model {label!r} is not one of {list(cost_models)}")
    return label, cost_models[label], {k: v for k, v in cost_models.items() if k != label}


# --------------------------------------------------------------------------------------------
# the robust choice on an FX graph
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class RobustResult:
    """What :func:`robust_schedule` found: the choice, and every candidate as judged."""

    #: name of the chosen candidate
    chosen: str
    #: the chosen rewritten graph (a copy: the input graph is not modified)
    gm: Any = dataclasses.field(repr=False)
    mem_budget_bytes: int | None
    #: name -> every candidate that could be written back, judged under every model of the family
    judged: dict[str, Candidate]
    #: candidates that were not made, or are over the budget, and why
    dropped: dict[str, str]
    #: names of the candidates solved by fsdp-sched, by the label of the model solved under
    #: (``"minimax"`` for :data:`MINIMAX`, polished under the whole family)
    solved_under: dict[str, str]
    time_s: float = 0.0

    @property
    def fitting(self) -> list[str]:
        return sorted(n for n in self.judged if n not in self.dropped)

    def step_ms_by_model(self) -> dict[str, dict[str, float]]:
        """Model label -> fitting candidate -> re-exported step time (ms)."""
        labels = next(iter(self.judged.values())).figures.step_ms
        return {label: {n: self.judged[n].figures.step_ms[label] for n in self.fitting} for label in labels}

    def worst_regret(self) -> dict[str, float]:
        return worst_regret(self.step_ms_by_model())

    def table(self) -> str:
        """Step time (ms) of every fitting candidate under every model, its worst regret."""
        times = self.step_ms_by_model()
        worst = self.worst_regret()
        width = max([24] + [len(n) + 2 for n in self.fitting])
        head = f"{'candidate':<{width}}" + "".join(f"{label:>16}" for label in times) + f"{'worst regret':>14}"
        lines = [head, "-" * len(head)]
        for n in self.fitting:
            mark = " <- robust" if n == self.chosen else ""
            lines.append(f"{n:<{width}}" + "".join(f"{times[label][n]:16.2f}" for label in times)
                         + f"{worst[n]:14.2%}{mark}")
        return "\n".join(lines)


def robust_schedule(
    gm: "torch.fx.GraphModule",
    mem_budget: int | str | None = None,
    *,
    cluster: Cluster | None = None,
    cost_models: Mapping[str, Any] | None = None,
    solve_under: Sequence[str] = BASE_COST_MODELS,
    baselines: Sequence[str] = ROBUST_BASELINES,
    time_limit_s: float = 15.0,
    blend: bool = True,
    minimax: bool | MinimaxConfig = True,
) -> RobustResult:
    """The schedule of ``gm`` that is best in the worst case across cost models.

    Candidates: :func:`product_candidate` at ``mem_budget`` under each model of ``solve_under``
    (labels of the family), with ``blend`` and two or more of them also under blends of them
    (:func:`blends`, :class:`scheduler.costs.BlendCostModel`: where the models prefer different
    schedules, a compromise can be within a few percent of both), and each
    baseline of ``baselines`` (:func:`judge_baselines`), each
    on its own copy of ``gm``, and the solvers' own schedules where verification installed
    another (:func:`solver_candidates`), judged under every model of ``cost_models`` (default
    :func:`scheduler.robust.cost_model_family` of ``cluster``); with ``minimax`` (default: on;
    a :class:`solvers.minimax.MinimaxConfig` sets its limits, else ``ROBUST.minimax_work_solves`` times
    ``time_limit_s`` of work),
    the best of them by the criterion (``ROBUST.minimax_starts``) polished on the worst case across
    those models as well
    (:func:`scheduler.verify.minimax_candidates`, named :data:`MINIMAX`); those whose re-export, liveness
    and torch tracker peaks are all within the budget compete, and
    :func:`scheduler.robust.choice_key` chooses. ``gm`` itself is not modified: the result holds
    the chosen rewritten copy. For one solve judged under the family, see
    ``optimize_schedule(robust=True)``. Needs an initialised process group in which the graph's
    groups resolve (a fake one is enough).

    Args:
        mem_budget: bytes or a string like ``"40GiB"``; None: no limit.
        time_limit_s: time limit of each solve (default 15 s).

    Raises:
        InfeasibleBudgetError: no candidate's rewritten graph fits the budget (states the
            smallest peak).
    """
    t0 = time.perf_counter()
    budget = parse_bytes(mem_budget)
    family = dict(cost_models) if cost_models is not None else cost_model_family(cluster)
    unknown = [label for label in solve_under if label not in family]
    if unknown:
        raise ValueError(f"solve_under {unknown} are not models of the family {list(family)}")
    solved_under = {f"fsdp-sched[{label}]": label for label in solve_under}
    candidates = [product_candidate(gm, budget, family, solve_under=label, cluster=cluster, time_limit_s=time_limit_s,
                                    name=name) for name, label in solved_under.items()]
    # the single-model solves' schedules: starts of the blends' solves (a compromise often lies
    # next to one of them, which a blend's own starts do not reach)
    starts = tuple(s for c in candidates if c.graph is not None and (s := c.graph.meta.get(SCHEDULE_KEY)) is not None)
    for label, mix in (blends(family, solve_under) if blend else {}).items():
        # compromises between the models solved under, judged like the others
        name = f"fsdp-sched[{label}]"
        candidates.append(product_candidate(gm, budget, family, cluster=cluster, time_limit_s=time_limit_s,
                                            name=name, solve_model=mix, extra_starts=starts))
        solved_under[name] = label
    candidates += judge_baselines(gm, baselines, family, cluster=cluster, keep_graphs=True)
    primary = next(iter(family))
    problem = Problem.from_dag(export_dag(gm, cost_model=family[primary], cluster=cluster))
    for product, own in solver_candidates(gm, problem, candidates, family, cluster=cluster):
        candidates.append(own)
        solved_under[own.name] = solved_under[product.name]
    if minimax:
        # the best so far polished on the worst case across the family itself
        config = (minimax if isinstance(minimax, MinimaxConfig)
                  else minimax_config(ROBUST.minimax_work_solves * time_limit_s, problem))
        for polished in minimax_candidates(gm, problem, candidates, budget, family, cluster=cluster,
                                           name=MINIMAX, config=config, starts=ROBUST.minimax_starts):
            candidates.append(polished)
            solved_under[polished.name] = "minimax"
    best, reasons = choose(candidates, budget, choice_key(candidates, budget))
    if best is None:
        raise none_fits_error(candidates, budget)
    fitting = {c.name for c in candidates if c.figures is not None and
               (budget is None or c.figures.max_peak_bytes <= budget)}
    result = RobustResult(chosen=best.name, gm=best.graph if best.graph is not gm else copy.deepcopy(gm),
                          mem_budget_bytes=budget, judged={c.name: c for c in candidates if c.figures is not None},
                          dropped={c.name: reasons[c.name].removeprefix("dropped: ") for c in candidates
                                   if c.name not in fitting},
                          solved_under={n: label for n, label in solved_under.items()
                                        if any(c.name == n and c.figures is not None for c in candidates)},
                          time_s=time.perf_counter() - t0)
    for c in candidates:
        c.graph = None  # the copies are large; the result keeps the chosen one
    logger.info("robust: chose %s (worst regret %.2f %%) among %d candidates in %.1f s", result.chosen,
                100 * result.worst_regret()[result.chosen], len(result.fitting), result.time_s)
    return result
