"""A claim study end to end: `python study/run.py` judges its claims when it ends (the lines, report.json,
claims.csv and the MLflow parent run's tags), and `python -m study.claims` pools two studies of one
spec run on other seeds. Real Ray, DeepSpeed, MLflow; nothing mocked."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from test_study import ENV, ROOT, RUN, mlflow_runs

pytestmark = pytest.mark.slow

# sparse parity with one planted bit fits in 120 steps and extrapolates; with three it does not fit
SPEC = {
    "name": "claimed",
    "task": {"name": "sparse_parity", "params": {"min_length": 2, "train_length": 6}},
    "base": {"positional": {"encoding": "learned", "ids": "random_shift", "max_position": 24},
             "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
             "optim": {"steps": 120, "batch_size": 32, "warmup_steps": 10, "lr": 0.01},
             "eval": {"lengths": [6, 12], "samples_per_point": 64, "val_samples": 64, "every_steps": 60}},
    "grid": {"task.params.train_k": [1, 3]},
    "search": "none", "replicas": 2,
    "resources": {"workers_per_trial": 1, "cpus_per_worker": 1, "max_concurrent_trials": 2},
    "claims": [
        {"name": "one_bit_extrapolates", "source": "test", "cell": {"train_k": 1}, "at_least": 0.9, "times": 2},
        {"name": "three_bits_extrapolate", "source": "test", "cell": {"train_k": 3}, "at_least": 0.9, "times": 2},
    ],
}


def test_a_claim_study_judges_records_and_pools_its_claims(tmp_path):
    space = tmp_path / "claimed.yaml"
    space.write_text(yaml.safe_dump(SPEC))
    outs = []
    for storage, seed in ((tmp_path / "a", 0), (tmp_path / "b", 7)):
        out = subprocess.run([*RUN, "--space", str(space), "--storage", str(storage), "--set", f"seed={seed}"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        outs.append(out.stdout)
    lines = [line for line in outs[0].splitlines() if line.startswith("claim ")]
    assert lines[0].startswith("claim one_bit_extrapolates: holds ("), lines
    assert lines[1].startswith("claim three_bits_extrapolate: inconclusive (fewer than 2 runs fit"), lines
    assert "runs fit 0/2" in lines[1]

    folder = tmp_path / "a" / "claimed"
    report = json.loads((folder / "report.json").read_text())
    assert [(c["name"], c["verdict"]) for c in report["claims"]] == [
        ("one_bit_extrapolates", "holds"), ("three_bits_extrapolate", "inconclusive")]
    table = pd.read_csv(folder / "claims.csv")
    assert set(table[table.claim == "one_bit_extrapolates"].seed) == {0, 1}
    _, parents, _ = mlflow_runs(tmp_path / "a" / "mlflow.db", "claimed")
    tags = parents[0].data.tags
    assert tags["claim.one_bit_extrapolates"] == "holds" and tags["claim.three_bits_extrapolate"] == "inconclusive"
    assert tags["claim.one_bit_extrapolates.line"] == lines[0]

    pooled = subprocess.run([sys.executable, "-m", "study.claims", str(folder), str(tmp_path / "b" / "claimed"),
                             "--out", str(tmp_path / "pooled.csv")],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert pooled.returncode == 0, pooled.stdout + pooled.stderr
    assert "2 studies pooled, 8 trials, 4 seeds" in pooled.stdout
    assert "reached on 4/4 runs that fit; runs fit 4/4" in pooled.stdout
    pooled_table = pd.read_csv(tmp_path / "pooled.csv")
    assert set(pooled_table[pooled_table.claim == "one_bit_extrapolates"].seed) == {0, 1, 7, 8}

    # another setup is not another seed: refused, naming the field
    other = dict(SPEC, base={**SPEC["base"], "optim": {**SPEC["base"]["optim"], "steps": 60}})
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    out = subprocess.run([*RUN, "--space", str(tmp_path / "other.yaml"), "--storage", str(tmp_path / "c")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-m", "study.claims", str(folder), str(tmp_path / "c" / "claimed")],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "base.optim.steps" in refused.stderr, refused.stderr
