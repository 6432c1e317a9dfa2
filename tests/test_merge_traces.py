"""Write-back traces torch's bucket-merge function once per bucket shape and reuses the trace.

A reused trace must still give every merged bucket storages of its own: torch's MemoryTracker
(and inductor) tell storages apart by their FakeTensors, so two buckets sharing one fake
storage would be counted as one storage, alive from the first bucket's issue to the second's
last reader. The outcome checked: on a graph whose blocks give several merged buckets of one
shape, torch's tracker count of the written graph equals the simulator's prediction of it, the
graph and its nodes' records (module stacks, stack traces, provenance) are the same as written by
torch's own functions unchanged, and each bucket shape is traced once, reduce-scatters included.
Judging a candidate, written on a copy that shares the graph's FakeTensors, leaves the graph as
it was.
"""

from __future__ import annotations

import copy
import contextlib

import pytest

import scheduler
from scheduler import writeback
from scheduler.check.written import graph_digest
from scheduler.check.judge import torch_tracker_peak
from solvers.core import Problem, simulate
from solvers.heuristics import fsdp2_schedule

from conftest import capture_llama_debug


@pytest.fixture(scope="module")
def graphs(group_name):
    return capture_llama_debug(4)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_buckets_of_one_shape_keep_storages_of_their_own(graphs, kind):
    gm = getattr(graphs, kind)
    p = Problem.from_dag(scheduler.export_dag(gm))
    schedule = fsdp2_schedule(p)  # one bucket per block: the blocks' buckets have one shape
    merged = [b for b in schedule.buckets if len(b.members) > 1]
    shapes = {(p.colls[b.members[0]].coll_type, *(p.colls[m].payload_bytes for m in b.members)) for b in merged}
    assert len(merged) > len(shapes), "the schedule must hold several merged buckets of one shape"

    predicted = simulate(p.dag, schedule, problem=p).tracker_peak_bytes
    reused = copy.deepcopy(gm)
    misses = writeback._MEMO.misses
    writeback.apply_schedule(reused, p, schedule)
    assert writeback._MEMO.hits > 0
    assert writeback._MEMO.misses - misses <= len(shapes)
    assert torch_tracker_peak(reused) == predicted

    fresh = copy.deepcopy(gm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writeback, "merge_traces_reused", contextlib.nullcontext)
        writeback.apply_schedule(fresh, p, schedule)
    assert graph_digest(fresh) == graph_digest(reused)
    assert torch_tracker_peak(fresh) == predicted
    assert node_records(fresh) == node_records(reused)


def node_records(gm):
    """Each node's records that torch's merge writes, provenance as (name, pass, chain) trees."""
    def source(s):
        return (s.name, s.target, s.pass_name, [a.name for a in s.action], [source(f) for f in s.from_node])

    out = {}
    for n in gm.graph.nodes:
        meta = {k: v for k, v in n.meta.items()
                if k in ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "custom")
                or k.startswith("bucketing_")}
        meta["from_node"] = [source(s) for s in n.meta.get("from_node", ())]
        out[n.name] = repr(meta)
    return out


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_judging_a_candidate_leaves_the_graph_as_it_was(graphs, kind):
    """Candidates are written on a copy that shares the graph's FakeTensors and meta values
    (writeback.copy_module), not on a deep copy: the graph judged from must come out unchanged,
    its nodes, their order and every meta entry (the same objects), provenance included."""
    from scheduler.check.written import write_and_judge

    gm = copy.deepcopy(getattr(graphs, kind))
    p = Problem.from_dag(scheduler.export_dag(gm))
    schedule = fsdp2_schedule(p)
    assert any(len(b.members) > 1 for b in schedule.buckets)

    def snapshot():
        records = node_records(gm)
        return [(n.name, n.op, {k: id(v) for k, v in n.meta.items()}, records[n.name]) for n in gm.graph.nodes]

    before, digest, code = snapshot(), graph_digest(gm), gm.code
    figures = write_and_judge(gm, p, schedule, cost_model=None, cluster=None, payload_order="registration",
                              control_deps=False)
    assert figures.n_collectives < len(p.colls)  # the copy was written: buckets merged
    assert snapshot() == before
    assert (graph_digest(gm), gm.code) == (digest, code)
