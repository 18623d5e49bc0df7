"""The study's figures (matplotlib), from the report's tables (study/record/report.py).

- accuracy_vs_length.png: one panel per cell, the mean with its interval band against test length,
  a line per k_test, the train length marked;
- accuracy_by_<factor>.png: per grid factor, its levels on the same axes (the other factors fixed
  per panel) at the largest k_test <= K_train;
- sparsity_vs_extrapolation.png (specs with a `sparsity:` section): every trial's measured sparsity
  (median k, analysis/sparsity.py) against its accuracy (or loss) beyond the train length, the paper's
  thesis as one scatter;
- a trial's own accuracy_vs_length.png, logged to its MLflow run (study/record/trial_record.py).
"""

from __future__ import annotations

import pandas as pd

from study.spec.schema import StudySpec


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(n: int, width: float, height: float):
    """Up to 3 panels a row, sharing the accuracy axis."""
    plt = _plt()
    cols = min(3, n)
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(width * cols, height * -(-n // cols)), squeeze=False,
                             sharey=True)
    return plt, fig, axes


def _save(plt, fig, axes, used: int, path: str, bottom: float, ncol: int, **legend) -> str:
    """Accuracy-against-length axes, one legend under the panels, the file written."""
    for ax in list(axes.flat)[:used]:
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length (dotted: train length)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("answer accuracy (mean, 95% band)")
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    by_label = {}  # from every panel: the first may have drawn nothing
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            by_label.setdefault(label, handle)
    if by_label:
        fig.legend(list(by_label.values()), list(by_label), loc="lower center", ncol=min(len(by_label), ncol),
                   fontsize=8, **legend)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(ax, g: pd.DataFrame, label: str, color, y: str = "answer_acc") -> None:
    ax.plot(g.length, g[y], marker="o", ms=3, color=color, label=label)
    if g[f"{y}_lo"].notna().any():
        ax.fill_between(g.length, g[f"{y}_lo"].clip(0, 1), g[f"{y}_hi"].clip(0, 1), color=color, alpha=0.2, lw=0)


def plot_accuracy(summary: pd.DataFrame, path: str, train_lengths: dict[str, int]) -> str:
    """One panel per cell: mean answer accuracy over the selected config's seeds against test
    length, a band for the 95% interval, a line per k_test, the train length dotted."""
    cells = list(dict.fromkeys(summary.cell))
    plt, fig, axes = _panels(len(cells), 4.2, 3.2)
    ks = sorted(k for k in summary.k.dropna().unique())
    cmap = plt.get_cmap("viridis", max(len(ks), 2))
    for ax, cell in zip(axes.flat, cells):
        rows = summary[summary.cell == cell]
        for k, g in rows.groupby("k", dropna=False):
            _band(ax, g, "all" if pd.isna(k) else f"k={int(k)}", "C0" if pd.isna(k) else cmap(ks.index(k)))
        ax.axvline(train_lengths.get(cell, 0), color="grey", ls=":", lw=1)
        ids = rows.ids.iloc[0]
        ax.set_title(f"{cell}{'' if ids == 'sequential' else f' ({ids} ids)'}, {int(rows.seeds.max())} seed(s)",
                     fontsize=8)
    return _save(plt, fig, axes, len(cells), path, bottom=0.06, ncol=8)


def plot_trial(records: list[dict], train_length: int, path: str) -> str:
    """One trial's answer accuracy against test length, a line per k_test (its own ids)."""
    rows = pd.DataFrame(records)
    rows = rows[rows.ids == rows.ids.iloc[0]]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 3.3))
    for k, g in rows.groupby("k", dropna=False):
        ax.plot(g.length, g.answer_acc, marker="o", ms=3, label="all" if pd.isna(k) else f"k={int(k)}")
    ax.axvline(train_length, color="grey", ls=":", lw=1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("test length (dotted: train length)", fontsize=8)
    ax.set_ylabel("answer accuracy", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_factor(spec: StudySpec, summary: pd.DataFrame, factor: str, path: str,
                train_lengths: dict[str, int], train_ks: dict[str, int | None]) -> str | None:
    """A grid factor's levels on the same axes: one panel per combination of the other factors,
    a line (with its band) per level, at the largest k_test <= K_train of the panel's cells."""
    cells = {c.label: c for c in spec.cells()}
    level_of = {label: json_label(c.factors, factor) for label, c in cells.items()}
    levels = list(dict.fromkeys(level_of.values()))
    if len(levels) < 2:
        return None
    rest = {label: " ".join(f"{k}={v}" for k, v in c.factors.items() if not _under(k, factor))
            for label, c in cells.items()}
    panels = list(dict.fromkeys(rest.values()))
    plt, fig, axes = _panels(len(panels), 4.4, 3.3)
    for ax, panel in zip(axes.flat, panels):
        members = [c for c in cells if rest[c] == panel]
        ks = [train_ks[c] for c in members if train_ks.get(c) is not None]
        k = min(ks) if ks else None
        for _i, cell in enumerate(members):
            rows = summary[summary.cell == cell]
            rows = rows[rows.k == k] if k is not None and rows.k.notna().any() else rows[rows.k.isna()]
            if not rows.empty:
                _band(ax, rows, level_of[cell], f"C{levels.index(level_of[cell])}")
            ax.axvline(train_lengths.get(cell, 0), color=f"C{levels.index(level_of[cell])}", ls=":", lw=1)
        ax.set_title((panel or "all cells") + ("" if k is None else f", k_test={k}"), fontsize=8)
    return _save(plt, fig, axes, len(panels), path, bottom=0.1, ncol=4, title=factor, title_fontsize=8)


def _under(key: str, factor: str) -> bool:
    return key == factor or key.startswith(factor + ".")


def json_label(factors: dict, factor: str) -> str:
    """A cell's level of one grid factor (a dict-valued factor is several flattened keys)."""
    return ",".join(f"{v}" for k, v in factors.items() if _under(k, factor))


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
    plt = _plt()
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
