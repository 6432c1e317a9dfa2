"""Measured collective times as a cost model (scheduler/cost_tables.py, TableCostModel):
CSV and nccl-tests output read back, log-log interpolation, extrapolation, groups without a row
reported as priced by the fallback, ``cost_model="table:PATH"`` through optimize_schedule, and
bad files refused with the line and the field named."""

from __future__ import annotations

import math

import pytest

from scheduler.costs.tables import CostTableError, interpolate_ms, read_nccl_tests
from scheduler.costs.annotate import annotate_costs
from scheduler.costs.hardware import Cluster, GroupInfo
from scheduler.costs.models import AnalyticCostModel, TableCostModel
from scheduler.costs.spec import resolve_cost_model
from scheduler.whatif.synthetic import DagBuilder

MiB = 1 << 20
H100 = Cluster()  # 8 GPUs per node
#: the dp group of a dp 8 x tp 8 mesh: one rank per node
DP_STRIDED = GroupInfo("dp", 8, tuple(range(0, 64, 8)))
#: the tp group: one node
TP = GroupInfo("tp", 8, tuple(range(8)))

CSV = """\
# all-gather / reduce-scatter on the dp group (8 ranks, 8 nodes), all-reduce on tp (one node)
collective,group_size,nodes,input_bytes,ms
all_gather,8,8,1048576,0.2397
all_gather,8,8,4194304,0.7181
all_gather,8,8,16777216,2.5531
reduce_scatter,8,8,8388608,0.2397
reduce_scatter,8,8,33554432,0.7181

all_reduce,8,1,1048576,0.028
all_reduce,8,1,16777216,0.1292
"""


@pytest.fixture
def csv_path(tmp_path):
    p = tmp_path / "colls.csv"
    p.write_text(CSV)
    return p


# --- reading and looking up ---------------------------------------------------------------------
def test_csv_read_back_exact_at_every_row(csv_path):
    """Every row of the CSV comes back as the model's time for its group (the group's nodes
    counted from its real ranks)."""
    model = TableCostModel.from_file(csv_path, cluster=H100)
    rows = [ln.split(",") for ln in CSV.splitlines() if ln and not ln.startswith(("#", "collective"))]
    assert len(rows) == 7
    for coll, n, nodes, nbytes, ms in rows:
        group = DP_STRIDED if nodes == "8" else TP
        assert model.collective_ms(coll, int(nbytes), group) == pytest.approx(float(ms), rel=1e-12)
    assert model.name == f"table:{csv_path}"


def test_interpolation_is_log_log_and_monotone_between_rows(csv_path):
    """Between two rows the time follows the power law through both: at the geometric mean of
    two sizes it is the geometric mean of their times; it never leaves [t_lo, t_hi] and never
    decreases as the size grows."""
    model = TableCostModel.from_file(csv_path, cluster=H100)
    ag = lambda b: model.collective_ms("all_gather", b, DP_STRIDED)  # noqa: E731
    assert ag(2 * MiB) == pytest.approx(math.sqrt(0.2397 * 0.7181), rel=1e-12)
    sizes = [int(MiB * 16 ** (i / 50)) for i in range(51)]  # 1 MiB .. 16 MiB
    times = [ag(b) for b in sizes]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert 0.2397 <= min(times) and max(times) <= 2.5531


def test_extrapolation_scales_the_largest_row_by_bandwidth_and_holds_the_smallest_row(csv_path):
    """Above the largest row: its time plus the extra bytes at the marginal bandwidth of the two
    largest rows. Below the smallest: that row's time (latency bound: a smaller collective is
    never priced cheaper than the table measured), so splitting a bucket below the table's
    range never looks free."""
    model = TableCostModel.from_file(csv_path, cluster=H100)
    ag = lambda b: model.collective_ms("all_gather", b, DP_STRIDED)  # noqa: E731
    slope_hi = (2.5531 - 0.7181) / (16 * MiB - 4 * MiB)
    assert ag(64 * MiB) == pytest.approx(2.5531 + 48 * MiB * slope_hi, rel=1e-12)
    assert ag(MiB // 2) == ag(1024) == ag(0) == ag(MiB) == 0.2397
    # two collectives under the smallest row cost more apart than merged into one of that row
    assert 2 * ag(MiB // 2) > ag(MiB)
    # one row only: bandwidth of that row above it, that row's time below it
    assert interpolate_ms([(1000, 2.0)], 3000) == pytest.approx(6.0)
    assert interpolate_ms([(1000, 2.0)], 10) == 2.0


def test_a_group_without_a_row_falls_back_and_is_reported(csv_path):
    """The table covers the dp group's all-gathers and reduce-scatters (8 ranks over 8 nodes),
    not the tp group's all-gathers: those fall back to the analytic model, and the DAG's
    cost_coverage names that group and collective (structured fields, not a note)::

        w -> ag_dp (dp) ----\
        w -> ag_tp (tp) ----> mm -> rs_dp (dp) -> output
    """
    b = DagBuilder(group_sizes={"dp": 8, "tp": 8})
    b.add_input("w", size_bytes=MiB, releasable=False)
    a = b.add_collective("ag_dp", "w", coll_type="all_gather", group="dp")
    t = b.add_collective("ag_tp", "w", coll_type="all_gather", group="tp")
    c = b.add_compute("mm", a, t, size_bytes=8 * MiB, flops=10**9)
    r = b.add_collective("rs_dp", c, coll_type="reduce_scatter", group="dp")
    b.add_output(r)
    dag = b.build(cluster=H100)
    assert "cost_coverage" not in dag.graph  # the builder's own table says nothing
    dag.graph["process_groups"]["dp"]["ranks"] = list(DP_STRIDED.ranks)
    dag.graph["process_groups"]["tp"]["ranks"] = list(TP.ranks)
    annotate_costs(dag, TableCostModel.from_file(csv_path, cluster=H100), H100)
    cov = dag.graph["cost_coverage"]
    assert cov["fallback_groups"] == [{"group_name": "tp", "coll_type": "all_gather", "group_size": 8, "nodes": 1}]
    assert cov["compute_matched_share"] is None  # the table does not price compute
    assert dag.nodes["ag_dp"]["runtime_ms"] == pytest.approx(0.2397)
    assert dag.nodes["rs_dp"]["runtime_ms"] == pytest.approx(0.2397)
    assert dag.nodes["ag_tp"]["runtime_ms"] == pytest.approx(
        AnalyticCostModel(H100).collective_ms("all_gather", MiB, TP))


def test_nodes_from_ranks_decide_the_row(csv_path):
    """The same 8 ranks priced by the row of 8 nodes when strided over 8 nodes, and by the
    fallback when consecutive (one node): never by the group size alone."""
    model = TableCostModel.from_file(csv_path, cluster=H100)
    consecutive = GroupInfo("dp", 8, tuple(range(8)))
    assert model.collective_ms("all_gather", MiB, DP_STRIDED) == pytest.approx(0.2397)
    assert model.collective_matched("all_gather", DP_STRIDED) is True
    assert model.collective_matched("all_gather", consecutive) is False
    assert model.collective_ms("all_gather", MiB, consecutive) == pytest.approx(
        AnalyticCostModel(H100).collective_ms("all_gather", MiB, consecutive))


# --- nccl-tests -----------------------------------------------------------------------------------
def _float_str(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: %.2f, else %.1f, else %.0f, else %.1e within ``width``."""
    for fmt in (f"%{width}.2f", f"%{width}.1f", f"%{width}.0f"):
        text = fmt % value
        if len(text) <= width:
            return text
    return f"%{width}.1e" % value


def nccl_tests_stdout(program: str, n_ranks: int, hosts: list[str], results: list[tuple[int, float]],
                      *, elt: str = "float", redop: str = "none") -> str:
    """What ``program`` prints (nccl-tests 2.17, src/util.cu formats): the header, one
    "#  Rank" line per rank (``n_ranks // len(hosts)`` per host), the result table (out-of-place
    and in-place; time in us, algbw / busbw in GB/s) and the footer. ``results``: (size column
    in bytes, out-of-place time in us)."""
    coll = {"all_gather_perf": "ag", "reduce_scatter_perf": "rs", "all_reduce_perf": "ar", "alltoall_perf": "a2a"}[program]
    per_host = n_ranks // len(hosts)
    lines = [
        "# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703",
        f"# Collective test starting: {program}",
        "# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    for r in range(n_ranks):
        dev = r % per_host
        lines.append("#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s"
                     % (r, 0, 41000 + r, hosts[r // per_host], dev, 0, 0x18 + 0x10 * dev, 0, "NVIDIA H100 80GB HBM3"))
    lines += [
        "#",
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          " % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s" % (
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
            "#wrong", 0, ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s" % (
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", 0, ""),
    ]
    bw_sum = 0.0
    for size, t_us in results:
        count = size // 4 // n_ranks if coll in ("ag", "rs") else size // 4
        algbw = size / 1e9 / (t_us * 1e-6)
        busbw = algbw * (2 * (n_ranks - 1) / n_ranks if coll == "ar" else (n_ranks - 1) / n_ranks)
        bw_sum += busbw
        t_in = t_us * 0.98
        line = "%12li  %12li  %8s  %6s  %6s" % (size, count, elt, redop, "%6i" % -1)
        line += "  %7s  %6s  %6s  %6g" % (_float_str(t_us, 7), _float_str(algbw, 6), _float_str(busbw, 6), 0)
        line += "  %7s  %6s  %6s  %6g" % (_float_str(t_in, 7), _float_str(size / 1e9 / (t_in * 1e-6), 6),
                                           _float_str(busbw / 0.98, 6), 0)
        lines.append(line)
    lines += [
        "# %-20s : %d %s" % ("Out of bounds values", 0, "OK"),
        "# %-20s : %g %s" % ("Avg bus bandwidth", bw_sum / len(results), ""),
        "#",
        f"# Collective test concluded: {program}",
        "",
    ]
    return "\n".join(lines)


#: (size column, out-of-place us) of an all-gather and a reduce-scatter on 16 ranks, 2 nodes
AG_RESULTS = [(16 * MiB, 497.7), (64 * MiB, 1529.1), (256 * MiB, 5461.3), (1024 * MiB, 21189.9)]
RS_RESULTS = [(16 * MiB, 485.8), (64 * MiB, 1469.7), (256 * MiB, 5286.5), (1024 * MiB, 20490.9)]


def test_nccl_tests_output_read_back(tmp_path):
    """all_gather_perf and reduce_scatter_perf on 16 ranks over two hosts, read from a directory:
    group size and nodes from the rank list, input bytes = size / ranks for the all-gather (its
    size column is the gathered output) and = size for the reduce-scatter (its full input)."""
    hosts = ["gpu-node-017", "gpu-node-018"]
    (tmp_path / "ag.log").write_text(nccl_tests_stdout("all_gather_perf", 16, hosts, AG_RESULTS))
    (tmp_path / "rs.log").write_text(nccl_tests_stdout("reduce_scatter_perf", 16, hosts, RS_RESULTS, redop="sum"))
    model = TableCostModel.from_file(tmp_path, cluster=H100)
    assert model.collectives.keys() == [("all_gather", 16, 2), ("reduce_scatter", 16, 2)]
    group = GroupInfo("dp", 16, tuple(range(16)))  # two nodes of 8
    for size, t_us in AG_RESULTS:
        assert model.collective_ms("all_gather", size // 16, group) == pytest.approx(t_us / 1e3, rel=1e-9)
    for size, t_us in RS_RESULTS:
        assert model.collective_ms("reduce_scatter", size, group) == pytest.approx(t_us / 1e3, rel=1e-9)
    # 16 ranks strided over 16 nodes are another group: not covered
    assert model.collective_matched("all_gather", group) is True
    assert model.collective_matched("all_gather", GroupInfo("dp", 16, tuple(range(0, 128, 8)))) is False


def test_nccl_tests_all_reduce_and_alltoall_sizes_are_the_input(tmp_path):
    text = nccl_tests_stdout("all_reduce_perf", 8, ["n1"], [(MiB, 28.0), (16 * MiB, 129.2)], redop="sum")
    rows = read_nccl_tests(text)
    assert [(r.collective, r.group_size, r.nodes, r.input_bytes) for r in rows] == [
        ("all_reduce", 8, 1, MiB), ("all_reduce", 8, 1, 16 * MiB)]
    assert [r.ms for r in rows] == pytest.approx([0.028, 0.1292], rel=1e-12)
    text = nccl_tests_stdout("alltoall_perf", 8, ["n1", "n2"], [(8 * MiB, 310.5)])
    assert [(r.collective, r.nodes, r.input_bytes) for r in read_nccl_tests(text)] == [("all_to_all", 2, 8 * MiB)]


def test_nccl_tests_without_a_rank_list_needs_the_group(tmp_path):
    text = nccl_tests_stdout("all_gather_perf", 8, ["n1"], AG_RESULTS[:2])
    bare = "\n".join(ln for ln in text.splitlines() if "Rank" not in ln)
    with pytest.raises(CostTableError, match="group_size"):
        read_nccl_tests(bare)
    rows = read_nccl_tests(bare, group_size=8, nodes=1)
    assert [r.input_bytes for r in rows] == [16 * MiB // 8, 64 * MiB // 8]
    nameless = bare.replace("all_gather_perf", "a_test")
    with pytest.raises(CostTableError, match="collective="):
        read_nccl_tests(nameless, group_size=8, nodes=1)



def test_a_log_of_two_programs_reads_each_run_as_its_own_collective(tmp_path):
    """reduce_scatter_perf's output followed by all_gather_perf's in one file (as people paste
    them): each run is its own collective, with its own sizes, times and input bytes."""
    hosts = ["gpu-node-017", "gpu-node-018"]
    path = tmp_path / "both.log"
    path.write_text(nccl_tests_stdout("reduce_scatter_perf", 16, hosts, RS_RESULTS, redop="sum")
                    + nccl_tests_stdout("all_gather_perf", 16, hosts, AG_RESULTS))
    model = TableCostModel.from_file(path, cluster=H100)
    assert model.collectives.keys() == [("all_gather", 16, 2), ("reduce_scatter", 16, 2)]
    group = GroupInfo("dp", 16, tuple(range(16)))
    for size, t_us in AG_RESULTS:
        assert model.collective_ms("all_gather", size // 16, group) == pytest.approx(t_us / 1e3, rel=1e-9)
    for size, t_us in RS_RESULTS:
        assert model.collective_ms("reduce_scatter", size, group) == pytest.approx(t_us / 1e3, rel=1e-9)


def test_a_log_of_two_programs_with_one_collective_named_is_refused(tmp_path):
    """``collective=`` names one collective: a file of two runs is refused, naming the line where
    the second run starts, rather than read as one."""
    text = (nccl_tests_stdout("reduce_scatter_perf", 8, ["n1"], RS_RESULTS[:2], redop="sum")
            + nccl_tests_stdout("all_gather_perf", 8, ["n1"], AG_RESULTS[:2]))
    second = next(i for i, ln in enumerate(text.splitlines()) if "starting: all_gather_perf" in ln) + 1
    with pytest.raises(CostTableError, match=rf"log:{second}\b.*all_gather_perf"):
        read_nccl_tests(text, "log", collective="reduce_scatter")


def test_a_result_line_cut_short_is_named(tmp_path):
    """The last result line of a log cut mid-write ("... -1  54" where the run printed 5461.3)
    has too few columns: refused naming the line, never read as 0.054 ms."""
    text = nccl_tests_stdout("all_gather_perf", 8, ["n1"], AG_RESULTS[:3])
    lines = text.splitlines()
    cut = next(i for i, ln in enumerate(lines) if ln.strip().startswith(str(256 * MiB)))
    lines[cut] = lines[cut][:lines[cut].index("5461.3") + 2]
    path = tmp_path / "cut.log"
    path.write_text("\n".join(lines[:cut + 1]))
    with pytest.raises(CostTableError, match=rf"{path}:{cut + 1}: .*6 fields.*13"):
        TableCostModel.from_file(path)


# --- bad files ----------------------------------------------------------------------------------
HEADER = "collective,group_size,nodes,input_bytes,ms"


@pytest.mark.parametrize("text, line, field", [
    ("collective,size,nodes,bytes,ms\nall_gather,8,1,1024,0.1\n", 1, "header"),
    (f"{HEADER}\nall_gather,8,1,1024,0.1\nallgather,8,1,2048,0.2\n", 3, "collective"),
    (f"{HEADER}\nall_gather,eight,1,1024,0.1\n", 2, "group_size"),
    (f"{HEADER}\nall_gather,8,1,1024,-0.1\n", 2, "ms"),
    (f"{HEADER}\nall_gather,8,1,1024,nan\n", 2, "ms"),
    (f"{HEADER}\n# a comment\nall_gather,8,1,1k,0.1\n", 3, "input_bytes"),
    (f"{HEADER}\nall_gather,8,9,1024,0.1\n", 2, "nodes"),
    (f"{HEADER}\nall_gather,8,1,1024\n", 2, "fields"),
])
def test_a_bad_csv_names_the_line_and_the_field(tmp_path, text, line, field):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(CostTableError) as info:
        TableCostModel.from_file(path)
    message = str(info.value)
    assert f"{path}:{line}" in message and field in message


def test_a_bad_nccl_tests_line_is_named(tmp_path):
    text = nccl_tests_stdout("all_gather_perf", 8, ["n1"], AG_RESULTS[:2])
    lines = text.splitlines()
    bad_index = next(i for i, ln in enumerate(lines) if ln.strip().startswith(str(64 * MiB)))
    lines[bad_index] = lines[bad_index].replace(lines[bad_index].split()[5], "fast", 1)
    path = tmp_path / "ag.log"
    path.write_text("\n".join(lines))
    with pytest.raises(CostTableError, match=rf"{path}:{bad_index + 1}.*'time'"):
        TableCostModel.from_file(path)


@pytest.mark.parametrize("spec, needle", [
    ("table:/no/such/file.csv", "/no/such/file.csv"),
    ("table:", "names no file"),
    ("table:a.csv+table:b.csv", "two table files"),
])
def test_a_bad_table_name_is_a_value_error_naming_it(spec, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        resolve_cost_model(spec)


def test_neither_format_is_refused(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("size,time\n1,2\n")
    with pytest.raises(CostTableError, match="neither a CSV"):
        TableCostModel.from_file(path)


# --- by name through the API --------------------------------------------------------------------
def test_table_by_name_through_optimize_schedule(group_name, tmp_path):
    """``cost_model="table:PATH"`` prices the graph the optimisation sees and judges: the
    report's traced step is the table's, unlike the analytic model's; a table with the
    all-gathers only leaves the reduce-scatters of the (4-rank, one-node) group to the
    fallback, and the report says so in its structured field."""
    import copy

    from test_writeback import toy_graph

    from scheduler import SolverOptions, export_dag, optimize_schedule, simulate
    from scheduler.api import REPORT_KEY

    gm0 = toy_graph(group_name, 4)
    analytic = export_dag(gm0)
    payloads = {a["coll_type"]: a["payload_bytes"] for _, a in analytic.nodes(data=True) if a["kind"] == "collective"}
    rows = [HEADER]
    for coll, b in payloads.items():  # 20x slower than the analytic model
        t = 20 * AnalyticCostModel(H100).collective_ms(coll, b, GroupInfo(group_name, 4, (0, 1, 2, 3)))
        rows += [f"{coll},4,1,{b // 2},{t / 1.5}", f"{coll},4,1,{b * 2},{t * 1.5}"]
    full = tmp_path / "full.csv"
    full.write_text("\n".join(rows) + "\n")
    half = tmp_path / "ag_only.csv"
    half.write_text("\n".join(r for r in rows if not r.startswith("reduce_scatter")) + "\n")

    for path, fallback in ((full, []), (half, [{"group_name": group_name, "coll_type": "reduce_scatter",
                                                  "group_size": 4, "nodes": 1}])):
        name = f"table:{path}"
        gm = copy.deepcopy(gm0)
        optimize_schedule(gm, None, cost_model=name, solver=SolverOptions(work_limit=2))
        report = gm.meta[REPORT_KEY]
        by_table = simulate(export_dag(copy.deepcopy(gm0), cost_model=name)).step_ms
        assert report.step_ms_before == pytest.approx(by_table)
        assert report.cost_coverage["fallback_groups"] == fallback
    assert simulate(export_dag(copy.deepcopy(gm0), cost_model=f"table:{full}")).step_ms > 2 * simulate(analytic).step_ms



def test_a_table_of_other_groups_warns_how_much_it_priced_and_why(group_name, tmp_path, caplog):
    """A table measured on 16 ranks over 2 nodes prices none of a graph whose group is 4 ranks on
    one node: once per optimisation (not once per candidate judged), a WARNING says how much it
    priced, what the file has and what the graph needs. A table of the graph's own group is
    silent."""
    import copy
    import logging

    from test_writeback import toy_graph

    from scheduler import SolverOptions, export_dag, optimize_schedule

    hosts = ["gpu-node-017", "gpu-node-018"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "ag.log").write_text(nccl_tests_stdout("all_gather_perf", 16, hosts, AG_RESULTS))
    (other / "rs.log").write_text(nccl_tests_stdout("reduce_scatter_perf", 16, hosts, RS_RESULTS, redop="sum"))
    gm0 = toy_graph(group_name, 4)
    with caplog.at_level(logging.WARNING, logger="scheduler.costs.annotate"):
        optimize_schedule(copy.deepcopy(gm0), None, cost_model=f"table:{other}", solver=SolverOptions(work_limit=1))
    [record] = [r for r in caplog.records if r.name == "scheduler.costs.annotate"]
    message = record.getMessage()
    assert str(other) in message and "0 of 5 collectives" in message
    assert "16 ranks over 2 nodes" in message and "4 ranks over 1 node" in message

    own = tmp_path / "own.csv"
    payloads = {a["coll_type"]: a["payload_bytes"] for _, a in export_dag(gm0).nodes(data=True)
                if a["kind"] == "collective"}
    own.write_text("\n".join([HEADER] + [f"{c},4,1,{b},0.5" for c, b in payloads.items()]) + "\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scheduler.costs.annotate"):
        optimize_schedule(copy.deepcopy(gm0), None, cost_model=f"table:{own}", solver=SolverOptions(work_limit=1))
    assert not [r for r in caplog.records if r.name == "scheduler.costs.annotate"]

def test_inductor_pass_cache_key_follows_the_table_file(csv_path):
    """The inductor pass's uuid (the key of inductor's FX graph cache) changes when the table
    a "table:PATH" name reads changes, so a cached graph scheduled with old times is not
    reused."""
    from scheduler.integrate.compile import inductor_post_grad_pass

    name = f"table:{csv_path}"
    before = inductor_post_grad_pass(cost_model=name).uuid()
    assert inductor_post_grad_pass(cost_model=name).uuid() == before
    csv_path.write_text(CSV.replace("0.2397", "0.23975"))
    assert inductor_post_grad_pass(cost_model=name).uuid() != before
