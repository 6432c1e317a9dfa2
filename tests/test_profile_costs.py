"""Compute costs from a torch.profiler trace (scheduler/profile_trace.py, ProfileCostModel), on
real CPU traces recorded here: a small model's training step runs eagerly under the profiler,
its Chrome trace is exported, the same step is traced to an FX graph and priced from the trace.

The step (w1: 256 x 64, w2: 64 x 256, x: 32 x 64)::

    x -> linear(w1) -> gelu -> linear(w2) -> pow(2) -> mean = loss;  grads of w1, w2
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from scheduler.costs.hardware import Cluster  # noqa: E402
from scheduler.costs.models import AnalyticCostModel, ProfileCostModel  # noqa: E402
from scheduler.costs.spec import resolve_cost_model  # noqa: E402
from scheduler.export.dag import export_dag  # noqa: E402
from scheduler.costs.profiles import ProfileTrace, ProfileTraceError  # noqa: E402

D, H, B = 64, 256, 32


def _loss(w1, w2, x):
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1))
    return torch.nn.functional.linear(h, w2).pow(2).mean()


def _train_step(w1, w2, x):
    return torch.autograd.grad(_loss(w1, w2, x), [w1, w2])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(trace path, traced graph): one eager step under the profiler (after warm-up steps), and
    the same step traced with make_fx on fake tensors."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(H, D, generator=g, requires_grad=True)
    w2 = torch.randn(D, H, generator=g, requires_grad=True)
    x = torch.randn(B, D, generator=g)
    for _ in range(2):
        _loss(w1, w2, x).backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _loss(w1, w2, x).backward()
    path = tmp_path_factory.mktemp("profile") / "step.json"
    prof.export_chrome_trace(str(path))
    gm = make_fx(_train_step, tracing_mode="fake")(w1, w2, x)
    return path, gm


def _events_by_op(path):
    """(aten op, tensor input shapes, their strides) -> durations (ms) of the trace's CPU op
    events, read from the JSON directly (not through the code under test)."""
    out = defaultdict(list)
    for ev in json.loads(path.read_text())["traceEvents"]:
        if ev.get("cat") == "cpu_op" and ev.get("dur", 0) > 0:
            args = ev.get("args", {})
            dims = tuple(tuple(d) for d in (args.get("Input Dims") or []) if d)
            strides = tuple(tuple(d) for d in (args.get("Input Strides") or []) if d)
            out[(ev["name"], dims, strides)].append(ev["dur"] / 1e3)
    return out


def _node_key(node):
    vals = [a.meta["val"] for a in node.args
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim()]
    return (f"aten::{node.target._schema.name.split('::')[-1]}", tuple(tuple(v.shape) for v in vals),
            tuple(tuple(v.stride()) for v in vals))


def test_every_matmul_is_priced_by_its_profiled_calls(recorded):
    """Each mm of the traced step (two forward, three backward) costs the mean of the trace's
    aten::mm calls with its input shapes and strides (those with its shapes where the eager
    step ran it on other strides); with the host time after each call, at least that."""
    path, gm = recorded
    events = _events_by_op(path)
    model = ProfileCostModel(ProfileTrace(path, host_time=False), cluster=Cluster())
    with_host = ProfileCostModel(path, cluster=Cluster())  # a CPU trace: host time counted by default
    dag = export_dag(gm, cost_model=model)
    dag_host = export_dag(gm, cost_model=with_host)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 5
    for node in mms:
        name, shapes, strides = _node_key(node)
        durations = events[(name, shapes, strides)] or [
            d for (op, dims, _), ds in events.items() if (op, dims) == (name, shapes) for d in ds]
        assert durations, f"the eager step ran no aten::mm on {shapes}"
        assert dag.nodes[node.name]["runtime_ms"] == pytest.approx(sum(durations) / len(durations), rel=1e-9)
        assert dag_host.nodes[node.name]["runtime_ms"] >= dag.nodes[node.name]["runtime_ms"]


def test_matched_share_and_fallback(recorded):
    """The DAG records the share of compute time priced from the trace; a node the trace has
    no call for (here: every node, with the trace's mm calls removed) is priced by the fallback
    model, and the share drops accordingly."""
    path, gm = recorded
    model = ProfileCostModel(path, cluster=Cluster())
    dag = export_dag(gm, cost_model=model)
    cov = dag.graph["cost_coverage"]
    computes = {n: a for n, a in dag.nodes(data=True) if a["kind"] == "compute"}
    matched = {n for n in computes if model.trace.lookup_ms(_fx(gm, n)) is not None}
    assert matched and cov["compute_matched_share"] == pytest.approx(
        sum(computes[n]["runtime_ms"] for n in matched) / sum(a["runtime_ms"] for a in computes.values()))
    assert cov["fallback_groups"] is None  # no collectives, no collective model that says
    # a trace without the mm calls: the mms fall back to the analytic model
    data = json.loads(path.read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("name") != "aten::mm"]
    stripped = path.with_name("no_mm.json")
    stripped.write_text(json.dumps(data))
    analytic = AnalyticCostModel(Cluster())
    dag2 = export_dag(gm, cost_model=ProfileCostModel(stripped, fallback=analytic))
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.mm.default:
            a = dag2.nodes[node.name]
            assert a["runtime_ms"] == pytest.approx(analytic.compute_ms({**a, "name": node.name}))
    assert dag2.graph["cost_coverage"]["compute_matched_share"] < cov["compute_matched_share"]


def _fx(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_profile_by_name_with_a_table(recorded, tmp_path):
    """``"profile:TRACE+table:CSV"`` resolves to compute from the trace and collectives from the
    table (the rest analytic); ``"profile:TRACE"`` alone prices the same compute."""
    path, gm = recorded
    csv = tmp_path / "t.csv"
    csv.write_text("collective,group_size,nodes,input_bytes,ms\nall_gather,4,1,1024,0.5\n")
    both = resolve_cost_model(f"profile:{path}+table:{csv}")
    alone = resolve_cost_model(f" profile:{path} ")
    from scheduler.costs.hardware import GroupInfo

    g4 = GroupInfo("0", 4, (0, 1, 2, 3))
    assert both.collective_ms("all_gather", 1024, g4) == pytest.approx(0.5)
    assert alone.collective_ms("all_gather", 1024, g4) == AnalyticCostModel().collective_ms("all_gather", 1024, g4)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    attrs = {"kind": "compute", "name": mm.name}
    assert both.compute_ms(attrs, mm) == alone.compute_ms(attrs, mm) == ProfileTrace(path).lookup_ms(mm)
    assert both.name == f"profile:{path}+table:{csv}"


def test_profile_by_name_through_optimize_schedule(group_name, tmp_path):
    """The toy FSDP graph (tests/test_writeback.py) priced by a profile of its own compute, run
    eagerly with the all-gathers replaced by concatenation (same shapes): the report gives the
    share of compute time the trace priced, as the DAG of the same name records it."""
    import copy

    from test_writeback import _inputs, toy_graph

    from scheduler import SolverOptions, optimize_schedule
    from scheduler.api import REPORT_KEY

    W = 4

    def compute(w1, w2, w3, x, gy):
        a1, a2, a3 = (torch.cat([w.to(torch.bfloat16)] * W) for w in (w1, w2, w3))
        h = torch.mm(x, a1)
        h = torch.relu(torch.mm(h, a2.t()))
        y = torch.mm(h, a3)
        return y, (h.t() @ gy).float(), (x.t() @ h).float()

    args = _inputs(16, W, torch.randn)
    compute(*args)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        compute(*args)
    trace = tmp_path / "toy.json"
    prof.export_chrome_trace(str(trace))
    gm = toy_graph(group_name, W)
    name = f"profile:{trace}"
    expected = export_dag(copy.deepcopy(gm), cost_model=name).graph["cost_coverage"]
    optimize_schedule(gm, None, cost_model=name, solver=SolverOptions(work_limit=2))
    report = gm.meta[REPORT_KEY]
    assert 0 < report.cost_coverage["compute_matched_share"] <= 1
    assert report.cost_coverage["compute_matched_share"] == pytest.approx(expected["compute_matched_share"])


def _op(name, ts, dur, tid=1, dims=((8, 8), (8, 8))):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Input Dims": [list(d) for d in dims], "Input Strides": [[8, 1]] * len(dims),
                     "Input type": ["float"] * len(dims)}}


def test_host_time_of_a_cpu_trace_adds_up_to_the_region_less_its_waits(tmp_path):
    """A graph region of 100 us on one thread (another thread's event is no sibling)::

        CompiledFunction [0, 100)
          aten::mm [0, 30)  c10d issue [35, 45)  aten::relu [50, 60)  wait [62, 80)  aten::add [85, 90)

    With host time: mm is charged up to relu's start (50 us: the issue and the gaps), relu up to
    add's start less the wait (17 us), add up to the region's end (15 us); together the region
    less its wait (82 us). Without: their own durations."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "CompiledFunction", "pid": 7, "tid": 1, "ts": 0, "dur": 100, "args": {}},
        _op("aten::mm", 0, 30),
        _op("_c10d_functional::all_gather_into_tensor", 35, 10, dims=((8, 8),)),
        _op("c10d::_allgather_base_", 36, 8, dims=((64, 8), (8, 8))),  # nested in the issue
        _op("aten::relu", 50, 10, dims=((8, 16),)),
        _op("_c10d_functional::wait_tensor", 62, 18, dims=((64, 8),)),
        _op("aten::add", 85, 5, dims=((4, 4), (4, 4))),
        _op("aten::relu", 20, 300, tid=2, dims=((8, 32),)),  # another thread
    ]
    path = tmp_path / "region.json"
    path.write_text(json.dumps({"traceEvents": events}))
    with_host, own = ProfileTrace(path), ProfileTrace(path, host_time=False)
    key = lambda name, *dims: (name, tuple(dims))  # noqa: E731
    got = {k: v / 1e3 for k, v in with_host._by_shapes.items()}
    assert got[key("aten::mm", (8, 8), (8, 8))] == pytest.approx(0.050)
    assert got[key("aten::relu", (8, 16))] == pytest.approx(0.017)
    assert got[key("aten::add", (4, 4), (4, 4))] == pytest.approx(0.015)
    assert got[key("aten::relu", (8, 32))] == pytest.approx(0.300)  # top level of its thread: no parent
    assert sum(got[key(*k)] for k in [("aten::mm", (8, 8), (8, 8)), ("aten::relu", (8, 16)),
                                      ("aten::add", (4, 4), (4, 4))]) == pytest.approx(0.100 - 0.018)
    assert own._by_shapes[key("aten::mm", (8, 8), (8, 8))] == pytest.approx(30)


@pytest.mark.parametrize("content, needle", [
    ("not json", "not JSON"),
    ("[1, 2]", "not a Chrome trace"),
    ('{"traceEvents": [{"cat": "cpu_op", "name": "aten::mm", "dur": 3, "args": {}}]}', "record_shapes=True"),
])
def test_a_bad_trace_says_why(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileTraceError, match=needle):
        ProfileTrace(path)
    with pytest.raises(ValueError, match=needle):
        resolve_cost_model(f"profile:{path}")



@pytest.mark.parametrize("event, needle", [
    ({**_op("aten::mm", 0, 30), "dur": "30"}, "'dur'"),
    ({**_op("aten::mm", 0, 30), "ts": [0]}, "'ts'"),
    ({**_op("aten::mm", 0, 30), "args": [1, 2]}, "'args'"),
    ({**_op("aten::mm", 0, 30), "name": ["aten::mm"]}, "'name'"),
    ({"name": "gloo:all_gather", "ph": "X", "ts": 0, "dur": "5", "args": {}}, "'dur'"),
    ({"name": "gloo:all_gather", "ph": "X", "ts": 0, "dur": 5, "args": [1]}, "'args'"),
    (7, "not an event object"),
])
def test_a_malformed_event_names_the_file_and_the_event(tmp_path, event, needle):
    """An event torch.profiler would never write (a duration as a string, args as a list, ...)
    is the library's error naming the file and the event, not a TypeError from deep inside."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": [_op("aten::mm", 0, 30, dims=((4, 4), (4, 4))), event]}))
    for read in (lambda: ProfileTrace(path), lambda: resolve_cost_model(f"profile:{path}")):
        with pytest.raises(ProfileTraceError) as info:
            read()
        assert str(path) in str(info.value) and "traceEvents[1]" in str(info.value) and needle in str(info.value)


def test_a_deeply_nested_trace_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ProfileTraceError, match=f"{path}.*nested too deeply"):
        ProfileTrace(path)


def test_a_profile_of_another_model_warns_how_much_it_priced(group_name, tmp_path, caplog):
    """A trace of other shapes prices none of the graph's compute: a WARNING says so (0 % of
    compute time matched), naming the file and the largest nodes it did not price."""
    import copy
    import logging

    from test_writeback import toy_graph

    from scheduler import SolverOptions, optimize_schedule

    path = tmp_path / "other.json"
    path.write_text(json.dumps({"traceEvents": [_op("aten::mm", 0, 30, dims=((3, 5), (5, 7)))]}))
    with caplog.at_level(logging.WARNING, logger="scheduler.costs.annotate"):
        optimize_schedule(copy.deepcopy(toy_graph(group_name, 4)), None, cost_model=f"profile:{path}",
                          solver=SolverOptions(work_limit=1))
    [record] = [r for r in caplog.records if r.name == "scheduler.costs.annotate"]
    message = record.getMessage()
    assert str(path) in message and "0.0% of compute time" in message and "mm" in message

def test_a_missing_trace_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such trace file"):
        resolve_cost_model(f"profile:{tmp_path / 'nope.json'}")


#: (all-gather shard, reduce-scatter input) of the recorded collectives: (rows, cols) fp32
_AG_SHARD, _RS_INPUT = (64, 32), (128, 32)


def _record_collectives(rank, world_size, out_dir):
    """One eager step of two all-gathers and a reduce-scatter on the real gloo group, under the
    profiler (after a warm-up); every rank writes its Chrome trace and returns the path (rank 1
    computes a while first, so that rank 0 waits for it inside each collective)."""
    import torch.distributed as dist

    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    shard, grad = torch.ones(_AG_SHARD), torch.ones(_RS_INPUT)

    def step():
        for _ in range(2):
            if rank == 1:
                torch.mm(torch.ones(256, 256), torch.ones(256, 256))
            ops.wait_tensor(ops.all_gather_into_tensor(shard, world_size, name))
        ops.wait_tensor(ops.reduce_scatter_tensor(grad, "sum", world_size, name))

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    path = f"{out_dir}/rank{rank}.json"
    prof.export_chrome_trace(path)
    return path


@pytest.fixture(scope="module")
def gloo_trace(tmp_path_factory):
    from gloo_harness import run_multiprocess

    out = tmp_path_factory.mktemp("gloo_profile")
    return run_multiprocess(_record_collectives, 2, str(out), timeout_s=120)


def _gloo_ms(path, names, dims):
    """Mean duration (ms) of the trace's events of one of ``names`` on an input of ``dims``,
    read from the JSON directly."""
    durs = [ev["dur"] / 1e3 for ev in json.loads(open(path).read())["traceEvents"]
            if ev.get("name") in names and (ev.get("args") or {}).get("Input Dims", [None])[0] == list(dims)]
    assert durs, f"no {names} event on {dims} in the trace"
    return sum(durs) / len(durs)


def _gloo_events(path):
    """(name, first input dims, start, duration ms) of the trace's gloo events, by start."""
    evs = [ev for ev in json.loads(open(path).read())["traceEvents"] if str(ev.get("name", "")).startswith("gloo:")]
    return sorted(((ev["name"], ev["args"]["Input Dims"][0], ev["ts"], ev["dur"] / 1e3) for ev in evs),
                  key=lambda e: e[2])


def test_with_its_peers_traces_each_collective_is_timed_on_the_rank_that_started_it_last(gloo_trace):
    """Every rank ran the same collectives in the same order; each is timed by the rank that
    started it last (it waited for no peer in it), whichever trace is read first."""
    mine, peer = (_gloo_events(p) for p in gloo_trace)
    assert [e[:2] for e in mine] == [e[:2] for e in peer]
    last = [max(a, b, key=lambda e: e[2])[3] for a, b in zip(mine, peer)]
    ag = [t for t, e in zip(last, mine) if e[0] == "gloo:all_gather"]
    ag_bytes = 4 * _AG_SHARD[0] * _AG_SHARD[1]
    for path, other in (gloo_trace, gloo_trace[::-1]):
        trace = ProfileTrace(path, peer_traces=[other])
        assert trace.collective_ms("all_gather", ag_bytes) == pytest.approx(sum(ag) / len(ag))
    # every rank's trace read once gives each rank the same times
    for trace in ProfileTrace.of_group(gloo_trace):
        assert trace.collective_ms("all_gather", ag_bytes) == pytest.approx(sum(ag) / len(ag))
    alone = ProfileTrace(gloo_trace[0])
    assert alone.collective_ms("all_gather", ag_bytes) == pytest.approx(
        _gloo_ms(gloo_trace[0], ("gloo:all_gather",), _AG_SHARD))


def test_a_gloo_trace_prices_the_collectives_it_ran(gloo_trace, group_name):
    """A trace of a real gloo group prices each collective of the same kind and per-rank input
    bytes by gloo's own time for it in that step (a reduce-scatter by the all-reduce gloo ran
    for it); other sizes, and every collective with ``collectives=False``, by the fallback. In
    a graph exported with the model, the collective nodes carry those times."""
    from scheduler.costs.hardware import GroupInfo

    gloo_trace = gloo_trace[0]

    analytic = AnalyticCostModel(Cluster())
    model = ProfileCostModel(gloo_trace, fallback=analytic)
    idle = ProfileCostModel(gloo_trace, fallback=analytic, collectives=False)
    group = GroupInfo(name="g", size=4)
    ag_bytes, rs_bytes = 4 * _AG_SHARD[0] * _AG_SHARD[1], 4 * _RS_INPUT[0] * _RS_INPUT[1]
    ag_ms = _gloo_ms(gloo_trace, ("gloo:all_gather",), _AG_SHARD)
    rs_ms = _gloo_ms(gloo_trace, ("gloo:reduce_scatter", "gloo:all_reduce"), _RS_INPUT)
    assert model.collective_ms("all_gather", ag_bytes, group) == pytest.approx(ag_ms)
    assert model.collective_ms("reduce_scatter", rs_bytes, group) == pytest.approx(rs_ms)
    assert idle.collective_ms("all_gather", ag_bytes, group) == analytic.collective_ms("all_gather", ag_bytes, group)
    assert model.collective_ms("all_gather", 2 * ag_bytes, group) == \
        analytic.collective_ms("all_gather", 2 * ag_bytes, group)
    assert model.collective_matched("all_gather", group) and not idle.collective_matched("all_gather", group)

    W, ops = 4, torch.ops._c10d_functional

    def f(shard, grad):
        a = ops.wait_tensor(ops.all_gather_into_tensor(shard, W, group_name))
        g = ops.wait_tensor(ops.reduce_scatter_tensor(grad, "sum", W, group_name))
        return a.sum() + g.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.ones(_AG_SHARD), torch.ones(_RS_INPUT))
    dag = export_dag(gm, cost_model=model)
    priced = {a["coll_type"]: a["runtime_ms"] for _, a in dag.nodes(data=True) if a.get("kind") == "collective"}
    assert priced == pytest.approx({"all_gather": ag_ms, "reduce_scatter": rs_ms})
