"""Experiment snapshots on events (study/experiment/snapshots.py, which wraps a private Tune method): a real
Tune experiment on a real local Ray, storage in a folder and in a bucket (moto's S3 server).

At every snapshot the listener reads the experiment back from storage with Tune's public
`ExperimentAnalysis`, as a resume would: each trial it was told had completed must be TERMINATED
there, and each checkpoint a trial reported must be the one the stored state names. This fails if
Ray renames or reorders `TuneController.checkpoint`, or stops making a forced, waited snapshot
durable before returning."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_study import BIN, ENV, ROOT

PROBE = r'''
import json, os, sys, tempfile
import ray
from ray import tune
from ray.tune import Callback, ExperimentAnalysis

from study.experiment.snapshots import BACKSTOP_PERIOD_S, snapshots_on_events

os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = BACKSTOP_PERIOD_S
storage, out = sys.argv[1], sys.argv[2]
path = storage.rstrip("/") + "/probe"


def trainable(config):
    for step in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            open(os.path.join(tmp, "step"), "w").write(str(step))
            tune.report({"step": step, "score": config["x"] * step},
                        checkpoint=tune.Checkpoint.from_directory(tmp))


class Listener(Callback):
    def __init__(self):
        self.due, self.completed, self.checkpoints, self.snapshots, self.calls = False, set(), {}, [], 0

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        self.due = True
        self.checkpoints[trial.trial_id] = os.path.basename(checkpoint.path)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.due = True
        self.completed.add(trial.trial_id)

    def snapshot_due(self):
        self.calls += 1
        return self.due

    def on_snapshot(self):
        self.due = False
        stored = ExperimentAnalysis(path)
        self.snapshots.append({
            "completed": sorted(self.completed),
            "status": {t.trial_id: t.status for t in stored.trials},
            "expected_checkpoint": dict(self.checkpoints),
            "stored_checkpoint": {t.trial_id: os.path.basename(t.checkpoint.path) for t in stored.trials
                                  if t.checkpoint is not None},
        })


ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
listener = Listener()
tuner = tune.Tuner(
    trainable,
    param_space={"x": tune.grid_search([1, 2, 3])},
    tune_config=tune.TuneConfig(max_concurrent_trials=2),
    run_config=tune.RunConfig(name="probe", storage_path=storage, callbacks=[listener], verbose=0,
                              checkpoint_config=tune.CheckpointConfig(num_to_keep=2)),
)
with snapshots_on_events(listener):
    grid = tuner.fit()
json.dump({"snapshots": listener.snapshots, "steps": listener.calls, "errors": grid.num_errors}, open(out, "w"))
'''


@pytest.mark.parametrize("where", ["folder", "bucket"])
@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_snapshots_are_in_storage_when_the_listener_is_told(where, tmp_path, request):
    env = dict(ENV)
    if where == "bucket":
        s3 = request.getfixturevalue("s3")
        env.update(s3["env"])
        storage = "s3://studies/snapshots"
    else:
        storage = str(tmp_path / "studies")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "python"), str(script), storage, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0
    snapshots = result["snapshots"]
    # 3 trials x 3 checkpoints, then completion: at most one snapshot per event, and far fewer
    # than the controller's steps (each of which snapshotted with TUNE_GLOBAL_CHECKPOINT_S=0)
    assert 3 <= len(snapshots) <= 3 * 3 + 3 + 1 and len(snapshots) < result["steps"] / 3
    for snap in snapshots:  # what the listener was told is what a resume would read
        assert all(snap["status"].get(t) == "TERMINATED" for t in snap["completed"]), snap
        assert snap["stored_checkpoint"] == snap["expected_checkpoint"], snap
    last = snapshots[-1]
    assert len(last["completed"]) == 3 and set(last["status"].values()) == {"TERMINATED"}
