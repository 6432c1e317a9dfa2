"""Choose: the cost models a schedule is judged under, and the written graph that is installed.

What is written back is what counts. :func:`write_and_judge` writes a schedule back on a copy
of the graph and judges the copy as written (:func:`judge_graph`): re-exported with the cost
model and simulated in its node order, its peak memory taken by the re-export's simulation and
by the reference liveness count (:func:`scheduler.judge.liveness_peak`): the memory the written
graph holds, and what the budget bounds. torch's ``MemoryTracker`` rules (a collective's input
freed at the collective, every wait's result a fresh storage) are counted too and reported, not
held: a wait returns its input, so the fresh storage is the estimator's, not the GPU's; and
torch's own ``MemoryTracker`` tells storages apart by their FakeTensors, so it takes a
recomputed copy (to which torch's remat passes give the forward original's FakeTensor) for an
alias of the original and keeps the original alive through the backward: held, it refused
every budget on joint graphs with selective checkpointing, their own peak included.
:func:`choose` takes the
search's schedule, then its next best starts, then the graph as traced, and keeps the first
whose written graph holds the budget by both counts. The search evaluates schedules on the
simulator, whose step time and memory counts equal those of the written graph; a written
graph over the budget is therefore rare, and the next candidate (never a slower one than the
traced order) is the answer, with the reason in the report.

The cost models (:func:`cost_models`): with a cost model given, that model alone decides. With
none, no single model is the machine: the analytic model and torch's estimators disagree by
1.2x to 1.8x on the same graphs and prefer other bucket sizes, and bandwidths differ from one
cluster to the next. The search then judges every schedule under a family (analytic and torch,
intra- and inter-node bandwidths as given and scaled by each of ``bandwidth_scales``) and
minimises the worst-case regret over it (:mod:`solvers.search`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs import Cluster, CostModel, annotate_costs, resolve_cost_model
from scheduler.dag import export_dag
from scheduler.judge import liveness_peak
from scheduler.writeback import apply_schedule
from solvers.core import InfeasibleBudgetError, Problem, Schedule, ScheduleError, fmt_bytes, simulate

if TYPE_CHECKING:
    import networkx as nx
    import torch.fx

logger = logging.getLogger(__name__)

#: the cost models every family starts from (names of :func:`scheduler.costs.resolve_cost_model`)
BASE_COST_MODELS = ("analytic", "torch")


# --------------------------------------------------------------------------------------------
# the cost models
# --------------------------------------------------------------------------------------------
def scale_bandwidth(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with its intra- and inter-node bus bandwidths multiplied by ``factor``."""
    return dataclasses.replace(cluster, intra_node_gbps=cluster.intra_node_gbps * factor,
                               inter_node_gbps=cluster.inter_node_gbps * factor)


def family_label(base: str, factor: float = 1.0) -> str:
    """``"analytic"`` for the cluster as given, ``"analytic bw-30%"`` for bandwidths x 0.7."""
    return base if factor == 1.0 else f"{base} bw{factor - 1:+.0%}"


def cost_model_family(cluster: Cluster | None = None, *, bandwidth_scales: Sequence[float] = (0.7, 1.3)
                      ) -> dict[str, CostModel]:
    """Label -> cost model: each of :data:`BASE_COST_MODELS` on ``cluster`` (default
    :class:`scheduler.costs.Cluster`), then on the cluster with bandwidths scaled by each factor
    of ``bandwidth_scales`` (labels by :func:`family_label`)."""
    cluster = cluster or Cluster()
    family: dict[str, CostModel] = {}
    for name in BASE_COST_MODELS:
        family[family_label(name)] = resolve_cost_model(name, cluster)
        for factor in bandwidth_scales:
            if not factor > 0:
                raise ValueError(f"bandwidth scale factors must be > 0, got {factor!r}")
            family[family_label(name, factor)] = resolve_cost_model(name, scale_bandwidth(cluster, factor))
    return family


def cost_model_label(cost_model: Any) -> str:
    """``"analytic"`` for None, the name for a name, else the model's ``name`` or class name."""
    if cost_model is None:
        return "analytic"
    if isinstance(cost_model, str):
        return cost_model.strip().lower()
    return str(getattr(cost_model, "name", type(cost_model).__name__))


def cost_models(cost_model: Any, cluster: Cluster | None, bandwidth_scales: Sequence[float]) -> dict[str, Any]:
    """The models the search judges under: ``cost_model`` alone when given, else the family
    (module docstring). The first is the primary one (the report's figures, CP-SAT's model)."""
    if cost_model is not None:
        return {cost_model_label(cost_model): cost_model}
    return cost_model_family(cluster, bandwidth_scales=bandwidth_scales)


def export_problems(gm: "torch.fx.GraphModule", models: Mapping[str, Any], cluster: Cluster | None
                    ) -> dict[str, Problem]:
    """``gm`` exported once and priced by each of ``models`` (label -> Problem, in order)."""
    labels = list(models)
    dag = export_dag(gm, cost_model=models[labels[0]], cluster=cluster)
    out = {labels[0]: Problem.from_dag(dag)}
    priced = {_compute_key(labels[0]): dag}
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    for label in labels[1:]:
        other: nx.DiGraph = dag.copy()
        other.graph = copy.deepcopy(dag.graph)
        model = resolve_cost_model(models[label], cluster)
        base = priced.get(_compute_key(label))
        annotate_costs(other, model if base is None else _ComputeFrom(model, base), cluster or Cluster(),
                       fx_nodes=fx_nodes)
        priced.setdefault(_compute_key(label), other)
        out[label] = Problem.from_dag(other)
    return out


def _compute_key(label: str) -> str:
    """Models of one family label prefix price compute alike: a bandwidth factor scales the
    network, not the GPU."""
    return label.split(" bw", 1)[0]


class _ComputeFrom:
    """``model`` with its compute times taken from a DAG it already priced (the same model on
    the cluster with other network bandwidths)."""

    def __init__(self, model: Any, dag: "nx.DiGraph"):
        self.model, self.dag = model, dag
        self.name = getattr(model, "name", type(model).__name__)

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        return float(self.dag.nodes[attrs["name"]]["runtime_ms"])

    def collective_ms(self, coll_type: str, payload_bytes: int, group: Any) -> float:
        return self.model.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self.model.copy_ms(nbytes)


# --------------------------------------------------------------------------------------------
# judging a written graph
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Figures:
    """A rewritten graph as judged on itself (times in ms, memory in bytes)."""

    #: re-exported step time under the primary cost model
    step_ms: float
    #: peak of the re-export simulated as written
    peak_bytes: int
    #: reference liveness count of the rewritten graph
    liveness_peak_bytes: int
    #: torch's MemoryTracker rules on the rewritten graph, read from its structure (the
    #: re-export simulated): reported, not held (module docstring)
    tracker_peak_bytes: int
    n_collectives: int
    exposed_comm_ms: float

    @property
    def max_peak_bytes(self) -> int:
        """The larger of the re-export's and the liveness count's peaks: what a budget holds."""
        return max(self.peak_bytes, self.liveness_peak_bytes)

    @property
    def decided_by(self) -> str:
        """Which count the budget is held by (the larger)."""
        return "liveness" if self.liveness_peak_bytes > self.peak_bytes else "re-export"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def judge_graph(gm: "torch.fx.GraphModule", cost_model: Any = None, cluster: Any = None) -> Figures:
    """Judge ``gm`` as written: re-export it with ``cost_model`` on ``cluster`` and simulate it
    in its node order (step time, its peak by the execution model and by torch's tracker rules);
    take its liveness peak."""
    problem = Problem.from_dag(export_dag(gm, cost_model=cost_model, cluster=cluster))
    sim = simulate(problem.dag, problem=problem)
    return Figures(step_ms=sim.step_ms, peak_bytes=sim.peak_bytes, liveness_peak_bytes=liveness_peak(gm),
                   tracker_peak_bytes=sim.tracker_peak_bytes, n_collectives=sim.n_collectives,
                   exposed_comm_ms=sim.exposed_comm_ms)


def graph_digest(gm: "torch.fx.GraphModule | torch.fx.Graph") -> str:
    """sha256 of a graph's node sequence: each node's op, target and arguments, with nodes
    named by position (equal graphs give equal digests whatever their node names)."""
    import torch.fx

    graph = getattr(gm, "graph", gm)
    index: dict[torch.fx.Node, int] = {}
    h = hashlib.sha256()

    def arg(a: Any) -> Any:
        return f"%{index.get(a, -1)}" if isinstance(a, torch.fx.Node) else a

    for i, n in enumerate(graph.nodes):
        index[n] = i
        args = torch.fx.node.map_aggregate((n.args, n.kwargs), arg)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", repr(n.target))
        h.update(f"{n.op}|{getattr(n.target, '__module__', '')}.{target}|{args!r}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# the choice
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Candidate:
    """A schedule over the traced graph's problem, and how its written graph was judged."""

    name: str
    schedule: Schedule
    figures: Figures | None = None
    #: why it was not installed (None for the chosen one)
    dropped: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.schedule.digest(),
                "figures": self.figures.to_json() if self.figures else None,
                "peak_decided_by": self.figures.decided_by if self.figures else None, "dropped": self.dropped}


def write_and_judge(gm: "torch.fx.GraphModule", problem: Problem, schedule: Schedule, *, cost_model: Any,
                    cluster: Any, payload_order: str, control_deps: bool) -> Figures:
    """``schedule`` written back on a copy of ``gm`` (without control dependencies: a pinned
    graph cannot be re-exported, and pins change no order) and judged there."""
    written = copy.deepcopy(gm)
    if schedule.digest() != problem.traced_schedule().digest():
        apply_schedule(written, problem, schedule, payload_order=payload_order, control_deps=False)
    return judge_graph(written, cost_model, cluster)


def choose(gm: "torch.fx.GraphModule", problem: Problem, ranked: Sequence[tuple[str, Schedule]],
           mem_budget_bytes: int | None, *, cost_model: Any, cluster: Any, payload_order: str,
           control_deps: bool) -> tuple[Candidate, list[Candidate]]:
    """The first of ``ranked`` (name, schedule), then the graph as traced, whose written graph
    holds ``mem_budget_bytes`` (:attr:`Figures.max_peak_bytes`). Returns it and every candidate
    judged.

    Raises:
        InfeasibleBudgetError: no written graph holds the budget (the smallest peak found).
        ScheduleError: no candidate could be written back and judged.
    """
    traced = problem.traced_schedule()
    seen: set[str] = set()
    judged: list[Candidate] = []
    for name, schedule in [*ranked, ("traced", traced)]:
        if schedule.digest() in seen:
            continue
        seen.add(schedule.digest())
        c = Candidate(name=name, schedule=schedule)
        judged.append(c)
        try:
            c.figures = write_and_judge(gm, problem, schedule, cost_model=cost_model, cluster=cluster,
                                        payload_order=payload_order, control_deps=control_deps)
        except (ScheduleError, ValueError, RuntimeError) as e:
            c.dropped = f"not written back: {type(e).__name__}: {e}"
            logger.warning("fsdp-sched: candidate %s could not be written back: %s", name, e)
            continue
        if mem_budget_bytes is not None and c.figures.max_peak_bytes > mem_budget_bytes:
            c.dropped = (f"its written graph peaks at {fmt_bytes(c.figures.max_peak_bytes)} by "
                         f"{c.figures.decided_by} ({_counts(c.figures)}), over the budget")
            logger.warning("fsdp-sched: candidate %s dropped: %s", name, c.dropped)
            continue
        return c, judged
    fitted = [c for c in judged if c.figures is not None]
    if not fitted:
        raise ScheduleError("no candidate could be written back and judged: "
                            + "; ".join(f"{c.name}: {c.dropped}" for c in judged))
    least = min(fitted, key=lambda c: c.figures.max_peak_bytes)
    peak = least.figures.max_peak_bytes
    raise InfeasibleBudgetError(
        f"no rewritten graph keeps peak memory under {fmt_bytes(mem_budget_bytes or 0)} ({mem_budget_bytes} B) by "
        f"the re-export and the liveness count; the smallest is {fmt_bytes(peak)} ({peak} B, "
        f"{least.name}): raise mem_budget to at least that", budget_bytes=mem_budget_bytes or 0, min_peak_bytes=peak)


def _counts(f: Figures) -> str:
    return (f"re-export {fmt_bytes(f.peak_bytes)}, liveness {fmt_bytes(f.liveness_peak_bytes)}, "
            f"torch's tracker rules {fmt_bytes(f.tracker_peak_bytes)}")
