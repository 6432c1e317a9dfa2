"""Costs on a DAG: :func:`annotate_costs` puts ``runtime_ms`` on every node of an exported DAG and
the bucket cost model on the graph (``comm_model``, ``copy_ms_*``), and records what priced
each component (``dag.graph["cost_sources"]``) and, for models that price some nodes from data
and leave the rest to a fallback, what they matched (``dag.graph["cost_coverage"]``: the share
of compute time matched and the process groups whose collectives the fallback priced);
:class:`CoverageCheck` says when a file priced too little of the graph to stay silent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

import networkx as nx

from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.models import CostModel, ask_model, is_all_to_all, source_of
from solvers.core.units import fmt_ms

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoverageCheck:
    """When a cost model that prices from its own data (a measured table, a profile) priced too
    little of a graph from it, :func:`annotate_costs` logs a WARNING saying how much it priced
    and why the rest was left to its fallback: the process groups (size, nodes) the graph needs
    and those the data has, or the largest compute nodes it did not price. A file measured on
    other groups or profiled from another model otherwise falls back to the analytic model in
    silence (only the report's ``cost_coverage`` shows it)."""

    #: least share of the graph's collectives (by count) the data must price
    min_collective_share: float = 0.5
    #: least share of the graph's compute time the data must price
    min_compute_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("min_collective_share", "min_compute_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} must be a share in [0, 1]")


def _check_ms(value: Any, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise ValueError(
            f"cost model returned {value!r} for {what}; it must return a finite time in ms >= 0 "
            "(fix the model or its table)"
        )
    return v


def group_info(dag: nx.DiGraph, group_name: str) -> GroupInfo:
    g = dag.graph["process_groups"][group_name]
    ranks = g.get("ranks")
    return GroupInfo(group_name, int(g["size"]), tuple(ranks) if ranks else None)


#: payloads at which a merged collective's time is tabulated (geometric spacing, dense enough
#: that linear interpolation between neighbours follows torch's concave NCCL estimate)
COMM_TABLE_POINTS = 65


def _comm_table(cost_model: CostModel, coll_type: str, gi: GroupInfo, lo: int, hi: int, key: str) -> list[list[float]]:
    """``[[payload_bytes, ms], ...]`` of one collective key, increasing, from ``lo`` to ``hi``."""
    ratio = (hi / lo) ** (1.0 / (COMM_TABLE_POINTS - 1))
    sizes = sorted({int(round(lo * ratio**i)) for i in range(COMM_TABLE_POINTS)} | {lo, hi})
    return [[b, _check_ms(cost_model.collective_ms(coll_type, b, gi), key)] for b in sizes]


def annotate_costs(
    dag: nx.DiGraph,
    cost_model: CostModel,
    cluster: Cluster,
    *,
    fx_nodes: Mapping[str, Any] | None = None,
    coverage_check: CoverageCheck | None = None,
) -> nx.DiGraph:
    """Put ``runtime_ms`` on every node and the bucket cost model on the graph (in place).

    With ``coverage_check``, a model that priced less of the graph from its own data than the
    check's shares is named in a WARNING (:class:`CoverageCheck`); None: no check (a graph
    exported again after a write-back, whose coverage was checked on the traced one).

    Also prices merged collectives, per (collective type, process group): the line
    ``alpha + beta * payload`` through the model's times at the smallest and at the summed
    payload of the graph's collectives of that key (exact for the analytic ring model; the
    linear solver models use it), and a table of the model's own times at
    :data:`COMM_TABLE_POINTS` payloads spaced geometrically over that range, which the
    simulator interpolates (:meth:`solvers.core.problem.Problem.bucket_comm_ms`): torch's NCCL
    estimate is concave in the payload, so the line alone under-prices a block-sized bucket
    there, and the prediction would disagree with the re-exported graph.

    Records where each price came from: ``dag.graph["cost_sources"]`` (every model:
    :meth:`_Coverage.sources`) and ``dag.graph["cost_coverage"]`` (models that say what they
    measured: :meth:`_Coverage.summary`).

    Raises:
        ValueError: the cost model returned NaN, a negative or a missing time.
    """
    fx_nodes = fx_nodes or {}
    keys: dict[str, list[int]] = {}
    coverage = _Coverage(cost_model, cluster)
    for n, a in dag.nodes(data=True):
        kind = a["kind"]
        if kind == "compute":
            attrs = {**a, "name": n}
            a["runtime_ms"] = _check_ms(cost_model.compute_ms(attrs, fx_nodes.get(n)), f"node {n!r}")
            coverage.compute(attrs, fx_nodes.get(n), a["runtime_ms"])
        elif kind == "collective":
            # all-to-all (expert parallel) too: not movable, but it occupies its group's stream
            if a["coll_type"] in ("all_gather", "reduce_scatter", "all_reduce") or is_all_to_all(a["coll_type"]):
                gi = group_info(dag, a["group_name"])
                a["runtime_ms"] = _check_ms(
                    cost_model.collective_ms(a["coll_type"], a["payload_bytes"], gi), f"collective {n!r}"
                )
                coverage.collective(a["coll_type"], gi, a["runtime_ms"])
                keys.setdefault(f"{a['coll_type']}|{a['group_name']}", []).append(a["payload_bytes"])
            else:
                a["runtime_ms"] = 0.0
        else:
            a["runtime_ms"] = 0.0
    comm_model = {}
    for key, payloads in sorted(keys.items()):
        coll_type, gname = key.split("|", 1)
        gi = group_info(dag, gname)
        lo, hi = max(1, min(payloads)), max(2, sum(payloads))
        if hi <= lo:
            hi = lo * 2
        t_lo = _check_ms(cost_model.collective_ms(coll_type, lo, gi), key)
        t_hi = _check_ms(cost_model.collective_ms(coll_type, hi, gi), key)
        beta = max(0.0, (t_hi - t_lo) / (hi - lo))
        comm_model[key] = {"alpha_ms": max(0.0, t_lo - beta * lo), "beta_ms_per_byte": beta,
                           "table": _comm_table(cost_model, coll_type, gi, lo, hi, key)}
    dag.graph["comm_model"] = comm_model
    # copy_ms is affine in bytes: store it as per-byte rate + a fixed part
    c0 = _check_ms(cost_model.copy_ms(0), "copy of 0 bytes")
    c1 = _check_ms(cost_model.copy_ms(1 << 30), "copy of 1 GiB")
    dag.graph["copy_ms_fixed"] = c0
    dag.graph["copy_ms_per_byte"] = (c1 - c0) / (1 << 30)
    dag.graph["cost_model"] = getattr(cost_model, "name", type(cost_model).__name__)
    dag.graph["cluster"] = cluster.to_json()
    summary = coverage.summary()
    if summary is None:
        dag.graph.pop("cost_coverage", None)
    else:
        dag.graph["cost_coverage"] = summary
    if coverage_check is not None:
        for line in coverage.shortfalls(coverage_check, getattr(cost_model, "name", type(cost_model).__name__)):
            logger.warning("fsdp-sched: %s", line)
    dag.graph["cost_sources"] = coverage.sources(source_of(cost_model, "copy_source"))
    return dag


class _Coverage:
    """What of a DAG a cost model priced from its own data (a profile, a measured table) and
    what it left to its fallback, for models that say (``compute_matched`` /
    ``collective_matched`` returning True or False, as
    :class:`~scheduler.costs.models.TableCostModel` with a collectives table and
    :class:`~scheduler.costs.models.ProfileCostModel` do; None: the model does not say)."""

    def __init__(self, cost_model: CostModel, cluster: Cluster):
        self.cluster = cluster
        self.model = cost_model
        self._compute = getattr(cost_model, "compute_matched", None)
        self._collective = getattr(cost_model, "collective_matched", None)
        self.compute_ms = 0.0
        self.matched_ms = 0.0
        self.compute_said = False
        self.collective_said = False
        self.fallback_groups: dict[tuple[str, str], dict[str, Any]] = {}
        #: collectives the model said of, and those it priced from its data
        self.n_collectives = 0
        self.n_matched = 0
        #: (ms, node name, target) of compute nodes the fallback priced
        self.unmatched: list[tuple[float, str, str]] = []
        #: (source, measured) -> [nodes, ms] of compute
        self.compute_by_source: dict[tuple[str, bool], list[Any]] = {}
        #: (group, collective type, source, measured) -> [collectives, ms, group size, nodes]
        self.collectives_by_source: dict[tuple[str, str, str, bool], list[Any]] = {}

    def compute(self, attrs: Mapping[str, Any], fx_node: Any, runtime_ms: float) -> None:
        self.compute_ms += runtime_ms
        said = self._compute(attrs, fx_node) if callable(self._compute) else None
        if said is not None:
            self.compute_said = True
            if said:
                self.matched_ms += runtime_ms
            else:
                self.unmatched.append((runtime_ms, str(attrs.get("name")), str(attrs.get("target"))))
        entry = self.compute_by_source.setdefault(
            (source_of(self.model, "compute_source", attrs, fx_node), bool(said)), [0, 0.0])
        entry[0] += 1
        entry[1] += runtime_ms

    def collective(self, coll_type: str, group: GroupInfo, runtime_ms: float = 0.0) -> None:
        said = self._collective(coll_type, group) if callable(self._collective) else None
        entry = self.collectives_by_source.setdefault(
            (group.name, coll_type, source_of(self.model, "collective_source", coll_type, group), bool(said)),
            [0, 0.0, group.size, group.n_nodes(self.cluster)])
        entry[0] += 1
        entry[1] += runtime_ms
        if said is None:
            return
        self.collective_said = True
        self.n_collectives += 1
        self.n_matched += bool(said)
        if not said:
            self.fallback_groups.setdefault((group.name, coll_type), {
                "group_name": group.name, "coll_type": coll_type, "group_size": group.size,
                "nodes": group.n_nodes(self.cluster)})

    def shortfalls(self, check: CoverageCheck, model_name: str) -> list[str]:
        """One line per share below ``check``'s: how much the model priced from its data and
        why it priced no more."""
        lines = []
        if self.collective_said and self.n_matched < check.min_collective_share * self.n_collectives:
            needs = "; ".join(f"{g['coll_type']} on group {g['group_name']!r}: {_ranks_over(g['group_size'], g['nodes'])}"
                              for g in self.fallback_groups.values())
            keys = ask_model(self.model, "collective_keys") or []
            has = "; ".join(f"{c} on {_ranks_over(n, nodes)}" for c, n, nodes in keys) or "no collective rows"
            lines.append(
                f"cost model {model_name!r} priced {self.n_matched} of {self.n_collectives} collectives "
                f"({self.n_matched / self.n_collectives:.0%}) from its data, less than "
                f"CoverageCheck.min_collective_share {check.min_collective_share:.0%}; its fallback prices the "
                f"rest. The graph needs {needs}; the data has {has}: measure the table on the job's own "
                "groups (fsdp-sched measure)")
        share = self.matched_ms / self.compute_ms if self.compute_ms > 0 else None
        if self.compute_said and share is not None and share < check.min_compute_share:
            largest = sorted(self.unmatched, reverse=True)[:3]
            lines.append(
                f"cost model {model_name!r} priced {share:.1%} of compute time from its data, less than "
                f"CoverageCheck.min_compute_share {check.min_compute_share:.0%}; its fallback prices the rest. "
                f"Not priced, the largest: {', '.join(f'{n} ({t}, {fmt_ms(ms)})' for ms, n, t in largest)}: "
                "was the profile recorded from this model, at these shapes, with record_shapes=True?")
        return lines

    def summary(self) -> dict[str, Any] | None:
        """``cost_coverage`` of the DAG: ``compute_ms`` (all compute), ``compute_matched_ms``
        and ``compute_matched_share`` (priced from the model's data; None when the model does
        not say, the share also when there is no compute time), ``fallback_groups`` (one
        record per process group and collective type priced by the fallback: group_name,
        coll_type, group_size, nodes; None when the model does not say). None for a model
        that says neither."""
        if not self.compute_said and not self.collective_said:
            return None
        matched = self.compute_said
        return {
            "compute_ms": self.compute_ms,
            "compute_matched_ms": self.matched_ms if matched else None,
            "compute_matched_share": self.matched_ms / self.compute_ms if matched and self.compute_ms > 0 else None,
            "fallback_groups": ([self.fallback_groups[k] for k in sorted(self.fallback_groups)]
                                if self.collective_said else None),
        }

    def sources(self, copy_source: str) -> dict[str, Any]:
        """``cost_sources`` of the DAG, for any model: what priced each cost component.
        ``compute``: one record per source (``source``: the model or file that priced the
        nodes, ``measured``: whether from measured data, ``nodes``, ``ms``); ``collectives``: one
        record per process group, collective type and source (``group_name``, ``coll_type``,
        ``group_size``, ``nodes``: the nodes its ranks span, ``source``, ``measured``,
        ``count``, ``ms``); ``copies``: ``{"source": ...}`` of the bucket copies."""
        compute = [{"source": src, "measured": measured, "nodes": n, "ms": ms}
                   for (src, measured), (n, ms) in sorted(self.compute_by_source.items(), key=lambda kv: (not kv[0][1], kv[0][0]))]
        collectives = [{"group_name": g, "coll_type": c, "group_size": size, "nodes": nodes, "source": src,
                        "measured": measured, "count": n, "ms": ms}
                       for (g, c, src, measured), (n, ms, size, nodes) in sorted(
                           self.collectives_by_source.items(), key=lambda kv: (kv[0][0], kv[0][1], not kv[0][3],
                                                                                  kv[0][2]))]
        return {"compute": compute, "collectives": collectives, "copies": {"source": copy_source}}


def _ranks_over(size: int, nodes: int) -> str:
    return f"{size} ranks over {nodes} node{'s' if nodes != 1 else ''}"
