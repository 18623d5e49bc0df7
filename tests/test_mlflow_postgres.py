"""A tracking record that survives the cluster: a real `mlflow server` whose backend store is
PostgreSQL (a real server, started here on 127.0.0.1 with its data in a temporary folder) and whose
artifacts go to an S3 bucket (moto's S3 API on 127.0.0.1, tests/conftest.py). The study's driver
knows only `--mlflow-uri http://...`: no database password and no bucket credentials reach it, so
everything it records goes through the server, into rows of PostgreSQL and objects in the bucket.

The server binaries are Debian's `postgresql`, installed with apt-get by the test setup where they
are missing (tests/conftest.py `debian_package`). Skips, saying why, only where PostgreSQL cannot be
installed or started here (apt-get failing; root with no unprivileged user to run it as).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import bucket_keys, debian_package
from test_report import chromium

from tests.support.postgres import (
    PostgresUnavailable,
    ServerFailed,
    backend_uri,
    postgres_bindir,
    query,
    running_mlflow_server,
    running_postgres,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# as tests/test_study.py runs a study: this venv first on PATH, and a Ray token of the test's own
# (Ray 2.60 would otherwise write one to ~/.ray/auth_token)
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
       "RAY_AUTH_TOKEN": secrets.token_hex(32)}
for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
    ENV.pop(var, None)


def run(args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "study" / "run.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


# --- PostgreSQL and the MLflow server (tests/support/postgres.py) -------------------------------------
@pytest.fixture(scope="module")
def postgres():
    """{"host", "port", "user", "password", "dbname", "env" (PGPASSWORD)}: a PostgreSQL server on
    127.0.0.1 (tests/support/postgres.py `running_postgres`); skips, saying why, where it cannot start."""
    debian_package("postgresql", postgres_bindir)
    try:
        with running_postgres() as pg:
            yield pg
    except PostgresUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def mlflow_pg_server(postgres, s3):
    """The command line docs/cluster.md gives, on 127.0.0.1: the backend store is
    PostgreSQL (its password in PGPASSWORD, not in the URI), artifacts are served by the server from
    s3://<bucket>/mlflow (the server alone holds the bucket's credentials and endpoint)."""
    env = {**ENV, **postgres["env"], **s3["env"], "MLFLOW_S3_ENDPOINT_URL": s3["url"]}
    try:
        with running_mlflow_server(backend_uri(postgres), env, f"s3://{s3['bucket']}/mlflow") as server:
            yield server
    except ServerFailed as e:
        pytest.fail(str(e))


# the driver gets no credentials: neither the database's nor the bucket's
DRIVER_ENV = {k: v for k, v in ENV.items() if not k.startswith(("AWS_", "PG", "MLFLOW_S3_"))}


def summary_block(text: str) -> list[str]:
    """The lines from "selected per cell" up to "files:" (the study's closing lines, the report's too)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("selected per cell"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "files:")
    return lines[start:end]


def test_a_study_records_into_postgresql_and_the_bucket_and_is_read_back(tmp_path, mlflow_pg_server, postgres,
                                                                           s3):
    url = mlflow_pg_server["url"]
    storage = tmp_path / "studies"
    out = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
               "--mlflow-uri", url, "--set", "resources.max_concurrent_trials=2"], env=DRIVER_ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + \
        Path(mlflow_pg_server["log"]).read_text()[-3000:]
    assert "goes away" not in out.stderr  # a tracking server: no warning that the record dies with the driver
    results = pd.read_csv(storage / "smoke" / "results.csv")
    trials = sorted(results.trial_id.unique())
    assert len(trials) == 4

    # --- the rows in PostgreSQL: one experiment, one parent run, 4 children with params and metrics
    (exp_id, location), = query(postgres, "SELECT experiment_id, artifact_location FROM experiments "
                                          "WHERE name = %s", "smoke")
    assert location.startswith("mlflow-artifacts:")  # proxied by the server: the driver never saw the bucket
    runs = query(postgres, "SELECT run_uuid, status, start_time, end_time FROM runs WHERE experiment_id = %s",
                 exp_id)
    assert len(runs) == 5 and {status for _, status, _, _ in runs} == {"FINISHED"}
    tags = query(postgres, "SELECT t.run_uuid, t.key, t.value FROM tags t JOIN runs r "
                           "ON r.run_uuid = t.run_uuid WHERE r.experiment_id = %s", exp_id)
    parent_of = {run: value for run, key, value in tags if key == "mlflow.parentRunId"}
    parents = [run for run, *_ in runs if run not in parent_of]
    assert len(parents) == 1 and set(parent_of.values()) == set(parents)
    parent = parents[0]
    assert ("study.parent", "true") in {(k, v) for run, k, v in tags if run == parent}
    children = sorted(parent_of)
    trial_of = {run: value for run, key, value in tags if key == "tune.trial_id"}
    assert sorted(trial_of[c] for c in children) == trials

    params = query(postgres, "SELECT run_uuid, key, value FROM params WHERE run_uuid = ANY(%s)", children)
    lrs = {run: float(value) for run, key, value in params if key == "optim.lr"}
    assert set(lrs) == set(children)
    by_trial = results.groupby("trial_id")["search.optim.lr"].first()
    for child in children:  # the params in the database are the trials' own
        assert lrs[child] == pytest.approx(by_trial[trial_of[child]], rel=1e-6)
    latest = query(postgres, "SELECT run_uuid, key, value FROM latest_metrics WHERE run_uuid = ANY(%s)",
                   children)
    val_exact = {run: value for run, key, value in latest if key == "val_exact"}
    assert set(val_exact) == set(children)
    for child in children:
        own = results[results.trial_id == trial_of[child]]
        assert val_exact[child] == pytest.approx(own.val_exact.iloc[0])
    history = query(postgres, "SELECT run_uuid, step, timestamp FROM metrics WHERE key = 'val_loss' "
                              "AND run_uuid = ANY(%s)", children)
    steps: dict[str, list[int]] = {}
    for run_id, step, _ in history:
        steps.setdefault(run_id, []).append(step)
    assert {c: sorted(s) for c, s in steps.items()} == {c: [20, 40, 60] for c in children}  # training curves
    acc = query(postgres, "SELECT DISTINCT run_uuid, step FROM metrics WHERE key = 'acc_len/k2' "
                          "AND run_uuid = ANY(%s)", children)
    assert sorted(step for _, step in acc) == sorted([8, 16, 24] * 4)  # accuracy against test length

    # two trials at a time, both recorded: some two children's runs are open at once (their lifetimes,
    # not their training curves: 60 steps take under a second, and a busy machine staggers the starts)
    span = {run_id: (start, end) for run_id, _, start, end in runs if run_id in parent_of}
    assert any(span[a][0] <= span[b][1] and span[b][0] <= span[a][1]
               for i, a in enumerate(children) for b in children[i + 1:]), span

    # --- the artifacts are objects in the bucket, the study's own bytes
    keys = bucket_keys(s3, "mlflow/")
    results_key = f"mlflow/{exp_id}/{parent}/artifacts/results.csv"
    assert results_key in keys, keys
    body = s3["client"].get_object(Bucket=s3["bucket"], Key=results_key)["Body"].read()
    assert body == (storage / "smoke" / "results.csv").read_bytes()
    for child in children:
        assert f"mlflow/{exp_id}/{child}/artifacts/eval/records.csv" in keys

    # --- read back through the server alone: the report equals the study's
    report = subprocess.run([sys.executable, "-m", "study.report", "smoke", "--mlflow-uri", url,
                             "--out", str(tmp_path / "report")], cwd=ROOT, env=DRIVER_ENV,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.startswith(f"study smoke from MLflow run {parent} of experiment smoke: 4 trials"), \
        report.stdout[:500]
    assert summary_block(report.stdout) == summary_block(out.stdout)
    study_csv = (storage / "smoke" / "results.csv").read_bytes()
    assert (tmp_path / "report" / "results.csv").read_bytes() == study_csv
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "report" / "summary.csv"),
                                  pd.read_csv(storage / "smoke" / "summary.csv"))


# --- the runs page at a tiny scale (benchmarks/mlflow_ui.py), on the same server ---------------------
N = 30


def test_the_runs_page_of_a_study_in_postgresql_shows_its_child_runs(tmp_path, mlflow_pg_server):
    """benchmarks/mlflow_ui.py at a tiny size, on the server above: a study of N trials read back with
    search_runs and on the runs page in headless Chromium. The page lists the study's run with its
    children nested under it, collapsed; sorted by a metric, or with the study's run expanded, it
    shows the children by name."""
    chromium()
    server, described = mlflow_pg_server, ("mlflow server --workers 1, backend postgresql+psycopg2 on "
                                           "127.0.0.1, artifacts in a bucket")
    out = tmp_path / "ui.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.mlflow_ui", "--tracking-uri", server["url"],
                          "--server", described, "--runs", str(N), "--repeats", "1", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    r = json.loads(out.read_text())["mlflow_ui"]
    assert (r["children"], r["runs"], r["source"]) == (N, N + 1, "synthetic")
    # the server it was given, described as the caller described it; an experiment of its own there
    assert (r["tracking_uri"], r["server"]) == (server["url"], described)
    assert r["server_mlflow"] == r["mlflow"] and r["experiment"].startswith("scale-mlflow_ui-"), r
    # the shape of a run of the default study: the tracker's params, tags and metrics
    assert r["params_per_child"] >= 20 and r["tags_per_child"] >= 13 and r["metric_keys_per_child"] >= 60

    # the API: every run, in pages of 1000 and of 100; the parent's children by their tag
    assert r["search_runs_runs"] == r["search_runs_page100_runs"] == N + 1
    assert r["children_search_runs"] == N

    # the page as opened: every run loaded ("31 matching runs"), the study's row, its children collapsed
    assert r["page_matching_runs"] == N + 1 and r["page_parent_row"], r
    assert r["page_child_rows"] == 0 and r["page_child_names"] == 0 and not r["page_load_more"], r
    # sorted by a metric the table is flat: every child, by name
    assert r["sorted_matching_runs"] == N + 1 and r["sorted_child_rows"] == r["sorted_child_names"] == N, r
    # clicked through: expanding the study's run shows its children; nothing left to load
    assert "browse_error" not in r, r["browse_error"]
    assert r["browse_open_matching_runs"] == N + 1 and r["browse_open_child_rows"] == 0
    assert r["browse_expanded_child_rows"] == N and r["browse_load_more_clicks"] == 0
    assert r["browse_all_matching_runs"] == N + 1

    # the figures are times, and sane ones
    for key in ("fill_s", "search_runs_s", "search_runs_page100_s", "search_runs_first_page100_s",
                "children_search_s", "page_wall_s", "sorted_wall_s", "filtered_wall_s", "browse_open_s",
                "browse_to_every_run_s"):
        assert 0 < r[key] < 120, (key, r[key])
    assert r["browse_open_s"] <= r["browse_to_every_run_s"]
    assert "matching runs" in run.stdout and "search_runs" in run.stdout
