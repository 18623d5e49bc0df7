"""A trial config is validated once where it becomes whole, and travels typed from there.

The study's check validates each cell (at every search point) when the spec is loaded and keeps the
typed config of each cell: what the driver reads of a cell (ASHA's reports per trial) comes from
there, never from validating a trial config again. The Tune config carries a trial's config as the
record's dict; the Ray trial validates it once and hands the loop, and Ray Train's workers, the typed
config, which travels without its task's corpus."""

from __future__ import annotations

import json
import pickle

import pytest
from test_study import SMOKE

from study.experiment import ray_trial
from study.experiment.tuning import build_search
from study.spec.schema import StudySpec
from trial.config import TrialConfig, load_trial_config


def test_asha_reads_each_cells_reports_from_the_checked_config_without_validating_again(monkeypatch):
    raw = json.loads(json.dumps(SMOKE))
    raw["scheduler"] = {"type": "asha", "grace_period": 1, "reduction_factor": 2}
    raw["grid"] = {"optim.steps": [60, 100]}  # every_steps 20: 3 and 5 reports
    del raw["base"]["optim"]["steps"]
    spec = StudySpec.model_validate(raw)
    assert [spec.checked_config(c).optim.steps for c in spec.cells()] == [60, 100]

    def refused(*args, **kwargs):
        raise AssertionError("a trial config validated again in the driver")

    monkeypatch.setattr(TrialConfig, "model_validate", refused)
    searcher, scheduler = build_search(spec, {"workers_per_trial": 1})
    config = searcher.suggest("t0")  # the record's dict, as Tune keeps it
    assert isinstance(config["trial"], dict) and config["trial"]["optim"]["steps"] == 60
    assert scheduler.reports == {0: 3, 1: 5}


def test_a_ray_trial_validates_its_config_once_and_the_loop_gets_it_typed(monkeypatch):
    raw = json.loads(json.dumps(SMOKE))
    trial = StudySpec.model_validate(raw).trial_config(StudySpec.model_validate(raw).cells()[0],
                                                         {"optim.lr": 0.003}, 0)
    calls, handed = [], []
    validate = TrialConfig.model_validate

    def counted(data, *args, **kwargs):
        calls.append(data)
        return validate(data, *args, **kwargs)

    monkeypatch.setattr(TrialConfig, "model_validate", counted)
    monkeypatch.setattr(ray_trial, "train_loop_per_worker", lambda cfg, session: handed.append(cfg))
    ray_trial.run_trial({"trial": trial, "resources": {"workers_per_trial": 1}})
    assert len(calls) == 1 and len(handed) == 1
    assert isinstance(handed[0], TrialConfig) and handed[0].optim.lr == 0.003


def test_a_typed_config_travels_without_its_tasks_corpus():
    cfg = load_trial_config("search_spaces/trials/lm_stdlib.yaml")
    corpus = len(pickle.dumps(cfg.task_instance))
    sent = pickle.dumps(cfg)
    assert len(sent) < 10_000 < corpus  # the config, not the tokens of a corpus
    received = pickle.loads(sent)
    assert received == cfg and "task_instance" not in received.__dict__
    assert received.task_instance.vocab.tokens == cfg.task_instance.vocab.tokens  # loaded again where it is used


@pytest.mark.parametrize("path", ["search_spaces/trials/addition_abacus.yaml", "search_spaces/trials/sparse_parity.yaml"])
def test_a_typed_config_round_trips_through_pickle(path):
    cfg = load_trial_config(path)
    assert pickle.loads(pickle.dumps(cfg)).model_dump() == cfg.model_dump()
