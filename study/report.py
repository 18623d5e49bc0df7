"""`python -m study.report STUDY [--markdown]`: rebuild a study's tables and figures
(study/results/tables.py) from what it stored, a study folder, a bucket prefix or an MLflow
experiment; nothing is rerun. `--markdown` prints the summary as Markdown tables to paste; two
studies side by side: `python -m study.compare A B`."""

from __future__ import annotations

import os

import pandas as pd

from study.results.tables import check_report_files, markdown_summary, report_from_results, summary_lines
from study.spec.schema import StudySpec


def add_recorder_flag(parser) -> None:
    """`--recorder NAME`: which record a study named (not a folder) is read back from."""
    from study.record.recorder import RECORDERS

    parser.add_argument("--recorder", default="mlflow", choices=sorted(RECORDERS),
                        help="the record a study given by name is read from (default mlflow, at --mlflow-uri)")


def read_series(folder: str, spec: StudySpec | None = None, results: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """series.csv of a study folder read by `read_study` (None where no trial tracked anything); of a
    study folder without one, rebuilt from its Tune reports (`spec` and `results` given)."""
    path = os.path.join(folder, "series.csv")
    if os.path.exists(path):
        return pd.read_csv(path)
    if spec is None or results is None or not os.path.isdir(os.path.join(folder, "tune")):
        return None
    from study.results.series import series_from_tune

    series = series_from_tune(spec, os.path.join(folder, "tune"), results)
    return None if series.empty else series


def read_study(source: str, tracking_uri: str | None, tmp: str, recorder: str = "mlflow"
               ) -> tuple[StudySpec, pd.DataFrame, str, str]:
    """(spec, results, where, the local folder of its report files) of a study folder or bucket prefix,
    or of an MLflow experiment's parent run."""
    from trial import storage as store

    if store.is_uri(source) or os.path.isdir(source):
        if not store.exists(store.join(source, "results.csv")):
            raise SystemExit(f"error: {source}: no results.csv (is it a study folder that finished?)")
        folder = store.download_dir(source, tmp) if store.is_uri(source) else source
        where = source
    else:  # the study's record: its report files, as the study logged them
        from study.record.recorder import recorder_class

        try:
            folder, where = recorder_class(recorder).stored_study(tracking_uri, source, tmp)
        except LookupError as e:
            raise SystemExit(str(e)) from None
    broken = check_report_files(folder)
    if broken:
        raise SystemExit(f"error: {where}: {broken}; `python study/run.py --resume` writes it again")
    with open(os.path.join(folder, "study_spec.json")) as f:
        spec = StudySpec.model_validate_json(f.read())
    return spec, pd.read_csv(os.path.join(folder, "results.csv")), where, folder


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import tempfile

    p = argparse.ArgumentParser(prog="python -m study.report",
                                description="Rebuild a study's tables and figures from what it stored; "
                                            "nothing is rerun.")
    p.add_argument("study", help="a study folder (<storage>/<name>), a bucket URI, or an MLflow experiment name")
    p.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db", help="where the experiment is")
    add_recorder_flag(p)
    p.add_argument("--out", help="write here (default: the study folder; ./report-<name> for an experiment)")
    p.add_argument("--markdown", action="store_true", help="print the summary as Markdown tables (to paste)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:
        try:
            spec, results, where, folder = read_study(args.study, args.mlflow_uri, tmp, args.recorder)
        except SystemExit as e:  # read_study's one-line errors: bad input
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                return 2
            raise
        out = args.out or (args.study if os.path.isdir(args.study) else f"report-{spec.name}")
        from study.results.verdicts import judge

        selected, summary, files = report_from_results(spec, results, out, read_series(folder, spec, results),
                                                       judge(spec, results))
    print(f"study {spec.name} from {where}: {results.trial_id.nunique()} trials")
    print(("\n" + markdown_summary(spec, selected, summary)) if args.markdown else
          "\n".join(summary_lines(spec, selected, summary)))
    print("files:\n" + "\n".join(f"  {path}" for path in files.values()))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
