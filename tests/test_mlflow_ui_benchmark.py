"""MLflow at scale for a person (benchmarks/mlflow_ui.py): the URIs it refuses. The benchmark itself, at
30 trials on the PostgreSQL-backed `mlflow server` a study records into, read back with search_runs
and on the runs page in headless Chromium: tests/test_mlflow_postgres.py (one PostgreSQL and one
server for both).
"""

from __future__ import annotations

import pytest

from tests.support.postgres import free_port


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
