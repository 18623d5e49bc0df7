"""Studies on object storage: `--storage s3://...` end to end against a real S3 API on 127.0.0.1
(moto's server, tests/conftest.py), the way a cluster uses a bucket: Tune's and Train's state,
checkpoints, the report and MLflow's artifacts all in the bucket, resumable from there."""

from __future__ import annotations

import io
import subprocess
import time

import pandas as pd
import pytest
from conftest import bucket_keys, start_s3_server
from test_study import BIN, ENV, ROOT, RUN, kill_when_finished, mlflow_runs, run, write_spec

from study import storage

pytestmark = pytest.mark.slow


def env_of(s3: dict) -> dict:
    return {**ENV, **s3["env"]}


def read_csv(s3: dict, key: str) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read()))


def test_storage_helpers_on_a_bucket(s3, tmp_path):
    base = "s3://studies/helpers/"
    assert storage.is_uri(base) and storage.absolute(base) == "s3://studies/helpers"
    assert storage.join("s3://studies/helpers", "a", "b.csv") == "s3://studies/helpers/a/b.csv"
    storage.check_writable(base)
    assert not any(".write-probe" in k for k in bucket_keys(s3, "helpers/"))  # the probe is gone
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "x.txt").write_text("hello")
    storage.upload_dir(str(tmp_path / "up"), "s3://studies/helpers/dir")
    assert storage.exists("s3://studies/helpers/dir/x.txt") and not storage.exists("s3://studies/helpers/none")
    down = storage.download_dir("s3://studies/helpers/dir", str(tmp_path / "down"))
    assert (tmp_path / "down" / "x.txt").read_text() == "hello" and down == str(tmp_path / "down")
    fs, path = storage.resolve("s3://studies/helpers/dir")
    assert storage.uri_of(fs, path) == "s3://studies/helpers/dir"
    with pytest.raises(storage.StorageError, match="s3://no-such-bucket/x"):
        storage.check_writable("s3://no-such-bucket/x")


def test_smoke_study_on_a_bucket(s3, tmp_path):
    db = tmp_path / "ml.db"
    uri = "s3://studies/team"
    out = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", uri, "--mlflow-uri", f"sqlite:///{db}"],
              env=env_of(s3), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "\n  s3://studies/team/smoke/results.csv\n" in out.stdout
    keys = bucket_keys(s3, "team/")
    for name in ("results.csv", "summary.csv", "accuracy_vs_length.png", "sparsity_vs_extrapolation.png"):
        assert f"team/smoke/{name}" in keys
    assert any(k.startswith("team/smoke/tune/experiment_state") for k in keys)  # what --resume reads
    assert any("/checkpoint_" in k for k in keys)  # the trials' DeepSpeed checkpoints
    results = read_csv(s3, "team/smoke/results.csv")
    assert results.trial_id.nunique() == 4 and len(results) == 4 * 3 * 2
    assert not (tmp_path / "team").exists() and not (tmp_path / "s3:").exists()  # nothing local by mistake

    # MLflow: the store is local SQLite, the artifacts are in the same bucket
    client, parents, children = mlflow_runs(db, "smoke")
    exp = client.get_experiment_by_name("smoke")
    assert exp.artifact_location == "s3://studies/team/mlartifacts/smoke"
    parent = parents[0].info.run_id
    assert {f"team/mlartifacts/smoke/{parent}/artifacts/{n}" for n in ("results.csv", "summary.csv")} <= set(keys)
    assert len(children) == 4
    for c in children:
        assert f"team/mlartifacts/smoke/{c.info.run_id}/artifacts/eval/records.csv" in keys
        assert c.data.tags["checkpoint"].startswith("s3://studies/team/smoke/tune/")

    # the analysis reads a trial's model from where it was stored
    meter = subprocess.run([str(BIN / "python"), "-m", "study.sparsity", "--mlflow-run", children[0].info.run_id,
                            "--mlflow-uri", f"sqlite:///{db}", "--targets", "6", "--k-max", "3",
                            "--out", str(tmp_path / "meter")], cwd=ROOT, env=env_of(s3), capture_output=True,
                           text=True, timeout=300)
    assert meter.returncode == 0, meter.stderr[-3000:]
    assert len(pd.read_csv(tmp_path / "meter" / "targets.csv")) == 6

    # the same study again without --resume: refused, the record in the bucket untouched
    before = s3["client"].head_object(Bucket="studies", Key="team/smoke/results.csv")["ETag"]
    again = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", uri, "--mlflow-uri",
                 f"sqlite:///{db}"], env=env_of(s3), cwd=tmp_path, timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr
    assert s3["client"].head_object(Bucket="studies", Key="team/smoke/results.csv")["ETag"] == before


def test_resume_from_a_bucket_after_the_driver_is_killed(s3, tmp_path):
    spec = write_spec(tmp_path, **{"name": "resumable_s3", "base/optim/steps": 240, "base/eval/every_steps": 40,
                                   "search/trials_per_cell": 3, "base/sparsity": None})
    db = tmp_path / "ml.db"
    args = ["--space", str(spec), "--storage", "s3://studies/resume", "--mlflow-uri", f"sqlite:///{db}"]
    finished_before = kill_when_finished([*RUN, *args], db, env_of(s3), tmp_path)
    assert 2 <= len(finished_before) < 6, "the kill should land mid-study"

    out = run([*args, "--resume"], env=env_of(s3), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client, parents, children = mlflow_runs(db, "resumable_s3")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 6 and all(c.info.status == "FINISHED" for c in children)  # no duplicates
    for run_id, end_time in finished_before.items():  # finished trials were not rerun
        assert client.get_run(run_id).info.end_time == end_time
    results = read_csv(s3, "resume/resumable_s3/results.csv")
    assert results.trial_id.nunique() == 6 and results.drop_duplicates("trial_id")["search.optim.lr"].nunique() == 6


def test_unreachable_or_unauthorised_bucket_exits_2_before_any_trial(s3, tmp_path):
    smoke = ["--space", str(ROOT / "search_spaces/smoke.yaml"), "--mlflow-uri", f"sqlite:///{tmp_path}/ml.db"]
    closed = start_s3_server()  # a server that is gone: nothing listens on its port any more
    closed[0].terminate()
    closed[0].wait()
    locked, locked_url = start_s3_server(enforce_auth=True)  # checks keys: ours are unknown to it
    try:
        cases = [
            ("s3://no-such-bucket/x", {}, "bucket does not exist"),
            ("s3://studies/x", {"AWS_ENDPOINT_URL": closed[1]}, "connect"),
            ("s3://studies/x", {"AWS_ENDPOINT_URL": locked_url}, "INVALID_ACCESS_KEY_ID"),
        ]
        for uri, env, why in cases:
            t0 = time.time()
            out = run([*smoke, "--storage", uri], env={**env_of(s3), **env}, cwd=tmp_path, timeout=120)
            assert out.returncode == 2, out.stderr[-2000:]
            assert f"--storage: {uri}" in out.stderr and why in out.stderr, out.stderr[-2000:]
            assert "Traceback" not in out.stderr and time.time() - t0 < 60
            assert "ray:" not in out.stdout  # no Ray was started, no trial ran
    finally:
        locked.terminate()
        locked.wait()
    assert not (tmp_path / "ml.db").exists()  # nothing recorded
