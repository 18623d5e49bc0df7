"""A trial whose loss becomes NaN or infinite stops at that step with the step and value, is FAILED
in Tune and MLflow with that reason, is not retried (it would diverge again from its last checkpoint,
whatever resources.max_failures says; nor do Ray Train's retries nest inside Tune's), and its study
goes on and then exits non-zero listing it. The 1-worker study that shows it is the first of
tests/test_records.py's two studies of one name; the 2-worker one is here."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pandas as pd
import pytest
from test_study import is_loopback, mlflow_runs, run_sampling_listeners, write_spec
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


def assert_went_on_past_the_diverging_trial(stderr: str, study_dir: Path, lrs: list[float]) -> pd.DataFrame:
    """The trial at lr 1e30 failed once, unretried (max_failures 2), and is accounted for; the others
    ran to the end; the study's record is FAILED. Returns the healthy trials' results."""
    failed = stderr[stderr.index("error: 1 trial(s) failed:"):]
    assert "(cell lr=1e+30)" in failed and "at step" in failed, failed
    assert "cell lr=1e+30: no trial finished" in failed
    results = pd.read_csv(study_dir / "results.csv")
    done = results[results.status == "TERMINATED"]
    assert set(done["optim.lr"]) == set(lrs) - {1e30}
    assert done.length.notna().all()  # the healthy cell ran to the end
    bad = results[results.status == "ERROR"]  # the failed trial is accounted for: one row, no test grid
    assert len(bad) == 1 and bad["optim.lr"].iloc[0] == 1e30 and bad.length.isna().all()
    assert tune_failures(study_dir) == [0, 1]  # failed once, not retried; the healthy trial never failed

    _, parents, children = mlflow_runs(study_dir.parent / "mlflow.db", study_dir.name)
    assert parents[0].info.status == "FAILED"
    status = {c.data.tags["cell"]: c for c in children}
    assert set(status) == {f"lr={lr:g}" for lr in lrs}
    assert status["lr=0.003"].info.status == "FINISHED"
    bad = status["lr=1e+30"]
    assert bad.info.status == "FAILED" and "at step" in bad.data.tags["error"], bad.data.tags
    return done


@pytest.mark.slow
def test_a_two_worker_zero2_study_goes_on_past_a_diverging_trial(tmp_path):
    """Trials of 2 workers (a Ray Train run each, whose own retries must not nest inside Tune's) under
    ZeRO-2: the healthy trial's validation sums both workers' halves, each checkpoint it keeps holds
    both ranks' optimizer shards, and its process group listens on 127.0.0.1 only; the diverging one
    fails as a 1-worker trial does."""
    lrs = [0.003, 1e30]
    spec = write_spec(tmp_path, **{
        "name": "zero2", "search": "none", "grid": {"optim.lr": lrs}, "task/params/train_length": 8,
        "base/optim/steps": 40, "resources": {"workers_per_trial": 2, "cpus_per_worker": 1, "zero_stage": 2,
                                              "max_failures": 2, "max_concurrent_trials": 1},
    })
    storage = tmp_path / "studies"
    seen = run_sampling_listeners(spec, storage, tmp_path / "out", code=1)
    done = assert_went_on_past_the_diverging_trial((tmp_path / "out").read_text(), storage / "zero2", lrs)
    assert done.trial_id.nunique() == 1 and len(done) == 6
    assert (done.n == 32).all()  # both workers' halves summed
    healthy = done.trial_id.iloc[0]
    shards = sorted(p.name for p in (storage / "zero2" / "train").rglob("zero_pp_rank_*_optim_states.pt")
                    if healthy in str(p))
    # each of the two kept checkpoints (num_to_keep=2, study/experiment/tuning.py) holds both ranks' shards
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"] * 2 + ["zero_pp_rank_1_mp_rank_00_optim_states.pt"] * 2
    # local means local: the workers' gloo group and rank 0's TCPStore (study/ray_compat.py's
    # loopback_torch_config) listen on 127.0.0.1
    workers = {(ip, port) for label, ip, port in seen if "RayTrainWorker" in label}
    assert workers and any(is_loopback(ip) for ip, _ in workers), "sampled while the workers trained"
    exposed = {(label, ip, port) for label, ip, port in seen if not is_loopback(ip)}
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"
