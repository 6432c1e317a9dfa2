"""Measured collective times: a table read from a CSV or from nccl-tests output.

A :class:`CollectiveTable` holds times in ms keyed by (collective, group size, nodes spanned)
and indexed by the per-rank input bytes of the collective; :meth:`CollectiveTable.lookup_ms`
interpolates between its rows. :class:`scheduler.costs.models.TableCostModel` prices collectives
with it (``cost_model="table:PATH"``); ``fsdp-sched measure`` writes one.

The CSV format (``#`` starts a comment line; blank lines are skipped)::

    collective,group_size,nodes,input_bytes,ms
    all_gather,8,1,1048576,0.0495

- ``collective``: one of :data:`COLLECTIVES`;
- ``group_size``: ranks of the process group;
- ``nodes``: how many nodes the group's ranks span (a dp group strided across the nodes of a
  dp x tp mesh spans as many nodes as it has ranks);
- ``input_bytes``: the per-rank input tensor of the collective (the convention of
  ``payload_bytes`` in :mod:`scheduler.costs.models`): an all-gather's shard, a reduce-scatter's full
  input, an all-reduce's tensor, an all-to-all's whole send buffer;
- ``ms``: the measured time of one call.

Several rows of one key and size (repeated runs, several dtypes) are merged to their median.

nccl-tests output (the stdout of ``all_gather_perf``, ``reduce_scatter_perf``,
``all_reduce_perf``, ``alltoall_perf``) is read by :func:`read_nccl_tests`; see its docstring
for how its ``size`` column maps to ``input_bytes``. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: collectives a table may hold (the names of the CSV's ``collective`` column)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
#: per-rank input sizes, bytes, that ``fsdp-sched measure`` times by default: powers of 4 from
#: 4 KiB to 64 MiB, the range of FSDP per-parameter and per-block collectives
DEFAULT_TABLE_SIZES = tuple(4 << (10 + 2 * i) for i in range(8))
#: the CSV's header, in order
CSV_HEADER = ("collective", "group_size", "nodes", "input_bytes", "ms")
#: nccl-tests programs -> the collective they time
NCCL_TESTS_PROGRAMS = {
    "all_gather_perf": "all_gather",
    "reduce_scatter_perf": "reduce_scatter",
    "all_reduce_perf": "all_reduce",
    "alltoall_perf": "all_to_all",
}


class CostTableError(ValueError):
    """A table that cannot be read or used; the message names the file, the line and the field
    and says what is accepted."""


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One measured time."""

    collective: str
    group_size: int
    nodes: int
    input_bytes: int
    ms: float
    #: where the row came from ("file.csv:12"), for error messages
    source: str = ""


def table_collective(coll_type: str) -> str:
    """The table's name of a DAG collective type (``all_to_all_single`` -> ``all_to_all``)."""
    return "all_to_all" if coll_type.startswith("all_to_all") else coll_type


class CollectiveTable:
    """Measured collective times, looked up by (collective, group size, nodes) and bytes.

    Between two rows of a key, the time is interpolated log-log (a power law through both
    rows: exact at each row, monotone between rows). Outside a key's rows:

    - above the largest input, the largest row's time plus the extra bytes at the marginal
      bandwidth of the two largest rows (the bandwidth the collective reaches there; the
      largest row's own bandwidth ``input_bytes / ms`` when the table has one row or the
      two largest are not increasing);
    - below the smallest input, the smallest row's time: a table measures nothing smaller,
      and a collective that moves less than its smallest row is bound by the latency that
      row already pays, not by its bytes. Scaling it down by bandwidth
      would price small all-gathers near zero and make splitting buckets look free. This is
      also how autoparallel's overlap simulator reads its published tables.

    A key without rows is not covered (:meth:`covers` is False, :meth:`lookup_ms` None): the
    cost model prices it otherwise and reports the group.
    """

    def __init__(self, rows: Iterable[CollectiveRow]):
        self.rows: list[CollectiveRow] = list(rows)
        if not self.rows:
            raise CostTableError("the collective table has no rows; give at least one measured time")
        grouped: dict[tuple[str, int, int], dict[int, list[float]]] = {}
        for r in self.rows:
            _check_row(r)
            grouped.setdefault((r.collective, r.group_size, r.nodes), {}).setdefault(r.input_bytes, []).append(r.ms)
        #: key -> [(input_bytes, ms), ...] by increasing input_bytes, duplicates merged
        self.points: dict[tuple[str, int, int], list[tuple[int, float]]] = {
            key: [(b, float(statistics.median(ts))) for b, ts in sorted(sizes.items())]
            for key, sizes in sorted(grouped.items())
        }

    def keys(self) -> list[tuple[str, int, int]]:
        """(collective, group_size, nodes) of every key the table covers."""
        return list(self.points)

    def covers(self, collective: str, group_size: int, nodes: int) -> bool:
        return (table_collective(collective), group_size, nodes) in self.points

    def lookup_ms(self, collective: str, group_size: int, nodes: int, input_bytes: int) -> float | None:
        """Time in ms of ``collective`` with ``input_bytes`` per rank on a group of
        ``group_size`` ranks over ``nodes`` nodes; None when the table has no row for that key."""
        pts = self.points.get((table_collective(collective), group_size, nodes))
        if pts is None:
            return None
        return interpolate_ms(pts, input_bytes)

    def to_csv(self, path: str | Path | None = None) -> str:
        """The table as CSV text (one row per merged point), also written to ``path``."""
        out = io.StringIO()
        out.write(",".join(CSV_HEADER) + "\n")
        for (coll, n, nodes), pts in self.points.items():
            for b, ms in pts:
                out.write(f"{coll},{n},{nodes},{b},{ms:.6g}\n")
        text = out.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def read(cls, path: str | Path, **nccl_tests_kw) -> "CollectiveTable":
        """The table in ``path``: a CSV (:mod:`this module's format <scheduler.costs.tables>`),
        the stdout of an nccl-tests program (``nccl_tests_kw`` go to :func:`read_nccl_tests`),
        or a directory of such files (every regular file in it, in name order).

        Raises:
            CostTableError: a file that is missing, unreadable or of neither format, or a bad
                line (the message names the file, the line and the field).
        """
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
            if not files:
                raise CostTableError(f"{p}: the directory holds no table files")
        elif p.is_file():
            files = [p]
        else:
            raise CostTableError(f"{p}: no such file or directory; give a CSV ({','.join(CSV_HEADER)}) "
                                 "or the output of an nccl-tests program")
        rows: list[CollectiveRow] = []
        for f in files:
            try:
                text = f.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise CostTableError(f"{f}: cannot read it ({e})") from None
            rows += parse_table_text(text, str(f), **nccl_tests_kw)
        return cls(rows)


def interpolate_ms(points: Sequence[tuple[int, float]], input_bytes: int) -> float:
    """The time at ``input_bytes`` through ``points`` (increasing bytes, times > 0), by the
    rules of :class:`CollectiveTable`."""
    b = max(0, int(input_bytes))
    lo_b, lo_t = points[0]
    hi_b, hi_t = points[-1]
    if b > hi_b:
        slope = (hi_t - points[-2][1]) / (hi_b - points[-2][0]) if len(points) > 1 else 0.0
        if slope <= 0:
            slope = hi_t / hi_b
        return hi_t + (b - hi_b) * slope
    if b < lo_b:
        return lo_t
    # bisect for the bracketing rows
    lo, hi = 0, len(points) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if points[mid][0] <= b:
            lo = mid
        else:
            hi = mid
    (b0, t0), (b1, t1) = points[lo], points[hi]
    if b == b0:
        return t0
    if b == b1:
        return t1
    w = (math.log(b) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


def _check_row(r: CollectiveRow) -> None:
    where = r.source or "row"
    if r.collective not in COLLECTIVES:
        raise CostTableError(f"{where}: collective {r.collective!r} is not one of {', '.join(COLLECTIVES)}")
    if r.group_size < 2:
        raise CostTableError(f"{where}: group_size {r.group_size} must be >= 2 (a group of one rank moves nothing)")
    if not 1 <= r.nodes <= r.group_size:
        raise CostTableError(f"{where}: nodes {r.nodes} must be between 1 and group_size {r.group_size}")
    if r.input_bytes < 1:
        raise CostTableError(f"{where}: input_bytes {r.input_bytes} must be >= 1")
    if not (math.isfinite(r.ms) and r.ms > 0):
        raise CostTableError(f"{where}: ms {r.ms!r} must be a finite time > 0")


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------
def parse_table_text(text: str, source: str = "<table>", **nccl_tests_kw) -> list[CollectiveRow]:
    """Rows of ``text``: a CSV with :data:`CSV_HEADER` (the first line that is neither blank
    nor a ``#`` comment is that header) or nccl-tests output."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
    given = sorted(k for k, v in nccl_tests_kw.items() if v is not None)
    if first.lower().replace(" ", "").startswith("collective,"):
        if given:
            raise CostTableError(f"{source}: a CSV names its collective, group size and nodes in its rows; "
                                 f"{given} apply to nccl-tests output only")
        return read_csv(text, source)
    if _NCCL_DATA.search(text) or "nccl-tests" in text or _NCCL_RANK.search(text):
        return read_nccl_tests(text, source, **nccl_tests_kw)
    raise CostTableError(
        f"{source}: neither a CSV whose first line is the header {','.join(CSV_HEADER)} nor the output of an "
        f"nccl-tests program ({', '.join(NCCL_TESTS_PROGRAMS)}); first line: {first[:80]!r}"
    )


def read_csv(text: str, source: str = "<csv>") -> list[CollectiveRow]:
    """Rows of a CSV in this module's format; a bad line raises :class:`CostTableError` naming
    the line number and the field."""
    rows: list[CollectiveRow] = []
    header_seen = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        where = f"{source}:{lineno}"
        if not header_seen:
            if tuple(f.lower() for f in fields) != CSV_HEADER:
                raise CostTableError(f"{where}: the header is {line!r}; expected {','.join(CSV_HEADER)}")
            header_seen = True
            continue
        if len(fields) != len(CSV_HEADER):
            raise CostTableError(f"{where}: {len(fields)} fields in {line!r}; expected {len(CSV_HEADER)} "
                                 f"({','.join(CSV_HEADER)})")
        values = dict(zip(CSV_HEADER, fields))
        coll = values["collective"].lower()
        if coll not in COLLECTIVES:
            raise CostTableError(f"{where}: field 'collective' is {values['collective']!r}; expected one of "
                                 f"{', '.join(COLLECTIVES)}")
        ints = {k: _int_field(values[k], k, where) for k in ("group_size", "nodes", "input_bytes")}
        rows.append(CollectiveRow(coll, ints["group_size"], ints["nodes"], ints["input_bytes"],
                                  _ms_field(values["ms"], where), where))
    if not header_seen:
        raise CostTableError(f"{source}: empty; expected the header {','.join(CSV_HEADER)} and rows")
    if not rows:
        raise CostTableError(f"{source}: a header and no rows; give at least one measured time")
    for r in rows:
        _check_row(r)
    return rows


def _int_field(text: str, field: str, where: str) -> int:
    try:
        v = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            f = float("nan")
        if not (math.isfinite(f) and f == int(f)):
            raise CostTableError(f"{where}: field {field!r} is {text!r}; expected a whole number") from None
        v = int(f)
    return v


def _ms_field(text: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise CostTableError(f"{where}: field 'ms' is {text!r}; expected a finite time in ms > 0")
    return v


#: a result line of nccl-tests: size, count, type, redop, root, then the out-of-place time (us)
_NCCL_DATA = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\S+)\s+(-?\d+)\s+([0-9.eE+-]+)\s", re.M)
#: "#  Rank  3 Group  0 Pid  4242 on    node-1 device  3 [0000:1b:00] NVIDIA H100 80GB HBM3"
_NCCL_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device", re.M)
_NCCL_PROGRAM = re.compile(r"\b(" + "|".join(NCCL_TESTS_PROGRAMS) + r")\b")
#: the first line of a run: "# Collective test starting: all_gather_perf" (nccl-tests 2.11 on),
#: else its parameter line "# nThread 1 nGpus 1 minBytes ..."
_NCCL_RUN_START = re.compile(r"^\s*#\s*Collective test starting:\s*(\S+)")
_NCCL_PARAMETERS = re.compile(r"^\s*#\s*nThread\b")
#: the column header of the result table: "#  size  count  type  redop  root  time  algbw ..."
_NCCL_COLUMNS = re.compile(r"^\s*#\s*size\s+count\s+type\b")
#: columns of a result line without a column header: size, count, type, redop, root, then
#: time, algbw, busbw, #wrong out of place and again in place
NCCL_TESTS_COLUMNS = 13
#: launcher prefixes such as mpirun's --tag-output ("[1,0]<stdout>:")
_LAUNCHER_PREFIX = re.compile(r"^\[[^\]]*\]<stdout>:", re.M)


def read_nccl_tests(
    text: str,
    source: str = "<nccl-tests>",
    *,
    collective: str | None = None,
    group_size: int | None = None,
    nodes: int | None = None,
) -> list[CollectiveRow]:
    """Rows of the stdout of nccl-tests runs: one run, or several one after the other (the
    output of ``reduce_scatter_perf`` followed by that of ``all_gather_perf``, as people paste
    them), each read as its own collective. A run starts at its "# Collective test starting:
    PROGRAM" line (nccl-tests 2.11 on), else at its "# nThread ..." parameter line.

    A run's program (hence its collective) is read from its starting line, else from any
    mention of a program in it (such as the command line saved with it), unless
    ``collective`` is given (then the text must hold one run). The group is every rank the run
    lists under "# Using devices" ("#  Rank  r Group g Pid p on HOST device d ..."):
    ``group_size`` is how many ranks, ``nodes`` how many distinct hosts; give them when the
    list is missing or was cut ("..." when a process drives many GPUs).

    Each result line gives the out-of-place time (us; functional collectives write a new
    output tensor). Its ``size`` column is ``max(send bytes, receive bytes)`` of one rank
    (nccl-tests ``common.cu``: ``writeBenchmarkLinePreamble(max(sendBytes, expectedBytes),
    ...)``), so ``input_bytes`` is:

    - ``all_gather_perf``: ``size / group_size`` (size is the gathered output; the input is
      one shard, the ``count`` column in elements);
    - ``reduce_scatter_perf``: ``size`` (the full input; the output is ``size / group_size``);
    - ``all_reduce_perf``: ``size``;
    - ``alltoall_perf``: ``size`` (the whole send buffer, ``size / group_size`` to each peer).

    A result line must have every column of the run's column header
    (:data:`NCCL_TESTS_COLUMNS` without one): a line cut short, as the last line of a log
    truncated mid-write, would otherwise be read with a cut time. Rows of a dtype sweep
    (``-d all``) share sizes: their times are merged to the median.

    Raises:
        CostTableError: a run whose program, group size or node count cannot be told, a run
            without result lines, several runs with ``collective`` given, or a malformed or
            short result line (named by its line number).
    """
    lines = _LAUNCHER_PREFIX.sub("", text).splitlines()
    runs = _nccl_runs(lines)
    if collective is not None and len(runs) > 1:
        starts = ", ".join(f"line {first + 1}" + (f" ({p})" if p else "") for first, _, p in runs)
        raise CostTableError(
            f"{source}:{runs[1][0] + 1}: the output holds {len(runs)} nccl-tests runs ({starts}) and "
            f"collective={collective!r} names one; leave collective= out (each run is read as its own program) or "
            "split the file")
    rows: list[CollectiveRow] = []
    for first, last, program in runs:
        rows += _read_nccl_run(lines, first, last, program, source, collective, group_size, nodes)
    return rows


def _nccl_runs(lines: list[str]) -> list[tuple[int, int, str | None]]:
    """(first line index, end index, program named by its starting line or None) of every run
    in ``lines``; text before the first run's start belongs to it (a saved command line)."""
    marks = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := _NCCL_RUN_START.match(ln))]
    if not marks:
        marks = [(i, None) for i, ln in enumerate(lines) if _NCCL_PARAMETERS.match(ln)]
    if not marks:
        return [(0, len(lines), None)]
    firsts = [0] + [i for i, _ in marks[1:]]
    ends = [i for i, _ in marks[1:]] + [len(lines)]
    return [(f, e, p) for f, e, (_, p) in zip(firsts, ends, marks)]


def _read_nccl_run(lines: list[str], first: int, end: int, program: str | None, source: str,
                   collective: str | None, group_size: int | None, nodes: int | None) -> list[CollectiveRow]:
    """Rows of one run, ``lines[first:end]`` (arguments as :func:`read_nccl_tests`')."""
    text = "\n".join(lines[first:end])
    at = f"{source}:{first + 1}" if first else source
    if collective is None:
        named = sorted({m.group(1) for m in _NCCL_PROGRAM.finditer(text)})
        if program not in NCCL_TESTS_PROGRAMS:
            if len(named) != 1:
                raise CostTableError(
                    f"{at}: cannot tell which nccl-tests program wrote this output ("
                    + (f"it mentions {' and '.join(named)}" if named else
                       f"no {' / '.join(NCCL_TESTS_PROGRAMS)} in it") + f"); pass collective= ({', '.join(COLLECTIVES)})")
            program = named[0]
        collective = NCCL_TESTS_PROGRAMS[program]
    if collective not in COLLECTIVES:
        raise CostTableError(f"{source}: collective={collective!r}; expected one of {', '.join(COLLECTIVES)}")
    ranks = {int(m.group(1)): m.group(4) for m in _NCCL_RANK.finditer(text)}
    cut = any(ln.rstrip().endswith("...") for ln in lines[first:end] if ln.lstrip().startswith("#"))
    if group_size is None:
        if not ranks or cut:
            raise CostTableError(
                f"{at}: the output does not list every rank under '# Using devices'"
                + (" (the list was cut)" if cut else "") + "; pass group_size= and nodes=")
        group_size = len(ranks)
    if nodes is None:
        if not ranks or cut or len(ranks) != group_size:
            raise CostTableError(f"{at}: cannot count the nodes from the rank list; pass nodes=")
        nodes = len(set(ranks.values()))
    columns = NCCL_TESTS_COLUMNS
    rows = []
    for lineno in range(first + 1, end + 1):
        line = lines[lineno - 1].strip()
        if _NCCL_COLUMNS.match(line):
            columns = len(line.lstrip("#").split())
        if not line or line.startswith("#") or not line[0].isdigit():
            continue
        where = f"{source}:{lineno}"
        parts = line.split()
        if len(parts) < columns:
            raise CostTableError(
                f"{where}: a result line with {len(parts)} fields; expected {columns} (size, count, type, redop, "
                "root, then time, algbw, busbw, #wrong out of place and in place): the line was cut short (a log "
                "truncated while it was written?); delete it or run the test again")
        size = _int_field(parts[0], "size", where)
        try:
            time_us = float(parts[5])
        except ValueError:
            raise CostTableError(f"{where}: field 'time' (out-of-place, us) is {parts[5]!r}; expected a number") from None
        if size == 0:
            continue  # nccl-tests prints zero-byte rows; they time only the launch
        if not (math.isfinite(time_us) and time_us > 0):
            raise CostTableError(f"{where}: field 'time' is {parts[5]!r}; expected a finite time in us > 0")
        input_bytes = size // group_size if collective == "all_gather" else size
        if input_bytes < 1:
            continue
        rows.append(CollectiveRow(collective, group_size, nodes, input_bytes, time_us / 1e3, where))
    if not rows:
        raise CostTableError(f"{at}: no result lines (size count type redop root time ...) in the output"
                             + (f" of {program}" if program else ""))
    logger.info("%s: %d %s rows on %d ranks over %d node(s)", at, len(rows), collective, group_size, nodes)
    return rows
