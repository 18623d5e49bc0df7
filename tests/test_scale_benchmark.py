"""P6 (benchmarks/scale.py) end to end at a tiny size: a simulated 2-node Ray cluster, a 6-trial
study through study/run.py, its driver killed at N/2 and resumed, the report; every figure the
JSON promises is there and sane, and the resume reran no finished trial. And the rule P6 led to:
events a resume can wait for share one snapshot (study/experiment/snapshots.py, SnapshotDue)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KEYS = ["trials", "concurrency", "driver_wall_s", "study_wall_s", "trial_s_sum", "driver_overhead_ms_per_trial",
        "first_trial_started_s", "first_trial_s", "mlflow_calls_per_trial", "mlflow_s_per_trial",
        "mlflow_store_calls_per_trial", "mlflow_by_method", "snapshot_s_per_trial", "tracker_s_per_trial",
        "searcher_s_per_trial", "state_bytes", "state_files", "tune_dir_bytes", "mlflow_runs", "report_s",
        "kill_signal", "killed_at_trials_ended", "finished_in_mlflow_at_kill", "resume_s", "resume_first_new_s",
        "resume_first_finished_s", "restarted_trials", "rerun_trials", "results_trials", "mlflow_finished",
        "mlflow_deleted"]


def test_events_a_resume_can_wait_for_share_a_snapshot(monkeypatch):
    from study.experiment import snapshots

    monkeypatch.setattr(snapshots, "COALESCE_S", 0.3)
    due = snapshots.SnapshotDue()
    assert not due.is_due()
    due.after_coalescing()  # a trial ended
    due.checkpoint(first=True)  # a trial's first checkpoint: no stored state names one of it
    assert not due.is_due(), "waits for COALESCE_S after the last snapshot"
    time.sleep(0.35)
    assert due.is_due()
    due.snapshot_taken()
    due.checkpoint(first=False)  # the stored state may name its previous one, deleted at its next
    assert due.is_due(), "due at once"
    time.sleep(0.2)  # a snapshot that took 0.2 s
    due.snapshot_taken()
    assert not due.is_due()
    # so the next events wait longer: snapshots take at most SNAPSHOT_SHARE of the driver's time
    assert due.wait >= 0.2 * (1 - snapshots.SNAPSHOT_SHARE) / snapshots.SNAPSHOT_SHARE
    due.after_coalescing()
    assert due.at >= due.last + due.wait and not due.is_due()


def test_the_trials_of_a_store_its_killed_driver_left_mid_write_are_read(tmp_path):
    """A driver SIGKILLed inside a write leaves a hot journal (pages of the write already in the file):
    P6 reads the store right after its kill, and only a read-write connection may roll that back."""
    import sqlite3

    from benchmarks.scale import mlflow_children

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.executescript("""
            CREATE TABLE runs (run_uuid TEXT, status TEXT, lifecycle_stage TEXT);
            CREATE TABLE tags (run_uuid TEXT, key TEXT, value TEXT);
            INSERT INTO runs VALUES ('r1', 'FINISHED', 'active');
            INSERT INTO tags VALUES ('r1', 'mlflow.parentRunId', 'p'), ('r1', 'tune.trial_id', 't1');
            CREATE TABLE filler (x BLOB);""")
        con.executemany("INSERT INTO filler VALUES (?)", [(b"x" * 1000,)] * 2000)
    killed_mid_write = ("import os, signal, sqlite3, sys\n"
                        "con = sqlite3.connect(sys.argv[1])\n"
                        "con.execute('PRAGMA cache_size=5')  # the write spills into the file before its commit\n"
                        "con.execute('UPDATE filler SET x = zeroblob(1000)')\n"
                        "os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", killed_mid_write, str(db)], timeout=60)
    assert (tmp_path / "mlflow.db-journal").stat().st_size > 0, "no hot journal: the test would prove nothing"
    assert mlflow_children(db) == [{"run": "r1", "status": "FINISHED", "deleted": False, "trial_id": "t1"}]


@pytest.mark.slow
def test_p6_on_a_tiny_study(tmp_path):
    out = tmp_path / "p6.json"
    # a whole CPU a trial: two trials at once, one on each node (each trial process started costs the
    # test its imports, in each of the three drivers)
    run = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--trials", "6", "--nodes", "2", "--trial-cpus", "1",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    p6 = json.loads(out.read_text())["P6"]
    assert p6["cluster"]["nodes"] == 2 and p6["cluster"]["concurrency"] == 2
    r = p6["6"]
    missing = [k for k in KEYS if k not in r]
    assert not missing, missing
    n = 6
    assert r["trials"] == n and r["mlflow_runs"] == n
    assert r["study_wall_s"] > 0 and r["trial_s_sum"] > 0
    assert 0 < r["first_trial_started_s"] <= r["first_trial_s"] < r["driver_wall_s"]
    # the driver talks to MLflow in batches: a handful of calls per trial, not one per metric
    assert 3 <= r["mlflow_calls_per_trial"] <= 20, r["mlflow_by_method"]
    assert r["mlflow_by_method"]["log_batch"]["calls"] <= 3 * n
    assert 0 < r["mlflow_s_per_trial"] < 10
    assert r["state_bytes"] > 0 and any(k.startswith("experiment_state-") for k in r["state_files"])
    assert r["tune_dir_bytes"] >= r["state_bytes"]
    assert 0 < r["report_s"] < 120
    # the kill came at N/2 and the resumed driver went on from there
    assert r["killed_at_trials_ended"] >= n // 2
    assert 0 < r["resume_s"] < 300 and r["resume_first_finished_s"] >= r["resume_s"]
    assert r["rerun_trials"] == 0, "a trial finished before the kill ran again"
    assert r["results_trials"] == n and r["mlflow_finished"] == n
