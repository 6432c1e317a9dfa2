"""``fsdp-sched sweep --address``: points solved on a Dask cluster (a LocalCluster on loopback)
give the same results table and SQLite rows as a sequential run; ray:// without ray is a user error."""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3

import pytest

from scheduler import cli
from scheduler.export.dagfile import save_dag
from scheduler.whatif.synthetic import make_fsdp_dag

BUDGETS = ["1.0x", "0.9x", "0.8x"]


def _sweep(dag_path, out, capsys, *extra: str) -> tuple[int, str, str]:
    args = ["-q", "sweep", str(dag_path), "--solver", "fsdp2", "--budgets", *BUDGETS,
            "--work-limit", "2", "--out", str(out), *extra]
    rc = cli.main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _db_rows(db) -> list[tuple]:
    """The stored rows without the wall-clock solve time (the only column that may differ)."""
    con = sqlite3.connect(db)
    try:
        q = con.execute("SELECT dag_hash, solver, budget_bytes, time_limit_s, status, step_ms, exposed_comm_ms, "
                        "peak_bytes, n_collectives, gap, error FROM results ORDER BY budget_bytes")
        return q.fetchall()
    finally:
        con.close()


def _table(text: str, out) -> str:
    """The printed table, with solve times and the output directory masked."""
    text = text.replace(str(out), "OUT")
    return re.sub(r"\d+\.\d\ds(?=\s*[\d.]+%|\s*$)", "S", text, flags=re.M)


@pytest.mark.timeout(60)
def test_sweep_on_local_dask_cluster_matches_sequential(tmp_path, capsys):
    distributed = pytest.importorskip("distributed")
    dag_path = tmp_path / "g.dag.json"
    save_dag(make_fsdp_dag(n_layers=1, params_per_layer=3, graph_kind="backward", seed=0), dag_path)

    rc, seq_out, _ = _sweep(dag_path, tmp_path / "seq", capsys)
    assert rc == 0
    seq_rows = _db_rows(tmp_path / "seq" / "sweep.sqlite")
    assert len(seq_rows) == len(BUDGETS)

    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                       host="127.0.0.1", protocol="tcp://", dashboard_address=None)
    try:
        address = cluster.scheduler_address
        assert address.startswith("tcp://127.0.0.1:")
        rc, dask_out, err = _sweep(dag_path, tmp_path / "dask", capsys, "--address", address)
        assert rc == 0, err
        # one progress line per point, as each finished
        assert len(re.findall(r"^\[\d/3\] budget ", err, flags=re.M)) == len(BUDGETS), err
        assert _db_rows(tmp_path / "dask" / "sweep.sqlite") == seq_rows
        assert _table(dask_out, tmp_path / "dask") == _table(seq_out, tmp_path / "seq")
        assert (tmp_path / "dask" / "g_pareto.png").is_file() or list((tmp_path / "dask").glob("*_pareto.png"))

        # a rerun against the cluster resumes from the database: nothing is solved again
        rc, json_out, err = _sweep(dag_path, tmp_path / "dask", capsys, "--address", address, "--json")
        assert rc == 0 and "budget" not in err
        assert len(json.loads(json_out)["points"]) == len(BUDGETS)
    finally:
        cluster.close()


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_ray_address_without_ray_is_a_user_error(tmp_path, capsys):
    dag_path = tmp_path / "g.dag.json"
    save_dag(make_fsdp_dag(n_layers=1, params_per_layer=3, graph_kind="backward", seed=0), dag_path)
    rc, out, err = _sweep(dag_path, tmp_path / "out", capsys, "--address", "ray://x")
    assert rc == 2
    assert "ray is not installed; pip install ray" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
