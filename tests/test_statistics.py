"""What the report says of a few seeds, and how a cell's search trial is selected.

Over seeds: mean, minimum and maximum, and the runs that reach the bar; every bound a value a run
reached, so none leaves its metric's range (a t-interval over 3 seeds gave a negative val_loss).
Selection: a difference in the objective below its sampling error over the validation samples is a
tie, broken by the search's order, never by val_loss noise; the searcher (which reruns the selected
config) and the report choose alike, and the closing lines say how each tie was broken."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_study import SMOKE

from study.experiment.search import CellSearcher
from study.results.selection import choose, standard_error, validation_samples
from study.results.tables import select, summarize_seeds, summary_lines
from study.spec.schema import StudySpec
from trial import metrics


def smoke(**changes) -> StudySpec:
    raw = json.loads(json.dumps(SMOKE))
    raw.update(changes)
    return StudySpec.model_validate(raw)


def seeds_of_one_cell(val_exact: list[float], val_loss: list[float], replicas: list[dict]) -> pd.DataFrame:
    """results.csv of one smoke cell: search trials t0, t1, ... (suggested in that order) and replicas of t0."""
    rows = []
    for i, (exact, loss) in enumerate(zip(val_exact, val_loss)):
        rows.append({"trial_id": f"t{i}", "role": "search", "selected_from": None, "search_index": i, "seed": 0,
                     "val_exact": exact, "val_loss": loss})
    for j, extra in enumerate(replicas, 1):
        rows.append({"trial_id": f"r{j}", "role": "replica", "selected_from": "t0", "search_index": None, "seed": j,
                     **extra})
    out = []
    for r in rows:
        base = {"cell": "train_length=8", "task.params.train_length": 8, "search.optim.lr": 1e-3, "status": "TERMINATED",
                "acc_in_dist": 1.0, "acc_beyond": 0.99, "acc_k_beyond": 0.5, "exact_in_dist": 1.0, "exact_beyond": 0.99,
                "sparsity/targets_flat": 0.0, "length": 16, "k": 2, "ids": "sequential", "in_distribution": False,
                "answer_acc": 0.99, "exact_match": 0.99}
        out.append({**base, **r})
    return pd.DataFrame(out)


def test_no_bound_over_seeds_leaves_its_metrics_range():
    """3 seeds with val_loss 0.01, 0.02, 0.30 and 0, 0, 12 flat targets: Student's t put the lower
    bounds at -0.34 and -13; the seeds' range is [0.01, 0.30] and [0, 12]."""
    spec = smoke(replicas=3)
    results = seeds_of_one_cell([1.0, 0.5], [0.01, 0.9], [
        {"val_exact": 1.0, "val_loss": 0.02, "sparsity/targets_flat": 0.0, "answer_acc": 1.0, "exact_match": 1.0},
        {"val_exact": 0.96, "val_loss": 0.30, "sparsity/targets_flat": 12.0, "answer_acc": 0.96, "exact_match": 0.90}])
    results.loc[results.trial_id == "t0", ["answer_acc", "exact_match"]] = 1.0
    selected = select(spec, results)
    row = selected.iloc[0]
    assert (row.val_loss_min, row.val_loss_max) == (0.01, 0.30) and row.val_loss_mean == pytest.approx(0.11)
    assert (row["sparsity/targets_flat_min"], row["sparsity/targets_flat_max"]) == (0.0, 12.0)
    bounds = [c for c in selected if c.endswith(("_min", "_max"))]
    assert bounds and not [c for c in selected if c.endswith(("_lo", "_hi"))]
    for column in bounds:
        value = row[column]
        assert value >= 0, column
        if metrics.is_proportion(column.rsplit("_", 1)[0]):
            assert value <= 1, column
    summary = summarize_seeds(spec, results, selected).iloc[0]
    assert (summary.answer_acc_min, summary.answer_acc, summary.answer_acc_max) == (0.96, pytest.approx(0.9867, abs=1e-4), 1.0)
    assert summary.runs_solved == pytest.approx(2 / 3)  # exact 1.0, 0.99 and 0.90: two reach 0.95


def test_a_difference_within_the_sampling_error_is_a_tie_broken_by_the_search_order():
    spec = smoke()
    n = validation_samples(spec, spec.cells()[0])
    assert n == SMOKE["base"]["eval"]["val_samples"] == 64
    # one sample in 64 is within the error (its standard error is 0.015-0.022); four are not
    assert 1 / 64 < (standard_error(1.0, n) ** 2 + standard_error(63 / 64, n) ** 2) ** 0.5 < 4 / 64
    tie = choose(spec, [("first", 63 / 64, 0), ("second", 1.0, 1)], n)
    assert (tie.key, tie.tied, tie.chosen_by) == ("first", 2, "first suggested")
    clear = choose(spec, [("first", 60 / 64, 0), ("second", 1.0, 1)], n)
    assert (clear.key, clear.tied, clear.chosen_by) == ("second", 1, "objective")
    # an objective with no sampling error known (here a loss): only equal values tie
    by_loss = smoke(objective={"metric": "val_loss", "mode": "min"})
    assert validation_samples(by_loss, by_loss.cells()[0]) is None
    assert choose(by_loss, [("a", 0.5, 0), ("b", 0.4999, 1)], None).key == "b"
    # a searched warm-up whose base value alone would not validate (steps 8 < the default warm-up of
    # 100): the validation samples are still known (a traceback in the report once)
    searched = smoke(base={**SMOKE["base"], "optim": {"steps": 8, "batch_size": 32}},
                     search={**SMOKE["search"], "params": {"optim.warmup_steps": {"choice": [0, 2]}}})
    assert validation_samples(searched, searched.cells()[0]) == 64
    # each worker validates an equal shard: 64 samples over 3 workers are 66
    assert validation_samples(smoke(resources={"workers_per_trial": 3}, base={
        **SMOKE["base"], "optim": {**SMOKE["base"]["optim"], "batch_size": 33}}), spec.cells()[0]) == 66


def test_the_searcher_and_the_report_choose_the_same_trial_and_say_how():
    """The default study's situation: every search trial at val_exact 1, val_loss ~1e-8 apart. The
    first suggested is chosen, its config is the one the replicas rerun, and the closing lines say so."""
    spec = smoke(replicas=2)
    searcher = CellSearcher(spec, {"workers_per_trial": 1})
    configs = {f"t{i}": searcher.suggest(f"t{i}") for i in range(4)}
    first, second = [t for t, c in configs.items() if c["cell"] == 0]
    assert configs[first]["search_index"] == 0
    searcher.on_trial_complete(second, {"val_exact": 1.0, "val_loss": 1e-9, "eval_records": []})
    searcher.on_trial_complete(first, {"val_exact": 1.0, "val_loss": 6e-8, "eval_records": []})
    replica = searcher.suggest("r0")
    assert replica["role"] == "replica" and replica["selected_from"] == first

    results = seeds_of_one_cell([1.0, 1.0], [6e-8, 1e-9], [{"val_exact": 1.0, "val_loss": 2e-8}])
    selected = select(spec, results)
    assert selected.trial_id.tolist() == ["t0"] and selected.tied.tolist() == [2]
    lines = "\n".join(summary_lines(spec, selected, summarize_seeds(spec, results, selected)))
    assert "2 trials tied within sampling error (n=64) on val_exact: chose the first suggested" in lines
    assert "val_loss" not in lines.split("selected per cell")[1].split("\n")[0]  # the rule names no val_loss
    assert "mean [min-max] over the selected config's seeds" in lines and "acc_beyond   0.990" in lines


def test_qmc_spreads_a_cells_few_learning_rates_over_the_range():
    """TPE draws its first 10 trials at random, and seed 0's four learning rates in [3e-4, 3e-3] all
    land in 1.05e-3-1.56e-3; `sampler: qmc` puts one in each quarter of the log range, in every cell."""
    import math

    spec = smoke(search={**SMOKE["search"], "sampler": "qmc", "trials_per_cell": 4,
                         "params": {"optim.lr": {"loguniform": [3e-4, 3e-3]}}})
    searcher = CellSearcher(spec, {"workers_per_trial": 1})
    configs = [searcher.suggest(f"t{i}") for i in range(8)]  # cells take turns: 4 each
    for cell in (0, 1):
        lrs = [c["params"]["optim.lr"] for c in configs if c["cell"] == cell]
        quarters = {int(4 * math.log(lr / 3e-4) / math.log(10)) for lr in lrs}
        assert quarters == {0, 1, 2, 3}, (cell, lrs)
