"""Robust to the cost model: the schedule whose worst case across cost models is best.

No cost model is the machine: ours (analytic roofline + NCCL ring) and torch's estimators
disagree by 1.3x to 1.8x on the same graphs and prefer different schedules (issue 13), and
bandwidths vary from one cluster to the next. A schedule chosen under one model can be far
from the best under another. The robust choice hedges:

- the family of cost models (:func:`cost_model_family`): each of :data:`BASE_COST_MODELS`
  (``"analytic"``, ``"torch"``) on the cluster as given and with its intra- and inter-node
  bandwidths scaled by each factor of :data:`BANDWIDTH_SCALES` (-30 %, +30 %);
- the regret of candidate ``c`` under model ``m``: ``t_m(c) / min_c' t_m(c') - 1``, the
  minimum over the candidates compared (those that fit the budget);
- the robust choice (:func:`robust_key`): the candidate with the smallest worst-case regret
  over the family; ties go to the first name in sorted order, so every rank agrees.

:func:`choice_key` turns the criterion into a ``key`` for a chooser over judged candidates
(objects with ``name`` and ``figures.step_ms``); :func:`robust_schedule` does the whole thing
with the public API: candidates from :func:`scheduler.optimize_schedule` under each base model
and from the baselines, each written back and judged on its rewritten graph under every model
of the family (:func:`scheduler.rewritten.judge`), the budget held on the rewritten graph.

With a chooser over judged candidates whose figures carry step times under the family, the
robust choice is ``choose(judged, budget, key=choice_key(judged, budget))``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs import Cluster, CostModel, resolve_cost_model
from scheduler.rewritten import Judged, judge, rewrite_baseline, rewrite_product
from solvers.core import InfeasibleBudgetError, ScheduleError, fmt_bytes, parse_bytes

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)

#: the cost models every family starts from (names of :data:`scheduler.costs.COST_MODELS`)
BASE_COST_MODELS = ("analytic", "torch")
#: factors applied to the cluster's intra- and inter-node bandwidths (-30 %, +30 %)
BANDWIDTH_SCALES = (0.7, 1.3)
#: baselines :func:`robust_schedule` considers besides its own solves
ROBUST_BASELINES = ("fsdp2", "simplefsdp", "autoparallel", "traced", "torch")


# --------------------------------------------------------------------------------------------
# the family of cost models
# --------------------------------------------------------------------------------------------
def scale_bandwidth(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with its intra- and inter-node bus bandwidths multiplied by ``factor``."""
    return dataclasses.replace(cluster, intra_node_gbps=cluster.intra_node_gbps * factor,
                               inter_node_gbps=cluster.inter_node_gbps * factor)


def family_label(base: str, factor: float = 1.0) -> str:
    """``"analytic"`` for the cluster as given, ``"analytic bw-30%"`` for bandwidths x 0.7."""
    return base if factor == 1.0 else f"{base} bw{factor - 1:+.0%}"


def cost_model_family(
    cluster: Cluster | None = None,
    *,
    base: Sequence[str] = BASE_COST_MODELS,
    bandwidth_scales: Sequence[float] = BANDWIDTH_SCALES,
) -> dict[str, CostModel]:
    """Label -> cost model: each model of ``base`` on ``cluster`` (default
    :class:`scheduler.costs.Cluster`), then on the cluster with bandwidths scaled by each
    factor of ``bandwidth_scales`` (labels by :func:`family_label`, in that order)."""
    cluster = cluster or Cluster()
    family: dict[str, CostModel] = {}
    for name in base:
        family[family_label(name)] = resolve_cost_model(name, cluster)
        for factor in bandwidth_scales:
            if not factor > 0:
                raise ValueError(f"bandwidth scale factors must be > 0, got {factor!r}")
            family[family_label(name, factor)] = resolve_cost_model(name, scale_bandwidth(cluster, factor))
    return family


# --------------------------------------------------------------------------------------------
# the criterion
# --------------------------------------------------------------------------------------------
def regrets(step_ms_by_model: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Candidate -> model label -> ``t_m(c) / min_c' t_m(c') - 1`` (0 for the best under m).

    Args:
        step_ms_by_model: model label -> candidate -> step time (ms); every model must time
            the same candidates, every time must be > 0.

    Raises:
        ValueError: no model or no candidate, models that time different candidates, or a
            time that is not > 0.
    """
    names = _candidates(step_ms_by_model)
    out: dict[str, dict[str, float]] = {c: {} for c in names}
    for label, times in step_ms_by_model.items():
        best = min(times.values())
        for c in names:
            out[c][label] = times[c] / best - 1.0
    return out


def worst_regret(step_ms_by_model: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Candidate -> its largest regret over the models (:func:`regrets`)."""
    return {c: max(by_model.values()) for c, by_model in regrets(step_ms_by_model).items()}


def robust_key(step_ms_by_model: Mapping[str, Mapping[str, float]]) -> str:
    """The candidate with the smallest worst-case ratio to the best candidate under each model;
    among equal ratios, the first name in sorted order. Same argument as :func:`regrets`."""
    worst = worst_regret(step_ms_by_model)
    return min(sorted(worst), key=lambda c: worst[c])


def single_model_pick(step_ms_by_model: Mapping[str, Mapping[str, float]], label: str) -> str:
    """The candidate that model ``label`` alone would choose (ties: the first name)."""
    times = step_ms_by_model[label]
    return min(sorted(times), key=lambda c: times[c])


def choice_key(candidates: Iterable[Any], mem_budget_bytes: int | None = None, *,
               fits: Callable[[Any, int | None], bool] | None = None) -> Callable[[Any], tuple[float, str]]:
    """A ``key`` that makes a ``min`` over ``candidates`` the robust choice.

    Candidates are objects with ``name`` and ``figures.step_ms`` (label -> ms, the same
    labels for all), as a chooser over judged candidates holds them; regrets are taken among
    those that fit ``mem_budget_bytes`` (``fits(candidate, budget)``, default: every
    candidate with figures whose ``figures.max_peak_bytes`` is within the budget). The key is
    ``(worst-case regret, name)``; a candidate outside that set keys as ``(inf, name)``.
    """
    fits = fits or _fits_by_figures
    pool = [c for c in candidates if getattr(c, "figures", None) is not None and fits(c, mem_budget_bytes)]
    if not pool:
        return lambda c: (float("inf"), c.name)
    labels = pool[0].figures.step_ms.keys()
    table = {label: {c.name: c.figures.step_ms[label] for c in pool} for label in labels}
    worst = worst_regret(table)
    return lambda c: (worst.get(c.name, float("inf")), c.name)


def _fits_by_figures(candidate: Any, mem_budget_bytes: int | None) -> bool:
    return mem_budget_bytes is None or candidate.figures.max_peak_bytes <= mem_budget_bytes


def _candidates(step_ms_by_model: Mapping[str, Mapping[str, float]]) -> list[str]:
    if not step_ms_by_model:
        raise ValueError("no cost model: give at least one model's step times")
    sets = {label: set(times) for label, times in step_ms_by_model.items()}
    names = next(iter(sets.values()))
    if not names:
        raise ValueError("no candidate to choose from")
    for label, s in sets.items():
        if s != names:
            raise ValueError(f"cost model {label!r} times other candidates ({sorted(s ^ names)} differ)")
        bad = [c for c, t in step_ms_by_model[label].items() if not t > 0]
        if bad:
            raise ValueError(f"cost model {label!r}: step times must be > 0 (candidates {bad})")
    return sorted(names)


# --------------------------------------------------------------------------------------------
# the whole thing on an FX graph
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class RobustResult:
    """What :func:`robust_schedule` found: the choice, and every candidate as judged."""

    #: name of the chosen candidate
    chosen: str
    #: the chosen rewritten graph (a copy: the input graph is not modified)
    gm: Any = dataclasses.field(repr=False)
    mem_budget_bytes: int | None
    #: every candidate that could be written back, judged under every model of the family
    judged: dict[str, Judged]
    #: candidates that were dropped (not made, or over the budget) and why
    dropped: dict[str, str]
    #: names of the candidates solved by fsdp-sched, by the label of the model solved under
    solved_under: dict[str, str]
    time_s: float = 0.0

    @property
    def fitting(self) -> list[str]:
        return sorted(n for n, j in self.judged.items() if j.fits(self.mem_budget_bytes))

    def step_ms_by_model(self) -> dict[str, dict[str, float]]:
        """Model label -> fitting candidate -> re-exported step time (ms)."""
        labels = next(iter(self.judged.values())).step_ms
        return {label: {n: self.judged[n].step_ms[label] for n in self.fitting} for label in labels}

    def worst_regret(self) -> dict[str, float]:
        return worst_regret(self.step_ms_by_model())

    def table(self) -> str:
        """Step time (ms) of every fitting candidate under every model, its worst regret."""
        times = self.step_ms_by_model()
        worst = self.worst_regret()
        head = f"{'candidate':<24}" + "".join(f"{label:>16}" for label in times) + f"{'worst regret':>14}"
        lines = [head, "-" * len(head)]
        for n in self.fitting:
            mark = " <- robust" if n == self.chosen else ""
            lines.append(f"{n:<24}" + "".join(f"{times[label][n]:16.2f}" for label in times)
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
) -> RobustResult:
    """The schedule of ``gm`` that is best in the worst case across cost models.

    Candidates: :func:`scheduler.optimize_schedule` at ``mem_budget`` under each model of
    ``solve_under`` (labels of the family) and each baseline of ``baselines``
    (:func:`scheduler.rewritten.rewrite_baseline`), each on its own copy of ``gm``. Each
    rewritten graph is re-exported and simulated under every model of ``cost_models``
    (default :func:`cost_model_family` of ``cluster``); those whose re-export, liveness and
    torch tracker peaks are all within the budget compete, and :func:`robust_key` chooses.
    ``gm`` itself is not modified: the result holds the chosen rewritten copy. Needs an
    initialised process group in which the graph's groups resolve (a fake one is enough).

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
    graphs, dropped, solved_under = _candidate_graphs(gm, budget, family, cluster=cluster, solve_under=solve_under,
                                                      baselines=baselines, time_limit_s=time_limit_s)
    judged = {}
    for i, (name, g) in enumerate(graphs.items()):
        logger.info("robust: judging %s (%d/%d) under %d cost models", name, i + 1, len(graphs), len(family))
        judged[name] = judge(g, family, name=name, cluster=cluster, keep_graph=True)
    result = RobustResult(chosen="", gm=None, mem_budget_bytes=budget, judged=judged, dropped=dropped,
                          solved_under=solved_under)
    _drop_over_budget(result)
    if not result.fitting:
        raise _none_fits(judged, budget)
    result.chosen = robust_key(result.step_ms_by_model())
    result.gm = judged[result.chosen].gm
    for j in judged.values():
        j.gm = None  # the copies are large; the result keeps the chosen one
    result.time_s = time.perf_counter() - t0
    logger.info("robust: chose %s (worst regret %.2f %%) among %d candidates in %.1f s", result.chosen,
                100 * result.worst_regret()[result.chosen], len(result.fitting), result.time_s)
    return result


def _candidate_graphs(gm, budget, family, *, cluster, solve_under, baselines, time_limit_s):
    """Name -> rewritten copy of ``gm``; name -> why a candidate was not made; and the
    product's candidate names -> the label solved under."""
    graphs: dict[str, Any] = {}
    dropped: dict[str, str] = {}
    solved_under: dict[str, str] = {}
    for label in solve_under:
        name = f"fsdp-sched[{label}]"
        logger.info("robust: solving under %s (limit %g s)", label, time_limit_s)
        try:
            graphs[name] = rewrite_product(gm, budget, cost_model=family[label], cluster=cluster,
                                           time_limit_s=time_limit_s)
            solved_under[name] = label
        except (InfeasibleBudgetError, ScheduleError) as e:
            dropped[name] = f"{type(e).__name__}: {e}"
    for name in baselines:
        logger.info("robust: writing back baseline %s", name)
        try:
            graphs[name] = rewrite_baseline(gm, name, cluster=cluster)
        except Exception as e:  # torch's pass fails on some graphs; one baseline must not stop the others
            dropped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return graphs, dropped, solved_under


def _drop_over_budget(result: RobustResult) -> None:
    for name, j in result.judged.items():
        if not j.fits(result.mem_budget_bytes):
            result.dropped[name] = (f"over budget: peak {fmt_bytes(j.peak_bytes)} > "
                                    f"{fmt_bytes(result.mem_budget_bytes)} on the rewritten graph")


def _none_fits(judged: Mapping[str, Judged], budget: int | None) -> Exception:
    if not judged:
        return ScheduleError("no candidate could be written back")
    least = min(judged.values(), key=lambda j: j.peak_bytes)
    return InfeasibleBudgetError(
        f"no rewritten graph keeps peak memory under {fmt_bytes(budget)}; the smallest is "
        f"{fmt_bytes(least.peak_bytes)} ({least.name}): raise mem_budget to at least that",
        budget_bytes=budget or 0, min_peak_bytes=least.peak_bytes)
