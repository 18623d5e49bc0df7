"""series.csv: what a study's trials measured while they trained about lengths beyond training
(`eval.track`, `eval.select`: `track/len{N}/exact`, `select/loss`, ...), a row per trial and report, so
extrapolation can be read against the training step after the study, from its folder or its record."""

from __future__ import annotations

import pandas as pd

from study.results.tables import planned_order
from study.spec.schema import StudySpec

SERIES_PREFIXES = ("track/", "select/")  # what a trial reports while it trains about lengths beyond training


def series_frame(spec: StudySpec, trials: list[dict], reports: dict[str, pd.DataFrame | None]) -> pd.DataFrame:
    """series.csv: a row per trial and report of what `eval.track` and `eval.select` measure while it
    trains (`track/len{N}/exact`, ...), with its cell and seed; `reports`: each trial id's reports, as
    Tune keeps them (Result.metrics_dataframe). Empty when no trial tracks anything."""
    cells = {c.index: c.label for c in spec.cells()}
    frames = []
    for t in sorted(trials, key=planned_order):
        df = reports.get(t["trial_id"])
        cols = [c for c in (df.columns if df is not None else []) if c.startswith(SERIES_PREFIXES)]
        if not cols or "step" not in df:
            continue
        rows = df[["step", *cols]].dropna(subset=cols, how="all")
        frames.append(rows.assign(trial_id=t["trial_id"], cell=cells[t["config"]["cell"]],
                                  seed=t["config"]["trial"]["seed"])[["trial_id", "cell", "seed", "step", *cols]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def series_means(series: pd.DataFrame, metric: str) -> pd.DataFrame:
    """`metric` (a column of series.csv) per cell and step, the mean over seeds, with their count."""
    if series is None or series.empty or metric not in series:
        return pd.DataFrame()
    kept = series.dropna(subset=[metric])
    return kept.groupby(["cell", "step"], sort=False)[metric].agg(["mean", "min", "max", "count"]).reset_index()


def series_from_tune(spec: StudySpec, tune_dir: str, results: pd.DataFrame) -> pd.DataFrame:
    """series.csv rebuilt from the reports Tune kept in the study's `tune/` folder (a study that ended
    before series.csv was written), each trial's cell and seed read from results.csv's rows."""
    from ray.tune import ExperimentAnalysis

    index = {c.label: c.index for c in spec.cells()}
    trials = [{"trial_id": r["trial_id"], "config": {"cell": index[r["cell"]], "role": r.get("role", "search"),
                                                     "search_index": r.get("search_index"), "trial": {"seed": r["seed"]}}}
              for r in results.drop_duplicates("trial_id").to_dict("records") if r["cell"] in index]
    reports = {str(df["trial_id"].iloc[0]): df for df in ExperimentAnalysis(tune_dir).trial_dataframes.values()
               if not df.empty and "trial_id" in df}
    return series_frame(spec, trials, reports)
