"""The study's results as tables and a figure (pandas, matplotlib).

- results.csv: one row per trial x evaluation cell (length, k_test, ids) with the trial's cell
  factors, searched hyperparameters, seed and metrics.
- summary: per study cell, the trial selected on the objective (in-distribution validation by
  default) with its in-distribution and beyond-train-length accuracy.
- accuracy_vs_length.png: the selected trial of every cell, accuracy against test length.
"""

from __future__ import annotations

import os

import pandas as pd

from study.spec import StudySpec

SUMMARY_COLUMNS = ["val_exact", "acc_in_dist", "acc_beyond", "exact_in_dist", "exact_beyond"]


def results_frame(spec: StudySpec, trials: list[dict]) -> pd.DataFrame:
    """trials: [{"trial_id", "config" (the Tune config), "metrics" (last result)}]."""
    cells = {c.index: c for c in spec.cells()}
    rows = []
    for t in trials:
        metrics = t["metrics"] or {}
        cell = cells[t["config"]["cell"]]
        common = {
            "trial_id": t["trial_id"],
            "cell": cell.label,
            **cell.factors,
            **{f"search.{k}": v for k, v in t["config"]["params"].items()},
            "seed": t["config"]["trial"]["seed"],
            "status": t["status"],
            **{k: metrics.get(k) for k in [spec.objective.metric, *SUMMARY_COLUMNS]},
        }
        for rec in metrics.get("eval_records") or []:
            rows.append({**common, **rec})
    return pd.DataFrame(rows)


def select(spec: StudySpec, results: pd.DataFrame) -> pd.DataFrame:
    """Per cell, the trial with the best objective (ties: the earlier trial)."""
    if results.empty:
        return results
    metric, ascending = spec.objective.metric, spec.objective.mode == "min"
    trials = results.drop_duplicates("trial_id")
    best = trials.sort_values([metric, "trial_id"], ascending=[ascending, True]).groupby("cell", sort=False).head(1)
    cols = ["cell", "trial_id", "seed", *[c for c in trials.columns if c.startswith("search.")],
            *dict.fromkeys([metric, *SUMMARY_COLUMNS])]
    order = {c.label: c.index for c in spec.cells()}
    return best[cols].sort_values("cell", key=lambda s: s.map(order)).reset_index(drop=True)


def plot_accuracy(results: pd.DataFrame, selected: pd.DataFrame, path: str, train_lengths: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for _, row in selected.iterrows():
        rows = results[results.trial_id == row.trial_id]
        primary = rows.ids.iloc[0]
        rows = rows[rows.ids == primary]
        for k, group in rows.groupby("k", dropna=False):
            label = row.cell + ("" if pd.isna(k) else f", k={int(k)}") + ("" if primary == "sequential" else f" ({primary})")
            ax.plot(group.length, group.answer_acc, marker="o", label=label)
    for length in sorted(set(train_lengths.values())):
        ax.axvline(length, color="grey", ls=":", lw=1)
    ax.set_xlabel("test length (dotted: train length)")
    ax.set_ylabel("answer accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(spec: StudySpec, trials: list[dict], out_dir: str) -> tuple[pd.DataFrame, dict[str, str]]:
    """Write results.csv, summary.csv and the plot; return the summary and the files written."""
    os.makedirs(out_dir, exist_ok=True)
    results = results_frame(spec, trials)
    files = {"results": os.path.join(out_dir, "results.csv")}
    results.to_csv(files["results"], index=False)
    summary = select(spec, results)
    files["summary"] = os.path.join(out_dir, "summary.csv")
    summary.to_csv(files["summary"], index=False)
    if not summary.empty:
        train_lengths = {t["trial_id"]: t["config"]["trial"]["task"]["params"].get("train_length", 0) for t in trials}
        files["plot"] = plot_accuracy(results, summary, os.path.join(out_dir, "accuracy_vs_length.png"), train_lengths)
    return summary, files
