"""Numerics of fsdp-sched on the small FSDP x TP graphs, on a real gloo group of 4 CPU processes.

Each rank builds a 2 x 2 (dp, tp) mesh, traces the sequence-parallel forward and backward of
``tests/parallel_graphs.py`` with its real process groups' names, runs the traced graph on its
own inputs (real collectives), then runs ``scheduler.optimize_schedule`` on a copy at the
traced peak (the ranks agree on the schedule as in a job) and runs the written graph on the same
inputs. The written graph merges FSDP all-gathers across the tensor-parallel collectives; every
output must be bitwise equal (``torch.equal``) to the traced graph's, on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # gloo_harness and parallel_graphs in spawned ranks

from gloo_harness import run_multiprocess  # noqa: E402

WORLD = 4
TIMEOUT_S = 600.0


def _rank_run(rank: int, world_size: int) -> dict[str, Any]:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import parallel_graphs as pg
    from scheduler import optimize_schedule
    from scheduler.api import REPORT_KEY
    from scheduler.check.written import judge_graph
    from scheduler.options import SolverOptions

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    g = pg.mesh_groups(mesh)
    gen = torch.Generator().manual_seed(1000 + rank)

    def make(*shape):
        return torch.randn(*shape, generator=gen)

    out: dict[str, Any] = {}
    for kind, fn, inputs in (("forward", pg.sp_forward(g), pg.sp_inputs(g, make=make)),
                             ("backward", pg.sp_backward(g), pg.sp_backward_inputs(g, make=make))):
        gm = pg.trace(fn, inputs)
        traced = gm(*inputs)
        written = copy.deepcopy(gm)
        optimize_schedule(written, judge_graph(gm, "analytic").max_peak_bytes, cost_model="analytic",
                          solver=SolverOptions(work_limit=2.0))
        after = written(*inputs)
        gathers = ("all_gather_into_tensor", "all_gather_into_tensor_out")
        dp_gathers = [sum(1 for n in m.graph.nodes if n.op == "call_function"
                          and getattr(n.target, "_opname", None) in gathers and n.args[-1] == g.dp)
                      for m in (gm, written)]
        out[kind] = {
            "equal": [bool(torch.equal(a, b)) for a, b in zip(traced, after)],
            "n_outputs": (len(traced), len(after)),
            "dp_gathers": dp_gathers,
            "digest": written.meta[REPORT_KEY].digest,
        }
    return out


@pytest.mark.slow
def test_written_fsdp_tp_graphs_compute_bitwise_what_the_traced_ones_compute():
    results = run_multiprocess(_rank_run, WORLD, timeout_s=TIMEOUT_S, threads_per_process=1)
    for kind in ("forward", "backward"):
        per_rank = [r[kind] for r in results]
        for rank, r in enumerate(per_rank):
            assert r["n_outputs"][0] == r["n_outputs"][1] and all(r["equal"]), (kind, rank, r)
            before, after = r["dp_gathers"]
            assert after < before, (kind, rank, r)  # the written graph merged FSDP all-gathers
        assert len({r["digest"] for r in per_rank}) == 1  # one schedule on every rank
