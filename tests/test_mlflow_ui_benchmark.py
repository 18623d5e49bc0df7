"""MLflow at scale for a person (benchmarks/mlflow_ui.py), at a tiny size: a study of 30 trials in a
PostgreSQL-backed `mlflow server`, read back with search_runs and on the runs page in headless
Chromium. The page lists the study's run with its children nested under it, collapsed; sorted by a
metric, or with the study's run expanded, it shows the children by name.

The benchmark measures the server it is given (`--tracking-uri`): PostgreSQL and the server are
started here (tests/support/postgres.py), as docs/cluster.md's command line starts them. Debian's
postgresql and chromium are installed with apt-get where missing (tests/conftest.py
`debian_package`); skips, saying why, only where they cannot be installed or PostgreSQL started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import debian_package
from test_report import chromium

from tests.support.postgres import (
    PostgresUnavailable,
    ServerFailed,
    backend_uri,
    free_port,
    postgres_bindir,
    running_mlflow_server,
    running_postgres,
)

ROOT = Path(__file__).resolve().parents[1]
N = 30


@pytest.fixture
def pg_server():
    """(the `mlflow server` {"url", "log", "pid"}, a line saying what it is): one worker, its backend
    store a PostgreSQL on 127.0.0.1, artifacts in a local folder; skips where PostgreSQL cannot start."""
    bindir = debian_package("postgresql", postgres_bindir)
    postgres = subprocess.run([os.path.join(bindir, "postgres"), "--version"], capture_output=True, text=True,
                              timeout=60, check=False).stdout.strip()
    try:
        with running_postgres() as pg, \
                running_mlflow_server(backend_uri(pg), {**os.environ, **pg["env"]}) as server:
            yield server, (f"mlflow server --workers 1, backend postgresql+psycopg2 ({postgres}) on 127.0.0.1, "
                           "artifacts in a local folder")
    except PostgresUnavailable as e:
        pytest.skip(str(e))
    except ServerFailed as e:
        pytest.fail(str(e))


@pytest.mark.slow
def test_the_runs_page_of_a_study_in_postgresql_shows_its_child_runs(tmp_path, pg_server):
    chromium()
    server, described = pg_server
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


@pytest.mark.parametrize("uri, says", [
    ("http://127.0.0.1:{port}", "--tracking-uri: no MLflow server answers at http://127.0.0.1:"),
    ("postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow", "is not an `mlflow server`"),
])
def test_the_benchmark_refuses_a_uri_that_is_no_server(uri, says, capsys):
    """Before it builds a record or opens a browser: exit 2, saying which URI."""
    from benchmarks.mlflow_ui import main

    with pytest.raises(SystemExit) as done:
        main(["--tracking-uri", uri.format(port=free_port()), "--runs", "1"])
    assert done.value.code == 2
    assert says in capsys.readouterr().err
