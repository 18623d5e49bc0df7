"""Trials side by side on one GPU (gpu/trials.py), rehearsed on this CPU: each trial's
plan, files and exact match come back, a trial past the deadline is stopped and named, and a bad
trial is refused before anything trains."""

import json
from pathlib import Path

import pytest

from gpu import trials as device_trials

ROOT = Path(__file__).resolve().parents[1]
ABACUS = "search_spaces/trials/addition_abacus.yaml"
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "eval.lengths=[3,6]",
        "task.params.train_length=3"]


@pytest.mark.slow  # two trial processes trained side by side: the whole suite's
def test_two_trials_side_by_side_each_keep_their_plan_records_and_trajectory(tmp_path):
    shift = "positional={encoding: learned, ids: random_shift, max_position: 64}"
    report = device_trials.run([["abacus", ABACUS, *TINY], ["shift", ABACUS, *TINY, shift]],
                               tmp_path, deadline_s=400, shrink=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trials.json", "trials_eval.csv", "trials_progress.csv"]
    assert report["versions"]["device"] == "cpu"
    for name in ("abacus", "shift"):
        trial = report["trials"][name]
        assert trial["exit"] == 0
        assert trial["plan"]["steps"] == trial["plan"]["full_steps"] == 20  # the shrunk budget fits
        assert set(trial["exact"]) == {"3", "6"}  # exact match at each test length
    progress = (tmp_path / "trials_progress.csv").read_text().splitlines()
    assert len(progress) == 1 + 2 * 2  # a header, then a report every 10 of 20 steps, per trial
    assert json.loads((tmp_path / "trials.json").read_text())["trials"]["shift"]["exit"] == 0


def test_a_trial_past_the_deadline_is_stopped_and_named(tmp_path):
    report = device_trials.run([["late", ABACUS, *TINY]], tmp_path, deadline_s=1, shrink=True)
    assert report["trials"]["late"] == {"exit": "stopped at the deadline"}


def test_a_bad_trial_is_refused_naming_it_before_anything_trains(tmp_path, capsys):
    code = device_trials.main(["--out", str(tmp_path / "out"), "--trial", "ok", ABACUS,
                               "--trial", "bad", ABACUS, "optim.lr=-1"])
    err = capsys.readouterr().err
    assert code == 2 and "--trial bad" in err and "optim.lr" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plan", sorted((ROOT / "search_spaces" / "device").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_plan_holds_trials_that_validate(plan):
    trials = device_trials.plan_trials(str(plan))
    assert trials and len({t[0] for t in trials}) == len(trials)
    for _name, config, *sets in trials:
        cfg = device_trials.trial_config(str(ROOT / config), sets, shrink=False)
        assert cfg["deepspeed"]["compile"] is False  # eager unless a trial says otherwise: its steps are timed


def test_a_plan_with_a_trial_lacking_its_config_is_refused_naming_the_trial(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"trials:\n  ok: {{config: {ABACUS}}}\n  broken: {{set: [seed=1]}}\n")
    code = device_trials.main(["--out", str(tmp_path / "out"), "--plan", str(plan)])
    err = capsys.readouterr().err
    assert code == 2 and "trials.broken" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
