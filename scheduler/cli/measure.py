"""``fsdp-sched measure``: time the collectives on the user's own process group and write the
table that ``--cost-model table:PATH`` (``cost_model="table:PATH"``) reads.

Run it on every rank of the job, as the training job itself is launched::

    torchrun --nproc-per-node 8 --nnodes 4 ... -m scheduler.cli measure --out collectives.csv
    torchrun ... -m scheduler.cli measure --mesh 4x8 --out collectives.csv   # dp x tp groups

Without an initialised process group it initialises one from the launcher's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL where CUDA is available,
else gloo (``--backend`` chooses). Rank 0 writes the CSV (:mod:`scheduler.costs.tables`), logs
each timing with the spread of its samples, and warns of the rows not to trust (a large spread,
or slower than a larger size: :func:`scheduler.costs.measure_collectives.noisy_rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path

from scheduler.cli.common import CliError
from scheduler.costs.tables import CollectiveTable
from solvers.core import parse_bytes

logger = logging.getLogger(__name__)

#: environment variables a launcher (torchrun, mpirun with them exported) sets on every rank
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def sizes_arg(text: str) -> tuple[int, ...]:
    """``--sizes``: comma-separated sizes ("4KiB,1MiB,64MiB") of the per-rank input."""
    try:
        sizes = tuple(parse_bytes(t.strip()) for t in text.split(",") if t.strip())
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad size in {text!r}: {e}") from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r}; give e.g. 4KiB,1MiB,64MiB")
    return tuple(sorted(set(sizes)))  # type: ignore[arg-type]


def mesh_arg(text: str) -> tuple[int, ...]:
    """``--mesh``: the job's device mesh, outermost dimension first ("8x8": dp 8 x tp 8)."""
    try:
        dims = tuple(int(t) for t in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad mesh {text!r}; write the dimensions like 8x8") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"bad mesh {text!r}; every dimension must be >= 1")
    return dims


def out_file_arg(text: str) -> str:
    """``--out``: a file in an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a CSV file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} of {text!r} does not exist")
    return text


def cmd_measure(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from scheduler.costs.measure_collectives import measure_collectives

    owned = False
    if not dist.is_initialized():
        missing = [v for v in _LAUNCH_ENV if v not in os.environ]
        if missing:
            raise CliError(
                f"fsdp-sched measure times collectives on a process group, and {', '.join(missing)} "
                "is not set: launch it on every rank like the job, e.g. `torchrun --nproc-per-node 8 -m "
                "scheduler.cli measure --out collectives.csv`")
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        owned = True
    try:
        world = dist.get_world_size()
        if world < 2:
            raise CliError("the process group has one rank; collectives need at least two")
        groups = _groups(args.mesh, world)
        rows, doubts = [], []
        for group in groups:
            table, noisy = measure_collectives(group, collectives=args.collectives, sizes=args.sizes,
                                               repeats=args.repeats, warmup=args.warmup)
            rows += table.rows
            doubts += noisy
        # every rank has its own groups' tables; rank 0 writes its own
        table = CollectiveTable(rows)
        failure = [_write_table(table, args.out) if dist.get_rank() == 0 else None]
        # in place of a barrier: every rank learns whether the table was written, so that a
        # rank 0 that could not write it is not the only one to stop
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise CliError(failure[0])
        if dist.get_rank() == 0:
            n_rows = sum(len(p) for p in table.points.values())
            if args.json:
                print(json.dumps({"out": args.out, "rows": n_rows, "noisy": doubts}))
                return 0
            if not args.quiet:
                print(table.to_csv(), end="")
            print(f"wrote {args.out} ({n_rows} rows" + (f"; {len(doubts)} noisy, warned about above: measure again "
                                                        "with more --repeats on a quiet machine)" if doubts else ")"))
    finally:
        if owned:
            dist.destroy_process_group()
    return 0


def _write_table(table: CollectiveTable, out: str) -> str | None:
    """Write ``table`` to ``out``; None when written, else the line that says why not (a
    partial regular file is removed: a CSV cut inside a number would read as another time)."""
    try:
        table.to_csv(out)
    except OSError as e:
        path = Path(out)
        with contextlib.suppress(OSError):
            if path.is_file():
                path.unlink()
        return f"cannot write the table to {out}: {e.strerror or e}; give --out a file on a writable disk with space"
    return None


def _groups(mesh: tuple[int, ...] | None, world: int) -> list:
    """The process groups to measure: the world, or this rank's group along every dimension of
    ``mesh`` (every group of a dimension runs at once, as in training)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if mesh is None:
        return [dist.group.WORLD]
    n = 1
    for d in mesh:
        n *= d
    if n != world:
        raise CliError(f"--mesh {'x'.join(map(str, mesh))} has {n} ranks; the process group has {world}")
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    if device == "cuda":
        torch.cuda.set_device(torch.cuda.current_device())
    dm = init_device_mesh(device, mesh)
    return [dm.get_group(d) for d in range(len(mesh)) if mesh[d] > 1]
