"""The study's figures (matplotlib), from the report's tables (study/results/tables.py).

- accuracy_vs_length.png: one panel per cell, the mean over seeds against test length with the
  seeds' range (min-max) as a band, a line per k_test, the train length marked;
- accuracy_by_<factor>.png: per grid factor, its levels on the same axes (the other factors fixed
  per panel) at the largest k_test <= K_train;
- sparsity_vs_extrapolation.png (specs with a `sparsity:` section): every trial's measured sparsity
  (median k, analysis/sparsity.py) against its accuracy (or loss) beyond the train length, the paper's
  thesis as one scatter;
- a trial's own accuracy_vs_length.png, logged to its MLflow run (study/record/mlflow/trial_runs.py).

Each has a title (study, task, budget, seeds), cells named by the factors that vary (`K_train 2,
learned / random_shift`), the chance level where the task's answer has one (`Task.answer_chance`),
its legend inside the canvas, and a vector copy (PDF) beside the PNG.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field

import pandas as pd

from study.spec.schema import StudySpec

DPI = 150
# readable names of the factors a grid varies most; any other is named by its last key
SHORT_NAMES = {"task.params.train_k": "K_train", "task.params.train_length": "train length",
               "task.params.min_length": "min length", "model.n_layers": "layers", "optim.steps": "steps"}
FACTOR_TITLES = {"positional": "positional scheme (encoding / ids)", "task.name": "task"}


@dataclass
class FigureText:
    """What a study's figures say beside the numbers: the title, each cell's readable name and the
    chance level of its task's answer (None where there is none)."""
    title: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    chance: dict[str, float | None] = field(default_factory=dict)

    def label(self, cell: str) -> str:
        return self.labels.get(cell, cell)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def vector_copy(path: str) -> str:
    """The PDF written beside a figure's PNG."""
    return os.path.splitext(path)[0] + ".pdf"


def save(fig, path: str) -> str:
    """The PNG and its vector copy; the PDF without a creation date, so a rebuilt report is the same
    file. Returns the PNG's path."""
    fig.savefig(path, dpi=DPI)
    fig.set_layout_engine("none")  # the PDF keeps the PNG's layout instead of laying the figure out again
    fig.savefig(vector_copy(path), metadata={"CreationDate": None})
    _plt().close(fig)
    return path


def readable(factors: dict, keep=None) -> str:
    """A cell's name from its factors (those in `keep`, or all): the positional scheme as
    `encoding / ids[ + abacus]`, a task by its name, other factors as `name value`."""
    parts, scheme, at = [], {}, None
    for key, value in factors.items():
        if keep is not None and key not in keep:
            continue
        if key.startswith("positional."):
            if at is None:  # named below, in the place of the group's first key
                at = len(parts)
                parts.append("")
            scheme[key.split(".", 1)[1]] = value
        elif key == "task.name":
            parts.append(str(value))
        else:
            parts.append(f"{SHORT_NAMES.get(key, key.split('.')[-1])} {value}")
    if scheme:
        name = " / ".join(str(scheme.pop(k)) for k in ("encoding", "ids") if k in scheme)
        name += " + abacus" if scheme.pop("abacus", False) else ""
        rest = ", ".join(f"{k} {v}" for k, v in scheme.items())
        parts[at] = ", ".join(p for p in (name, rest) if p)
    return ", ".join(p for p in parts if p) or "all"


def describe(spec: StudySpec, seeds: int | None = None) -> FigureText:
    """The study's figure text: `name: tasks, steps x batch, seeds`, each cell named by the factors
    that vary between cells, and each cell's chance level."""
    cells = spec.cells()
    varying = {k for k in {k for c in cells for k in c.factors if k not in c.hidden}
               if len({repr(c.factors.get(k)) for c in cells}) > 1}
    configs = [spec.trial_config(c, {}, spec.seed) for c in cells]
    tasks = list(dict.fromkeys(cfg["task"]["name"] for cfg in configs))
    steps = sorted({(cfg.get("optim") or {}).get("steps", 0) for cfg in configs})
    batches = sorted({(cfg.get("optim") or {}).get("batch_size", 0) for cfg in configs})
    budget = f"{'/'.join(f'{s:,}' for s in steps)} steps x batch {'/'.join(map(str, batches))}"
    title = f"{spec.name}: {', '.join(tasks)}; {budget}" + (f"; {seeds} seed(s)" if seeds else "")
    return FigureText(title, {c.label: readable(c.factors, varying) for c in cells},
                      {c.label: chance_of(cfg["task"]["name"]) for c, cfg in zip(cells, configs)})


def chance_of(task: str) -> float | None:
    """The answer accuracy of a guess, where a task declares one (`answer_chance`: parity's bit, 0.5);
    None where guessing gets nearly nothing (a number, a string)."""
    from tasks import TASKS

    return getattr(TASKS[task], "answer_chance", None)


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """Text broken into lines that fit `width_in` inches at `fontsize` (a character ~0.6 of its size)."""
    return textwrap.fill(text, max(12, int(width_in * 72 / (0.6 * fontsize))))


def wrapped_figure(rows: int, cols: int, width: float, height: float, title: str, sharex: bool = False,
                   sharey: bool = True):
    """A figure of rows x cols panels (`width` x `height` inches each) laid out so that its title
    (wrapped to the width), labels and a legend under the panels stay inside the canvas."""
    fig = _plt().figure(figsize=(width * cols, height * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=sharex, sharey=sharey)
    if title:
        fig.suptitle(_wrap(title, width * cols, 10), fontsize=10)
    return fig, axes


def _figure(n: int, width: float, height: float, title: str):
    """Up to 3 panels a row sharing the accuracy axis."""
    cols = min(3, max(n, 1))
    return wrapped_figure(-(-max(n, 1) // cols), cols, width, height, title)


def wrapped_legend(fig, axes, title: str | None = None, ncol_max: int = 6) -> None:
    """One legend for all panels, under them and inside the canvas: as many columns as fit, the
    figure made taller by the legend's height (the panels keep theirs)."""
    entries = {}  # from every panel: the first may have drawn nothing
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(len(entries), ncol_max), 0, -1):
        legend = fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=ncol,
                            fontsize=8, title=title, title_fontsize=8)
        box = legend.get_window_extent(renderer)
        if ncol == 1 or box.width <= 0.98 * fig.bbox.width:
            width, height = fig.get_size_inches()
            fig.set_size_inches(width, height + box.height / fig.dpi)
            return
        legend.remove()


def _accuracy_axes(axes, used: int, ylabel: str = "answer accuracy") -> None:
    for ax in list(axes.flat)[:used]:
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length (dotted: train length)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[used:]:
        ax.axis("off")


def _chance(ax, level: float | None) -> None:
    if level is not None:
        ax.axhline(level, color="black", ls="--", lw=0.8, alpha=0.6, label=f"chance ({level:g})")


def _band(ax, g: pd.DataFrame, label: str, color, y: str = "answer_acc") -> None:
    """The mean over seeds, and their range (min-max) as a band where there are several."""
    ax.plot(g.length, g[y], marker="o", ms=3, color=color, label=label)
    if f"{y}_min" in g and g[f"{y}_min"].notna().any():
        ax.fill_between(g.length, g[f"{y}_min"], g[f"{y}_max"], color=color, alpha=0.2, lw=0)


def plot_accuracy(summary: pd.DataFrame, path: str, train_lengths: dict[str, int],
                  text: FigureText | None = None) -> str:
    """One panel per cell: mean answer accuracy over the selected config's seeds against test
    length, a band for the seeds' range, a line per k_test, the train length dotted."""
    text = text or FigureText()
    cells = list(dict.fromkeys(summary.cell))
    fig, axes = _figure(len(cells), 4.2, 3.2, text.title)
    ks = sorted(k for k in summary.k.dropna().unique())
    cmap = _plt().get_cmap("viridis", max(len(ks), 2))
    for ax, cell in zip(axes.flat, cells):
        rows = summary[summary.cell == cell]
        for k, g in rows.groupby("k", dropna=False):
            _band(ax, g, "all" if pd.isna(k) else f"k_test {int(k)}", "C0" if pd.isna(k) else cmap(ks.index(k)))
        ax.axvline(train_lengths.get(cell, 0), color="grey", ls=":", lw=1)
        _chance(ax, text.chance.get(cell))
        ids = rows.ids.iloc[0]
        ax.set_title(_wrap(f"{text.label(cell)}{'' if ids == 'sequential' else f' ({ids} ids at test)'}", 4.2, 8),
                     fontsize=8)
    _accuracy_axes(axes, len(cells), "answer accuracy (band: seeds' min-max)")
    wrapped_legend(fig, axes)
    return save(fig, path)


def trial_title(trial_config: dict) -> str:
    """What one trial is: `task, encoding / ids; steps x batch; seed`."""
    task, optim = trial_config["task"], trial_config.get("optim") or {}
    scheme = readable({f"positional.{k}": v for k, v in (trial_config.get("positional") or {}).items()
                       if k in ("encoding", "ids", "abacus")})
    return (f"{task['name']}, {scheme}; {optim.get('steps', 0):,} steps x batch {optim.get('batch_size', 0)}; "
            f"seed {trial_config.get('seed', 0)}")


def plot_trial(records: list[dict], train_length: int, path: str, trial_config: dict | None = None) -> str:
    """One trial's answer accuracy against test length, a line per k_test (its own ids); the title
    and the chance level from its config."""
    rows = pd.DataFrame(records)
    rows = rows[rows.ids == rows.ids.iloc[0]]
    title = trial_title(trial_config) if trial_config else ""
    chance = chance_of(trial_config["task"]["name"]) if trial_config else None
    fig, axes = _figure(1, 4.6, 3.3, title)
    ax = axes[0, 0]
    for k, g in rows.groupby("k", dropna=False):
        ax.plot(g.length, g.answer_acc, marker="o", ms=3, label="all" if pd.isna(k) else f"k_test {int(k)}")
    ax.axvline(train_length, color="grey", ls=":", lw=1)
    _chance(ax, chance)
    _accuracy_axes(axes, 1)
    wrapped_legend(fig, axes)
    return save(fig, path)


def plot_factor(spec: StudySpec, summary: pd.DataFrame, factor: str, path: str,
                train_lengths: dict[str, int], train_ks: dict[str, int | None],
                text: FigureText | None = None) -> str | None:
    """A grid factor's levels on the same axes: one panel per combination of the other factors,
    a line (with its band) per level, at the largest k_test <= K_train of the panel's cells."""
    text = text or FigureText()
    cells = {c.label: c for c in spec.cells()}
    varying = {k for c in cells.values() for k in c.factors if k not in c.hidden
               and len({repr(other.factors.get(k)) for other in cells.values()}) > 1}
    mine = varying & spec.factor_leaves(factor)
    level_of = {label: readable(c.factors, mine) for label, c in cells.items()}
    levels = list(dict.fromkeys(level_of.values()))
    if len(levels) < 2:
        return None
    rest = {label: readable(c.factors, varying - mine) if varying - mine else "" for label, c in cells.items()}
    panels = list(dict.fromkeys(rest.values()))
    fig, axes = _figure(len(panels), 4.4, 3.3, text.title)
    for ax, panel in zip(axes.flat, panels):
        members = [c for c in cells if rest[c] == panel]
        ks = [train_ks[c] for c in members if train_ks.get(c) is not None]
        k = min(ks) if ks else None
        for cell in members:
            rows = summary[summary.cell == cell]
            rows = rows[rows.k == k] if k is not None and rows.k.notna().any() else rows[rows.k.isna()]
            color = f"C{levels.index(level_of[cell]) % 10}"
            if not rows.empty:
                _band(ax, rows, level_of[cell], color)
            ax.axvline(train_lengths.get(cell, 0), color=color, ls=":", lw=1)
        chances = {text.chance.get(c) for c in members}
        _chance(ax, chances.pop() if len(chances) == 1 else None)
        ax.set_title(_wrap((panel or "all cells") + ("" if k is None else f", k_test {k}"), 4.4, 8), fontsize=8)
    _accuracy_axes(axes, len(panels), "answer accuracy (band: seeds' min-max)")
    wrapped_legend(fig, axes, title=FACTOR_TITLES.get(factor, SHORT_NAMES.get(factor, factor)))
    return save(fig, path)


def plot_sparsity(results: pd.DataFrame, path: str, text: FigureText | None = None) -> str | None:
    """Each trial's median k (the meter) against its extrapolation: accuracy beyond the train
    length, or loss there for language models; one marker per cell. None when nothing to plot."""
    text = text or FigureText()
    trials = results.drop_duplicates("trial_id")
    # language models report a loss beyond the train length: the quantity their sparsity is about
    y = "loss_beyond" if trials.get("loss_beyond", pd.Series(dtype=float)).notna().any() else "acc_beyond"
    if "sparsity/k_median" not in trials or y not in trials:
        return None
    trials = trials[trials["sparsity/k_median"].notna() & trials[y].notna()]
    if trials.empty:
        return None
    fig, axes = _figure(1, 5.6, 4, text.title)
    ax = axes[0, 0]
    for i, (cell, group) in enumerate(trials.groupby("cell", sort=False)):
        ax.scatter(group["sparsity/k_median"], group[y], s=30, alpha=0.8, marker="osD^v<>p"[i % 8],
                   color=f"C{i % 10}", label=text.label(cell))
    if y == "acc_beyond":
        chances = {text.chance.get(c) for c in trials.cell.unique()}
        _chance(ax, chances.pop() if len(chances) == 1 else None)
    if y == "acc_beyond":
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("measured sparsity: median k of tokens a target needs", fontsize=8)
    ax.set_ylabel("answer accuracy beyond the train length" if y == "acc_beyond" else "loss beyond the train length",
                  fontsize=8)
    wrapped_legend(fig, axes)
    return save(fig, path)
