"""Every figure the platform writes, rendered and read back: a title naming the study (or runs), task
and budget; cells named by what varies between them, never by raw keys (`train_k=2,encoding=...`); the
chance level where the task's answer has one (sparse parity's bit: 0.5); every text inside the canvas
(titles, labels, ticks and the legend); and a PDF beside each PNG.

The figures are drawn from hand-made results (the statistics are test_report.py's), through the same
functions a study and the benchmarks call; `Figure.savefig` is wrapped (a spy: the real one runs) to
read each figure back as it is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.figure import Figure
from matplotlib.text import Text
from test_study import ROOT

from study.results.tables import report_from_results
from study.spec.schema import load_spec
from trial.config import TrialConfig


def read_back(fig: Figure) -> dict:
    """What a reader sees of a figure: its title, every text (and those not wholly inside the canvas)
    and the labels of its lines, after a draw."""
    fig.canvas.draw()
    renderer, canvas = fig.canvas.get_renderer(), fig.bbox
    undrawn = set()  # the labels of ticks beyond an axis's limits, which matplotlib keeps but does not draw
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if not low - 1e-9 * (high - low) <= tick.get_loc() <= high + 1e-9 * (high - low):
                    undrawn |= {id(tick.label1), id(tick.label2)}
    texts, outside = [], []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
            continue
        box = text.get_window_extent(renderer)
        texts.append(text.get_text())
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            outside.append(text.get_text())
    lines = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    return {"title": " ".join(fig.get_suptitle().split()), "texts": texts, "outside": outside, "lines": lines}


@pytest.fixture
def written(monkeypatch) -> dict[str, dict]:
    """Each PNG written while the test runs (its file name; a report stages its files in a folder of
    its own) -> what its figure showed. The PDF beside a PNG is the same picture: its panels where
    the PNG's are."""
    figures: dict[str, dict] = {}
    panels: dict[int, list] = {}
    original = Figure.savefig

    def spy(fig, path, *args, **kwargs):
        original(fig, path, *args, **kwargs)
        if str(path).endswith(".png"):
            figures[Path(path).name] = read_back(fig)
            panels[id(fig)] = [ax.get_position().bounds for ax in fig.axes]
        elif id(fig) in panels:
            assert [ax.get_position().bounds for ax in fig.axes] == panels.pop(id(fig)), path
    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def made_up_results(spec, seeds: int = 3) -> pd.DataFrame:
    """results.csv of a study that ran: 2 search trials and seeds - 1 replicas per cell, every test
    cell of its trial config, accuracy falling beyond the train length, a sparsity measurement."""
    rng = np.random.default_rng(0)
    rows = []
    for cell in spec.cells():
        cfg = TrialConfig.model_validate(spec.trial_config(cell, {}, spec.seed))
        train = cfg.task_instance.train_length
        for i in range(2 + seeds - 1):
            role = "search" if i < 2 else "replica"
            common = {"trial_id": f"{cell.index}-{i}", "cell": cell.label, **cell.factors,
                      "search.optim.lr": 1e-3 * (1 + i % 2), "seed": max(0, i - 1), "role": role,
                      "selected_from": f"{cell.index}-0" if role == "replica" else None,
                      "search_index": i if role == "search" else None, "status": "TERMINATED", "val_exact": 1.0,
                      "val_loss": 1e-8, "acc_in_dist": 1.0, "acc_beyond": 0.7, "acc_k_beyond": 0.5,
                      "exact_in_dist": 1.0, "exact_beyond": 0.7, "sparsity/k_median": 2.0}
            for length, k in cfg.eval_points():
                acc = float(np.clip(1 - 0.1 * (k or 1) * (length > train) + rng.normal(0, 0.05), 0, 1))
                rows.append({**common, "length": length, "k": k, "ids": "sequential", "answer_acc": acc,
                             "exact_match": acc, "in_distribution": length <= train})
    return pd.DataFrame(rows)


DEFAULT_FIGURES = {"accuracy_vs_length.png", "accuracy_by_task_params_train_k.png", "accuracy_by_positional.png",
                   "sparsity_vs_extrapolation.png"}


# the figures with a chance line: all of sparse parity's; of the schemes' 7 tasks, the panels of the
# parities (a panel per task: by scheme; by task, a panel mixes tasks and has no one level); none of
# variable assignment's
# schemes_by_task keeps its 7 tasks and 2 of its 9 schemes: 14 panels show what 63 do (63 constrained-
# layout panels take a minute of the fast tier to draw)
TWO_SCHEMES = ["grid.positional=[{encoding: learned, ids: sequential, max_position: 96}, "
               "{encoding: rope, ids: sequential, max_position: 96}]"]


@pytest.mark.parametrize("space, with_chance", [("default", DEFAULT_FIGURES),
                                                ("experiments/schemes_by_task",
                                                 {"accuracy_vs_length.png", "accuracy_by_positional.png"}),
                                                ("experiments/coupling_variable_assignment", set())])
def test_a_studys_figures_have_a_title_readable_labels_chance_and_every_text_inside(space, with_chance, written,
                                                                                   tmp_path):
    overrides = TWO_SCHEMES if space == "experiments/schemes_by_task" else []
    spec = load_spec(str(ROOT / "search_spaces" / f"{space}.yaml"), overrides=overrides)
    _, _, files = report_from_results(spec, made_up_results(spec), str(tmp_path))
    pngs = {Path(p).name for p in files.values() if p.endswith(".png")}
    assert len(pngs) >= 2 and set(written) == pngs
    for path, fig in written.items():
        assert fig["outside"] == [], (path, fig["outside"])
        assert fig["title"].startswith(f"{spec.name}: ") and " steps x batch " in fig["title"], path
        assert not [t for t in fig["texts"] if "=" in t], path  # `train_k=2,encoding=learned` is a key, not a label
        assert (tmp_path / path).with_suffix(".pdf").read_bytes().startswith(b"%PDF"), path
        assert ("chance (0.5)" in fig["lines"]) == (path in with_chance), path
    if space == "default":
        by_scheme = written["accuracy_by_positional.png"]
        assert "learned / random_shift" in by_scheme["texts"] and "K_train 2, k_test 2" in by_scheme["texts"]


def test_a_trials_figure_names_its_task_scheme_budget_and_seed(written, tmp_path):
    from study.results.figures import plot_trial

    config = yaml.safe_load((ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text())
    records = [{"length": n, "k": k, "ids": "sequential", "answer_acc": 1.0 if n <= 20 else 0.6}
               for n in (10, 20, 40) for k in (1, 2, 3)]
    plot_trial(records, 20, str(tmp_path / "accuracy_vs_length.png"), config)
    fig = written["accuracy_vs_length.png"]
    assert fig["outside"] == [] and "chance (0.5)" in fig["lines"]
    assert fig["title"].startswith("sparse_parity, ") and " steps x batch " in fig["title"] and "seed" in fig["title"]
    assert (tmp_path / "accuracy_vs_length.pdf").exists()


def test_the_analyses_figures_say_what_was_measured(written, tmp_path):
    """The loss gap's scatter and the sparsity meter's histogram, as a study logs them for a trial."""
    from analysis.loss_gap import plot_gap
    from analysis.sparsity import plot_k
    from study.results.figures import trial_title

    config = yaml.safe_load((ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text())
    gaps = pd.DataFrame({"k": [1, 1, 2, 2], "L_short": [2.0, 1.5, 2.2, 1.0], "L_long": [0.5, 0.4, 0.6, 0.3],
                         "L_sparse": [0.9, 0.8, 0.7, 0.5]})
    plot_gap(gaps, str(tmp_path / "gap_scatter.png"), f"loss gap: {trial_title(config)}")
    targets = pd.DataFrame({"k": [1, 2, 2, 9], "k_planted": [1, 2, 2, 2], "flat": [False, False, False, True]})
    plot_k(targets, 4, str(tmp_path / "k_hist.png"), f"sparsity meter: {trial_title(config)}")
    for name, what in (("gap_scatter.png", "loss gap: "), ("k_hist.png", "sparsity meter: ")):
        fig = written[name]
        assert fig["outside"] == [] and fig["title"].startswith(f"{what}sparse_parity, learned / random_shift; 600 steps")
        assert (tmp_path / name).with_suffix(".pdf").exists()
