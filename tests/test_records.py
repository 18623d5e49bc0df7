"""Nothing recorded is lost or mixed: a study's identity in MLflow, a resume held to the
stored spec, ASHA that accounts for every trial, failed trials not rerun, one driver per study,
reports written whole. Real `python study/run.py` processes, real Ray, MLflow (SQLite) and Optuna."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_study import (
    BIN,
    ENV,
    MLFLOW_SERVER_ENV,
    ROOT,
    RUN,
    cli_in_process,
    main_in_process,
    mlflow_runs,
    run,
    write_spec,
)

pytestmark = pytest.mark.slow


def record_of(db: Path, experiment: str) -> dict:
    """Everything MLflow holds of an experiment's runs: ids, statuses, tags,
    params, metric histories and every artifact's bytes, to compare before and after."""
    client, parents, children = mlflow_runs(db, experiment)
    out = {}
    for r in [*parents, *children]:
        rid = r.info.run_id
        arts = {}
        stack = [None]
        while stack:
            for f in client.list_artifacts(rid, stack.pop()):
                if f.is_dir:
                    stack.append(f.path)
                else:
                    arts[f.path] = Path(client.download_artifacts(rid, f.path)).read_bytes()
        history = {k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k)) for k in r.data.metrics}
        out[rid] = {"status": r.info.status, "end_time": r.info.end_time, "tags": r.data.tags,
                    "params": r.data.params, "metrics": history, "artifacts": arts, "deleted": r.info.lifecycle_stage}
    return out


LRS = [0.003, 1e30]


def diverging_spec(tmp_path: Path, name: str = "records") -> Path:
    """Two cells, one of which diverges: a FAILED child run, which a second study must not delete, and
    which is not retried though resources.max_failures would allow it (tests/test_divergence.py)."""
    return write_spec(tmp_path, **{
        "name": name, "search": "none", "grid": {"optim.lr": LRS},
        "task/params/train_length": 8, "base/optim/steps": 20, "base/optim/warmup_steps": 0,
        "base/eval/every_steps": 10, "base/sparsity": None, "resources/max_failures": 2,
    })


def test_two_studies_of_one_name_never_touch_each_others_record_and_reports_are_whole(tmp_path, monkeypatch,
                                                                                       capsys):
    """Three studies of one name in one MLflow store: the first and third in one storage under a quote,
    in its default store (MLflow's filter strings take a literal's text between its quotes as it is: a
    quote in the study's location once ended a study, and its resume, in a traceback), the second in
    another storage. The first is resumed: it holds to its stored spec and reruns no failed trial.
    The first is also the 1-worker study that goes on past a diverging trial (tests/test_divergence.py)."""
    from test_divergence import assert_went_on_past_the_diverging_trial

    from study import report as report_cli

    spec = diverging_spec(tmp_path)
    a, b = tmp_path / "o'neil" / "studies", tmp_path / "b"
    db = a / "mlflow.db"
    uri = f"sqlite:///{db}"
    first = run(["--space", str(spec), "--storage", str(a)])  # the default store, under the quote
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # the diverging cell
    assert_went_on_past_the_diverging_trial(first.stderr, a / "records", LRS)
    stored = json.loads((a / "records" / "study.json").read_text())
    client, parents, children = mlflow_runs(db, "records")
    assert len(parents) == 1 and parents[0].data.tags["study.id"] == stored["id"]
    assert parents[0].data.tags["study.location"] == str(a / "records")
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED"]
    for r in [*parents, *children]:
        assert r.info.artifact_uri.startswith(str(a / "mlartifacts")), r.info.artifact_uri
    assert client.list_artifacts(parents[0].info.run_id)  # results.csv and the rest
    # a resume holds to the stored spec: a change to what the trials are is refused, before Ray starts
    record, results = record_of(db, "records"), (a / "records" / "results.csv").read_bytes()
    raw = yaml.safe_load(spec.read_text())
    for change, field in (({"grid": {"optim.lr": [0.003, 0.01]}}, "grid.optim.lr"),
                          ({"objective": {"metric": "val_loss", "mode": "min"}}, "objective.metric"),
                          ({"base": {**raw["base"], "optim": {**raw["base"]["optim"], "steps": 30}}},
                           "base.optim.steps")):
        changed = tmp_path / "changed.yaml"
        changed.write_text(yaml.safe_dump({**raw, **change}))
        # run.py's main in this process, a tripwire in place of Ray and the study
        code, out, err = main_in_process(["--space", str(changed), "--storage", str(a), "--resume"],
                                         monkeypatch, capsys)
        assert code == 2 and field in err, err[-3000:]
        assert "ray:" not in out  # refused before Ray started
    assert record_of(db, "records") == record

    # what a resume may change is how the rest runs; under the quote it finds its own study's run
    # again, and the diverged trial is not run again
    resumed_spec = tmp_path / "resumed.yaml"
    resumed_spec.write_text(yaml.safe_dump({**raw, "description": "now described", "resources": {
        **raw["resources"], "max_concurrent_trials": 1, "max_failures": 3}}))
    again = run(["--space", str(resumed_spec), "--storage", str(a), "--resume"])
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "started " not in again.stdout  # no trial ran again
    _, resumed, children = mlflow_runs(db, "records")
    assert [p.info.run_id for p in resumed] == [parents[0].info.run_id] and len(children) == 2
    before = record_of(db, "records")
    kids = {rid: r for rid, r in before.items() if "mlflow.parentRunId" in r["tags"]}
    assert set(before) == set(record) and sorted(r["status"] for r in kids.values()) == ["FAILED", "FINISHED"]
    assert {rid: (r["metrics"], r["params"]) for rid, r in kids.items()} == \
        {rid: (r["metrics"], r["params"]) for rid, r in record.items() if rid in kids}
    pd.testing.assert_frame_equal(pd.read_csv(a / "records" / "results.csv"),
                                  pd.read_csv(pd.io.common.BytesIO(results)))

    # the same spec in another storage, one MLflow store: a second study beside the first, in an
    # experiment of its own whose artifacts are under its own storage
    second = run(["--space", str(spec), "--storage", str(b), "--mlflow-uri", uri])
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    elsewhere = f"records @ {b / 'mlartifacts' / 'records'}"
    assert f"this study records to experiment {elsewhere!r}" in second.stdout, second.stdout[-3000:]
    # and the first study's folder deleted and made again: a third, beside the first
    shutil.rmtree(a / "records")
    third = run(["--space", str(spec), "--storage", str(a), "--mlflow-uri", uri])
    assert third.returncode == 1, third.stdout[-3000:] + third.stderr[-3000:]
    assert "already holds another study of this name" in third.stdout

    _, parents, children = mlflow_runs(db, "records")
    _, b_parents, b_children = mlflow_runs(db, elsewhere)
    assert len(parents) == 2 and len(b_parents) == 1
    assert len({p.data.tags["study.id"] for p in [*parents, *b_parents]}) == 3
    assert len(children) == 4 and len(b_children) == 2
    assert all(r.info.artifact_uri.startswith(str(b / "mlartifacts")) for r in [*b_parents, *b_children])
    assert json.loads((b / "records" / "study.json").read_text())["location"] == str(b / "records")
    after = record_of(db, "records")
    assert {rid: after[rid] for rid in before} == before  # byte for byte, tags and artifacts too

    # python -m study.report by experiment name takes the newest study and says which
    code, rep, err = cli_in_process(report_cli.main, ["records", "--mlflow-uri", uri, "--out", str(tmp_path / "rep")],
                                    capsys)
    assert code == 0, err[-3000:]
    newest = json.loads((a / "records" / "study.json").read_text())["location"]
    assert newest == str(a / "records") and newest in rep and "3 studies of this name" in rep, rep

    # a report is written whole, its marker last: results.csv cut short (what a crash mid-write left
    # before) no longer matches report.json, and `python -m study.report` refuses it
    folder = b / "records"
    marker = json.loads((folder / "report.json").read_text())
    assert {"results.csv", "selected.csv", "summary.csv", "study_spec.json"} <= set(marker["files"])
    assert not [p for p in folder.iterdir() if p.name.startswith(".report-") or ".tmp-" in p.name]
    report = [str(folder), "--out", str(tmp_path / "rep2")]
    code, _, err = cli_in_process(report_cli.main, report, capsys)
    assert code == 0, err[-3000:]
    data = (folder / "results.csv").read_bytes()
    (folder / "results.csv").write_bytes(data[: len(data) // 2])
    code, _, err = cli_in_process(report_cli.main, report, capsys)  # an exception would fail this test
    assert code != 0 and "results.csv" in err and "interrupted" in err, err[-3000:]


def test_asha_runs_accounts_for_every_trial_and_selects_a_finished_one(tmp_path):
    """Its storage is a path with every character a shell, a URI or SQL quotes: the study runs to the
    end there and writes nothing beside it."""
    spec = write_spec(tmp_path, **{
        "name": "asha", "scheduler": {"type": "asha", "grace_period": 1, "reduction_factor": 2},
        "grid": {"task.params.train_length": [8]},
        "base/optim/steps": 70,  # not a multiple of eval.every_steps 20: 4 reports, the last at 70
        "base/sparsity": None, "search/trials_per_cell": 4, "replicas": 2,
        "search/params": {"optim.lr": {"loguniform": [1e-5, 1e-2]}},
        "objective": {"metric": "val_loss", "mode": "min"}, "resources/max_concurrent_trials": 1,
    })
    outer = tmp_path / "outer"
    storage = outer / "a#b'c\"d\\e;f g é"
    out = run(["--space", str(spec), "--storage", str(storage)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tree = sorted(str(p.relative_to(outer)) for p in outer.rglob("*"))
    assert tree[0] == storage.name and all(p.startswith(storage.name) for p in tree)  # nothing beside it
    assert (storage / "mlflow.db").is_file() and any((storage / "mlartifacts" / "asha").rglob("study_spec.json"))
    results = pd.read_csv(storage / "asha" / "results.csv")
    trials = results.drop_duplicates("trial_id")
    assert len(trials) == 4 + 1  # every trial, stopped ones too
    stopped = trials[trials.status == "STOPPED"]
    assert len(stopped) >= 1 and stopped.length.isna().all() and (stopped.role == "search").all()
    assert (trials[trials.role == "replica"].status == "TERMINATED").all()  # ASHA never stops a replica
    assert "stopped " in out.stdout and "by the scheduler" in out.stdout
    finished = results[results.status == "TERMINATED"]
    assert set(finished.length) == {8, 16, 24}  # a trial that ran on reported its whole grid at step 70
    selected = pd.read_csv(storage / "asha" / "selected.csv")
    assert len(selected) == 1 and set(selected.trial_id) <= set(finished.trial_id) and (selected.seeds == 2).all()
    _, parents, children = mlflow_runs(storage / "mlflow.db", "asha")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    tagged = {c.data.tags[TRIAL] for c in children if "stopped" in c.data.tags}
    assert tagged == {t for t in stopped.trial_id}, (tagged, list(stopped.trial_id))
    assert all(c.info.status == "FINISHED" for c in children)


TRIAL = "tune.trial_id"


def test_one_driver_per_study_and_a_killed_drivers_lock_is_taken_over(tmp_path, monkeypatch, capsys):
    spec = write_spec(tmp_path, **{"name": "locked", "base/optim/steps": 3000, "base/sparsity": None})
    storage = tmp_path / "studies"
    lock = storage / "locked" / "driver.lock"
    command = [*RUN, "--space", str(spec), "--storage", str(storage)]
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:  # until a trial trains (not while DeepSpeed may be building its op: a kill would leave its lock)
        assert wait_for_metrics(storage / "mlflow.db", proc), "the first driver ended early"
        holder = json.loads(lock.read_text())
        assert holder["pid"] == proc.pid
        # a second driver (run.py's main in this process, a tripwire in place of Ray and the study)
        code, out, err = main_in_process([*command[2:], "--resume"], monkeypatch, capsys)
        assert code == 2, out[-3000:] + err[-3000:]
        assert f"pid {proc.pid}" in err and holder["host"] in err
        assert "ray:" not in out  # refused before Ray started
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert lock.exists()  # a killed driver leaves its lock; its process is gone, so it is stale
    resumed = subprocess.Popen([*command, "--resume"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and resumed.poll() is None and not held_by(lock, resumed.pid):
            time.sleep(0.3)
        assert resumed.poll() is None, resumed.communicate()
        assert held_by(lock, resumed.pid)  # taken over
        trained = wait_for_metrics(storage / "mlflow.db", resumed, more_than=count_metrics(storage / "mlflow.db"))
        assert trained, resumed.communicate(timeout=120)  # ended without a report: say how
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGINT)  # Ctrl-C: the study ends KILLED, the lock released
        out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 130, out[-3000:] + err[-3000:]
    assert not lock.exists()
    # Ctrl-C (SIGINT to the terminal's foreground group) stops the trials, saves the experiment and
    # ends KILLED, with no results presented as the study's outcome (SIGTERM: tests/test_study.py)
    assert "--resume" in err and "Traceback" not in err, err[-3000:]
    _, parents, children = mlflow_runs(storage / "mlflow.db", "locked")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert children and all(c.info.status == "KILLED" for c in children), [c.info.status for c in children]
    assert not (storage / "locked" / "results.csv").exists() and not (storage / "locked" / "summary.csv").exists()
    assert "results:" not in out and (storage / "locked" / "tune").is_dir()  # what --resume continues


def held_by(lock: Path, pid: int) -> bool:
    try:
        return json.loads(lock.read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def count_metrics(db: Path) -> int:
    import sqlite3

    try:
        with sqlite3.connect(db) as con:
            return con.execute("select count(*) from metrics").fetchone()[0]
    except sqlite3.Error:
        return 0


def wait_for_metrics(db: Path, proc: subprocess.Popen, more_than: int = 0, timeout: float = 300) -> bool:
    """Wait until MLflow holds more than `more_than` metrics (a trial reported); False if `proc` ended."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if count_metrics(db) > more_than:
            return True
        time.sleep(0.5)
    return False


def test_a_trial_process_killed_mid_trial_resumes_from_its_checkpoint(tmp_path):
    """The trial's own process is SIGKILLed after its first checkpoint: Tune restarts it from that
    checkpoint (resources.max_failures 1), and it ends with the metrics of an uninterrupted run."""
    spec = write_spec(tmp_path, **{"name": "killed", "search": "none", "grid": {"task.params.train_length": [8]},
                                   "base/optim/steps": 160, "base/eval/every_steps": 20, "base/sparsity": None,
                                   "resources/max_failures": 1})
    ref = run(["--space", str(spec), "--storage", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    storage = tmp_path / "studies"
    db = storage / "mlflow.db"
    out, err, code = run_killing_a_trial(spec, storage, when=lambda: checkpoint_tagged(db))
    assert code == 0, out[-3000:] + err[-3000:]
    metrics = ["length", "k", "answer_acc", "exact_match", "val_exact", "val_loss", "acc_in_dist", "acc_beyond"]
    resumed = pd.read_csv(storage / "killed" / "results.csv")[metrics]
    uninterrupted = pd.read_csv(tmp_path / "ref" / "killed" / "results.csv")[metrics]
    pd.testing.assert_frame_equal(resumed, uninterrupted)
    _, _, children = mlflow_runs(db, "killed")
    assert len(children) == 1 and children[0].info.status == "FINISHED"


def test_a_trial_killed_before_its_first_report_fails_alone_and_the_study_reports(tmp_path):
    """A trial's process is SIGKILLed (as the OOM killer does) before it reports anything, and is not
    retried (resources.max_failures 0). Tune's result for it holds no metrics and so no config; the
    study still ends as a study with a failed trial does: exit 1 naming its cell, its ERROR row in
    results.csv, its MLflow run FAILED, and the other cell finished."""
    spec = write_spec(tmp_path, **{"name": "unreported", "search": "none", "grid": {"optim.lr": [0.003, 0.001]},
                                   "task/params/train_length": 8, "base/optim/steps": 40,
                                   "base/eval/every_steps": 20, "base/sparsity": None,
                                   "resources/max_failures": 0, "resources/max_concurrent_trials": 1})
    storage = tmp_path / "studies"
    out, err, code = run_killing_a_trial(spec, storage, when=lambda: True)  # as soon as its process is there
    assert code == 1, out[-3000:] + err[-3000:]
    assert "error: 1 trial(s) failed:" in err, err[-3000:]  # not a traceback of the study's own
    failed = err[err.index("error: 1 trial(s) failed:"):]
    results = pd.read_csv(storage / "unreported" / "results.csv")
    bad = results[results.status == "ERROR"]
    assert len(bad) == 1 and bad.length.isna().all(), results
    lost = bad["optim.lr"].iloc[0]
    assert f"(cell lr={lost:g})" in failed, failed
    done = results[results.status == "TERMINATED"]
    assert set(done["optim.lr"]) == {0.003, 0.001} - {lost} and done.length.notna().all()
    _, parents, children = mlflow_runs(storage / "mlflow.db", "unreported")
    assert parents[0].info.status == "FAILED"
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED"]


def run_killing_a_trial(spec: Path, storage: Path, when) -> tuple[str, str, int]:
    """`study/run.py` on `spec`; the first trial process (Tune's ray::ImplicitFunc) SIGKILLed once
    `when()` holds. Returns the study's stdout, stderr and exit code."""
    import psutil

    proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(storage)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and killed is None:
            time.sleep(0.05)
            if not when():
                continue
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if p.cmdline() and p.cmdline()[0].startswith("ray::ImplicitFunc"):
                        p.kill()
                        killed = p.pid
                        break
                except psutil.Error:
                    continue
        assert killed, "no trial process was found to kill"
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, err, proc.returncode


def checkpoint_tagged(db: Path) -> bool:
    import sqlite3

    try:
        with sqlite3.connect(db) as con:
            return bool(con.execute("select count(*) from tags where key = 'checkpoint'").fetchone()[0])
    except sqlite3.Error:
        return False


def start_mlflow_server(folder: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{folder}/server.db", "--artifacts-destination",
         str(folder / "server-artifacts"), "--workers", "1"],
        env=MLFLOW_SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300  # a loaded machine starts it in minutes, a quiet one in seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    code = proc.poll()
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"mlflow server did not start in 300 s (exit code {code})")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_an_mlflow_server_down_mid_study_loses_nothing(tmp_path):
    """The tracking server stops while trials run and comes back (a restart, a few seconds): the study
    goes on, says it could not record, records everything it held once the server answers, and ends
    with a complete record. A server that never comes back: the results are still all in the folder,
    and the study says what MLflow lacks (exit 1)."""
    from test_study import free_port

    port = free_port()
    server = start_mlflow_server(tmp_path, port)
    uri = f"http://127.0.0.1:{port}"
    spec = write_spec(tmp_path, **{"name": "outage", "grid": {"task.params.train_length": [8]},
                                   "base/optim/steps": 100, "base/eval/every_steps": 20, "base/sparsity": None,
                                   "resources/max_concurrent_trials": 1})
    storage = tmp_path / "studies"
    proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(storage), "--mlflow-uri", uri],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        try:
            assert wait_for_metrics(tmp_path / "server.db", proc), "no trial reported"
            stop(server)  # once the first trial reported: its later reports and the second trial's are held
            time.sleep(2)  # and for as long as its restart takes
            server = start_mlflow_server(tmp_path, port)
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert "cannot record" in err and "recording again" in out, out[-2000:] + err[-2000:]
        results = pd.read_csv(storage / "outage" / "results.csv")
        assert results.trial_id.nunique() == 2
        _, parents, children = mlflow_runs(tmp_path / "server.db", "outage")
        assert [p.info.status for p in parents] == ["FINISHED"] and len(children) == 2
        for child in children:
            assert child.info.status == "FINISHED" and "acc_beyond" in child.data.metrics
            client = mlflow_runs(tmp_path / "server.db", "outage")[0]
            steps = sorted(m.step for m in client.get_metric_history(child.info.run_id, "val_loss"))
            assert steps == list(range(20, 101, 20)), steps  # every report, those held during the outage too

        # never back (the same server, stopped once this one-trial study has reported): the study's
        # results are complete, and it says what MLflow lacks
        proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(tmp_path / "second"), "--mlflow-uri",
                                 uri, "--set", "search.trials_per_cell=1"], cwd=ROOT,
                                env={**ENV, "STUDY_MLFLOW_WAIT_S": "5"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert wait_for_metrics(tmp_path / "server.db", proc, more_than=count_metrics(tmp_path / "server.db"))
            stop(server)
            out, err = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        if server.poll() is None:
            stop(server)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "not recorded" in err and "results are complete" in err and "Traceback" not in err, err[-3000:]
    assert pd.read_csv(tmp_path / "second" / "outage" / "results.csv").trial_id.nunique() == 1


def earlier_study(storage: Path, name: str) -> None:
    """A finished study's folder and MLflow record in `storage`, its parent and child runs with params,
    metric histories, tags and artifacts in `storage/mlartifacts`."""
    from mlflow.tracking import MlflowClient

    folder = storage / name
    folder.mkdir(parents=True)
    (folder / "results.csv").write_text("trial_id,val_exact\nt1,0.9\n")
    (folder / "report.json").write_text('{"files": ["results.csv"]}')
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    experiment = client.create_experiment(name, artifact_location=str(storage / "mlartifacts" / name))
    parent = client.create_run(experiment, tags={"study.location": str(folder)}).info.run_id
    child = client.create_run(experiment, tags={"mlflow.parentRunId": parent, "cell": "train_length=8"}).info.run_id
    client.log_param(child, "optim.lr", 0.003)
    for step in (10, 20):
        client.log_metric(child, "val_loss", 1 / step, step=step)
    client.log_artifact(parent, str(folder / "results.csv"))
    for run_id in (child, parent):
        client.set_terminated(run_id)


def test_a_full_disk_is_a_clear_error_and_earlier_results_stay_intact(tmp_path):
    """The study folder's disk (a 24 MiB tmpfs) fills up during a study: it ends naming --storage and
    the full disk, and an earlier study's files and MLflow runs are as they were. The earlier study's
    record is written here as a study writes one (a parent run, a child run, metrics, artifacts): what
    is checked is that nothing of it changes, byte for byte."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        small = {"grid": {"task.params.train_length": [8]}, "base/sparsity": None}
        storage = disk / "studies"
        earlier_study(storage, "first")
        files = {p.name: p.read_bytes() for p in (storage / "first").iterdir() if p.is_file()}
        before = record_of(storage / "mlflow.db", "first")
        big = write_spec(tmp_path, name="second", **small, **{"base/model": {"d_model": 256, "n_layers": 4, "n_heads": 4},
                                                               "base/optim/steps": 200})
        out = run(["--space", str(big), "--storage", str(storage)], timeout=900)
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("error: --storage:") and "is full" in last and "--resume" in last, last
        assert {p.name: p.read_bytes() for p in (storage / "first").iterdir() if p.is_file()} == files
        assert record_of(storage / "mlflow.db", "first") == before
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
