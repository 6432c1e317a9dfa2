"""On-disk cache of solved schedules, shared by the ranks of one host and across restarts.

A solve takes seconds; every rank of a job, and every restart of it, asks for the same schedule.
An entry is looked up by a key that covers everything that decides the schedule, so that a hit
is the answer the solve would have given (or, for work-limited solves, an equally valid one):

- the DAG (:func:`dag_fingerprint`): every node in graph order with all its attributes (costs
  ``runtime_ms``, sizes ``size_bytes``, aliasing, collective metadata), every edge, and the
  graph attributes (order, process groups, cluster, cost model name, ``comm_model`` fit). The
  cost model enters through the costs it wrote, so one graph priced twice gives two keys;
- the peak-memory budget ``mem_budget_bytes``;
- the options of the solve (solver, work limit, seed, ...), JSON-serialised with sorted keys;
- the versions of the code that computes a schedule: fsdp-sched, torch (the export), ortools
  (CP-SAT), networkx, Python major.minor, :data:`FORMAT_VERSION` of the entry file, and a digest
  of the library's own source files (``scheduler`` and ``solvers``), so that an edited or
  editable install never reads the answer of other code under an unchanged version number.

Caching is on by default, like inductor's FX graph cache. :func:`cache_root` resolves where, for
every reader (this module and the timing cache of :mod:`scheduler.costs.measure`):
``$FSDP_SCHED_CACHE`` when set to a directory, ``$XDG_CACHE_HOME/fsdp-sched`` or
``~/.cache/fsdp-sched`` (per user) when unset, and off when set to ``0``, ``off``, ``false``,
``no``, ``none`` or nothing. Entries are ``<key>.json`` files in its subdirectory
``schedules-v<FORMAT_VERSION>`` (:func:`cache_dir`).

Several ranks may write the same key at once, so a write goes to a temporary file in the same
directory and is then renamed over the entry (``os.replace``, atomic within one file system):
a reader sees the old file or the new one, never a half-written one, and the last writer wins.
The cache never stops a solve: an unreadable or stale entry is a miss with a warning, a failed
write is a warning, and a directory that cannot be made turns caching off with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import operator
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

import solvers
from scheduler.export.dagfile import dag_to_json

if TYPE_CHECKING:
    from scheduler.check.written import Candidate, Figures
    from solvers.core.schedule import Schedule

logger = logging.getLogger(__name__)

CACHE_ENV = "FSDP_SCHED_CACHE"
#: layout of an entry file; bump when it changes, so that old entries read as misses
FORMAT_VERSION = 1

_KEY = re.compile(r"[0-9a-f]{64}")


#: values of ``$FSDP_SCHED_CACHE`` that turn caching off (case and surrounding spaces ignored)
OFF_VALUES = frozenset({"", "0", "off", "false", "no", "none"})
#: the cache root's directory of schedule entries (a new format starts an empty one)
SCHEDULES_DIR = f"schedules-v{FORMAT_VERSION}"

#: directories already warned about, so that a cache that cannot be made warns once, not per call
_warned: set[str] = set()


def cache_root() -> Path | None:
    """Where fsdp-sched caches on disk (schedule entries, measured op timings); None when
    caching is off. Nothing is created here.

    - ``$FSDP_SCHED_CACHE`` unset: the per-user default, ``$XDG_CACHE_HOME/fsdp-sched``, or
      ``~/.cache/fsdp-sched`` when ``XDG_CACHE_HOME`` is unset, empty or not absolute (the XDG
      base directory rules);
    - set to one of :data:`OFF_VALUES` (``0``, ``off``, ``false``, ``no``, ``none``, or empty):
      None, caching is off;
    - set to anything else: that directory (``~`` expanded).

    A home directory that cannot be found turns caching off with one warning.
    """
    raw = os.environ.get(CACHE_ENV)
    if raw is not None:
        if raw.strip().lower() in OFF_VALUES:
            return None
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "fsdp-sched"
    try:
        return Path.home() / ".cache" / "fsdp-sched"
    except RuntimeError as e:  # no HOME and no password entry for this user
        _warn_once("~", f"no home directory for the default schedule cache ({e}); schedule caching is off: "
                        f"set {CACHE_ENV} to a directory to turn it on")
        return None


def cache_dir() -> Path | None:
    """The directory of schedule entries, :data:`SCHEDULES_DIR` under :func:`cache_root`,
    created if missing; None when caching is off, or, with one warning per directory, when it
    cannot be created."""
    root = cache_root()
    if root is None:
        return None
    path = root / SCHEDULES_DIR
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _warn_once(str(path), f"the schedule cache {path} cannot be created ({e}); schedule caching is off: set "
                              f"{CACHE_ENV} to a writable directory, or to 0 to turn caching off without this warning")
        return None
    return path


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Caching off for the block (``$FSDP_SCHED_CACHE=0``, then restored), for code that times
    solves (a benchmark's compile time must be a solve's, never a cache hit's)."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning("%s", message)


def dag_fingerprint(dag: nx.DiGraph) -> str:
    """sha256 hex digest of every node in graph order with all its attributes, every edge and
    ``dag.graph``, in the form :func:`scheduler.export.dagfile.save_dag` writes (tuples as lists, floats
    by ``repr``), so a DAG and its saved-and-loaded copy agree. Sets and edges are sorted (edge
    insertion order means nothing), so every process gets the same digest whatever its hash
    seed."""
    canon = nx.DiGraph(**_sorted_sets(dict(dag.graph)))
    canon.add_nodes_from((n, _sorted_sets(a)) for n, a in dag.nodes(data=True))
    canon.add_edges_from(dag.edges())
    doc = dag_to_json(canon)
    doc["edges"].sort(key=repr)
    return _sha256(doc)


def cache_key(fingerprint: str, *, mem_budget_bytes: int | None, options: Mapping[str, Any]) -> str:
    """sha256 hex digest naming the schedule of one solve (see the module docstring).

    Args:
        fingerprint: :func:`dag_fingerprint` of the DAG solved.
        mem_budget_bytes: peak-memory budget of the solve (bytes); None for no budget.
        options: every other input that can change the answer (solver, work limit, seed, ...),
            as JSON values; their order does not matter.

    Raises:
        TypeError: an option JSON cannot hold (the message names it), or a non-integer budget.
    """
    mem_budget_bytes = None if mem_budget_bytes is None else operator.index(mem_budget_bytes)
    opts: dict[str, Any] = {}
    for name, value in options.items():
        try:
            json.dumps(value, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"option {name!r}={value!r} cannot be part of a schedule cache key ({e}); pass "
                "plain JSON values (str, int, float, bool, None, lists, dicts of them)"
            ) from e
        opts[str(name)] = value
    doc = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "mem_budget_bytes": mem_budget_bytes,
           "options": opts}
    return _sha256({**doc, "versions": _versions()})


def load(key: str, directory: Path | None = None) -> dict | None:
    """The payload stored under ``key`` in ``directory`` (default :func:`cache_dir`), or None.

    An entry that is not JSON, of another :data:`FORMAT_VERSION`, recorded under another key or
    without a payload is a miss with a warning naming the file and why; what is on disk never
    makes this raise.

    Raises:
        ValueError: ``key`` is not a key from :func:`cache_key` (a caller's mistake).
    """
    _check_key(key)
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None:
        return None
    path = directory / f"{key}.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        logger.debug("schedule cache miss: %s", path)
        return None
    except OSError as e:
        logger.warning("ignoring schedule cache entry %s: cannot read it (%s)", path, e)
        return None
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and bad JSON
        logger.warning("ignoring schedule cache entry %s: not valid JSON (%s)", path, e)
        return None
    problem = _entry_problem(entry, key)
    if problem:
        logger.warning("ignoring schedule cache entry %s: %s", path, problem)
        return None
    logger.debug("schedule cache hit: %s", path)
    return entry["payload"]


def entry_path(key: str, directory: Path | None = None) -> Path | None:
    """Where the entry of ``key`` lives in ``directory`` (default :func:`cache_dir`), for
    messages; None when caching is off.

    Raises:
        ValueError: ``key`` is not a key from :func:`cache_key`.
    """
    _check_key(key)
    directory = cache_dir() if directory is None else Path(directory)
    return None if directory is None else directory / f"{key}.json"


def store(key: str, payload: dict, directory: Path | None = None) -> Path | None:
    """Write ``payload`` under ``key`` atomically, with :data:`FORMAT_VERSION` and the key;
    returns the entry's path. None when caching is off (no ``directory`` and no
    :func:`cache_dir`), and with a warning when it cannot be written (read-only, disk full).

    Raises:
        ValueError: ``key`` is not a key from :func:`cache_key`.
        TypeError: ``payload`` is not a dict of JSON-serialisable values (a caller's mistake,
            raised so that it is fixed rather than silently never cached).
    """
    _check_key(key)
    if not isinstance(payload, dict):
        raise TypeError(f"a schedule cache payload must be a dict, not {type(payload).__name__}")
    text = json.dumps({"format": FORMAT_VERSION, "key": key, "payload": payload})
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None:
        return None
    path = directory / f"{key}.json"
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a unique temporary name per writer, in the entry's directory so the rename is atomic
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot write schedule cache entry %s: %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None
    logger.debug("schedule cache stored: %s", path)
    return path


def _entry_problem(entry: Any, key: str) -> str | None:
    """Why ``entry`` (a parsed file) is not a usable entry for ``key``; None when it is."""
    if not isinstance(entry, dict):
        return f"not a JSON object but {type(entry).__name__}"
    if entry.get("format") != FORMAT_VERSION:
        return f"format version {entry.get('format')!r}, this fsdp-sched reads {FORMAT_VERSION}"
    if entry.get("key") != key:
        return f"it records key {entry.get('key')!r}, not its file name's"
    if not isinstance(entry.get("payload"), dict):
        return "no payload object"
    return None


def _check_key(key: str) -> None:
    # the key becomes a file name: anything but a digest could name a path outside the cache
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not a schedule cache key (64 lowercase hex digits from cache_key())")


def _versions() -> dict[str, str]:
    """Versions of the code that decides a schedule."""
    import torch  # imported here so that load / store alone do not pay for importing torch

    return {
        "fsdp-sched": _dist_version("fsdp-sched"),
        "source": source_digest(),
        "torch": str(torch.__version__),
        "ortools": _dist_version("ortools"),
        "networkx": str(nx.__version__),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


@functools.cache
def source_digest() -> str:
    """sha256 of the Python sources of the packages that decide a schedule (``scheduler`` and
    ``solvers``, as imported: a working tree, an editable or a regular install), each file by
    its path within its package; read once per process."""
    h = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], Path(solvers.__file__).resolve().parent):
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _sorted_sets(obj: Any) -> Any:
    """``obj`` with every set replaced by a sorted list: set order follows the hash seed."""
    if isinstance(obj, (set, frozenset)):
        return sorted((_sorted_sets(v) for v in obj), key=repr)
    if isinstance(obj, dict):
        return {k: _sorted_sets(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sorted_sets(v) for v in obj]
    return obj


def _sha256(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------------------------
# the keys of a solve
# --------------------------------------------------------------------------------------------
def graph_key(problems: Mapping[str, Any], solver: Any, writeback: Any) -> str | None:
    """What decides the schedule besides the budget: the graph (its export under the primary
    cost model), the models judged, the options; None when the solve is not a function of data
    alone (a hook, a solver given as a callable)."""
    if solver.schedule_hook is not None or not isinstance(solver.solver, str):
        return None
    options = {"solver": solver.solver, "work_limit": solver.work_limit, "seed": solver.seed,
               "num_workers": solver.num_workers, "fallback": solver.fallback,
               "all_gather_stream": solver.all_gather_stream, "merge_all_reduces": solver.merge_all_reduces,
               "torch_starts": list(solver.torch_starts), "compute_order": solver.compute_order,
               "order_margin": solver.order_margin,
               "extra_starts": [s.digest() for s in solver.extra_starts], "search": dataclasses.asdict(solver.search),
               "payload_order": writeback.payload_order, "control_deps": writeback.control_deps,
               "cost_models": getattr(problems, "model_names", None) or {label: label for label in problems},
               "graph": dag_fingerprint(next(iter(problems.values())).dag)}
    return cache_key("", mem_budget_bytes=None, options=options)


def entry_key(graph_key: str | None, mem_budget_bytes: int | None) -> str | None:
    """The schedule cache's key of this solve , None when caching is off
    or the solve is not a function of data alone."""
    if cache_dir() is None or graph_key is None:
        return None
    return cache_key(graph_key, mem_budget_bytes=mem_budget_bytes, options={})


# --------------------------------------------------------------------------------------------
# judged figures kept with an entry
# --------------------------------------------------------------------------------------------
def judged_record(graph_key: str | None, chosen: Candidate) -> dict[str, Any] | None:
    """What a cache entry keeps of the judging of ``chosen``'s written graph: its figures, the
    graph (``graph_key``) and schedule they were judged on, and a seal over the three, so that
    an entry copied under another key or edited is judged again (:func:`recorded_figures`).
    None when the solve is not a function of data alone (no graph key)."""
    if graph_key is None or chosen.figures is None:
        return None
    record = {"graph": graph_key, "digest": chosen.schedule.digest(), "figures": chosen.figures.to_json()}
    return {**record, "seal": cache_key("", mem_budget_bytes=None, options=record)}


def recorded_figures(record: Any, graph_key: str | None, schedule: Schedule) -> Figures | None:
    """The figures of :func:`judged_record`'s ``record`` when it was made for this graph
    (``graph_key``) and ``schedule`` and its seal holds; None otherwise (judge again)."""
    from scheduler.check.written import Figures

    if graph_key is None or not isinstance(record, dict):
        return None
    body = {k: record.get(k) for k in ("graph", "digest", "figures")}
    if body["graph"] != graph_key or body["digest"] != schedule.digest() or not isinstance(body["figures"], dict):
        return None
    try:
        if record.get("seal") != cache_key("", mem_budget_bytes=None, options=body):
            return None
        figures = Figures(**body["figures"])
    except (TypeError, ValueError):
        return None
    numbers = dataclasses.astuple(figures)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers):
        return None
    return figures
