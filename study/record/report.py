"""The study's results as tables and a figure (pandas, matplotlib).

- results.csv: one row per trial x evaluation cell (length, k_test, ids) with the trial's cell
  factors, searched hyperparameters, seed, role (search | replica) and metrics.
- selected.csv: per study cell, the search trial selected on the objective (in-distribution
  validation by default; ties to the lower val_loss, and how many tied), its config, and the mean
  and 95% interval over the seeds of that config (the selected trial and its replicas) of the
  summary metrics.
- summary.csv: per cell x test length x k_test (the model's own ids), the selected config's answer
  accuracy, exact match and answer-token accuracy over its seeds: mean, 95% t-interval (Student's
  t, n - 1 degrees of freedom, clipped to [0, 1]; none for one seed) and the number of seeds.
- the figures (study/record/figures.py): accuracy_vs_length.png, accuracy_by_<factor>.png and, for specs
  with a `sparsity:` section, sparsity_vs_extrapolation.png.
"""

from __future__ import annotations

import json
import os

import pandas as pd

from study.record.figures import plot_accuracy, plot_factor, plot_sparsity
from study.spec.schema import StudySpec
from trial import metrics

SUMMARY_COLUMNS = list(metrics.SUMMARY)
OPTIONAL_COLUMNS = list(metrics.OPTIONAL)  # kept where a trial reports them (language models, the meter)


def results_frame(spec: StudySpec, trials: list[dict]) -> pd.DataFrame:
    """trials: [{"trial_id", "config" (the Tune config), "metrics" (last result), "status"}]: a row per
    trial x test cell, and one row (no length, no k) for a trial without an evaluation of the test grid:
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
            **{k: metrics[k] for k in OPTIONAL_COLUMNS if k in metrics},
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
    """Per cell, the selected trial: with a search the best search trial on the objective (ties:
    the lower validation loss, `ObjectiveSpec.rank`), without one the cell's first seed; `tied`
    counts the trials that matched its objective, `seeds` the runs of its config."""
    if results.empty:
        return results
    metric = spec.objective.metric
    trials = results.drop_duplicates("trial_id")
    rows = []
    for _cell, group in trials.groupby("cell", sort=False):
        done = group[group.status == "TERMINATED"]  # a failed or early-stopped trial has no test grid
        candidates = done[done.role == "search"] if spec.search is not None else done.sort_values("seed")
        if candidates.empty:
            continue
        ranked = sorted(candidates.to_dict("records"),
                        key=lambda r: spec.objective.rank(r[metric], r["val_loss"],
                                                          r.get("search_index", r["trial_id"]))
                        if spec.search is not None else (r["seed"],))
        best = ranked[0]
        runs = seed_runs(spec, group, best["trial_id"])
        best["tied"] = int((candidates[metric] == best[metric]).sum()) if spec.search is not None else 1
        best["seeds"] = len(runs)
        for col in [*SUMMARY_COLUMNS, *[c for c in OPTIONAL_COLUMNS if c in runs]]:
            mean, lo, hi, _ = interval(runs[col], proportion=metrics.is_proportion(col))
            best[f"{col}_mean"], best[f"{col}_lo"], best[f"{col}_hi"] = mean, lo, hi
        rows.append(best)
    out = pd.DataFrame(rows)
    keep = ["cell", "trial_id", "seed", *[c for c in out.columns if c.startswith("search.")], metric, "val_loss",
            "tied", "seeds", *[c for c in out.columns if c.endswith(("_mean", "_lo", "_hi"))]]
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


def interval(values: pd.Series, proportion: bool = False) -> tuple[float, float, float, int]:
    """Mean and 95% t-interval over seeds (Student's t with n - 1 degrees of freedom), clipped to
    [0, 1] for a proportion (3 seeds at 1.0, 1.0, 0.96 would otherwise reach 1.03); the interval is
    NaN for fewer than 2 values."""
    from scipy import stats

    v = pd.to_numeric(values, errors="coerce").dropna().to_numpy(dtype=float)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    mean = float(v.mean())
    if n < 2:
        return mean, float("nan"), float("nan"), n
    half = float(stats.t.ppf(0.975, n - 1) * v.std(ddof=1) / n ** 0.5)
    lo, hi = mean - half, mean + half
    return (mean, max(lo, 0.0), min(hi, 1.0), n) if proportion else (mean, lo, hi, n)


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
            acc, lo, hi, n = interval(g.answer_acc, proportion=True)
            exact, elo, ehi, _ = interval(g.exact_match, proportion=True)
            solved = pd.to_numeric(g.exact_match, errors="coerce").dropna()
            rows.append({"cell": sel.cell, **dict(zip(by, key)), "ids": g.ids.iloc[0],
                         "in_distribution": bool(g.in_distribution.iloc[0]), "seeds": n,
                         "answer_acc": acc, "answer_acc_lo": lo, "answer_acc_hi": hi,
                         "exact_match": exact, "exact_match_lo": elo, "exact_match_hi": ehi,
                         "runs_solved": float((solved >= EXTRAPOLATES).mean()) if len(solved) else float("nan"),
                         **_token_interval(g)})
    return pd.DataFrame(rows)


def _token_interval(g: pd.DataFrame) -> dict:
    """answer_token_acc's mean and interval over seeds, where the rows have it (results.csv written
    before it was measured have not)."""
    if "answer_token_acc" not in g or g.answer_token_acc.isna().all():
        return {}
    mean, lo, hi, _ = interval(g.answer_token_acc, proportion=True)
    return {"answer_token_acc": mean, "answer_token_acc_lo": lo, "answer_token_acc_hi": hi}


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


def report_from_results(spec: StudySpec, results: pd.DataFrame, out_dir: str
                        ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """Everything the report holds, from results.csv's rows (so `python -m study.report` can
    rebuild it from what a study stored, without rerunning anything).

    Nothing is written in place: the files are made in a staging folder, moved into `out_dir` one
    by one (each rename replaces a whole file), and `report.json` (MARKER: each file's sha256) comes
    last, so a crash mid-report leaves files that do not match the marker, which readers refuse."""
    import shutil
    import tempfile

    os.makedirs(out_dir, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".report-", dir=out_dir)
    try:
        selected, summary, staged = _write_report_files(spec, results, stage)
        files = {key: os.path.join(out_dir, os.path.basename(path)) for key, path in staged.items()}
        for key, path in staged.items():
            os.replace(path, files[key])
        files["marker"] = os.path.join(out_dir, MARKER)
        _write_atomic(files["marker"], json.dumps(seal(files), indent=1).encode())
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return selected, summary, files


MARKER = "report.json"


def seal(files: dict[str, str]) -> dict[str, dict[str, str]]:
    """What report.json holds: {"files": {file name: sha256}} of the report's files."""
    import hashlib

    def digest(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return {"files": {os.path.basename(p): digest(p) for k, p in files.items() if k != "marker"}}


def check_sealed(folder: str) -> str | None:
    """Why the report in `folder` cannot be trusted (a file missing or not the one its marker
    names: a report interrupted mid-write), or None. A study written before markers has none."""
    path = os.path.join(folder, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        expected = json.load(f)["files"]
    actual = seal({n: os.path.join(folder, n) for n in expected if os.path.exists(os.path.join(folder, n))})["files"]
    bad = sorted(n for n in expected if actual.get(n) != expected[n])
    return f"{', '.join(bad)} do(es) not match {MARKER}: the report was interrupted while written" if bad else None


def _write_atomic(path: str, data: bytes) -> None:
    from trial import storage as store

    store.write_atomic(path, data)


def _to_csv(frame: pd.DataFrame, path: str) -> None:
    """Lengths and k as whole numbers, also in a column that has gaps (a trial without a test grid,
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
        # the figures show the last checkpoint; summary.csv holds both
        shown = summary[summary.checkpoint == "last"] if "checkpoint" in summary else summary
        files["plot"] = plot_accuracy(shown, os.path.join(out_dir, "accuracy_vs_length.png"), train_lengths)
        for factor in spec.grid:
            name = f"accuracy_by_{factor.replace('.', '_')}.png"
            written = plot_factor(spec, shown, factor, os.path.join(out_dir, name), train_lengths, train_ks)
            if written:
                files[f"by_{factor}"] = written
        scatter = plot_sparsity(results, os.path.join(out_dir, "sparsity_vs_extrapolation.png"))
        if scatter:
            files["sparsity_plot"] = scatter
    return selected, summary, files


def _sig(x, digits: int = 3) -> str:
    """A number with its significant digits (lr 0.00136, not 0.001; val_loss 2.1e-05, not 0.000)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "nan" if x != x else f"{x:.{digits}g}"


def _mean_ci(mean, lo, hi) -> str:
    if mean != mean:
        return "-"
    return f"{mean:.3f}" if lo != lo else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def summary_lines(spec: StudySpec, selected: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    """Per cell the selected config (and how a tie was broken), its means and 95% intervals over
    seeds, and accuracy per k_test at the longest test length."""
    metric = spec.objective.metric
    lines = ["", f"selected per cell ({spec.objective.mode} {metric} on in-distribution validation; ties: "
             "lower val_loss), means [95% t-interval] over the selected config's seeds:"]
    for row in selected.to_dict("records"):
        params = ", ".join(f"{k[len('search.'):]}={_sig(v)}" for k, v in row.items() if k.startswith("search."))
        tie = f"; {row['tied']} trials tied at {_sig(row[metric])}, broken by val_loss" if row["tied"] > 1 else ""
        lines.append(f"  {row['cell']}: trial {row['trial_id']} ({params or 'no search'}), {metric} "
                     f"{_sig(row[metric])}, val_loss {_sig(row['val_loss'])}{tie}; {row['seeds']} seed(s)")
        for col in ("acc_in_dist", "acc_beyond", "acc_k_beyond", "loss_beyond"):
            mean = row.get(f"{col}_mean", float("nan"))
            if mean == mean:
                lines.append(f"      {col:<13}{_mean_ci(mean, row[f'{col}_lo'], row[f'{col}_hi'])}")
    if len(summary):
        longest = int(summary.length.max())
        at = summary[summary.length == longest]
        lines.append(f"answer accuracy at test length {longest}, per k_test (mean [95% interval] over seeds):")
        for cell, g in at.groupby("cell", sort=False):
            for checkpoint, part in (g.groupby("checkpoint", sort=False) if "checkpoint" in g else [("", g)]):
                parts = [f"k={'all' if k != k else int(k)}: {_mean_ci(a, lo, hi)} "
                         f"({solved:.0%} of runs exact >= {EXTRAPOLATES})" for k, a, lo, hi, solved in
                         zip(part.k, part.answer_acc, part.answer_acc_lo, part.answer_acc_hi, part.runs_solved)]
                lines.append(f"  {cell}{f' ({checkpoint} checkpoint)' if checkpoint else ''}: " + "; ".join(parts))
    return lines
