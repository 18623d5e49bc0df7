"""The per-position analysis: a trial with a `per_position:` section reports, per evaluation point, the
lowest accuracy over answer positions and the first position whose query sees an id distance no
training sequence had, and keeps the table behind them."""

from __future__ import annotations

import numpy as np
import pytest

import analysis  # noqa: F401  (registers the analyses)
from analysis.per_position import id_span
from trial.config import TrialConfig
from trial.loop import train_loop_per_worker

CONFIG = {"task": {"name": "addition", "params": {"train_length": 3, "min_length": 1}},
          "positional": {"encoding": "learned", "ids": "coupled", "max_position": 16},
          "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
          "optim": {"steps": 4, "batch_size": 8, "warmup_steps": 1},
          "eval": {"lengths": [3, 6], "samples_per_point": 4, "val_samples": 4, "every_steps": 4},
          "per_position": {"samples": 8}}


def test_the_id_distance_a_query_sees_is_its_farthest_visible_key():
    ids = np.array([[0, 5, 1, 2]])
    assert id_span(ids, np.array([4])).tolist() == [[0, 5, 4, 3]]


def test_a_trial_reports_accuracy_per_position_and_where_unseen_distances_begin():
    out = train_loop_per_worker(CONFIG)
    m = out["metrics"]
    assert 0 <= m["per_position/worst_len3"] <= 1 and 0 <= m["per_position/worst_len6"] <= 1
    assert m["per_position/first_unseen_len3"] == -1  # the train length: every distance was trained
    assert m["per_position/first_unseen_len6"] >= 0  # twice it: some query sees farther than training did


def test_the_section_refuses_a_model_it_cannot_measure():
    with pytest.raises(ValueError, match=r"the analyses \(per_position\) measure decoders"):
        TrialConfig.model_validate({**CONFIG, "model": {**CONFIG["model"], "output": "encoder"}})
