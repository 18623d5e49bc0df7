"""Studies on object storage: `--storage s3://...` end to end against a real S3 API on 127.0.0.1
(moto's server, tests/conftest.py), the way a cluster uses a bucket: Tune's and Train's state,
checkpoints, the report and MLflow's artifacts all in the bucket, resumable from there."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import sqlite3
import struct
import subprocess
import threading
import time

import pandas as pd
import pytest
from conftest import bucket_keys, start_s3_server
from test_study import (
    ENV,
    ROOT,
    RUN,
    cli_in_process,
    kill_when_finished,
    main_in_process,
    mlflow_runs,
    run,
    write_spec,
)

from trial import storage

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


def test_a_study_on_a_bucket_killed_and_resumed(s3, tmp_path, monkeypatch, capsys):
    """The driver and the local Ray it started SIGKILLed mid-study, two trials side by side, the study
    in a bucket; `--resume` ends it: the study's MLflow run kept, no trial run twice, none that had
    finished rerun, the Optuna search continued (a fresh one would repeat its suggestions) and each
    cell's replica run after it. What the study left is in the bucket (its report, Tune's state, the
    checkpoints, MLflow's artifacts) and nothing beside it locally; an analysis reads a trial's model
    from there; the same study again without --resume is refused, the record untouched. A study in a
    folder killed and resumed: P6 (tests/test_scale_benchmark.py, which counts the reruns) and
    tests/test_records.py's driver lock taken over."""
    spec = write_spec(tmp_path, **{"name": "resumable", "base/optim/steps": 120, "base/eval/every_steps": 40,
                                   "search/trials_per_cell": 3, "replicas": 2, "base/sparsity": None,
                                   "resources/max_concurrent_trials": 2})  # killed with trials side by side
    db = tmp_path / "ml.db"
    args = ["--space", str(spec), "--storage", "s3://studies/resume", "--mlflow-uri", f"sqlite:///{db}"]
    finished_before = kill_when_finished([*RUN, *args], db, env_of(s3), tmp_path)
    assert 2 <= len(finished_before) < 8, "the kill should land mid-study"
    _, parents, _ = mlflow_runs(db, "resumable")
    parent_before = parents[0].info.run_id

    out = run([*args, "--resume"], env=env_of(s3), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client, parents, children = mlflow_runs(db, "resumable")
    assert [p.info.run_id for p in parents] == [parent_before]  # the study's run is kept
    assert parents[0].info.status == "FINISHED"
    assert len(children) == 8 and all(c.info.status == "FINISHED" for c in children)  # no duplicates
    for run_id, end_time in finished_before.items():  # finished trials were not rerun
        assert client.get_run(run_id).info.end_time == end_time
    results = read_csv(s3, "resume/resumable/results.csv")
    trials = results.drop_duplicates("trial_id")
    assert len(trials) == 8 and (trials.groupby("task.params.train_length").trial_id.nunique() == 4).all()
    search, replicas = trials[trials.role == "search"], trials[trials.role == "replica"]
    assert search["search.optim.lr"].nunique() == 6, "a restored Optuna search continues; a fresh one would repeat"
    selected = read_csv(s3, "resume/resumable/selected.csv")
    for row in selected.itertuples():  # each cell's replica reruns its selected lr with the next seed
        rep = replicas[replicas.selected_from == row.trial_id]
        assert len(rep) == 1 and rep.seed.tolist() == [1] and row.seeds == 2
        assert rep["search.optim.lr"].iloc[0] == search[search.trial_id == row.trial_id]["search.optim.lr"].iloc[0]

    # what it left is in the bucket, and nothing local by mistake
    assert "\n  s3://studies/resume/resumable/results.csv\n" in out.stdout
    keys = bucket_keys(s3, "resume/")
    for name in ("results.csv", "summary.csv", "selected.csv", "accuracy_vs_length.png"):
        assert f"resume/resumable/{name}" in keys
    assert any(k.startswith("resume/resumable/tune/experiment_state") for k in keys)  # what --resume reads
    assert any("/checkpoint_" in k for k in keys)  # the trials' DeepSpeed checkpoints
    assert not (tmp_path / "resume").exists() and not (tmp_path / "s3:").exists()
    # MLflow: the store is local SQLite, the artifacts are in the same bucket
    exp = client.get_experiment_by_name("resumable")
    assert exp.artifact_location == "s3://studies/resume/mlartifacts/resumable"
    parent = parents[0].info.run_id
    assert {f"resume/mlartifacts/resumable/{parent}/artifacts/{n}" for n in ("results.csv", "summary.csv")} <= set(keys)
    for c in children:
        assert f"resume/mlartifacts/resumable/{c.info.run_id}/artifacts/eval/records.csv" in keys
        assert c.data.tags["checkpoint"].startswith("s3://studies/resume/resumable/tune/")

    # the analysis reads a trial's model from where it was stored (this process has the bucket's
    # endpoint and keys: the s3 fixture)
    from study import sparsity as sparsity_cli

    monkeypatch.chdir(tmp_path)
    code, _, err = cli_in_process(sparsity_cli.main, [
        "--mlflow-run", children[0].info.run_id, "--mlflow-uri", f"sqlite:///{db}", "--targets", "6", "--k-max", "3",
        "--out", str(tmp_path / "meter")], capsys)
    assert code == 0, err[-3000:]
    assert len(pd.read_csv(tmp_path / "meter" / "targets.csv")) == 6

    # the same study again without --resume: refused, the record in the bucket untouched
    before = s3["client"].head_object(Bucket="studies", Key="resume/resumable/results.csv")["ETag"]
    code, _, err = main_in_process(args, monkeypatch, capsys)
    assert code == 2 and "--resume" in err, err
    assert s3["client"].head_object(Bucket="studies", Key="resume/resumable/results.csv")["ETag"] == before


def test_a_resume_starts_from_the_last_complete_snapshot(s3, tmp_path):
    """A snapshot's state files are uploaded one by one; one cut half-way (the driver killed, the
    bucket gone) leaves some new and some old. `--resume` puts back the last snapshot known complete
    (study/experiment/snapshots.py): each file that differs, and no file of a later driver session."""
    from types import SimpleNamespace

    from study.experiment import snapshots

    tune_dir, session, later = "s3://studies/torn/tune", "2026-01-01_00-00-00", "2026-01-01_00-00-05"
    names = [f"{kind}-{session}.{ext}" for kind, ext in
             (("experiment_state", "json"), ("search_gen_state", "json"), ("searcher-state", "pkl"))]
    staged = tmp_path / "staged"
    staged.mkdir()
    for name in [*names, "tuner.pkl"]:
        (staged / name).write_bytes(f"complete {name}".encode())
    storage.upload_dir(str(staged), tune_dir)
    fs, inner = storage.resolve(tune_dir)
    controller = SimpleNamespace(experiment_state_file_name=names[0], _storage=SimpleNamespace(
        experiment_driver_staging_path=str(staged), experiment_fs_path=inner, storage_filesystem=fs))
    assert snapshots.mark_complete(controller, snapshots.StorageWatch())
    assert snapshots.restore_complete_snapshot(tune_dir) == []  # storage holds that snapshot: nothing to do
    assert snapshots.restore_complete_snapshot("s3://studies/none/tune") == []  # no record: nothing to restore either

    storage.write_atomic(f"{tune_dir}/{names[2]}", b"a newer searcher")  # the next upload, cut short
    storage.write_atomic(f"{tune_dir}/experiment_state-{later}.json", b"a later driver's")
    put_back = snapshots.restore_complete_snapshot(tune_dir)
    assert sorted(put_back) == [f"experiment_state-{later}.json", names[2]]
    for name in [*names, "tuner.pkl"]:
        assert storage.read_bytes(f"{tune_dir}/{name}") == f"complete {name}".encode()
    assert not storage.exists(f"{tune_dir}/experiment_state-{later}.json")


def test_unreachable_or_unauthorised_bucket_exits_2_before_any_trial(s3, tmp_path, monkeypatch, capsys):
    """Refused before Ray starts. The server that is gone is a real `python study/run.py` (the exit a
    shell sees); the other two are run.py's main in this process, whose environment (the s3 fixture's)
    holds the endpoint and keys, behind a tripwire in place of Ray and the study."""
    smoke = ["--space", str(ROOT / "search_spaces/smoke.yaml"), "--mlflow-uri", f"sqlite:///{tmp_path}/ml.db"]
    closed = start_s3_server()  # a server that is gone: nothing listens on its port any more
    closed[0].terminate()
    closed[0].wait()
    locked, locked_url = start_s3_server(enforce_auth=True)  # checks keys: ours are unknown to it
    monkeypatch.chdir(tmp_path)
    try:
        cases = [
            ("s3://no-such-bucket/x", {}, "bucket does not exist", False),
            ("s3://studies/x", {"AWS_ENDPOINT_URL": closed[1]}, "connect", True),
            ("s3://studies/x", {"AWS_ENDPOINT_URL": locked_url}, "INVALID_ACCESS_KEY_ID", False),
        ]
        for uri, env, why, as_process in cases:
            t0 = time.time()
            if as_process:
                out = run([*smoke, "--storage", uri], env={**env_of(s3), **env}, cwd=tmp_path, timeout=120)
                code, stdout, stderr = out.returncode, out.stdout, out.stderr
            else:
                with monkeypatch.context() as patch:
                    for k, v in env.items():
                        patch.setenv(k, v)
                    code, stdout, stderr = main_in_process([*smoke, "--storage", uri], patch, capsys)
            assert code == 2, stderr[-2000:]
            assert f"--storage: {uri}" in stderr and why in stderr, stderr[-2000:]
            assert "Traceback" not in stderr and time.time() - t0 < 60
            assert "ray:" not in stdout  # no Ray was started, no trial ran
    finally:
        locked.terminate()
        locked.wait()
    assert not (tmp_path / "ml.db").exists()  # nothing recorded


class Outage:
    """A TCP relay in front of the S3 server, standing for the network between the study and its
    bucket: `down()` cuts every open connection and refuses new ones (the bucket unreachable; what it
    holds is kept, as a real outage keeps it), `up()` serves again on the same address."""

    def __init__(self, target_url: str):
        host, _, port = target_url.rpartition("//")[2].partition(":")
        self.target = (host, int(port))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        if self.listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self.lock:
            listener, self.listener = self.listener, None
            conns, self.open = self.open, set()
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
            listener.close()
        for conn in conns:  # a reset, not a clean close: the request in flight fails
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    continue
                self.open |= {client, server}
            pumps = [threading.Thread(target=self._pump, args=(a, b), daemon=True)
                     for a, b in ((client, server), (server, client))]
            for p in pumps:
                p.start()
            threading.Thread(target=self._close_after, args=(pumps, client, server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _close_after(self, pumps: list[threading.Thread], *conns: socket.socket) -> None:
        for p in pumps:
            p.join()
        with self.lock:
            self.open -= set(conns)
        for conn in conns:
            conn.close()


def finished_trials(db) -> dict[str, int]:
    """{run id: end time} of the FINISHED child runs in an MLflow SQLite store, read while a study
    writes it."""
    try:
        with sqlite3.connect(db) as con:
            return dict(con.execute(
                "select run_uuid, end_time from runs r join tags t using (run_uuid) "
                "where t.key = 'mlflow.parentRunId' and r.status = 'FINISHED'").fetchall())
    except sqlite3.Error:
        return {}


def test_a_bucket_unreachable_mid_study_loses_nothing(s3, tmp_path):
    """The bucket stops answering twice, each time once a trial has finished (what it holds is kept, as
    in a real outage), in one study waiting STUDY_STORAGE_WAIT_S 45 s for it:
    - first it comes back: the S3 server frozen (SIGSTOP: connections hang) for 10 s, then connections
      refused for 15 s, then back. The trials and the driver wait for it and go on, no trial restarted
      (not shorter: at 5 and 10 s the outage was over before the driver met it, and only the trials
      waited);
    - then it stays down: every connection cut and refused for longer than the study waits. The study
      stops by itself, exit 1, naming the storage and --resume, and what had finished is kept.
    `--resume`, with the bucket back, ends the study (exit 0) and reruns no trial that had finished:
    one MLflow run and one row set of results.csv per trial."""
    import boto3

    moto, url = start_s3_server()  # its own: this test freezes it
    relay = Outage(url)  # the network between the study and the bucket
    try:
        bucket = {"client": boto3.client("s3", endpoint_url=url), "bucket": "studies"}
        bucket["client"].create_bucket(Bucket="studies")
        env = {**env_of(s3), "AWS_ENDPOINT_URL": relay.url, "STUDY_STORAGE_WAIT_S": "45"}
        name = "outage"
        spec = write_spec(tmp_path, **{"name": name, "base/optim/steps": 160, "base/eval/every_steps": 40,
                                       "base/sparsity": None})
        db = tmp_path / "ml.db"
        storage = "s3://studies/outages"
        args = ["--space", str(spec), "--storage", storage, "--mlflow-uri", f"sqlite:///{db}"]
        proc = subprocess.Popen([*RUN, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        # the driver's progress, read as it prints it (MLflow's record may lag it); each pipe has one reader
        lines: list[str] = []
        errors: list[str] = []
        readers = [threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True),
                   threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]
        for reader in readers:
            reader.start()

        def wait_for_trials(n: int) -> dict[str, int]:
            """Once the driver says the n-th trial finished: its finished MLflow runs."""
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None and sum("] finished " in x for x in lines) < n:
                time.sleep(0.2)
            assert proc.poll() is None, "the study ended before its outage"
            while time.time() < deadline and len(finished_trials(db)) < n:
                time.sleep(0.2)
            return finished_trials(db)

        try:
            wait_for_trials(1)
            os.kill(moto.pid, signal.SIGSTOP)  # it comes back
            time.sleep(10)
            relay.down()
            time.sleep(15)
            os.kill(moto.pid, signal.SIGCONT)
            relay.up()
            finished_before = wait_for_trials(2)  # the study went on; 2 of its 4 trials are left
            relay.down()  # it stays down
            try:  # bounded: the study ends by itself, or this fails
                proc.wait(timeout=400)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"no end within 400 s of the outage (a hang):\n{''.join(lines)[-3000:]}\n"
                            f"{''.join(errors)[-5000:]}")
        finally:
            os.kill(moto.pid, signal.SIGCONT)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for reader in readers:
            reader.join(timeout=30)
        out, err = "".join(lines), "".join(errors)
        # no trial failed for either (Ray logs a failed trial's traceback): a trial waits for the bucket
        assert "Traceback" not in err and "FAILED " not in out, out[-3000:] + err[-5000:]
        started = re.findall(r"\] started .*#(\w+)", out)
        assert len(started) == len(set(started)) >= 2, out[-3000:]  # no trial was restarted for the first
        assert proc.returncode == 1, out[-3000:] + err[-5000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: --storage: {storage}/{name}/tune did not answer"), err[-5000:]
        assert "--resume" in last and "Traceback" not in last
        assert {k: v for k, v in finished_trials(db).items() if k in finished_before} == finished_before
        relay.up()

        again = run([*args, "--resume"], env=env, cwd=tmp_path)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
        client, parents, children = mlflow_runs(db, name)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        trials = sorted((c.data.tags["tune.trial_id"], c.info.status) for c in children)
        assert len(children) == 4, (trials, again.stdout[-3000:], out[-3000:])  # none lost, none twice
        assert all(c.info.status == "FINISHED" for c in children)
        for run_id, end_time in finished_before.items():  # finished trials were not rerun
            assert client.get_run(run_id).info.end_time == end_time
        results = read_csv(bucket, f"outages/{name}/results.csv")
        assert results.trial_id.nunique() == 4 and len(results) == 4 * 3 * 2  # one row set per trial
    finally:
        relay.down()
        moto.terminate()
        moto.wait(timeout=30)
