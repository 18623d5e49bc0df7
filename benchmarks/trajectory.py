"""The series a trial tracks while training (eval.track: exact match, loss and attention margin at
longer lengths; eval.select: the selection loss), as a table and a figure, from
`python -m benchmarks.coupling`'s runs."""

from __future__ import annotations


def trajectory(series, every: int = 1) -> str:
    """The tracked series of each cell (eval.track: teacher-forced exact match and attention margin at
    longer lengths; eval.select: the selection loss), mean over seeds, a row per `every`-th report."""
    import pandas as pd

    frame = pd.DataFrame(series)
    columns = [c for c in frame.columns if c.startswith(("track/", "select/"))]
    out = []
    for cell, group in frame.groupby("cell", sort=False):
        means = group.groupby("step")[columns].mean()
        out.append(f"\n{cell}\n" + means.iloc[::every].round(3).to_string())
    return "\n".join(out)


def trajectory_markdown(series, train_length: int, labels: dict[str, str], columns: int = 8) -> str:
    """The tracked series as the docs print them ("" without any): a row per cell and metric, a
    column per report (at most `columns`, evenly spaced, the last kept), mean over the seeds that
    tracked it; `labels` names each cell as its table does."""
    import pandas as pd

    if not series:
        return ""
    frame = pd.DataFrame(series)
    steps = sorted(frame.step.unique())
    steps = [steps[round(i * (len(steps) - 1) / (columns - 1))] for i in range(columns)] \
        if len(steps) > columns else steps
    lengths = sorted({int(c.split("/")[1][3:]) for c in frame.columns if c.startswith("track/len")})
    names = {f"track/len{n}/{m}": f"{m} at {n} ({n / train_length:g}x)" for n in lengths
             for m in ("exact", "loss", "margin")}
    names |= {"select/exact": "exact on the selection set", "select/loss": "loss on the selection set"}
    lines = ["| cell | tracked | seeds | " + " | ".join(f"step {s:,}" for s in steps) + " |",
             "|---|---|---|" + "---|" * len(steps)]
    for cell, group in frame.groupby("cell", sort=False):
        means = group.groupby("step")[[c for c in names if c in group]].mean().reindex(steps)
        for column, name in names.items():
            if column in means and means[column].notna().any():
                values = " | ".join("" if pd.isna(v) else f"{v:.2f}" for v in means[column])
                lines.append(f"| `{labels.get(cell, cell)}` | {name} | {group.seed.nunique()} | {values} |")
    return ("\n\nTracked while training (`eval.track`: teacher-forced on held-out samples, the margin of the "
            "matching key over the best key farther than any trained id distance; `eval.select`), mean over "
            "seeds:\n\n" + "\n".join(lines))


def runs_title(jobs: list[dict], seeds: list[int]) -> str:
    """What a figure of these runs shows: specs, tasks, budget (steps x batch) and seeds."""
    def joined(values) -> str:
        return "/".join(dict.fromkeys(map(str, values)))

    optim = [j["trial"].get("optim") or {} for j in jobs]
    steps = joined(f"{o.get('steps', 0):,}" for o in optim)
    return (f"{joined(j['spec'] for j in jobs)}: {joined(j['trial']['task']['name'] for j in jobs)}; {steps} steps "
            f"x batch {joined(o.get('batch_size') for o in optim)}; seeds {' '.join(map(str, seeds))}")


def plot_trajectory(series, path: str, title: str = "", labels: dict[str, str] | None = None) -> str:
    """The tracked series against training steps, a column per tracked length: exact match, loss and
    the attention margin (trained-distance keys over untrained ones); a line per cell, mean over
    seeds with the seeds' range shaded. `title` names the runs (specs, task, budget, seeds), `labels`
    each cell as the docs' table does (default: its factors); one legend under the panels, inside the
    figure; a PDF beside the PNG (study/results/figures.py)."""
    import textwrap

    import pandas as pd

    from study.results.figures import FigureText, save, wrapped_figure, wrapped_legend

    frame = pd.DataFrame(series)
    lengths = sorted({int(c.split("/")[1][3:]) for c in frame.columns if c.startswith("track/len")})
    fig, axes = wrapped_figure(3, len(lengths), 4.5, 2.8, title, sharex=True, sharey=False)
    text = FigureText(labels=labels or {})
    for i, n in enumerate(lengths):
        rows = (("exact", f"exact match at {n}"), ("loss", f"loss at {n}"), ("margin", f"margin at {n}"))
        for row, (metric, label) in enumerate(rows):
            ax, column = axes[row][i], f"track/len{n}/{metric}"
            for cell, group in frame.groupby("cell", sort=False):
                stats = group.groupby("step")[column].agg(["mean", "min", "max"])
                name = text.label(cell).replace("=", " ").replace(",", ", ")
                line, = ax.plot(stats.index, stats["mean"], label=textwrap.fill(name, 70))
                ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15)
            ax.set_ylabel(label, fontsize=8)
            if metric == "exact":
                ax.set_ylim(-0.02, 1.02)
            if metric == "margin":
                ax.axhline(0, color="grey", lw=0.8, ls=":")
                ax.set_xlabel("training step", fontsize=8)
    wrapped_legend(fig, axes, ncol_max=1 if frame.cell.map(len).max() > 40 else 4)
    return save(fig, path)
