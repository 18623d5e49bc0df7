"""The study platform end to end: real local Ray, real DeepSpeed, real Optuna, real MLflow.

Each study runs as `python study/run.py`, as a user would (a subprocess), so Ray, its workers and
MLflow are the real ones; nothing is mocked. A run refused before anything starts is run.py's main
in the test's process (main_in_process), behind a tripwire in place of Ray and the study.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
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
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, str(ROOT / "study" / "run.py")]
BIN = Path(sys.executable).parent
SMOKE = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
# RAY_AUTH_TOKEN: Ray 2.60 turns token authentication on for every new cluster and, with no token
# in the environment, writes one to ~/.ray/auth_token; tests leave the user's home alone
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
       "RAY_AUTH_TOKEN": secrets.token_hex(32)}
for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
    ENV.pop(var, None)
# for the tests' own `mlflow server`s: MLflow 3's server also starts a job runner and 7 huey consumers
# (its server-side jobs: GenAI evaluation, trace rollups), which no study uses. Measured side by side
# on 2 loaded cores: up in 54-82 s against 25-49 s, 31 CPU-s in its first 2 minutes against 10, and
# 22% of a core while idle against none
MLFLOW_SERVER_ENV = {**ENV, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

pytestmark = pytest.mark.slow


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct ports free now (all held until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def listening(pid: int, titles: dict[int, set[str]] | None = None) -> set[tuple[str, str, int]]:
    """(process, ip, port) of every listening TCP socket of a process and all its descendants (Ray's
    daemons and workers descend from the driver that started them). A Ray worker retitles itself after
    each task it runs, so `titles` (pid -> every title seen) gives each socket the titles its process
    has had, not the one it had at this sample."""
    import psutil

    titles = {} if titles is None else titles
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    tree = {}
    for p in procs:
        try:
            names = titles.setdefault(p.pid, set())
            names.add(" ".join([p.name(), *p.cmdline()[:3]]))
            tree[p.pid] = names
        except psutil.Error:  # exited meanwhile
            continue
    # the machine's sockets read once, not once a process (each read parses every socket there is)
    return {(" | ".join(sorted(tree[c.pid])), c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in tree}


def sample_listeners(proc: subprocess.Popen, timeout: float) -> set[tuple[str, str, int]]:
    """Everything the process tree of `proc` listens on, sampled until it exits."""
    seen, titles, deadline = set(), {}, time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        seen |= listening(proc.pid, titles)
        time.sleep(0.3)
    return seen


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


def main_in_process(argv: list[str], monkeypatch, capsys, env: dict | None = None,
                    until_ray: bool = False) -> tuple[int, str, str]:
    """run.py's main on `argv` in this process, for a run that is refused before anything starts: no
    interpreter, Ray or DeepSpeed start to wait for (each `python study/run.py` imports for 4 CPU-s),
    and a tripwire in place of Ray and the study (as test_record_identity.py's `no_study_starts`), so a
    refusal that regressed fails at once instead of running a study in the test process. What main
    sets in the environment for the Ray it would start (study/run.py: the local-only switch, DeepSpeed's
    build folder) is undone. Returns the exit code, stdout and stderr. A shell's view of the same exit
    (a real process) is what tests/test_validation_fuzz.py and each test's remaining subprocess case
    check. `env`: variables set for the call (RAY_ADDRESS, as `ray job submit` sets it). `until_ray`:
    the tripwire is Ray's start alone, so the study's checks before it run too (a resume's snapshot)."""
    from study import run as run_cli
    from study.experiment import tuning

    def tripwire(*args, **kwargs):
        raise AssertionError("the study started: the input was not refused")

    environ = dict(os.environ)
    try:
        with monkeypatch.context() as patch:
            if not until_ray:
                patch.setattr(tuning, "run_study", tripwire)
            patch.setattr(tuning, "start_ray", tripwire)
            patch.delenv("RAY_ADDRESS", raising=False)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            capsys.readouterr()
            try:
                code = run_cli.main(argv)
            except SystemExit as e:  # how the study's own checks stop it (study/experiment/tuning.py)
                code = e.code
            out, err = capsys.readouterr()
    finally:
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
    return code, out, err


def cli_in_process(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """A `python -m study.<command>` (report, claims, sparsity) as its `main(argv)` in this process:
    (exit code, stdout, stderr), what the subprocess would have given, without its interpreter's start
    and imports (4-5 CPU-s each)."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def mlflow_runs(db: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


# --- validation before anything starts -------------------------------------------------------
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
def test_bad_spec_exits_2_naming_the_field_and_writes_nothing(tmp_path, change, field, capsys, monkeypatch):
    """In-process (run.py's main, with and without --dry-run); tests/test_validation_fuzz.py runs
    real processes for the exit status a shell sees."""
    from study import run as run_cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = write_spec(tmp_path, **change)
    storage = tmp_path / "storage"
    for extra in (["--dry-run"], []):
        code = run_cli.main(["--space", str(spec), "--storage", str(storage), *extra])
        out, err = capsys.readouterr()
        assert code == 2, out + err
        assert field in err, err
        assert "Traceback" not in err
    assert not storage.exists()


# --- the smoke study, recorded by a real MLflow server ---------------------------------------
@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
        env=MLFLOW_SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
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


MEASURED_SINCE = ["answer_token_acc"]  # Ruoss et al.'s per-token accuracy


def assert_same_results(new: pd.DataFrame, old: pd.DataFrame) -> None:
    """The same spec and seed give the same results.csv: every column and value but the trial ids
    (made afresh by each run). The recorded one (tests/data) was written by the smoke study with an
    older version of the platform, so a change of shape that changes a number fails here. Floats to
    a relative 1e-4: the same wheels on another CPU may round a loss differently, while an accuracy
    that moves moves by at least one sample in 64. A metric measured since (MEASURED_SINCE) is a new
    column; every old one keeps its place and values."""
    key = ["cell", "search_index", "role", "seed", "length", "k", "ids"]
    assert set(MEASURED_SINCE) <= set(new.columns)
    new = new.drop(columns=[c for c in MEASURED_SINCE if c not in old])
    new, old = (f.drop(columns="trial_id").sort_values(key).reset_index(drop=True) for f in (new, old))
    assert list(new.columns) == list(old.columns)
    pd.testing.assert_frame_equal(new, old, check_exact=False, rtol=1e-4, atol=1e-6)


def test_smoke_study_end_to_end_on_an_mlflow_server(tmp_path, mlflow_server, monkeypatch, capsys):
    storage = tmp_path / "studies"
    out = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
               "--mlflow-uri", mlflow_server, "--set", "resources.max_concurrent_trials=2"])  # trials side by side
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
    assert_same_results(results, pd.read_csv(ROOT / "tests" / "data" / "smoke_results_before_redesign.csv"))

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
        # the sparsity meter's record (the spec's `sparsity:` section): metrics and per-target table
        metrics = {m["key"]: m["value"] for m in r["data"]["metrics"]}
        assert 1 <= metrics["sparsity/k_median"] <= metrics["sparsity/k_p90"] <= 5  # k_max 4, 5 = beyond
        assert 0 <= metrics["sparsity/precision"] <= 1 and "sparsity/recall" in metrics
        arts = rest(mlflow_server, "artifacts/list", query=f"?run_id={r['info']['run_id']}&path=sparsity")
        assert {"sparsity/targets.csv", "sparsity/k_hist.png", "sparsity/k_hist.pdf"} == {f["path"] for f in arts["files"]}
    arts = rest(mlflow_server, "artifacts/list", query=f"?run_id={parent_id}")
    assert {"results.csv", "summary.csv", "accuracy_vs_length.png",
            "sparsity_vs_extrapolation.png"} <= {f["path"] for f in arts["files"]}
    assert results["sparsity/k_median"].notna().all()  # every trial, beside its extrapolation
    # the meter again on a recorded trial, found through its MLflow run: written back to that run
    child = found[0]["info"]["run_id"]
    from study import sparsity as sparsity_cli

    code, _, err = cli_in_process(sparsity_cli.main, ["--mlflow-run", child, "--mlflow-uri", mlflow_server, "--targets",
                                                      "8", "--k-max", "3", "--out", str(tmp_path / "meter")], capsys)
    assert code == 0, err[-3000:]
    tags = {t["key"]: t["value"] for t in rest(mlflow_server, "runs/get", query=f"?run_id={child}")["run"]["data"]["tags"]}
    assert tags["sparsity.method"] == "occlusion/resample"
    arts = rest(mlflow_server, "artifacts/list", query=f"?run_id={child}&path=sparsity")
    assert "sparsity/summary.csv" in {f["path"] for f in arts["files"]}

    # running the same study again without --resume refuses and leaves the record alone
    before = (storage / "smoke" / "results.csv").stat().st_mtime_ns
    code, _, err = main_in_process(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
                                    "--mlflow-uri", mlflow_server], monkeypatch, capsys)
    assert code == 2 and "--resume" in err, err
    assert (storage / "smoke" / "results.csv").stat().st_mtime_ns == before


# --- resume after the driver is killed --------------------------------------------------------
def kill_when_finished(command: list[str], db: Path, env: dict, cwd: Path, trials: int = 2) -> dict[str, int]:
    """Start a study and SIGKILL it (the driver and the local Ray it started) once `trials` of its
    MLflow child runs are FINISHED; returns {run id: end time} of those finished before the kill."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    finished = {}
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
            if len(rows) >= trials:
                finished = dict(rows)
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return finished


# The driver killed mid-study and resumed, end to end: tests/test_storage.py's
# test_a_study_on_a_bucket_killed_and_resumed, on a bucket (a folder: P6, tests/test_scale_benchmark.py).


# --- a study's listeners -----------------------------------------------------------------------
def run_sampling_listeners(spec, storage, log_path, env=ENV, code: int = 0) -> set[tuple[str, str, int]]:
    """Run the study to the end (exit `code` asserted; its output in log_path) while sampling its
    process tree's listeners."""
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(storage)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            seen = sample_listeners(proc, timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        assert proc.returncode == code, log.read()[-5000:]
    return seen


# The 2-worker ZeRO-2 trial (its shards, its process group on 127.0.0.1): tests/test_divergence.py's
# test_a_two_worker_zero2_study_goes_on_past_a_diverging_trial, beside a trial that diverges.


# --- ray job submit against `ray start --head` ------------------------------------------------
def copy_checkout(work: Path) -> None:
    """The tracked (and untracked, not ignored) files of this checkout: what a job ships."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, work / f)


HEAD_PORTS = ("port", "node-manager-port", "object-manager-port", "ray-client-server-port", "dashboard-port",
              "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port")
METRIC_PORT_ENV = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")  # Ray reads these, no flag


@dataclass
class Head:
    proc: subprocess.Popen
    ports: dict[str, int]
    temp_dir: str  # Ray's temp dir: sessions and their logs
    log: Path  # what `ray start` printed

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"


def head_ports() -> dict[str, int]:
    return dict(zip(HEAD_PORTS + METRIC_PORT_ENV, free_ports(len(HEAD_PORTS) + len(METRIC_PORT_ENV))))


def start_head(env: dict, cwd: Path, temp_dir: str | None, *args: str, ports: dict | None = None) -> Head:
    """`ray start --head --block` with a free port for every listener (`ports`: from head_ports()).
    Ray's defaults (GCS 6379, dashboard 8265, dashboard agent 52365, metrics 44217 and 44227, ...)
    collide with any other Ray on the machine, and a head whose dashboard agent cannot bind its port
    takes no jobs. `temp_dir` None: Ray's default temp dir (under RAY_TMPDIR)."""
    ports = ports or head_ports()
    log = cwd / "ray-head.log"
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--dashboard-host=127.0.0.1",
         *[f"--{name}={ports[name]}" for name in HEAD_PORTS], *args,
         *([f"--temp-dir={temp_dir}"] if temp_dir else [])],
        env={**env, **{name: str(ports[name]) for name in METRIC_PORT_ENV}}, cwd=cwd,
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    default_tmp = os.path.join(env.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")
    return Head(proc, ports, temp_dir or default_tmp, log)


def wait_for_job_api(ray_cli: list[str], cwd: Path, env: dict, head: Head, limit_s: float = 240) -> None:
    """Up when a trivial job runs: the dashboard answers before its job agent is ready. Fails at
    once with what it saw when the head cannot come up: `ray start` exited, or its dashboard agent
    gave up serving HTTP (then every submission is refused with "No available agent")."""
    deadline = time.time() + limit_s
    agent_log = Path(head.temp_dir) / "session_latest" / "logs" / "dashboard_agent.log"
    probe = None
    while True:
        if head.proc.poll() is not None:
            raise AssertionError(f"ray start --head exited with {head.proc.returncode}:\n"
                                 + head.log.read_text(errors="replace")[-3000:])
        if agent_log.exists():
            fatal = [line for line in agent_log.read_text(errors="replace").splitlines()
                     if "failed to bind after" in line or "Failed to start HTTP server" in line]
            if fatal:
                raise AssertionError(f"the head's dashboard agent takes no jobs: {fatal[-1]}")
        left = deadline - time.time()
        if left <= 0:
            raise AssertionError(f"no job ran within {limit_s:.0f} s; the last try said: "
                                 + (probe.stdout[-2000:] + probe.stderr[-2000:] if probe else "nothing"))
        try:
            probe = subprocess.run([*ray_cli, "--", "python", "-c", "pass"], cwd=cwd, env=env,
                                   capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"a trivial job did not finish within {limit_s:.0f} s: {e}") from None
        if probe.returncode == 0:
            return
        time.sleep(2)


def stop_ray_started_here(head: Head, ray_tmp: str) -> None:
    """Stop only the Ray processes this test started: the head's process group, then anything
    still running out of its temp dir."""
    import psutil

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.proc.pid, sig)
            head.proc.wait(timeout=wait)
            break
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
    for proc in psutil.process_iter(["cmdline"]):
        if any(ray_tmp in part for part in proc.info["cmdline"] or []):
            proc.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)


# the Abacus claim study, shrunk by --set to two cells of two seeds and a few steps of a tiny model
ABACUS_SHRUNK = [
    "--set", "name=abacus_shrunk", "--set", "replicas=2",
    "--set", "grid.positional=[{encoding: learned, ids: random_shift, max_position: 128}, {encoding: nope, "
             "ids: sequential, max_position: 128, abacus: true, abacus_offset: sample, abacus_max_offset: 40, "
             "abacus_norm: true, abacus_init_std: 0.088}]",
    *[arg for item in ("base.optim.steps=4", "base.optim.warmup_steps=0", "base.optim.batch_size=8",
                       "base.model.d_model=16", "base.model.n_layers=1", "base.eval.samples_per_point=4",
                       "base.eval.val_samples=4", "base.eval.every_steps=2", "base.eval.batch_size=4")
      for arg in ("--set", item)],
]


def test_ray_job_submit_to_a_head_node(tmp_path):
    # the job gets a copy of the tracked files as its working dir; it must use that code
    work = tmp_path / "checkout"
    copy_checkout(work)
    ray_tmp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths are limited
    # Ray 2.60 clusters use token authentication: the job client sends ENV's RAY_AUTH_TOKEN
    env = {**ENV, "PYTHONPATH": "", "RAY_AUTH_MODE": "token"}
    head = start_head(env, tmp_path, ray_tmp, "--num-cpus=2")
    storage, db = tmp_path / "studies", tmp_path / "ml.db"
    try:
        ray_cli = [str(BIN / "ray"), "job", "submit", f"--address={head.dashboard}"]
        wait_for_job_api(ray_cli, tmp_path, env, head)
        out = subprocess.run(
            [*ray_cli, "--working-dir", str(work), "--", "python", "study/run.py", "--space",
             "search_spaces/experiments/schemes_abacus_train10.yaml", *ABACUS_SHRUNK, "--storage", str(storage),
             "--mlflow-uri", f"sqlite:///{db}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        code_line = next(line for line in out.stdout.splitlines() if line.startswith("code: "))
        code_dir = code_line.removeprefix("code: ")
        assert code_dir.startswith(ray_tmp) and str(ROOT) not in code_dir, code_line
        ray_line = next(line for line in out.stdout.splitlines() if line.startswith("ray: "))
        assert ray_line.startswith("ray: cluster at "), ray_line
        assert ray_line.endswith(f":{head.ports['port']}"), ray_line
        assert "succeeded" in (out.stdout + out.stderr).lower()
        # a few steps fit nothing: the claim is judged, and says that it cannot tell
        assert "claim abacus_addition: inconclusive (fewer than 2 seeds where both cells fit" in out.stdout
    finally:
        stop_ray_started_here(head, ray_tmp)
    results = pd.read_csv(storage / "abacus_shrunk" / "results.csv")
    assert results.trial_id.nunique() == 4
    _, parents, children = mlflow_runs(db, "abacus_shrunk")
    assert len(parents) == 1 and len(children) == 4
    assert parents[0].data.tags["claim.abacus_addition"] == "inconclusive"


# --- local means local ---------------------------------------------------------------------------
def test_the_embedded_study_starts_its_own_ray_beside_another_on_the_loopback_only(tmp_path):
    """A bare `ray.init()` attaches to the last `ray start` cluster of the machine (the address file
    in Ray's temp dir): a laptop study would silently run on someone else's Ray. Its own Ray listens on
    127.0.0.1 only: Ray's daemons, the driver and the trials (their gloo groups). And `--storage
    file:///new/dir` is that folder (a bucket URI's probe once failed in a folder not made yet). The
    spellings of RAY_ADDRESS=local: tests/test_validation_fuzz.py."""
    ray_tmp = tempfile.mkdtemp(prefix="rayo", dir="/tmp")
    # the other Ray and the study share Ray's default temp dir, as on a laptop: the other's address
    # file is where a bare ray.init() of the study would look
    env = {**ENV, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token"}
    # a home of its own shows whether Ray writes ~/.ray/auth_token (the cache stays: DeepSpeed's op)
    home = tmp_path / "home"
    env.update(HOME=str(home), XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")))
    head = start_head(env, tmp_path, None, "--num-cpus=1")
    storage = tmp_path / "new" / "dir"
    try:
        address_file = Path(ray_tmp) / "ray" / "ray_current_cluster"
        deadline = time.time() + 120
        while not address_file.exists() and head.proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert address_file.exists(), head.log.read_text(errors="replace")[-3000:]
        other = address_file.read_text().strip()
        assert other.endswith(f":{head.ports['port']}")

        spec = write_spec(tmp_path, **{"name": "beside", "search/trials_per_cell": 1, "base/optim/steps": 40})
        seen = run_sampling_listeners(spec, f"file://{storage}", tmp_path / "out", env=env)
        out = (tmp_path / "out").read_text()
        ray_line = next(line for line in out.splitlines() if line.startswith("ray: "))
        assert ray_line.startswith("ray: embedded local Ray on 127.0.0.1") and other not in ray_line, ray_line
        # and the other cluster never saw a driver
        jobs = subprocess.run([sys.executable, "-c", JOBS, head.dashboard], env=env, capture_output=True,
                              text=True, timeout=120)
        assert jobs.returncode == 0, jobs.stderr[-2000:]
        assert json.loads(jobs.stdout.strip().splitlines()[-1]) == []
    finally:
        stop_ray_started_here(head, ray_tmp)
    labels = " ".join(label for label, _, _ in seen)
    # sampled while it ran: Ray's daemons, the driver and the trials (their gloo groups listen)
    for owner in ("gcs_server", "raylet", "DashboardAgent", "ImplicitFunc", "study/run.py"):
        assert owner in labels, (owner, seen)
    exposed = sorted((label, ip, port) for label, ip, port in seen if not is_loopback(ip))
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"
    # the file: URI is the folder: the study and its default MLflow store are in it
    assert pd.read_csv(storage / "beside" / "results.csv").trial_id.nunique() == 2
    assert (storage / "mlflow.db").is_file() and not (ROOT / "studies" / "beside").exists()
    assert not (home / ".ray").exists(), "Ray wrote to the user's home"


JOBS = """
import json, sys
from ray.util.state import list_jobs
print(json.dumps([j.job_id for j in list_jobs(address=sys.argv[1], raise_on_missing_output=False)]))
"""


# --- failures are loud ---------------------------------------------------------------------------
def test_sigterm_stops_the_study_killed_with_no_results(tmp_path):
    """SIGTERM to the driver alone (`kill`, a scheduler, a node shutting down) stops the trials, saves
    the experiment and ends KILLED, as Ctrl-C does (tests/test_records.py's resumed driver)."""
    spec = write_spec(tmp_path, **{"name": "interrupted", "base/optim/steps": 3000})  # minutes: far beyond
    storage = tmp_path / "studies"
    db = storage / "mlflow.db"
    with (tmp_path / "out").open("w+") as out, (tmp_path / "err").open("w+") as err:
        proc = subprocess.Popen([*RUN, "--space", str(spec), "--storage", str(storage)], cwd=ROOT, env=ENV,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:  # until a trial has reported
                time.sleep(0.5)
                try:
                    with sqlite3.connect(db) as con:
                        if con.execute("select count(*) from metrics").fetchone()[0]:
                            break
                except sqlite3.Error:
                    continue
            assert proc.poll() is None, "the study should still be running"
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert rc == 143, stdout[-3000:] + stderr[-3000:]
    assert "--resume" in stderr and "Traceback" not in stderr, stderr[-3000:]
    _, parents, children = mlflow_runs(db, "interrupted")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert children and all(c.info.status == "KILLED" for c in children)
    study_dir = storage / "interrupted"
    assert not (study_dir / "results.csv").exists() and not (study_dir / "summary.csv").exists()
    assert "results:" not in stdout  # no table presented as the study's outcome
    assert (study_dir / "tune").is_dir()  # what --resume continues
