"""A trial whose loss becomes NaN or infinite stops at that step with the step and value, is FAILED
in Tune and MLflow with that reason, is not retried (it would diverge again from its last checkpoint,
whatever resources.max_failures says; nor do Ray Train's retries nest inside Tune's), and its study
goes on and then exits non-zero listing it."""

from __future__ import annotations

import glob
import json

import pandas as pd
import pytest
from test_study import mlflow_runs, run, write_spec
from test_train import Recorder, config

from trial.loop import Diverged, train_loop_per_worker


def test_a_diverging_loss_stops_the_trial_at_that_step():
    rec = Recorder()
    with pytest.raises(Diverged, match=r"loss: (nan|inf|-inf) at step \d+") as err:
        train_loop_per_worker(config(optim={"lr": 1e30, "steps": 8, "warmup_steps": 0}), rec)
    step = int(err.value.args[0].split("at step ")[1].split()[0])
    assert 1 <= step < 8 and len(rec.reports) < 2  # at that step, not at the end


def tune_failures(study_dir) -> list[int]:
    """How many times Tune saw each trial fail (its experiment state, as a resume reads it)."""
    state = json.loads(open(sorted(glob.glob(f"{study_dir}/tune/experiment_state-*.json"))[-1]).read())
    return sorted(json.loads(metadata)["num_failures"] for _, metadata in state["trial_data"])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_study_with_a_diverging_trial_goes_on_and_exits_non_zero(tmp_path, workers):
    """1 worker: a healthy cell besides, which the study runs to the end. 2 workers (a Ray Train run
    per trial, whose own retries must not nest inside Tune's): the diverging cell alone, since a
    healthy 2-worker trial is tests/test_study.py's test_two_worker_zero2_trial (and costs a Ray
    Train run of ~15 s on 2 cores)."""
    lrs = [0.003, 1e30] if workers == 1 else [1e30]
    spec = write_spec(tmp_path, **{
        "name": "diverging", "search": "none", "grid": {"optim.lr": lrs},
        "task/params/train_length": 8, "base/optim/steps": 20, "base/optim/warmup_steps": 0,
        "base/eval/every_steps": 10, "resources/max_failures": 2, "resources/workers_per_trial": workers,
        "resources/max_concurrent_trials": 1,
    })
    storage = tmp_path / "studies"
    out = run(["--space", str(spec), "--storage", str(storage)])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    failed = out.stderr[out.stderr.index("error: 1 trial(s) failed:"):]
    assert "(cell lr=1e+30)" in failed and "at step" in failed, failed
    assert "cell lr=1e+30: no trial finished" in failed
    results = pd.read_csv(storage / "diverging" / "results.csv")
    done = results[results.status == "TERMINATED"]
    assert set(done["optim.lr"]) == set(lrs) - {1e30}
    if workers == 1:
        assert done.length.notna().all()  # the healthy cell ran to the end
    bad = results[results.status == "ERROR"]  # the failed trial is accounted for: one row, no test grid
    assert len(bad) == 1 and bad["optim.lr"].iloc[0] == 1e30
    assert "length" not in bad or bad.length.isna().all()  # no column at all where no trial reported a grid
    # failed once, not retried (max_failures 2); the healthy trial never failed
    assert tune_failures(storage / "diverging") == ([0, 1] if workers == 1 else [1])

    _, parents, children = mlflow_runs(storage / "mlflow.db", "diverging")
    assert parents[0].info.status == "FAILED"
    status = {c.data.tags["cell"]: c for c in children}
    assert set(status) == {f"lr={lr:g}" for lr in lrs}
    if workers == 1:
        assert status["lr=0.003"].info.status == "FINISHED"
    bad = status["lr=1e+30"]
    assert bad.info.status == "FAILED" and "at step" in bad.data.tags["error"], bad.data.tags
