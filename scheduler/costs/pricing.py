"""One exported graph priced by several cost models (the members of a family,
:mod:`scheduler.costs.family`): :func:`export_problems` exports once and prices a copy of the
DAG under each model, the others only when first asked for (:class:`PricedProblems`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import networkx as nx

from scheduler.costs.annotate import annotate_costs
from scheduler.costs.family import ComputeFrom, compute_key
from scheduler.costs.hardware import Cluster
from scheduler.costs.spec import resolve_cost_model
from scheduler.export.dag import export_dag
from solvers.core.problem import Problem, copy_dag

if TYPE_CHECKING:
    import torch.fx


def export_problems(gm: "torch.fx.GraphModule", models: Mapping[str, Any], cluster: Cluster | None, *,
                    merge_all_reduces: bool = False) -> "PricedProblems":
    """``gm`` exported once and priced by each of ``models`` (label -> Problem, in order): the
    first at once, the others when one of them is first asked for (:class:`PricedProblems`).
    A family (:class:`scheduler.costs.family.CostModelFamily`) first leaves out the members
    that would price this graph as another does (:meth:`~scheduler.costs.family.CostModelFamily.needed`)."""
    labels = list(models)
    dag = export_dag(gm, cost_model=models[labels[0]], cluster=cluster, merge_all_reduces=merge_all_reduces)
    needed = getattr(models, "needed", None)
    if callable(needed):  # a family leaves out the members that price this graph alike
        models = needed(dag)
        labels = list(models)
        dag.graph["cost_model"] = _model_name(models[labels[0]])
    key_of = getattr(models, "compute_key", compute_key)
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    priced_on = Cluster.from_json(dag.graph["cluster"])

    def price_the_others() -> dict[str, Problem]:
        out: dict[str, Problem] = {}
        priced = {key_of(labels[0]): dag}
        for label in labels[1:]:
            other: nx.DiGraph = copy_dag(dag)
            other.graph = copy.deepcopy(dag.graph)
            model = resolve_cost_model(models[label], cluster)
            base = priced.get(key_of(label))
            annotate_costs(other, model if base is None else ComputeFrom(model, base), priced_on, fx_nodes=fx_nodes)
            priced.setdefault(key_of(label), other)
            out[label] = Problem.from_dag(other)
        return out

    return PricedProblems(labels, Problem.from_dag(dag), price_the_others,
                          model_names={label: _model_name(models[label]) for label in labels})


def _model_name(model: Any) -> str:
    return model if isinstance(model, str) else str(getattr(model, "name", type(model).__name__))


class PricedProblems(Mapping):
    """Label -> the graph's :class:`Problem` under that cost model, in the models' order. The
    first is priced when made; the others together, the first time one of them is read: an
    answer from the schedule cache reads only the first (its key is the first's export)."""

    def __init__(self, labels: list[str], first: Problem, price_the_others: Any,
                 model_names: Mapping[str, str] | None = None):
        self._labels = labels
        #: label -> the name of the model that priced it (a family's members are named by
        #: their spec and label), known before the others are priced
        self.model_names = dict(model_names or {label: label for label in labels})
        self._problems: dict[str, Problem] = {labels[0]: first}
        self._price_the_others = price_the_others

    def __getitem__(self, label: str) -> Problem:
        if label not in self._problems and label in self._labels and self._price_the_others is not None:
            self._problems.update(self._price_the_others())
            self._price_the_others = None
        return self._problems[label]

    def __iter__(self):
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)
