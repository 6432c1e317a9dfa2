"""The on-disk schedule cache (scheduler/cache.py): what its key tells apart, and that a bad or
concurrently written entry is a miss or a valid entry, never an exception."""

from __future__ import annotations

import enum
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

from scheduler.integrate import cache
from scheduler.export.dagfile import load_dag, save_dag
from scheduler.whatif.synthetic import DagBuilder

_TESTS = Path(__file__).parent


def _small_dag() -> nx.DiGraph:
    """One all-gathered weight feeding a matmul::

        primals_1 -> ag -> ag_wait -> mm -> output
                               x ----^
    """
    b = DagBuilder("cache")
    b.add_input("x", size_bytes=400)
    b.add_input("primals_1", size_bytes=100, releasable=False)
    w = b.add_collective("ag", "primals_1", runtime_ms=2.0, size_bytes=400, fqn="w")
    b.add_compute("mm", "x", w, runtime_ms=1.0, size_bytes=400)
    b.add_output("mm")
    return b.build()


def _key(**overrides) -> str:
    kwargs = {"mem_budget_bytes": 1 << 30, "options": {"solver": "cpsat", "work_limit": 5.0}}
    kwargs.update(overrides)
    return cache.cache_key("ab" * 32, **kwargs)


# ---- dag_fingerprint -------------------------------------------------------------------------
def test_fingerprint_equal_for_copies_rebuilds_and_saved_copies(tmp_path):
    dag = _small_dag()
    save_dag(dag, tmp_path / "dag.json")
    fp = cache.dag_fingerprint(dag)
    assert len(fp) == 64
    assert cache.dag_fingerprint(_small_dag()) == fp
    assert cache.dag_fingerprint(dag.copy()) == fp
    assert cache.dag_fingerprint(load_dag(tmp_path / "dag.json")) == fp


def _set_runtime(dag):
    dag.nodes["mm"]["runtime_ms"] = 1.0 + 1e-9


def _add_edge(dag):
    dag.add_edge("x", "output")


def _set_size(dag):
    dag.nodes["ag"]["size_bytes"] = 404


def _set_comm_model(dag):
    dag.graph["copy_ms_per_byte"] = 2 * dag.graph["copy_ms_per_byte"] + 1e-6


@pytest.mark.parametrize("change", [_set_runtime, _add_edge, _set_size, _set_comm_model])
def test_fingerprint_changes_with_any_cost_size_edge_or_graph_attribute(change):
    dag = _small_dag()
    before = cache.dag_fingerprint(dag)
    change(dag)
    assert cache.dag_fingerprint(dag) != before


class _Mode(enum.Enum):
    FAST = 1
    SLOW = 2


def test_fingerprint_ignores_edge_insertion_order_and_handles_odd_attribute_types():
    dag = _small_dag()
    dag.add_edge("x", "output")  # x now has two successors, whose order the copy reverses
    reordered = nx.DiGraph(**dag.graph)
    reordered.add_nodes_from(dag.nodes(data=True))
    reordered.add_edges_from(reversed(list(dag.edges())))
    assert list(reordered.successors("x")) != list(dag.successors("x"))
    assert cache.dag_fingerprint(reordered) == cache.dag_fingerprint(dag)
    dag = _small_dag()
    dag.nodes["mm"]["tags"] = {"b", "a", "c"}
    dag.nodes["mm"]["shape"] = (4, None, float("nan"))
    dag.nodes["mm"]["mode"] = _Mode.FAST
    again = _small_dag()
    again.nodes["mm"]["tags"] = {"c", "a", "b"}
    again.nodes["mm"]["shape"] = [4, None, float("nan")]
    again.nodes["mm"]["mode"] = _Mode.FAST
    assert cache.dag_fingerprint(dag) == cache.dag_fingerprint(again)
    again.nodes["mm"]["mode"] = _Mode.SLOW
    assert cache.dag_fingerprint(dag) != cache.dag_fingerprint(again)


def test_fingerprint_equal_in_processes_with_other_hash_seeds(tmp_path):
    """The saved DAG loaded in two fresh processes (different PYTHONHASHSEED), and the same DAG
    built there with a set-valued attribute, give this process's digests."""
    dag = _small_dag()
    save_dag(dag, tmp_path / "dag.json")
    with_set = _small_dag()
    with_set.nodes["mm"]["tags"] = {f"tag{i}" for i in range(20)}
    expected = [cache.dag_fingerprint(dag), cache.dag_fingerprint(with_set)]
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(_TESTS)!r})
        from test_cache import _small_dag
        from scheduler.integrate.cache import dag_fingerprint
        from scheduler.export.dagfile import load_dag
        with_set = _small_dag()
        with_set.nodes["mm"]["tags"] = {{f"tag{{i}}" for i in range(20)}}
        print(json.dumps([dag_fingerprint(load_dag({str(tmp_path / "dag.json")!r})), dag_fingerprint(with_set)]))
        """
    )
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


# ---- cache_key -------------------------------------------------------------------------------
def test_key_is_stable_and_ignores_option_order():
    assert _key() == _key()
    assert _key(options={"work_limit": 5.0, "solver": "cpsat"}) == _key()


@pytest.mark.parametrize(
    "overrides",
    [
        {"mem_budget_bytes": (1 << 30) + 1},
        {"mem_budget_bytes": None},
        {"options": {"solver": "cpsat", "work_limit": 6.0}},
        {"options": {"solver": "milp", "work_limit": 5.0}},
        {"options": {"solver": "cpsat", "work_limit": 5.0, "seed": 0}},
    ],
)
def test_key_differs_with_budget_and_options(overrides):
    assert _key(**overrides) != _key()


def test_key_differs_with_fingerprint_and_package_version(monkeypatch):
    other_dag = cache.cache_key("cd" * 32, mem_budget_bytes=1 << 30, options={"solver": "cpsat", "work_limit": 5.0})
    assert other_dag != _key()
    before = _key()
    real = cache._dist_version
    monkeypatch.setattr(cache, "_dist_version", lambda d: "999.0" if d == "fsdp-sched" else real(d))
    assert _key() != before


def test_missing_package_version_reads_unknown(monkeypatch):
    def missing(dist):
        raise cache.importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(cache.importlib.metadata, "version", missing)
    assert cache._dist_version("fsdp-sched") == "unknown"
    assert len(_key()) == 64


def test_key_rejects_an_option_json_cannot_hold():
    with pytest.raises(TypeError, match="cost_fn"):
        _key(options={"solver": "cpsat", "cost_fn": lambda n: 1.0})


# ---- store / load ----------------------------------------------------------------------------
def test_store_then_load_round_trips(tmp_path):
    key = _key()
    payload = {"buckets": [["ag", "ag_1"]], "objective_ms": 12.5, "status": "optimal", "bound": None}
    path = cache.store(key, payload, tmp_path)
    assert path == tmp_path / f"{key}.json"
    assert cache.load(key, tmp_path) == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.json"]  # no temporary left
    assert cache.load(_key(mem_budget_bytes=1), tmp_path) is None


def test_default_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "sched"))
    assert cache.store(_key(), {"a": 1}) == tmp_path / "sched" / cache.SCHEDULES_DIR / f"{_key()}.json"
    assert cache.load(_key()) == {"a": 1}
    monkeypatch.setenv(cache.CACHE_ENV, "0")
    assert cache.store(_key(), {"a": 2}) is None and cache.load(_key()) is None


def _wrong_key(key):
    return json.dumps({"format": cache.FORMAT_VERSION, "key": "0" * 64, "payload": {"a": 1}}).encode()


@pytest.mark.parametrize(
    "content, why",
    [
        (lambda key: b"\xff\xfe\x00garbage", "not valid JSON"),
        (lambda key: b'{"format": 1, "key": ', "not valid JSON"),
        (_wrong_key, "records key"),
        (lambda key: json.dumps({"format": 0, "key": key, "payload": {"a": 1}}).encode(), "format version 0"),
        (lambda key: json.dumps({"format": cache.FORMAT_VERSION, "key": key}).encode(), "no payload"),
        (lambda key: b"[1, 2]", "not a JSON object"),
    ],
)
def test_corrupt_entry_is_a_miss_with_a_warning(tmp_path, caplog, content, why):
    key = _key()
    (tmp_path / f"{key}.json").write_bytes(content(key))
    with caplog.at_level(logging.WARNING, logger="scheduler.integrate.cache"):
        assert cache.load(key, tmp_path) is None
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"{key}.json" in m and why in m for m in messages), messages
    cache.store(key, {"a": 3}, tmp_path)  # a fresh store replaces the bad entry
    assert cache.load(key, tmp_path) == {"a": 3}


def test_unwritable_directory_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="scheduler.integrate.cache"):
        assert cache.store(_key(), {"a": 1}, blocker) is None
    assert any("cannot write" in r.getMessage() for r in caplog.records)


def test_bad_key_and_payload_are_caller_errors(tmp_path):
    with pytest.raises(ValueError, match="not a schedule cache key"):
        cache.load("../etc/passwd", tmp_path)
    with pytest.raises(TypeError, match="dict"):
        cache.store(_key(), [1, 2], tmp_path)  # type: ignore[arg-type]


# ---- where the cache lives ------------------------------------------------------------------
def test_cache_root_default_is_per_user_under_the_standard_cache_location(tmp_path, monkeypatch):
    """Unset: ``$XDG_CACHE_HOME/fsdp-sched`` when that is an absolute path, else
    ``~/.cache/fsdp-sched``; nothing is created by resolving it."""
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "fsdp-sched"
    for ignored in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert cache.cache_root() == tmp_path / "home" / ".cache" / "fsdp-sched"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "fsdp-sched"
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_default_cache_is_on_and_versioned(tmp_path, monkeypatch):
    """With nothing set, entries go to a directory named by the entry format under the
    per-user cache root, and are read back from there."""
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = cache.store(_key(), {"a": 1})
    assert path == tmp_path / "xdg" / "fsdp-sched" / f"schedules-v{cache.FORMAT_VERSION}" / f"{_key()}.json"
    assert cache.load(_key()) == {"a": 1}


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", "no", "none", "", " 0 "])
def test_cache_turned_off(value, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() is None and cache.cache_dir() is None
    assert cache.store(_key(), {"a": 1}) is None and cache.load(_key()) is None
    assert not (tmp_path / "xdg").exists()


def test_cache_moved_and_created(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "a" / "b"))
    assert cache.cache_root() == tmp_path / "a" / "b"
    assert cache.cache_dir() == tmp_path / "a" / "b" / cache.SCHEDULES_DIR
    assert (tmp_path / "a" / "b" / cache.SCHEDULES_DIR).is_dir()


def test_the_timing_cache_of_measured_costs_lives_in_the_same_root(tmp_path, monkeypatch):
    """One function resolves the cache for every reader: ``measure``'s timings sit in the
    same root, and are kept in memory only when caching is off."""
    from scheduler.costs.measure import default_cache_dir

    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == cache.cache_root() == tmp_path / "xdg" / "fsdp-sched"
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    assert default_cache_dir() is None


def test_uncreatable_cache_dir_is_off_with_one_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "a_file" / "sub"))
    with caplog.at_level(logging.WARNING, logger="scheduler.integrate.cache"):
        assert cache.cache_dir() is None
        assert cache.cache_dir() is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and cache.CACHE_ENV in warned[0] and "off" in warned[0]


def test_disabled_turns_caching_off_for_the_block(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    with cache.disabled():
        assert cache.cache_dir() is None
    assert cache.cache_dir() == tmp_path / cache.SCHEDULES_DIR


def test_the_key_follows_the_library_source(monkeypatch):
    """An edited library (an editable install under an unchanged version number) must not
    read the answers of the code before the edit."""
    before = _key()
    monkeypatch.setattr(cache, "source_digest", lambda: "0" * 64)
    assert _key() != before


# ---- concurrency -----------------------------------------------------------------------------
_WRITER = """
import sys
from pathlib import Path
from scheduler.integrate import cache
directory, key, writer, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
bad = 0
for i in range(n):
    cache.store(key, {"writer": writer, "i": i, "blob": "x" * 20000}, directory)
    got = cache.load(key, directory)
    bad += not (isinstance(got, dict) and len(got["blob"]) == 20000 and got["writer"] in (0, 1))
print(bad)
"""


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    """Two processes store and load one key a few hundred times each: every load sees a whole
    entry (its own or the other's), and the last one stands."""
    key = _key()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), key, str(w), "300"], stdout=subprocess.PIPE, text=True
        )
        for w in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [int(o.strip()) for o in outs] == [0, 0]
    final = cache.load(key, tmp_path)
    assert final is not None and final["i"] == 299 and len(final["blob"]) == 20000
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.json"]
