"""Which trained model an analysis command measures: a trial checkpoint (a folder or a bucket URI),
the model a recorded trial run stored (`--mlflow-run`), or a local Hugging Face folder."""

from __future__ import annotations

from study.record.recorder import recorder_class

RECORD = "mlflow"  # the recorder --mlflow-run and --mlflow-uri name (loaded only when they are used)


def add_model_source(parser, hf_help: str) -> None:
    """The CLIs' (study.loss_gap's and study.sparsity's) choice of model: a checkpoint, an MLflow trial
    run or a Hugging Face folder."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a trial checkpoint folder or bucket URI (holds trial_config.json)")
    src.add_argument("--mlflow-run", help="an MLflow trial run id (its `checkpoint` tag)")
    src.add_argument("--hf", help=hf_help)
    parser.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db",
                        help="where --mlflow-run's run is (default sqlite:///studies/mlflow.db)")


def checkpoint_of(args) -> str | None:
    """The checkpoint the command measures: --checkpoint, or the model of --mlflow-run's trial run (a
    ValueError naming the flag when the record has none); None for --hf."""
    if args.mlflow_run:
        return recorder_class(RECORD).trial_model(args.mlflow_uri, args.mlflow_run)
    return args.checkpoint


def record_measurement(args, name: str, metrics: dict[str, float], tags: dict[str, str]) -> None:
    """With --mlflow-run, the measurement (metrics, tags, the files in --out) goes to that run too."""
    if args.mlflow_run:
        recorder_class(RECORD).analysis_measured(args.mlflow_uri, args.mlflow_run, name, metrics, tags, args.out)
