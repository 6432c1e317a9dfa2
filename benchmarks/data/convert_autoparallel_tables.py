"""Convert autoparallel's measured H100 collective tables (``tools/overlap_simulator/colls*.table``)
into fsdp-sched's table CSV (``collective,group_size,nodes,input_bytes,ms``).

An upstream table ``colls{DP}_{TP}.table`` holds, per process group of the ``DP x TP`` mesh of
its repros (group "0": the FSDP / dp group; group "1": the tp group, also used for expert
parallel groups), one row per collective and a column per input size ("1MB (ms)" ... "2048MB
(ms)"). Its reader (``run.py``: ``BYTES_PER_MB = 1024 * 1024``; ``get_collective_info`` takes the
bytes of the collective's input tensor, ``node.args[0]``) makes a column the per-rank input in
MiB: our ``input_bytes``.

Nodes spanned (H100 nodes of 8 GPUs, tp innermost): the tp group (size TP = 8) is one node;
the dp group of a 2-D mesh has one rank per node (stride TP), so it spans as many nodes as it
has ranks; a 1-D group (TP = 1) of n ranks spans ceil(n / 8) nodes. ``all_gather_into_tensor_out``
rows repeat the ``all_gather_into_tensor`` rows and are left out.

    python benchmarks/data/convert_autoparallel_tables.py UPSTREAM_DIR/colls8_8.table ... \\
        --out benchmarks/data/autoparallel_h100 --source "meta-pytorch/autoparallel@<commit>"
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

GPUS_PER_NODE = 8
_NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def convert(text: str, dp: int, tp: int) -> list[tuple[str, int, int, int, float]]:
    """Rows (collective, group_size, nodes, input_bytes, ms) of one upstream table."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    sizes_mib = [int(m) for m in re.findall(r"(\d+)MB \(ms\)", lines[0])]
    rows = []
    for line in lines[2:]:  # header, dashes
        parts = line.split()
        group, size, coll = parts[0], int(parts[1]), parts[2]
        if coll not in _NAMES:
            continue
        if group == "1" or tp == 1 and size <= GPUS_PER_NODE:
            nodes = 1
        elif tp == GPUS_PER_NODE:
            nodes = size  # dp strided by tp: one rank per node
        else:
            nodes = math.ceil(size / GPUS_PER_NODE)
        for mib, ms in zip(sizes_mib, parts[3:]):
            rows.append((_NAMES[coll], size, nodes, mib << 20, float(ms)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--source", required=True, help="repository@commit the tables were read from")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.tables:
        dp, tp = (int(x) for x in re.fullmatch(r"colls(\d+)_(\d+)\.table", path.name).groups())
        rows = convert(path.read_text(), dp, tp)
        out = args.out / f"h100_dp{dp}_tp{tp}.csv"
        with open(out, "w") as f:
            f.write(f"# measured H100 collective times, from {args.source}:"
                    f"autoparallel/tools/overlap_simulator/{path.name}\n")
            f.write(f"# mesh dp {dp} x tp {tp}, 8 GPUs per node; see benchmarks/data/README.md\n")
            f.write("collective,group_size,nodes,input_bytes,ms\n")
            for coll, size, nodes, nbytes, ms in rows:
                f.write(f"{coll},{size},{nodes},{nbytes},{ms:g}\n")
        print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
