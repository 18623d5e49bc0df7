"""`python -m study.report STUDY [--markdown]`: rebuild a study's tables and figures
(study/record/report.py) from what it stored, a study folder, a bucket prefix or an MLflow
experiment; nothing is rerun. `--markdown` prints the summary as Markdown tables to paste; two
studies side by side: `python -m study.compare A B`."""

from __future__ import annotations

import os

import pandas as pd

from study.record.report import check_sealed, markdown_summary, report_from_results, summary_lines
from study.spec.schema import StudySpec


def read_study(source: str, tracking_uri: str | None, tmp: str) -> tuple[StudySpec, pd.DataFrame, str]:
    """(spec, results) of a study folder or bucket prefix, or of an MLflow experiment's parent run."""
    from trial import storage as store

    if store.is_uri(source) or os.path.isdir(source):
        if not store.exists(store.join(source, "results.csv")):
            raise SystemExit(f"error: {source}: no results.csv (is it a study folder that finished?)")
        folder = store.download_dir(source, tmp) if store.is_uri(source) else source
        where = source
    else:
        from mlflow.tracking import MlflowClient

        from study.record.identity import NAME_TAG, PARENT_TAG, find_runs, literal

        database = tracking_uri.partition("sqlite:///")[2] if tracking_uri.startswith("sqlite:///") else None
        if database and not os.path.exists(database):  # MLflow would create an empty one to search
            raise SystemExit(f"error: {source}: neither a study folder nor an experiment (no database {database})")
        client = MlflowClient(tracking_uri)
        # the studies of a name: in its experiment and in those of other artifact locations (study/record/identity.py)
        exps = {e.experiment_id: e for e in client.search_experiments(
            filter_string=f"tags.`{NAME_TAG}` = {literal(source)}")} if literal(source) else {}
        exp = client.get_experiment_by_name(source)
        if exp is not None and exp.lifecycle_stage == "active":
            exps[exp.experiment_id] = exp
        if not exps:
            raise SystemExit(f"error: {source}: neither a study folder nor an experiment in {tracking_uri}")
        parents = find_runs(client, list(exps), {PARENT_TAG: "true"}, max_results=1000)
        if not parents:
            raise SystemExit(f"error: experiment {source} has no study run")
        run_id = parents[0].info.run_id  # studies of one name (other storages): the newest
        for name in ("results.csv", "study_spec.json"):
            client.download_artifacts(run_id, name, tmp)
        folder, where = tmp, f"MLflow run {run_id} of experiment {exps[parents[0].info.experiment_id].name}"
        if len(parents) > 1:
            where += (f" (the tracking store holds {len(parents)} studies of this name; this is the newest, "
                      f"{parents[0].data.tags.get('study.location', 'made before study ids')}; "
                      "give a study folder to read another)")
    broken = check_sealed(folder)
    if broken:
        raise SystemExit(f"error: {where}: {broken}; `python study/run.py --resume` writes it again")
    with open(os.path.join(folder, "study_spec.json")) as f:
        spec = StudySpec.model_validate_json(f.read())
    return spec, pd.read_csv(os.path.join(folder, "results.csv")), where


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import tempfile

    p = argparse.ArgumentParser(prog="python -m study.report",
                                description="Rebuild a study's tables and figures from what it stored; "
                                            "nothing is rerun.")
    p.add_argument("study", help="a study folder (<storage>/<name>), a bucket URI, or an MLflow experiment name")
    p.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db", help="where the experiment is")
    p.add_argument("--out", help="write here (default: the study folder; ./report-<name> for an experiment)")
    p.add_argument("--markdown", action="store_true", help="print the summary as Markdown tables (to paste)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:
        try:
            spec, results, where = read_study(args.study, args.mlflow_uri, tmp)
        except SystemExit as e:  # read_study's one-line errors: bad input
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                return 2
            raise
        out = args.out or (args.study if os.path.isdir(args.study) else f"report-{spec.name}")
        selected, summary, files = report_from_results(spec, results, out)
    print(f"study {spec.name} from {where}: {results.trial_id.nunique()} trials")
    print(("\n" + markdown_summary(spec, selected, summary)) if args.markdown else
          "\n".join(summary_lines(spec, selected, summary)))
    print("files:\n" + "\n".join(f"  {path}" for path in files.values()))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
