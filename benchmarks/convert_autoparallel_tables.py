"""Convert autoparallel's measured H100 collective tables into fsdp-sched's table CSV.

autoparallel (github.com/meta-pytorch/autoparallel) publishes, beside the FSDP graphs of its
overlap simulator (``autoparallel/tools/overlap_simulator``), collective times measured on H100
clusters: ``colls{DP}_{TP}.table``, one per ``DP x TP`` mesh. They are third-party files: this
script reads them from a checkout the user fetched and writes the CSVs
(``collective,group_size,nodes,input_bytes,ms``, :mod:`scheduler.costs.tables`) into a folder of
the user's choice; nothing of them is kept in this repository. The equal-memory rows judged by
measured times and ``fidelity_collectives.py`` read the folder it writes (``BENCHMARKS.md``)::

    python benchmarks/convert_autoparallel_tables.py ~/autoparallel/autoparallel/tools/overlap_simulator --out h100

writes ``h100/h100_dp8_tp8.csv``, ``h100_dp16_tp8.csv`` and ``h100_dp32_tp8.csv``; use them as
``cost_model="table:h100"`` (a folder reads as one table) or one file as ``table:PATH``.

How the upstream columns map:

- sizes: a column "N MB (ms)" is N MiB (``run.py``: ``BYTES_PER_MB = 1024 * 1024``) of the
  collective's input tensor (``get_collective_info`` reads ``node.args[0]``): for an all-gather
  the shard, for a reduce-scatter the full input; that is ``input_bytes``. 1 MiB to 2 GiB.
- groups and nodes: group "0" is the FSDP (dp) group, group "1" the tp group (the DeepSeek-V3
  repros map their expert-parallel groups to it as "intranode"). H100 nodes of 8 GPUs with tp
  innermost: tp spans one node, the dp group of a 2-D mesh one rank per node (``nodes =
  group_size``), a 1-D group (TP = 1) of n ranks ``ceil(n / 8)`` nodes. This placement is our
  reading of the mesh (the files do not state it).
- ``all_gather_into_tensor_out`` rows repeat the ``all_gather_into_tensor`` rows and are left
  out.

What to know about the figures as published: in ``colls8_8`` and ``colls32_8`` (dp group) and
in the tp group, the all-gather time at input ``s`` equals the reduce-scatter time at input
``n * s`` to the last digit (the same bytes on the wire: one was probably derived from the
other); the tp rows are the same in all three files; ``colls64_1.table`` (a 1-D group of 64)
holds round numbers on an exact doubling pattern and is converted only when named.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

GPUS_PER_NODE = 8
#: the tables of the 2-D meshes, converted when none is named
DEFAULT_TABLES = ("colls8_8.table", "colls16_8.table", "colls32_8.table")
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


def convert_folder(folder: Path, out: Path, names: tuple[str, ...] = DEFAULT_TABLES) -> list[Path]:
    """Each table ``names`` of ``folder`` (autoparallel's ``tools/overlap_simulator``) as
    ``out/h100_dp{DP}_tp{TP}.csv``; the paths written.

    Raises:
        SystemExit: a table is missing or its name is not ``colls{DP}_{TP}.table``.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        path = folder / name
        match = re.fullmatch(r"colls(\d+)_(\d+)\.table", name)
        if match is None or not path.is_file():
            raise SystemExit(f"{path}: not an autoparallel collective table (colls{{DP}}_{{TP}}.table); give the "
                             "folder autoparallel/tools/overlap_simulator of a checkout of meta-pytorch/autoparallel")
        dp, tp = (int(x) for x in match.groups())
        rows = convert(path.read_text(), dp, tp)
        target = out / f"h100_dp{dp}_tp{tp}.csv"
        with open(target, "w") as f:
            f.write(f"# measured H100 collective times, converted from {path}\n")
            f.write(f"# mesh dp {dp} x tp {tp}, 8 GPUs per node (benchmarks/convert_autoparallel_tables.py)\n")
            f.write("collective,group_size,nodes,input_bytes,ms\n")
            for coll, size, nodes, nbytes, ms in rows:
                f.write(f"{coll},{size},{nodes},{nbytes},{ms:g}\n")
        written.append(target)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="autoparallel's autoparallel/tools/overlap_simulator folder")
    p.add_argument("--out", type=Path, required=True, help="the folder the CSVs are written to")
    p.add_argument("--tables", nargs="+", default=list(DEFAULT_TABLES), help="table names (default: %(default)s)")
    args = p.parse_args()
    for path in convert_folder(args.folder, args.out, tuple(args.tables)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
