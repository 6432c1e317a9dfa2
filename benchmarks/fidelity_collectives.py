"""Fidelity of the collective cost models against measured H100 collective times.

For every row of a measured table (``--table``: a CSV, nccl-tests output or a folder of them;
``BENCHMARKS.md`` uses autoparallel's published H100 tables, converted outside this repository
by ``benchmarks/convert_autoparallel_tables.py``), the time our cost models predict for
that collective, input size and group, against the measured time (ratio predicted / measured):

- ``analytic``: :class:`scheduler.costs.models.AnalyticCostModel` (NCCL ring alpha-beta);
- ``torch``: :class:`scheduler.costs.torch_model.TorchCostModel` (torch's NCCL estimator), the group priced
  by the nodes its ranks span;
- ``torch (size only)``: the same estimator given the group size alone, as torch prices an FX
  node by itself (``ceil(size / 8)`` nodes): what the torch model did before it counted nodes
  from the ranks.

Groups are placed as the table says: a group of ``n`` ranks over ``k`` nodes gets the ranks
``n / k`` per node on ``k`` nodes of the cluster (8 H100 per node, the :class:`Cluster` defaults).
Prints markdown: a summary per (collective, group, nodes) over the sizes of at least
``--min-mib`` MiB (geometric mean and range of the ratio), then every row.

    python benchmarks/convert_autoparallel_tables.py AP/autoparallel/tools/overlap_simulator --out h100
    python benchmarks/fidelity_collectives.py --table h100     # a few seconds
    python benchmarks/fidelity_collectives.py --table my_nccl_tests_logs/ --all-rows
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scheduler.costs.tables import CollectiveTable  # noqa: E402
from scheduler.costs.hardware import Cluster, GroupInfo  # noqa: E402
from scheduler.costs.models import AnalyticCostModel  # noqa: E402
from scheduler.costs.torch_model import TorchCostModel  # noqa: E402

MODELS = ("analytic", "torch", "torch (size only)")


def placed_group(size: int, nodes: int, cluster: Cluster) -> GroupInfo:
    """``size`` ranks over ``nodes`` nodes: ``size / nodes`` consecutive ranks on each."""
    per_node = math.ceil(size / nodes)
    ranks = tuple(node * cluster.gpus_per_node + i for node in range(nodes) for i in range(per_node))[:size]
    return GroupInfo(f"{size}x{nodes}", size, ranks)


def compare(table: CollectiveTable, cluster: Cluster) -> list[dict[str, Any]]:
    """One row per measured point: collective, group_size, nodes, input_bytes, measured_ms and
    each model's ms."""
    analytic, torch_model = AnalyticCostModel(cluster), TorchCostModel(cluster)
    rows = []
    for (coll, size, nodes), points in table.points.items():
        group = placed_group(size, nodes, cluster)
        by_size = GroupInfo(group.name, size, None)
        assert group.n_nodes(cluster) == nodes
        for nbytes, ms in points:
            rows.append({
                "collective": coll, "group_size": size, "nodes": nodes, "input_bytes": nbytes, "measured_ms": ms,
                "analytic": analytic.collective_ms(coll, nbytes, group),
                "torch": torch_model.collective_ms(coll, nbytes, group),
                "torch (size only)": torch_model.collective_ms(coll, nbytes, by_size),
            })
    return rows


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary_table(rows: list[dict[str, Any]], min_bytes: int) -> str:
    keys = sorted({(r["collective"], r["group_size"], r["nodes"]) for r in rows})
    lines = ["| collective | ranks | nodes | sizes | " + " | ".join(f"{m}: pred / meas" for m in MODELS) + " |",
             "|---|---|---|---|" + "---|" * len(MODELS)]
    for key in keys:
        sel = [r for r in rows if (r["collective"], r["group_size"], r["nodes"]) == key and r["input_bytes"] >= min_bytes]
        if not sel:
            continue
        cells = []
        for m in MODELS:
            ratios = [r[m] / r["measured_ms"] for r in sel]
            cells.append(f"{_geomean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        span = f"{_mib(sel[0]['input_bytes'])}-{_mib(sel[-1]['input_bytes'])} MiB"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {span} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| collective | ranks | nodes | input MiB | measured ms | " + " | ".join(f"{m} ms (ratio)" for m in MODELS) + " |",
             "|---|---|---|---|---|" + "---|" * len(MODELS)]
    for r in rows:
        cells = [f"{r[m]:.4g} ({r[m] / r['measured_ms']:.2f})" for m in MODELS]
        lines.append(f"| {r['collective']} | {r['group_size']} | {r['nodes']} | {_mib(r['input_bytes'])} | "
                     f"{r['measured_ms']:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, required=True,
                   help="a measured table: CSV, nccl-tests output or a directory of them")
    p.add_argument("--min-mib", type=float, default=1.0,
                   help="summary over sizes of at least this many MiB (default %(default)s)")
    p.add_argument("--all-rows", action="store_true", help="also print every row")
    args = p.parse_args(argv)
    cluster = Cluster()
    rows = compare(CollectiveTable.read(args.table), cluster)
    print(f"Collective models against measured times ({args.table}); cluster: {cluster.gpu_spec.name}, "
          f"{cluster.gpus_per_node} GPUs per node, NVLink {cluster.intra_node_gbps:g} GB/s, network "
          f"{cluster.inter_node_gbps:g} GB/s per GPU. Ratio predicted / measured: geometric mean (range).\n")
    print(summary_table(rows, int(args.min_mib * (1 << 20))))
    if args.all_rows:
        print()
        print(rows_table(rows))


if __name__ == "__main__":
    main()
