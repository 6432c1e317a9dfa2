"""The family of plausible cost models, judged when no cost model is given.

No single model is the machine: the analytic model and torch's estimators disagree by 1.2x to
1.8x on the same graphs and prefer other bucket sizes, and bandwidths differ from one cluster
to the next. With a cost model given, that model alone decides; without one, every schedule is
judged under a family (analytic and torch, intra- and inter-node bandwidths as given and scaled
by each of ``bandwidth_scales``) and the search minimises the worst-case regret over it
(:mod:`solvers.search`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs.models import Cluster, CostModel, resolve_cost_model

if TYPE_CHECKING:
    import networkx as nx

#: the cost models every family starts from (names of :func:`scheduler.costs.models.resolve_cost_model`)
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
    :class:`scheduler.costs.models.Cluster`), then on the cluster with bandwidths scaled by each factor
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


def compute_key(label: str) -> str:
    """Models of one family label prefix price compute alike: a bandwidth factor scales the
    network, not the GPU."""
    return label.split(" bw", 1)[0]


class ComputeFrom:
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
