"""The study's results as tables and a figure (pandas, matplotlib).

- results.csv: one row per trial x evaluation point (length, k_test, ids) with the trial's cell
  factors, searched hyperparameters, seed, role (search | replica) and metrics.
- selected.csv: per study cell, the search trial selected on the objective (in-distribution
  validation by default; trials within its sampling error are tied, the first suggested of them is
  chosen: study/results/selection.py; `tied`, `chosen_by`), its config, and the mean, minimum and
  maximum over the seeds of that config (the selected trial and its replicas) of the summary metrics.
- summary.csv: per cell x test length x k_test (the model's own ids), the selected config's answer
  accuracy, exact match and answer-token accuracy over its seeds: mean, minimum and maximum, the
  fraction of runs whose exact match reaches EXTRAPOLATES (`runs_solved`) and the number of seeds.
  Few seeds (3) give no interval worth the name; the seeds' range is what they show (docs/statistics.md).
- the figures (study/results/figures.py): accuracy_vs_length.png, accuracy_by_<factor>.png and, for specs
  with a `sparsity:` section, sparsity_vs_extrapolation.png, each with a PDF copy beside it.
"""

from __future__ import annotations

import json
import os

import pandas as pd

from study.results.figures import describe, plot_accuracy, plot_factor, plot_sparsity, vector_copy
from study.results.selection import BY_OBJECTIVE, choose, tie_sentence, validation_samples
from study.spec.schema import StudySpec
from trial import metrics

SUMMARY_COLUMNS = list(metrics.SUMMARY)
OPTIONAL_COLUMNS = metrics.OPTIONAL  # kept where a trial reports them (language models, the analyses)


def report_columns(metrics: dict) -> list[str]:
    """A trial's metrics that are results.csv columns, in OPTIONAL's order, a family's in the trial's."""
    named = [c for c in OPTIONAL_COLUMNS if not c.endswith("/*") and c in metrics]
    return named + [k for k in metrics if k not in named and is_report_column(k)]


def is_report_column(key: str) -> bool:
    """Whether a trial's metric is a column of results.csv: an OPTIONAL name, or under an OPTIONAL family
    (`loss_gap/recovered_median/*`: one column per k)."""
    return any(key == c or c.endswith("/*") and key.startswith(c[:-1]) for c in OPTIONAL_COLUMNS)


def results_frame(spec: StudySpec, trials: list[dict]) -> pd.DataFrame:
    """trials: [{"trial_id", "config" (the Tune config), "metrics" (last result), "status"}]: a row per
    trial x evaluation point, and one row (no length, no k) for a trial without an evaluation of the evaluation points:
    status ERROR (failed) or STOPPED (stopped early by the scheduler, with its last validation)."""
    cells = {c.index: c for c in spec.cells()}
    rows = []
    for t in sorted(trials, key=planned_order):  # not Tune's order, which a resume changes
        metrics = t["metrics"] or {}
        cell = cells[t["config"]["cell"]]
        common = {
            "trial_id": t["trial_id"],
            "cell": cell.label,
            **cell.factors,
            **{f"search.{k}": v for k, v in t["config"]["params"].items()},
            "seed": t["config"]["trial"]["seed"],
            # the data seed where it is not the model seed (a grid over it is a factor already)
            **({"data_seed": t["config"]["trial"]["data_seed"]} if "data_seed" in t["config"]["trial"] else {}),
            "role": t["config"].get("role", "search"),
            "selected_from": t["config"].get("selected_from"),
            "search_index": t["config"].get("search_index"),
            "status": t["status"],
            **{k: metrics.get(k) for k in [spec.objective.metric, *SUMMARY_COLUMNS]},
            **{k: metrics[k] for k in report_columns(metrics)},
        }
        records = metrics.get("eval_records") or []
        rows += [{**common, **rec} for rec in records] or [common]  # every trial has a row, failed or stopped
    return pd.DataFrame(rows)


def planned_order(trial: dict) -> tuple:
    """A trial's place in the study's plan: its cell, the search before the replicas of the selected
    config, then the order of suggestion (search_index) and the seed."""
    config = trial["config"]
    index = config.get("search_index")
    return (config["cell"], config.get("role", "search") != "search", index is None, index or 0,
            config["trial"]["seed"], trial["trial_id"])


def select(spec: StudySpec, results: pd.DataFrame) -> pd.DataFrame:
    """Per cell, the selected trial: with a search the best search trial on the objective, trials
    within its sampling error tied and the first suggested of them chosen (study/results/selection.py;
    `tied` counts them, `chosen_by` says which rule chose), without a search the cell's first seed;
    `seeds` counts the runs of its config."""
    if results.empty:
        return results
    metric = spec.objective.metric
    trials = results.drop_duplicates("trial_id")
    cells = {c.label: c for c in spec.cells()}
    rows = []
    for cell, group in trials.groupby("cell", sort=False):
        done = group[group.status == "TERMINATED"]  # a failed or early-stopped trial has no evaluation points
        candidates = done[done.role == "search"] if spec.search is not None else done.sort_values("seed")
        if candidates.empty:
            continue
        records = candidates.to_dict("records")
        if spec.search is not None:
            chosen = choose(spec, [(i, r[metric], _order(r)) for i, r in enumerate(records)],
                            validation_samples(spec, cells[cell]))
            if chosen is None:
                continue
            best = {**records[chosen.key], "tied": chosen.tied, "chosen_by": chosen.chosen_by}
        else:
            best = {**records[0], "tied": 1, "chosen_by": "first seed"}
        runs = seed_runs(spec, group, best["trial_id"])
        best["seeds"] = len(runs)
        for col in [*SUMMARY_COLUMNS, *[c for c in runs.columns if is_report_column(c)]]:
            best[f"{col}_mean"], best[f"{col}_min"], best[f"{col}_max"], _ = mean_and_range(runs[col])
        rows.append(best)
    if not rows:
        return pd.DataFrame()
    out = pd.DataFrame(rows)
    keep = ["cell", "trial_id", "seed", *[c for c in out.columns if c.startswith("search.")], metric, "val_loss",
            "tied", "chosen_by", "seeds", *[c for c in out.columns if c.endswith(("_mean", "_min", "_max"))]]
    order = {c.label: c.index for c in spec.cells()}
    return out[list(dict.fromkeys(keep))].sort_values("cell", key=lambda s: s.map(order)).reset_index(drop=True)


def seed_runs(spec: StudySpec, cell_trials: pd.DataFrame, selected: str) -> pd.DataFrame:
    """The finished runs of a cell's selected config: the selected trial and its replicas (without
    a search, every trial of the cell)."""
    if spec.search is None:
        runs = cell_trials
    else:
        runs = cell_trials[(cell_trials.trial_id == selected) | (cell_trials.selected_from == selected)]
    return runs[runs.status == "TERMINATED"]


def _order(trial: dict) -> tuple:
    """A search trial's place in its cell's search (results.csv written before search_index: its id)."""
    index = trial.get("search_index")
    missing = index is None or index != index
    return (missing, 0 if missing else int(index), str(trial["trial_id"]))


def mean_and_range(values: pd.Series) -> tuple[float, float, float, int]:
    """Mean, minimum and maximum over seeds, and how many: what few seeds show (every bound is a
    value a run reached, so it stays inside the metric's range). NaN where nothing was measured."""
    v = pd.to_numeric(values, errors="coerce").dropna().to_numpy(dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan"), float("nan"), 0
    return float(v.mean()), float(v.min()), float(v.max()), len(v)


def mean_and_range_text(values: pd.Series) -> str:
    """`mean [min-max]` over seeds as the tables print it (the mean alone where every run agrees, - for none)."""
    mean, low, high, n = mean_and_range(values)
    if n == 0:
        return "-"
    return f"{mean:.2f}" if low == high else f"{mean:.2f} [{low:.2f}-{high:.2f}]"


EXTRAPOLATES = 0.95  # the exact match from which a run counts as solving a length (Zhou et al. 2024 count them)


def summarize_seeds(spec: StudySpec, results: pd.DataFrame, selected: pd.DataFrame) -> pd.DataFrame:
    """Per cell x test length x k_test (x checkpoint, with eval.select): the selected config's accuracy
    over its seeds (the model's own ids: PPC's predicted ids, coupling's oracle ids), and the fraction
    of its runs whose exact match reaches EXTRAPOLATES (`runs_solved`): results swing with the seed."""
    rows = []
    by = ["length", "k", "checkpoint"] if "checkpoint" in results else ["length", "k"]
    for sel in selected.itertuples(index=False):
        cell_rows = results[results.cell == sel.cell]
        runs = seed_runs(spec, cell_rows.drop_duplicates("trial_id"), sel.trial_id)
        rec = cell_rows[cell_rows.trial_id.isin(runs.trial_id)]
        if rec.empty:
            continue
        rec = rec[rec.ids == rec.ids.iloc[0]]
        for key, g in rec.groupby(by, dropna=False, sort=True):
            solved = pd.to_numeric(g.exact_match, errors="coerce").dropna()
            row = {"cell": sel.cell, **dict(zip(by, key)), "ids": g.ids.iloc[0],
                   "in_distribution": bool(g.in_distribution.iloc[0]), "seeds": mean_and_range(g.answer_acc)[3]}
            # answer_token_acc where the rows have it (results.csv written before it was measured have not)
            for col in ("answer_acc", "exact_match", "answer_token_acc"):
                if col in g and g[col].notna().any():
                    row[col], row[f"{col}_min"], row[f"{col}_max"], _ = mean_and_range(g[col])
                if col == "exact_match":
                    row["runs_solved"] = float((solved >= EXTRAPOLATES).mean()) if len(solved) else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def train_sizes(task: dict) -> tuple[int, int | None]:
    """A trial config's task section -> (train length, K_train), the task's defaults where unset."""
    from tasks import TASKS

    cls, params = TASKS[task["name"]], task.get("params") or {}
    return params.get("train_length", cls.default_train_length), params.get("train_k", cls.default_train_k)


def cell_train_sizes(spec: StudySpec) -> tuple[dict[str, int], dict[str, int | None]]:
    """Each cell's train length and K_train."""
    lengths, ks = {}, {}
    for cell in spec.cells():
        lengths[cell.label], ks[cell.label] = train_sizes(spec.trial_config(cell, {}, spec.seed)["task"])
    return lengths, ks


def write_report(spec: StudySpec, trials: list[dict], out_dir: str) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """Write results.csv, selected.csv, summary.csv, the figures and the spec; return the
    selection, the per-length summary and the files written."""
    return report_from_results(spec, results_frame(spec, trials), out_dir)


def report_from_results(spec: StudySpec, results: pd.DataFrame, out_dir: str, series: pd.DataFrame | None = None,
                        verdicts: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """Everything the report holds, from results.csv's rows (so `python -m study.report` can
    rebuild it from what a study stored, without rerunning anything), and series.csv and the claims'
    verdicts (study/results/verdicts.py: claims.csv, and each verdict in report.json) where given.

    Nothing is written in place: the files are made in a staging folder, moved into `out_dir` one
    by one (each rename replaces a whole file), and `report.json` (MARKER: each file's sha256) comes
    last, so a crash mid-report leaves files that do not match the marker, which readers refuse."""
    import shutil
    import tempfile

    os.makedirs(out_dir, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".report-", dir=out_dir)
    try:
        selected, summary, staged = _write_report_files(spec, results, stage)
        if series is not None and not series.empty:  # kept as the study wrote it: it is no table of results.csv
            staged["series"] = os.path.join(stage, "series.csv")
            series.to_csv(staged["series"], index=False)
        if verdicts:  # the table behind each claim's line, a row per judged seed
            staged["claims"] = os.path.join(stage, "claims.csv")
            pd.DataFrame([row for v in verdicts for row in v.table_rows()]).to_csv(staged["claims"], index=False)
        files = {key: os.path.join(out_dir, os.path.basename(path)) for key, path in staged.items()}
        for key, path in staged.items():
            os.replace(path, files[key])
        files["marker"] = os.path.join(out_dir, MARKER)
        marker = {**file_digests(files), **({"claims": [v.record() for v in verdicts]} if verdicts else {})}
        _write_atomic(files["marker"], json.dumps(marker, indent=1).encode())
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return selected, summary, files


MARKER = "report.json"


def file_digests(files: dict[str, str]) -> dict[str, dict[str, str]]:
    """report.json's files: {"files": {file name: sha256}} of the report's files (beside them, "claims":
    each claim's verdict and line, study/results/verdicts.py)."""
    import hashlib

    def digest(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return {"files": {os.path.basename(p): digest(p) for k, p in files.items() if k != "marker"}}


def check_report_files(folder: str) -> str | None:
    """Why the report in `folder` cannot be trusted (a file missing or not the one its marker
    names: a report interrupted mid-write), or None. A study written before markers has none."""
    path = os.path.join(folder, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        expected = json.load(f)["files"]
    actual = file_digests({n: os.path.join(folder, n) for n in expected if os.path.exists(os.path.join(folder, n))})["files"]
    bad = sorted(n for n in expected if actual.get(n) != expected[n])
    return f"{', '.join(bad)} do(es) not match {MARKER}: the report was interrupted while written" if bad else None


def _write_atomic(path: str, data: bytes) -> None:
    from trial import storage as store

    store.write_atomic(path, data)


def _to_csv(frame: pd.DataFrame, path: str) -> None:
    """Lengths and k as whole numbers, also in a column that has gaps (a trial without evaluation points,
    a task without k), where pandas holds them as floats."""
    whole = {c: "Int64" for c in ("length", "k") if c in frame and frame[c].dropna().map(lambda v: float(v).is_integer()).all()}
    frame.astype(whole).to_csv(path, index=False)


def _write_report_files(spec: StudySpec, results: pd.DataFrame, out_dir: str
                        ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    files = {"results": os.path.join(out_dir, "results.csv"), "spec": os.path.join(out_dir, "study_spec.json")}
    _to_csv(results, files["results"])
    with open(files["spec"], "w") as f:
        f.write(spec.model_dump_json(indent=1))
    selected = select(spec, results)
    files["selected"] = os.path.join(out_dir, "selected.csv")
    _to_csv(selected, files["selected"])
    summary = summarize_seeds(spec, results, selected) if not selected.empty else pd.DataFrame()
    files["summary"] = os.path.join(out_dir, "summary.csv")
    _to_csv(summary, files["summary"])
    if not summary.empty:
        train_lengths, train_ks = cell_train_sizes(spec)
        text = describe(spec, int(summary.seeds.max()))
        # the figures show the last checkpoint; summary.csv holds both
        shown = summary[summary.checkpoint == "last"] if "checkpoint" in summary else summary
        figures = {"plot": plot_accuracy(shown, os.path.join(out_dir, "accuracy_vs_length.png"), train_lengths, text)}
        for factor in spec.grid:
            name = f"accuracy_by_{factor.replace('.', '_')}.png"
            figures[f"by_{factor}"] = plot_factor(spec, shown, factor, os.path.join(out_dir, name), train_lengths,
                                                  train_ks, text)
        figures["sparsity_plot"] = plot_sparsity(results, os.path.join(out_dir, "sparsity_vs_extrapolation.png"), text)
        for key, png in figures.items():
            if png:  # each PNG with its vector copy
                files[key], files[f"{key}_pdf"] = png, vector_copy(png)
    return selected, summary, files


def _sig(x, digits: int = 3) -> str:
    """A number with its significant digits (lr 0.00136, not 0.001; val_loss 2.1e-05, not 0.000)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "nan" if x != x else f"{x:.{digits}g}"


def mean_range(mean, low, high, digits: int = 3) -> str:
    """`mean [min-max]` over seeds, the convention of the report and the docs (docs/statistics.md)."""
    if mean != mean:
        return "-"
    low, high = f"{low:.{digits}f}", f"{high:.{digits}f}"  # a range that rounds to one value is that value
    return f"{mean:.{digits}f}" if low == "nan" or low == high else f"{mean:.{digits}f} [{low}-{high}]"


def summary_lines(spec: StudySpec, selected: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    """Per cell the selected config (and how a tie was broken), its mean [min-max] over seeds, and
    accuracy per k_test at the longest test length with the runs that reach EXTRAPOLATES."""
    metric = spec.objective.metric
    cells = {c.label: c for c in spec.cells()}
    lines = ["", f"selected per cell ({spec.objective.mode} {metric} on in-distribution validation; trials within "
             "its sampling error are tied, the first suggested of them is chosen), mean [min-max] over the "
             "selected config's seeds:"]
    for row in selected.to_dict("records"):
        params = ", ".join(f"{k[len('search.'):]}={_sig(v)}" for k, v in row.items() if k.startswith("search."))
        tie = tie_sentence(spec, row["tied"], validation_samples(spec, cells[row["cell"]])) \
            if row.get("chosen_by") != BY_OBJECTIVE and row["cell"] in cells else ""
        lines.append(f"  {row['cell']}: trial {row['trial_id']} ({params or 'no search'}), {metric} "
                     f"{_sig(row[metric])}, val_loss {_sig(row['val_loss'])}{f'; {tie}' if tie else ''}; "
                     f"{row['seeds']} seed(s)")
        for col in ("acc_in_dist", "acc_beyond", "acc_k_beyond", "loss_beyond"):
            mean = row.get(f"{col}_mean", float("nan"))
            if mean == mean:
                lines.append(f"      {col:<13}{mean_range(mean, row[f'{col}_min'], row[f'{col}_max'])}")
    if len(summary):
        longest = int(summary.length.max())
        at = summary[summary.length == longest]
        lines.append(f"answer accuracy at test length {longest}, per k_test (mean [min-max] over seeds; runs whose "
                     f"exact match >= {EXTRAPOLATES}):")
        for cell, g in at.groupby("cell", sort=False):
            for checkpoint, part in (g.groupby("checkpoint", sort=False) if "checkpoint" in g else [("", g)]):
                parts = [f"k={'all' if k != k else int(k)}: {mean_range(a, lo, hi)}"
                         + ("" if solved != solved else f" ({round(solved * n)}/{n} runs)") for k, a, lo, hi, solved, n in
                         zip(part.k, part.answer_acc, part.answer_acc_min, part.answer_acc_max, part.runs_solved,
                             part.seeds)]
                lines.append(f"  {cell}{f' ({checkpoint} checkpoint)' if checkpoint else ''}: " + "; ".join(parts))
    return lines


SHOWN = ("acc_in_dist", "acc_beyond", "acc_k_beyond", "loss_beyond")  # per cell, in the closing lines and tables


def cell_mean_range(row: dict, col: str) -> str:
    """`mean [min-max]` of one of selected.csv's metrics, as the docs write it ("-" where not measured)."""
    return mean_range(*(row.get(f"{col}_{part}", float("nan")) for part in ("mean", "min", "max")), digits=2)


def markdown_summary(spec: StudySpec, selected: pd.DataFrame, summary: pd.DataFrame) -> str:
    """The closing lines as Markdown tables to paste: per cell the chosen config and its metrics over
    seeds; then answer accuracy per cell and k_test at each test length, with the runs whose exact
    match reaches EXTRAPOLATES at the longest. Cells are named as the figures name them."""
    names = describe(spec).labels
    rows = selected.to_dict("records")
    shown = [c for c in SHOWN if any(cell_mean_range(r, c) != "-" for r in rows)]
    lines = [f"{spec.name}: mean [min-max] over the selected config's seeds (docs/statistics.md)", "",
             "| cell | chosen | seeds | " + " | ".join(shown) + " |", "|---|---|---|" + "---|" * len(shown)]
    for r in rows:
        chosen = ", ".join(f"{k[len('search.'):]} {_sig(v)}" for k, v in r.items() if k.startswith("search.")) or "-"
        lines.append(f"| {names.get(r['cell'], r['cell'])} | {chosen} | {r['seeds']} | "
                     + " | ".join(cell_mean_range(r, c) for c in shown) + " |")
    if summary.empty:
        return "\n".join(lines)
    lengths = sorted(int(n) for n in summary.length.dropna().unique())
    by = [c for c in ("k", "checkpoint") if c in summary]
    lines += ["", f"answer accuracy, mean [min-max] over seeds; runs: exact match >= {EXTRAPOLATES} at {lengths[-1]}", "",
              "| cell | " + "".join(f"{c} | " for c in by) + " | ".join(map(str, lengths)) + " | runs |",
              "|---|" + "---|" * (len(by) + len(lengths) + 1)]
    for (cell, *key), g in summary.groupby(["cell", *by], dropna=False, sort=False):
        at = {int(n): row for n, row in zip(g.length, g.to_dict("records"))}
        last = at.get(lengths[-1], {})
        runs = "-" if last.get("runs_solved", float("nan")) != last.get("runs_solved", float("nan")) else \
            f"{round(last['runs_solved'] * last['seeds'])}/{last['seeds']}"
        keys = "".join(f"{'all' if v != v else (int(v) if isinstance(v, float) else v)} | " for v in key)
        lines.append(f"| {names.get(cell, cell)} | {keys}" + " | ".join(
            mean_range(at[n]["answer_acc"], at[n]["answer_acc_min"], at[n]["answer_acc_max"], 2) if n in at else "-"
            for n in lengths) + f" | {runs} |")
    return "\n".join(lines)

