"""Which trained model an analysis command measures: a trial checkpoint (a folder or a bucket URI),
the checkpoint of an MLflow trial run (its `checkpoint` tag), or a local Hugging Face folder."""

from __future__ import annotations

import os

from study.record.mlflow.uri_checks import check_mlflow_uri
from trial import storage as store


def add_model_source(parser, hf_help: str) -> None:
    """The CLIs' (study.loss_gap's and study.sparsity's) choice of model: a checkpoint, an MLflow trial
    run or a Hugging Face folder."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a trial checkpoint folder or bucket URI (holds trial_config.json)")
    src.add_argument("--mlflow-run", help="an MLflow trial run id (its `checkpoint` tag)")
    src.add_argument("--hf", help=hf_help)
    parser.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db",
                        help="where --mlflow-run's run is (default sqlite:///studies/mlflow.db)")


def checkpoint_of_run(uri: str, run_id: str):
    """(MlflowClient, run id, checkpoint folder) for the CLIs' --mlflow-run: a trial run's
    `checkpoint` tag (study/record/mlflow/recorder.py) is where its model was stored."""
    from mlflow.tracking import MlflowClient

    checkpoint = tagged_checkpoint(uri, run_id)  # a ValueError naming --mlflow-run or --mlflow-uri
    return MlflowClient(uri), run_id, checkpoint


def tagged_checkpoint(uri: str, run_id: str) -> str:
    """The `checkpoint` tag of an MLflow trial run, for the analysis CLIs' `--mlflow-run`; a run that
    does not exist, a tracking store that cannot be read, or a run without the tag is a ValueError
    naming the flag (their `main` prints it and exits 2)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    problem = check_mlflow_uri(uri)
    if not problem and uri.lower().startswith("sqlite:///"):  # MLflow would create an empty one
        path = os.path.abspath(uri.partition(":///")[2])
        if not os.path.isfile(path):
            problem = f"--mlflow-uri: {uri}: no MLflow database at {path}"
    if problem:
        raise ValueError(problem)
    try:
        run = MlflowClient(uri).get_run(run_id)
    except MlflowException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--mlflow-run: no run {run_id!r} in {store.redact(uri)} ({first})") from None
    checkpoint = run.data.tags.get("checkpoint")
    if not checkpoint:
        raise ValueError(f"--mlflow-run: run {run_id} has no `checkpoint` tag (not a trial run of a study?)")
    return checkpoint
