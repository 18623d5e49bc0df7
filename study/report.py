"""The study's results as tables and a figure (pandas, matplotlib).

- results.csv: one row per trial x evaluation cell (length, k_test, ids) with the trial's cell
  factors, searched hyperparameters, seed and metrics.
- summary: per study cell, the trial selected on the objective (in-distribution validation by
  default) with its in-distribution and beyond-train-length accuracy.
- accuracy_vs_length.png: the selected trial of every cell, accuracy against test length.
- sparsity_vs_extrapolation.png (specs with a `sparsity:` section): every trial's measured sparsity
  (median k, study/sparsity.py) against its accuracy (or loss) beyond the train length, the paper's
  thesis as one scatter.
"""

from __future__ import annotations

import os

import pandas as pd

from study.spec import StudySpec

SUMMARY_COLUMNS = ["val_exact", "val_loss", "acc_in_dist", "acc_beyond", "exact_in_dist", "exact_beyond"]
# kept where a trial reports them: the loss of language models, the sparsity meter's summary
OPTIONAL_COLUMNS = ["loss_beyond", "sparsity/k_median", "sparsity/k_p90", "sparsity/k_match",
                    "sparsity/precision", "sparsity/recall", "sparsity/targets_flat"]


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
            **{k: metrics[k] for k in OPTIONAL_COLUMNS if k in metrics},
        }
        for rec in metrics.get("eval_records") or []:
            rows.append({**common, **rec})
    return pd.DataFrame(rows)


def select(spec: StudySpec, results: pd.DataFrame) -> pd.DataFrame:
    """Per cell, the trial with the best objective (ties: the lower validation loss)."""
    if results.empty:
        return results
    metric, ascending = spec.objective.metric, spec.objective.mode == "min"
    trials = results.drop_duplicates("trial_id")
    by = [metric, "val_loss", "trial_id"] if metric != "val_loss" else [metric, "trial_id"]
    order = [ascending, True, True][: len(by)]
    best = trials.sort_values(by, ascending=order).groupby("cell", sort=False).head(1)
    cols = ["cell", "trial_id", "seed", *[c for c in trials.columns if c.startswith("search.")],
            *dict.fromkeys([metric, *SUMMARY_COLUMNS, *[c for c in OPTIONAL_COLUMNS if c in trials]])]
    order = {c.label: c.index for c in spec.cells()}
    return best[cols].sort_values("cell", key=lambda s: s.map(order)).reset_index(drop=True)


def plot_accuracy(results: pd.DataFrame, selected: pd.DataFrame, path: str, train_lengths: dict) -> str:
    """One panel per cell (its selected trial): accuracy against test length, a line per k_test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(selected)
    cols = min(3, n)
    rows_n = -(-n // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False, sharey=True)
    ks = sorted(k for k in results.k.dropna().unique())
    cmap = plt.get_cmap("viridis", max(len(ks), 2))
    for ax, (_, row) in zip(axes.flat, selected.iterrows()):
        rows = results[results.trial_id == row.trial_id]
        primary = rows.ids.iloc[0]
        rows = rows[rows.ids == primary]
        for k, group in rows.groupby("k", dropna=False):
            color = "C0" if pd.isna(k) else cmap(ks.index(k))
            ax.plot(group.length, group.answer_acc, marker="o", color=color,
                    label="all" if pd.isna(k) else f"k={int(k)}")
        ax.axvline(train_lengths.get(row.trial_id, 0), color="grey", ls=":", lw=1)
        ax.set_title(row.cell + ("" if primary == "sequential" else f" ({primary} ids)"), fontsize=8)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length (dotted: train length)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("answer accuracy")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sparsity(results: pd.DataFrame, path: str) -> str | None:
    """Each trial's median k (the meter) against its extrapolation: accuracy beyond the train
    length, or loss there for language models; one marker per cell. None when nothing to plot."""
    trials = results.drop_duplicates("trial_id")
    # language models report a loss beyond the train length: the quantity their sparsity is about
    y = "loss_beyond" if trials.get("loss_beyond", pd.Series(dtype=float)).notna().any() else "acc_beyond"
    if "sparsity/k_median" not in trials or y not in trials:
        return None
    trials = trials[trials["sparsity/k_median"].notna() & trials[y].notna()]
    if trials.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4))
    for i, (cell, group) in enumerate(trials.groupby("cell", sort=False)):
        ax.scatter(group["sparsity/k_median"], group[y], s=30, alpha=0.8, marker="osD^v<>p"[i % 8],
                   label=cell)
    ax.set_xlabel("measured sparsity: median k of tokens a target needs")
    ax.set_ylabel("answer accuracy beyond the train length" if y == "acc_beyond" else "loss beyond the train length")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
        scatter = plot_sparsity(results, os.path.join(out_dir, "sparsity_vs_extrapolation.png"))
        if scatter:
            files["sparsity_plot"] = scatter
    return summary, files
