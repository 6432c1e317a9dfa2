"""The family of plausible cost models: what a schedule is judged under where a cost is not known.

No single model is the machine: the analytic model and torch's estimators disagree on the same
graphs and prefer other bucket sizes, and bandwidths differ from one cluster to the next. What
a file measured is known, though, and only that: a collective table fixes the collectives of
the groups it has rows for, a profile fixes the compute nodes it timed (and the collectives of
a gloo group it ran). So a cost model spec (:class:`scheduler.costs.spec.CostSpec`) gives a
family (:class:`CostModelFamily`, :func:`cost_models`) whose members price what is fixed
alike and each open component (one the spec names no model for) by one plausible model:
analytic or torch's estimators, collectives also on the intra- and inter-node bandwidths scaled
by each of ``bandwidth_scales``. The search minimises the worst-case regret over the members
(:mod:`solvers.search`).

- no cost model: nothing is fixed; the members are analytic and torch on the cluster as given
  and on scaled bandwidths;
- ``"table:PATH"``: every member takes the table's times for the groups it covers; compute is
  priced by analytic or torch, the other groups' collectives by their NCCL models on each
  bandwidth;
- ``"profile:PATH"``: every member takes the trace's times for the nodes (and gloo collectives)
  it timed; the other nodes by analytic or torch, collectives as without a model;
- a spec that names a model for every component (``"torch"``, ``"compute:torch+collectives:
  analytic"``, ``"compute:torch+table:PATH"`` where the table covers every group) and a cost
  model object: that one model.

Labels name what prices the open components: ``"analytic"``, ``"torch"``, ``"analytic bw-30%"``,
...; the unscaled ones are the nominal members (:attr:`solvers.objective.SearchConfig.strict_models`),
the first is the primary one (the report's figures). A family of one model is labelled by its
spec. Members that price a graph alike (a scaled bandwidth where the table covers every group)
are left out once the graph is exported (:meth:`CostModelFamily.needed`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.costs.hardware import Cluster, scale_bandwidth
from scheduler.costs.models import CostModel
from scheduler.costs.spec import CostSpec, family_label, parse_cost_spec, spec_cost_model

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["BASE_COST_MODELS", "CostModelFamily", "ComputeFrom", "compute_key", "cost_model_family",
           "cost_model_label", "cost_models", "family_label", "fixed_parts", "merged_cost_sources", "scale_bandwidth"]

#: the models that price an open component, in order (names of :data:`scheduler.costs.spec.COST_MODELS`)
BASE_COST_MODELS = ("analytic", "torch")


# --------------------------------------------------------------------------------------------
# the family
# --------------------------------------------------------------------------------------------
class CostModelFamily(Mapping[str, Any]):
    """Label -> cost model: the members of ``spec``'s family (module docstring), in order.

    Args:
        spec: what is fixed and what is open (:class:`scheduler.costs.spec.CostSpec`).
        cluster: the topology (default :class:`scheduler.costs.hardware.Cluster`).
        bandwidth_scales: factors of the bandwidths an open collective component is also priced
            on (each > 0).
        members: the labels to keep (default: all); for :meth:`needed`.

    Raises:
        ValueError: a factor <= 0, or a file of the spec that cannot be read.
    """

    def __init__(self, spec: CostSpec, cluster: Cluster | None = None, bandwidth_scales: Sequence[float] = (0.7, 1.3),
                 *, members: Sequence[str] | None = None):
        for factor in bandwidth_scales:
            if not factor > 0:
                raise ValueError(f"bandwidth scale factors must be > 0, got {factor!r}")
        self.spec = spec
        self.cluster = cluster or Cluster()
        self.bandwidth_scales = tuple(bandwidth_scales)
        #: label -> (model pricing the open components, bandwidth factor of open collectives)
        self._hedges: dict[str, tuple[str, float]] = {}
        if spec.open_parts:
            factors = (1.0, *self.bandwidth_scales) if "collectives" in spec.open_parts else (1.0,)
            self._hedges = {family_label(base, f): (base, f) for base in BASE_COST_MODELS for f in factors}
        else:
            self._hedges = {spec.text: (BASE_COST_MODELS[0], 1.0)}
        if members is not None:
            unknown = [m for m in members if m not in self._hedges]
            if unknown or not members:
                raise ValueError(f"members={list(members)!r} must be a non-empty selection of {list(self._hedges)}")
            self._hedges = {label: h for label, h in self._hedges.items() if label in members}
            if len(self._hedges) == 1 and spec.text:  # the others priced the graph alike: one model
                self._hedges = {spec.text: next(iter(self._hedges.values()))}
        self._models = {label: spec_cost_model(spec, self.cluster, hedge=base, bandwidth_factor=f,
                                               name=self._name(label))
                        for label, (base, f) in self._hedges.items()}

    def _name(self, label: str) -> str:
        if not self.spec.text:
            return label
        return self.spec.text if label == self.spec.text else f"{self.spec.text} [{label}]"

    def __getitem__(self, label: str) -> CostModel:
        return self._models[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def compute_key(self, label: str) -> str:
        """Members of one key price compute alike: the model of open compute, or one key for
        all when the spec names the compute model."""
        return self._hedges[label][0] if "compute" in self.spec.open_parts else ""

    def needed(self, dag: "nx.DiGraph") -> "CostModelFamily":
        """The members that price ``dag`` differently, ``dag`` priced by the first
        (``dag.graph["cost_sources"]``, :func:`scheduler.costs.annotate.annotate_costs`): scaled
        bandwidths only where a collective is priced by no measurement, and torch's member only
        where some compute or collective is; a family of one is labelled by the spec (the
        others' prices equal its own). ``self`` when every member is needed."""
        sources = dag.graph.get("cost_sources") or {}
        if not self.spec.open_parts or not sources:
            return self
        compute_open = "compute" in self.spec.open_parts and any(
            not r["measured"] and r["ms"] > 0 for r in sources.get("compute", ()))
        collectives_open = "collectives" in self.spec.open_parts and any(
            not r["measured"] for r in sources.get("collectives", ()))
        keep = [label for label, (base, f) in self._hedges.items()
                if (f == 1.0 or collectives_open) and (base == BASE_COST_MODELS[0] or compute_open or collectives_open)]
        if len(keep) == len(self):
            return self
        return CostModelFamily(self.spec, self.cluster, self.bandwidth_scales, members=keep)


def fixed_parts(cost_model: Any) -> str:
    """What every member of ``cost_model``'s family takes from the spec (its files and the
    models it names), for the report's criterion: ``"table:colls.csv"``, ``"compute:torch and
    table:colls.csv"``; empty for None, an object or a spec without such parts."""
    if not isinstance(cost_model, str):
        return ""
    spec = parse_cost_spec(cost_model)
    parts = [p for p in (spec.profile and f"profile:{spec.profile}", spec.table and f"table:{spec.table}",
                         spec.compute and f"compute:{spec.compute}",
                         spec.collectives and f"collectives:{spec.collectives}") if p]
    return " and ".join(parts)


def cost_model_family(cluster: Cluster | None = None, *, bandwidth_scales: Sequence[float] = (0.7, 1.3)
                      ) -> CostModelFamily:
    """The family judged without a cost model: each of :data:`BASE_COST_MODELS` on ``cluster``
    (default :class:`scheduler.costs.hardware.Cluster`), then on the cluster with bandwidths
    scaled by each factor of ``bandwidth_scales`` (labels by :func:`family_label`)."""
    return CostModelFamily(CostSpec(), cluster, bandwidth_scales)


def cost_model_label(cost_model: Any) -> str:
    """``"analytic"`` for None, the spec's text for a spec (a lone model name in lower case),
    else the model's ``name`` or class name."""
    if cost_model is None:
        return "analytic"
    if isinstance(cost_model, str):
        try:
            return parse_cost_spec(cost_model).text
        except ValueError:
            return cost_model.strip()
    return str(getattr(cost_model, "name", type(cost_model).__name__))


def cost_models(cost_model: Any, cluster: Cluster | None, bandwidth_scales: Sequence[float]) -> Mapping[str, Any]:
    """The models the search judges under: the family of ``cost_model`` (None: nothing fixed; a
    name or spec: :class:`CostModelFamily`), or a cost model object alone. The first is the
    primary one (the report's figures, CP-SAT's model).

    Raises:
        ValueError: a bad spec or a file that cannot be read.
    """
    if cost_model is None:
        return cost_model_family(cluster, bandwidth_scales=bandwidth_scales)
    if isinstance(cost_model, str):
        return CostModelFamily(parse_cost_spec(cost_model), cluster, bandwidth_scales)
    return {cost_model_label(cost_model): cost_model}


def compute_key(label: str) -> str:
    """Models of one family label prefix price compute alike: a bandwidth factor scales the
    network, not the GPU (for label -> model mappings that are no :class:`CostModelFamily`)."""
    return label.split(" bw", 1)[0]


class ComputeFrom:
    """``model`` with its compute times taken from a DAG it already priced (the same model on
    the cluster with other network bandwidths); what priced each part is the model's own
    answer."""

    def __init__(self, model: Any, dag: "nx.DiGraph"):
        self.model, self.dag = model, dag
        self.name = getattr(model, "name", type(model).__name__)

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        return float(self.dag.nodes[attrs["name"]]["runtime_ms"])

    def collective_ms(self, coll_type: str, payload_bytes: int, group: Any) -> float:
        return self.model.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self.model.copy_ms(nbytes)

    def __getattr__(self, name: str) -> Any:
        # the coverage and source methods (compute_matched, collective_source, ...) are the
        # model's: only attributes it has, so that a model without them stays without them
        if name in _DELEGATED:
            return getattr(self.model, name)
        raise AttributeError(name)


_DELEGATED = frozenset({"compute_matched", "collective_matched", "compute_source", "collective_source",
                        "copy_source"})


# --------------------------------------------------------------------------------------------
# where each price came from
# --------------------------------------------------------------------------------------------
def merged_cost_sources(dags: Mapping[str, "nx.DiGraph"]) -> list[dict[str, Any]]:
    """Per cost component, where its prices came from over the models judged (label -> the
    graph each priced; ``dag.graph["cost_sources"]``): one record per component, ``part``
    (``"compute"``, ``"collectives"``, ``"copies"``), for collectives ``group_name``,
    ``coll_type``, ``group_size`` and ``nodes`` (the nodes the group's ranks span), ``items``
    (compute nodes or collectives), ``measured`` (per measured source: ``source``, ``items``,
    ``share`` of the component's time under the first model), and ``rest`` (``items`` priced by
    no measurement, and ``sources``: what priced them, one name per distinct model over the
    members: one name is fixed, several are the hedge). Empty for graphs without sources."""
    labels = list(dags)
    per = [dags[label].graph.get("cost_sources") for label in labels]
    if not labels or any(p is None for p in per):
        return []
    out = [_merged("compute", [p["compute"] for p in per], "nodes")]
    keys: list[tuple[str, str]] = []
    for r in per[0]["collectives"]:
        if (r["group_name"], r["coll_type"]) not in keys:
            keys.append((r["group_name"], r["coll_type"]))
    for g, c in keys:
        records = [[r for r in p["collectives"] if (r["group_name"], r["coll_type"]) == (g, c)] for p in per]
        first = records[0][0]
        out.append({**_merged("collectives", records, "count"), "group_name": g, "coll_type": c,
                    "group_size": first["group_size"], "nodes": first["nodes"]})
    out.append({"part": "copies", "items": None, "measured": [],
                "rest": {"items": None, "sources": _unique(p["copies"]["source"] for p in per)}})
    return out


def _merged(part: str, records: list[list[dict[str, Any]]], count: str) -> dict[str, Any]:
    primary = records[0]
    total_ms = sum(r["ms"] for r in primary)
    measured = [{"source": r["source"], "items": r[count], "share": r["ms"] / total_ms if total_ms > 0 else None}
                for r in primary if r["measured"]]
    rest = sum(r[count] for r in primary if not r["measured"])
    sources = _unique(r["source"] for rs in records for r in rs if not r["measured"])
    return {"part": part, "items": sum(r[count] for r in primary), "measured": measured,
            "rest": {"items": rest, "sources": sources if rest else []}}


def _unique(names: Any) -> list[str]:
    out: list[str] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out
