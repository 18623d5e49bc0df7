"""Warm trial processes (`resources.warm_processes`, study/experiment/ray_trial.py's preload): a process that
already ran a trial takes the next one, and that changes nothing but the time. A cell of the smoke study
run with a fresh process per trial gives the metrics the smoke study recorded; the warm study of
tests/test_report.py ran its trials in one process, and recorded every trial's start-up and step
times (MLflow) and the study's share of wall time in train and eval steps."""

from __future__ import annotations

import glob
import json
import os

import pandas as pd
import pytest
from test_study import ROOT, assert_same_results, run, write_spec

pytestmark = pytest.mark.slow


def trial_pids(study: str) -> set[int]:
    """The processes Tune ran the trials in (Tune's `pid` in each trial's result.json)."""
    pids = set()
    for path in glob.glob(os.path.join(study, "tune", "cell*", "result.json")):
        with open(path) as f:
            pids |= {json.loads(line)["pid"] for line in f if line.strip()}
    return pids


def test_fresh_processes_change_the_time_not_the_metrics(tmp_path):
    """A fresh process per trial gives the metrics the smoke study recorded (tests/data), which the
    smoke study end to end (tests/test_study.py) holds its warm processes to; that the warm ones ran
    their trials in one process, and the timing metrics, are checked on tests/test_report.py's study."""
    spec = write_spec(tmp_path, **{"name": "fresh", "resources/warm_processes": False,
                                   "grid": {"task.params.train_length": [8]}})
    storage = tmp_path / "studies"
    out = run(["--space", str(spec), "--storage", str(storage)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = pd.read_csv(storage / "fresh" / "results.csv")
    assert results.trial_id.nunique() == 2 and len(trial_pids(str(storage / "fresh"))) == 2  # one process each
    recorded = pd.read_csv(ROOT / "tests" / "data" / "smoke_results_before_redesign.csv")
    assert_same_results(results, recorded[recorded["task.params.train_length"] == 8])


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
