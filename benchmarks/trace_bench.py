"""Time the capture of full-size FSDP training-step graphs (models.capture_fsdp_graphs).

Usage::

    python benchmarks/trace_bench.py --models llama3-8b llama3-70b --world-size 8
    python benchmarks/trace_bench.py --models llama3-405b --n-layers 16

Prints, per model: wall time of the capture, node counts of the forward and backward graphs,
the number of collectives of each kind (all-gather, reduce-scatter, all-reduce) per graph, the
export time of each graph and its traced-order simulation (step, exposed communication, peak
memory) with the analytic cost model on ``--world-size`` GPUs, ``--gpus-per-node`` per node.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import capture_fsdp_graphs  # noqa: E402
from models.capture import COLLECTIVES  # noqa: E402
from scheduler import Cluster, export_dag, save_dag, simulate  # noqa: E402

DEFAULT_MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")


def collective_counts(gm) -> dict[str, int]:
    """Collective op name (e.g. 'all_gather_into_tensor') -> number of nodes in ``gm``."""
    counts = Counter(n.target._overloadpacket.__name__ for n in gm.graph.nodes if n.target in COLLECTIVES)
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="preset names")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the fake group (dp * tp)")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel degree (2-D mesh if > 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="cluster topology for costs")
    parser.add_argument("--save-dags", type=Path, default=None, help="write the exported DAGs (JSON) here")
    parser.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                        help="activation checkpointing per block")
    parser.add_argument("-v", "--verbose", action="store_true", help="log capture progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    for name in args.models:
        start, cpu_start = time.perf_counter(), time.process_time()
        c = capture_fsdp_graphs(name, world_size=args.world_size, n_layers=args.n_layers,
                                tp_size=args.tp_size, reshard_after_forward=not args.no_reshard,
                                activation_checkpointing=args.ac)
        wall_s = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start  # differs from wall time when the machine is shared
        max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{name}: {c.config.n_layers} layers, {len(c.param_fqns)} params, world {args.world_size}, "
              f"capture {wall_s:.1f} s wall / {cpu_s:.1f} s CPU, max RSS {max_rss_mib:.0f} MiB")
        cluster = Cluster(n_gpus=args.world_size, gpus_per_node=args.gpus_per_node)
        for kind, gm in (("forward", c.forward), ("backward", c.backward)):
            t0 = time.perf_counter()
            dag = export_dag(gm, cluster=cluster)
            export_s = time.perf_counter() - t0
            sim = simulate(dag)
            if args.save_dags:
                save_dag(dag, args.save_dags / f"{name}-{c.config.n_layers}l-w{args.world_size}-{kind}.json")
            print(f"  {kind:8s} {len(gm.graph.nodes):6d} nodes  {collective_counts(gm)}  export {export_s:.2f} s; "
                  f"traced order on {args.world_size} GPUs ({args.gpus_per_node}/node): step {sim.step_ms:.1f} ms, "
                  f"exposed comm {sim.exposed_comm_ms:.1f} ms, peak {sim.peak_bytes / 2**30:.2f} GiB")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
