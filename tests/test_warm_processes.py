"""Warm trial processes (`resources.warm_processes`, study/experiment/ray_trial.py's preload): a process that
already ran a trial takes the next one, and that changes nothing but the time. One cell of the smoke
study (its 2 searched trials) run both ways gives the same metrics; the warm one ran its trials in one
process, the fresh one in 2;
every trial's start-up and step times are recorded (MLflow), and the study's share of wall time in
train and eval steps is on the parent run."""

from __future__ import annotations

import glob
import json
import os

import pandas as pd
import pytest
from test_study import mlflow_runs, run, write_spec

from trial.metrics import is_timing

pytestmark = pytest.mark.slow


def trial_pids(study: str) -> set[int]:
    """The processes Tune ran the trials in (Tune's `pid` in each trial's result.json)."""
    pids = set()
    for path in glob.glob(os.path.join(study, "tune", "cell*", "result.json")):
        with open(path) as f:
            pids |= {json.loads(line)["pid"] for line in f if line.strip()}
    return pids


def test_warm_processes_change_the_time_not_the_metrics(tmp_path):
    results, pids = {}, {}
    for warm in (True, False):
        spec = write_spec(tmp_path, **{"name": f"warm_{warm}".lower(), "resources/warm_processes": warm,
                                       "grid": {"task.params.train_length": [8]}, "base/sparsity": None})
        storage = tmp_path / "studies"
        out = run(["--space", str(spec), "--storage", str(storage)])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "time: " in out.stdout and "trial slot" in out.stdout
        study = storage / f"warm_{warm}".lower()
        results[warm] = pd.read_csv(study / "results.csv")
        pids[warm] = trial_pids(str(study))

        client, parents, children = mlflow_runs(storage / "mlflow.db", f"warm_{warm}".lower())
        assert 0 < parents[0].data.metrics["time/in_steps_share"] <= 1.05
        for c in children:
            m = c.data.metrics
            assert m["time/train_s"] > 0 and m["time/eval_s"] > 0
            assert 0 < m["startup/from_schedule_s"] < 900 and m["startup/total_s"] <= m["startup/from_schedule_s"]
            assert not any(k.endswith("_at") for k in m)  # wall-clock stamps are not metrics

    # fresh: one process per trial. Warm: Tune keeps a finished trial's actor for the next trial, so
    # one at a time (the smoke spec's resources) every trial runs in the first one's process
    assert len(results[True].trial_id.unique()) == 2
    assert len(pids[False]) == 2 and len(pids[True]) == 1
    cols = [c for c in results[True].columns if not is_timing(c) and c not in ("trial_id",)]
    key = ["cell", "search.optim.lr", "length", "k", "ids"]
    warm, cold = (results[w].sort_values(key).reset_index(drop=True)[cols] for w in (True, False))
    pd.testing.assert_frame_equal(warm, cold)


def test_a_trial_imports_deepspeed_without_mlflow_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner imports MLflow when installed (1.5 s of every trial process's start on 2
    cores); a trial never uses it, and a process that wants MLflow afterwards still gets it."""
    import subprocess
    import sys

    code = ("import sys; from trial.session import import_deepspeed; import_deepspeed(); "
            "assert 'mlflow' not in sys.modules, 'mlflow imported'; import mlflow; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
