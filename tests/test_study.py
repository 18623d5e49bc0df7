"""The study platform end to end: real local Ray, real DeepSpeed, real Optuna, real MLflow.

Each test runs `python study/run.py` as a user would (a subprocess), so Ray, its workers and
MLflow are the real ones; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, str(ROOT / "study" / "run.py")]
BIN = Path(sys.executable).parent
SMOKE = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
ENV.pop("RAY_ADDRESS", None)

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_spec(tmp_path: Path, **changes) -> Path:
    spec = json.loads(json.dumps(SMOKE))
    for dotted, value in changes.items():
        node = spec
        *parents, leaf = dotted.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], cwd=kw.pop("cwd", ROOT), env=kw.pop("env", ENV),
                          capture_output=True, text=True, timeout=timeout, **kw)


def mlflow_runs(db: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


# --- validation before anything starts -------------------------------------------------------
def test_dry_run_prints_the_plan_of_every_shipped_spec():
    for spec in sorted((ROOT / "search_spaces").glob("*.yaml")):
        out = run(["--space", str(spec), "--dry-run"], timeout=120)
        assert out.returncode == 0, (spec.name, out.stderr)
        assert "cell 0:" in out.stdout and "per trial:" in out.stdout


@pytest.mark.parametrize(
    "change, field",
    [
        ({"grid/task.params.train_length": [8, 1]}, "task.params.train_k"),
        ({"base/eval/ks": [1, 50]}, "eval.ks"),
        ({"base/eval/lengths": [8, 100]}, "eval.lengths"),
        ({"base/positional/encoding": "sinusoid"}, "positional.encoding"),
        ({"base/positional/ids": "magic"}, "positional.ids"),
        ({"grid/optim.lrr": [0.1]}, "optim.lrr"),
        ({"search/params/optim.lr": {"loguniform": [0.01, 0.001]}}, "search.params.optim.lr"),
        ({"objective/metric": "acc_beyond"}, "objective.metric"),
        ({"task/name": "sorting"}, "task.name"),
        ({"resources/zero_stage": 5}, "resources.zero_stage"),
        ({"replicas": 0}, "replicas"),
    ],
)
def test_bad_spec_exits_2_naming_the_field_and_writes_nothing(tmp_path, change, field):
    spec = write_spec(tmp_path, **change)
    storage = tmp_path / "storage"
    for extra in (["--dry-run"], []):
        out = run(["--space", str(spec), "--storage", str(storage), *extra], timeout=120)
        assert out.returncode == 2, out.stdout + out.stderr
        assert field in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert not storage.exists()


# --- the smoke study, recorded by a real MLflow server ---------------------------------------
@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not start")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def rest(url: str, path: str, body: dict | None = None, query: str = "") -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}{query}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_smoke_study_end_to_end_on_an_mlflow_server(tmp_path, mlflow_server):
    storage = tmp_path / "studies"
    out = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
               "--mlflow-uri", mlflow_server])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the closing table: one row per cell with in-distribution and extrapolation accuracy
    assert "train_length=8" in out.stdout and "acc_beyond" in out.stdout

    results = pd.read_csv(storage / "smoke" / "results.csv")
    assert results.trial_id.nunique() == 4
    assert len(results) == 4 * 3 * 2  # trials x test lengths x k_test
    assert set(results.length) == {8, 16, 24} and set(results.k) == {1, 2}
    assert {"task.params.train_length", "search.optim.lr", "seed", "answer_acc", "val_exact"} <= set(results.columns)
    assert results.groupby("task.params.train_length").trial_id.nunique().to_dict() == {8: 2, 12: 2}
    assert (results.in_distribution == (results.length <= results["task.params.train_length"])
            & (results.k <= 2)).all()

    # the REST API finds the study's runs by factor
    exp = rest(mlflow_server, "experiments/get-by-name", query="?experiment_name=smoke")["experiment"]
    found = rest(mlflow_server, "runs/search", {
        "experiment_ids": [exp["experiment_id"]],
        "filter": "tags.`factor.task.params.train_length` = '12'",
    })["runs"]
    assert len(found) == 2
    all_runs = rest(mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    parents = [r for r in all_runs if not any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))]
    assert len(parents) == 1 and len(all_runs) == 5
    parent_id = parents[0]["info"]["run_id"]
    assert all(r["info"]["status"] == "FINISHED" for r in all_runs)
    for r in found:
        tags = {t["key"]: t["value"] for t in r["data"]["tags"]}
        params = {p["key"]: p["value"] for p in r["data"]["params"]}
        assert tags["mlflow.parentRunId"] == parent_id
        assert params["task.params.train_length"] == "12" and "optim.lr" in params
        history = rest(mlflow_server, "metrics/get-history",
                       query=f"?run_id={r['info']['run_id']}&metric_key=acc_len/k2")["metrics"]
        assert sorted(m["step"] for m in history) == [8, 16, 24]  # accuracy against test length
        curve = rest(mlflow_server, "metrics/get-history",
                     query=f"?run_id={r['info']['run_id']}&metric_key=val_loss")["metrics"]
        assert sorted(m["step"] for m in curve) == [20, 40, 60]  # the training curve
        arts = rest(mlflow_server, "artifacts/list", query=f"?run_id={r['info']['run_id']}&path=eval")
        assert [f["path"] for f in arts["files"]] == ["eval/records.csv"]
    arts = rest(mlflow_server, "artifacts/list", query=f"?run_id={parent_id}")
    assert {"results.csv", "summary.csv", "accuracy_vs_length.png"} <= {f["path"] for f in arts["files"]}

    # running the same study again without --resume refuses and leaves the record alone
    before = (storage / "smoke" / "results.csv").stat().st_mtime_ns
    again = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
                 "--mlflow-uri", mlflow_server], timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr
    assert (storage / "smoke" / "results.csv").stat().st_mtime_ns == before


# --- resume after the driver is killed --------------------------------------------------------
def test_resume_after_the_driver_is_killed(tmp_path):
    spec = write_spec(tmp_path, **{"name": "resumable", "base/optim/steps": 240, "base/eval/every_steps": 40,
                                   "search/trials_per_cell": 3})
    storage = tmp_path / "studies"
    db = storage / "mlflow.db"
    proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(storage)], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    finished_before = {}
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if not db.exists():
                continue
            try:
                with sqlite3.connect(db) as con:
                    rows = con.execute("select run_uuid, end_time from runs r join tags t using (run_uuid) "
                                       "where t.key = 'mlflow.parentRunId' and r.status = 'FINISHED'").fetchall()
            except sqlite3.Error:
                continue
            if len(rows) >= 2:
                finished_before = dict(rows)
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
        proc.wait()
    assert 2 <= len(finished_before) < 6, "the kill should land mid-study"
    client, parents, children = mlflow_runs(db, "resumable")
    parent_before = parents[0].info.run_id

    out = run(["--space", str(spec), "--storage", str(storage), "--resume"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client, parents, children = mlflow_runs(db, "resumable")
    assert [p.info.run_id for p in parents] == [parent_before]  # the study's run is kept
    assert parents[0].info.status == "FINISHED"
    assert len(children) == 6 and all(c.info.status == "FINISHED" for c in children)  # no duplicates
    for run_id, end_time in finished_before.items():  # finished trials were not rerun
        assert client.get_run(run_id).info.end_time == end_time
    results = pd.read_csv(storage / "resumable" / "results.csv")
    assert results.trial_id.nunique() == 6
    lrs = results.drop_duplicates("trial_id")["search.optim.lr"]
    assert lrs.nunique() == 6, "a restored Optuna search continues; a fresh one would repeat itself"
    assert (results.groupby("task.params.train_length").trial_id.nunique() == 3).all()


# --- a 2-worker ZeRO-2 trial --------------------------------------------------------------------
def test_two_worker_zero2_trial(tmp_path):
    spec = write_spec(tmp_path, **{
        "name": "zero2", "grid": None, "search": None, "task/params/train_length": 8,
        "resources": {"workers_per_trial": 2, "cpus_per_worker": 1, "zero_stage": 2},
        "base/optim/steps": 40,
    })
    storage = tmp_path / "studies"
    out = run(["--space", str(spec), "--storage", str(storage)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = pd.read_csv(storage / "zero2" / "results.csv")
    assert results.trial_id.nunique() == 1 and len(results) == 6
    assert (results.n == 32).all()  # both workers' halves summed
    shards = sorted(p.name for p in (storage / "zero2" / "train").rglob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


# --- ray job submit against `ray start --head` ------------------------------------------------
def copy_checkout(work: Path) -> None:
    """The tracked (and untracked, not ignored) files of this checkout: what a job ships."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, work / f)


def wait_for_job_api(ray_cli: list[str], cwd: Path, env: dict) -> None:
    """Up when a trivial job runs: the dashboard answers before its job agent is ready."""
    for _ in range(60):
        probe = subprocess.run([*ray_cli, "--", "python", "-c", "pass"], cwd=cwd, env=env,
                               capture_output=True, text=True, timeout=120)
        if probe.returncode == 0:
            return
        time.sleep(2)
    raise AssertionError(probe.stdout[-2000:] + probe.stderr[-2000:])


def stop_ray_started_here(head: subprocess.Popen, ray_tmp: str) -> None:
    """Stop only the Ray processes this test started: the head's process group, then anything
    still running out of its temp dir."""
    import psutil

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
            head.wait(timeout=wait)
            break
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
    for proc in psutil.process_iter(["cmdline"]):
        if any(ray_tmp in part for part in proc.info["cmdline"] or []):
            proc.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ray_job_submit_to_a_head_node(tmp_path):
    # the job gets a copy of the tracked files as its working dir; it must use that code
    work = tmp_path / "checkout"
    copy_checkout(work)
    ray_tmp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths are limited
    port, dash = free_port(), free_port()
    # Ray 2.60 clusters use token authentication: the head makes ~/.ray/auth_token if missing and
    # the job client sends it
    env = {**ENV, "PYTHONPATH": "", "RAY_AUTH_MODE": "token"}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={ray_tmp}"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    storage, db = tmp_path / "studies", tmp_path / "ml.db"
    try:
        address = f"http://127.0.0.1:{dash}"
        ray_cli = [str(BIN / "ray"), "job", "submit", f"--address={address}"]
        wait_for_job_api(ray_cli, tmp_path, env)
        out = subprocess.run(
            [*ray_cli, "--working-dir", str(work), "--", "python", "study/run.py", "--space",
             "search_spaces/smoke.yaml", "--storage", str(storage), "--mlflow-uri", f"sqlite:///{db}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        code_line = next(line for line in out.stdout.splitlines() if line.startswith("code: "))
        code_dir = code_line.removeprefix("code: ")
        assert code_dir.startswith(ray_tmp) and str(ROOT) not in code_dir, code_line
        assert "succeeded" in (out.stdout + out.stderr).lower()
    finally:
        stop_ray_started_here(head, ray_tmp)
    results = pd.read_csv(storage / "smoke" / "results.csv")
    assert results.trial_id.nunique() == 4
    _, parents, children = mlflow_runs(db, "smoke")
    assert len(parents) == 1 and len(children) == 4
