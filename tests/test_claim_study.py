"""A claim study end to end: `python study/run.py` judges its claims when it ends (the lines, report.json,
claims.csv and the MLflow parent run's tags), and `python -m study.claims` pools it with a study of the
spec on another seed. Real Ray, DeepSpeed, MLflow; nothing mocked."""

from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest
import yaml
from test_study import ENV, ROOT, RUN, cli_in_process, mlflow_runs

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


def test_a_claim_study_judges_records_and_pools_its_claims(tmp_path, capsys):
    from study import claims as claims_cli

    space = tmp_path / "claimed.yaml"
    space.write_text(yaml.safe_dump(SPEC))
    out = subprocess.run([*RUN, "--space", str(space), "--storage", str(tmp_path / "a"), "--set", "seed=0"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("claim ")]
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

    # a second study of the spec on one other seed (replicas may differ between the studies pooled),
    # reported as `python -m study.report` writes a report (what such a study stores, bar the figures):
    # study a's seed-0 trials, as seed 7's
    from study.results.tables import report_from_results
    from study.spec.schema import StudySpec

    results = pd.read_csv(folder / "results.csv")
    seed7 = results[results.seed == 0].assign(seed=7, trial_id=lambda r: "b" + r.trial_id.astype(str))
    report_from_results(StudySpec.model_validate(dict(SPEC, seed=7, replicas=1)), seed7,
                        str(tmp_path / "b" / "claimed"))

    # `python -m study.claims` as its main in this process
    code, pooled, err = cli_in_process(claims_cli.main, [str(folder), str(tmp_path / "b" / "claimed"),
                                                         "--out", str(tmp_path / "pooled.csv")], capsys)
    assert code == 0, pooled + err
    assert "2 studies pooled, 6 trials, 3 seeds" in pooled
    assert "reached on 3/3 runs that fit; runs fit 3/3" in pooled
    pooled_table = pd.read_csv(tmp_path / "pooled.csv")
    assert set(pooled_table[pooled_table.claim == "one_bit_extrapolates"].seed) == {0, 1, 7}

    # another setup is not another seed: refused, naming the field. Its record is study b's rows
    # reported under a spec of 60 steps, as `python -m study.report` writes a report (what a study of
    # that spec would store, bar the figures)
    other = StudySpec.model_validate(dict(SPEC, base={**SPEC["base"], "optim": {**SPEC["base"]["optim"], "steps": 60}},
                                          seed=7, replicas=1))
    report_from_results(other, pd.read_csv(tmp_path / "b" / "claimed" / "results.csv"), str(tmp_path / "c"))
    code, _, err = cli_in_process(claims_cli.main, [str(folder), str(tmp_path / "c")], capsys)
    assert code == 2 and "base.optim.steps" in err, err
