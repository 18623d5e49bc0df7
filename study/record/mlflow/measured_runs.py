"""The analysis commands' side of the MLflow record (`--mlflow-run`): the model a trial run stored
(its `checkpoint` tag, study/record/mlflow/recorder.py) and a measurement logged back to that run."""

from __future__ import annotations

import math
import os

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from study.record.mlflow.uri_checks import check_mlflow_uri
from trial import storage as store


def checkpoint_of_run(uri: str, run: str) -> str:
    """Where trial run `run` (its id) stored its model; a run that does not exist, a tracking store that
    cannot be read, or a run without the tag is a ValueError naming the flag."""
    problem = check_mlflow_uri(uri)
    if not problem and uri.lower().startswith("sqlite:///"):  # MLflow would create an empty one
        path = os.path.abspath(uri.partition(":///")[2])
        if not os.path.isfile(path):
            problem = f"--mlflow-uri: {uri}: no MLflow database at {path}"
    if problem:
        raise ValueError(problem)
    try:
        recorded = MlflowClient(uri).get_run(run)
    except MlflowException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--mlflow-run: no run {run!r} in {store.redact(uri)} ({first})") from None
    checkpoint = recorded.data.tags.get("checkpoint")
    if not checkpoint:
        raise ValueError(f"--mlflow-run: run {run} has no `checkpoint` tag (not a trial run of a study?)")
    return checkpoint


def log_measurement(uri: str, run: str, name: str, metrics: dict[str, float], tags: dict[str, str],
                    folder: str) -> None:
    """Metrics as `<name>/<key>` (the finite ones), the tags, and the files in `folder` under `name/`."""
    client = MlflowClient(uri)
    for key, value in metrics.items():
        if math.isfinite(value):
            client.log_metric(run, f"{name}/{key}", float(value))
    client.log_artifacts(run, folder, name)
    for key, value in tags.items():
        client.set_tag(run, key, value)
