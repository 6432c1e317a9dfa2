"""Cross-check our simulator's peak memory against torch's memory estimator.

For each model, captures the forward and backward FSDP graphs and compares, on the graphs as
traced (no schedule applied):

- ours:  ``scheduler.simulate(gm).peak_bytes`` (execution model of DESIGN.md);
- torch: ``scheduler.compare.baselines.torch_memory_peak(gm)``, i.e.
  ``memory_estimator.build_memory_profile`` with ``wait_tensor`` treated as an alias of its
  collective's output (what the real op does);
- torch raw: the same without that correction (torch's fake ``wait_tensor`` gets a fresh
  storage, so every wait briefly holds the collective's output twice).

It also lists every node whose allocation differs between our DAG and torch's storage
tracking (waits excluded), which is where any disagreement comes from. Exit status 1 when a
relative difference ours vs torch exceeds ``--tolerance``.

    python benchmarks/memcheck.py                       # llama3-debug:2, llama3-8b:2, llama3-8b:32
    python benchmarks/memcheck.py llama3-8b:32 --world-size 64
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):  # this repository's library and its harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("llama3-debug:2", "llama3-8b:2", "llama3-8b:32")


def allocation_mismatches(gm, dag) -> list[tuple[str, str, int, int]]:
    """Nodes whose fresh allocation differs: (name, target, ours bytes, torch bytes).

    Ours: ``size_bytes`` of a DAG node that owns its storage (``alias_of`` is None); torch:
    bytes of the storages ``GraphAliasTracker`` sees the node allocate. Waits are skipped
    (aliases in our model, fresh storages in torch's fake tensors: see torch_memory_peak).
    """
    import torch
    from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker

    wait = torch.ops._c10d_functional.wait_tensor.default
    nodes = list(gm.graph.nodes)
    tracker = GraphAliasTracker(nodes)
    out = []
    for n in nodes:
        a = dag.nodes[n.name]
        if n.target is wait or a["kind"] == "output":
            continue
        ours = int(a["size_bytes"]) if a["alias_of"] is None else 0
        theirs = sum(int(s.storage.nbytes()) for s in tracker.get_fresh_allocations(n))
        if ours != theirs:
            out.append((n.name, str(a["target"]), ours, theirs))
    return out


def check(model: str, n_layers: int, world_size: int, tolerance: float) -> bool:
    from models import capture_fsdp_graphs
    from scheduler import export_dag, simulate
    from scheduler.compare.baselines import torch_memory_peak

    t0 = time.perf_counter()
    graphs = capture_fsdp_graphs(model, world_size=world_size, n_layers=n_layers)
    print(f"{model} x{n_layers} layers, {world_size} ranks (captured in {time.perf_counter() - t0:.1f} s)")
    ok = True
    for kind in ("forward", "backward"):
        gm = getattr(graphs, kind)
        dag = export_dag(gm)
        ours = simulate(dag).peak_bytes
        torch_peak = torch_memory_peak(gm)
        torch_raw = torch_memory_peak(gm, wait_aliases_input=False)
        rel = (ours - torch_peak) / torch_peak
        rel_raw = (ours - torch_raw) / torch_raw
        ok &= abs(rel) <= tolerance
        print(
            f"  {kind:8s} nodes={len(gm.graph.nodes):5d} ours={ours / 2**20:10.2f} MiB  "
            f"torch={torch_peak / 2**20:10.2f} MiB ({rel:+.3%})  "
            f"torch raw={torch_raw / 2**20:10.2f} MiB ({rel_raw:+.3%})"
        )
        mismatches = allocation_mismatches(gm, dag)
        for name, target, a, b in mismatches[:10]:
            print(f"    allocation differs: {name} ({target}): ours {a} B, torch {b} B")
        if len(mismatches) > 10:
            print(f"    ... {len(mismatches) - 10} more")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), help="PRESET:N_LAYERS")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.02, help="max |ours - torch| / torch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ok = True
    for spec in args.models:
        model, _, layers = spec.partition(":")
        ok &= check(model, int(layers) if layers else None, args.world_size, args.tolerance)
    print("all within tolerance" if ok else f"some differ by more than {args.tolerance:.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
