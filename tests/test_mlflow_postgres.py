"""A tracking record that survives the cluster: a real `mlflow server` whose backend store is
PostgreSQL (a real server, started here on 127.0.0.1 with its data in a temporary folder) and whose
artifacts go to an S3 bucket (moto's S3 API on 127.0.0.1, tests/conftest.py). The study's driver
knows only `--mlflow-uri http://...`: no database password and no bucket credentials reach it, so
everything it records goes through the server, into rows of PostgreSQL and objects in the bucket.

Skips, saying why, only where PostgreSQL cannot be started here (no server binaries: on Debian
`apt-get install postgresql`; root with no unprivileged user to run it as).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
from conftest import _free_port as free_port
from conftest import bucket_keys

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DB_USER, DB_NAME = "mlflow", "mlflow"
# as tests/test_study.py runs a study: this venv first on PATH, and a Ray token of the test's own
# (Ray 2.60 would otherwise write one to ~/.ray/auth_token)
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
       "RAY_AUTH_TOKEN": secrets.token_hex(32)}
for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
    ENV.pop(var, None)


def run(args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "study" / "run.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


# --- PostgreSQL --------------------------------------------------------------------------------------
def postgres_bindir() -> str | None:
    """The folder holding initdb and postgres: on PATH, else Debian's /usr/lib/postgresql/<version>/bin
    (the newest), else what `pg_config --bindir` says."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return os.path.dirname(found)
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: [int(x) for x in p.split("/")[4].split(".") if x.isdigit()])
    if versions:
        return os.path.dirname(versions[-1])
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        if out.returncode == 0 and os.path.isfile(os.path.join(out.stdout.strip(), "initdb")):
            return out.stdout.strip()
    return None


def unprivileged_user() -> tuple[list[str], str | None]:
    """(command prefix, user name) to run PostgreSQL with: nothing as a normal user; as root (which
    PostgreSQL refuses) `runuser -u <user> --` for the `postgres` account the Debian package makes,
    else `nobody`."""
    if os.geteuid() != 0:
        return [], None
    runuser = shutil.which("runuser")
    if not runuser:
        pytest.skip("PostgreSQL refuses to run as root, and there is no runuser to run it as another user")
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return [runuser, "-u", name, "--"], name
    pytest.skip("PostgreSQL refuses to run as root, and there is no `postgres` or `nobody` user to run it as")


@pytest.fixture(scope="module")
def postgres():
    """{"host", "port", "user", "password", "dbname", "env" (PGPASSWORD)}: a PostgreSQL server on
    127.0.0.1, password-authenticated (scram-sha-256), no Unix socket, its data in a temporary folder
    removed afterwards."""
    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres) on this machine; on Debian/Ubuntu: "
                    "apt-get install postgresql")
    try:
        import psycopg2
    except ImportError:
        pytest.skip("no psycopg2 (MLflow's PostgreSQL driver): pip install -e '.[test]'")
    prefix, user = unprivileged_user()
    top = tempfile.mkdtemp(prefix="mlflow-pg-")  # under /tmp: the other user can reach it (pytest's is 0700)
    data, pwfile, log = (os.path.join(top, name) for name in ("data", "pwfile", "postgres.log"))
    password = secrets.token_hex(16)
    with open(pwfile, "w") as f:
        f.write(password + "\n")
    if user:
        info = pwd.getpwnam(user)
        for path in (top, pwfile):
            os.chown(path, info.pw_uid, info.pw_gid)
    proc = None
    try:
        initdb = os.path.join(bindir, "initdb")
        init = subprocess.run([*prefix, initdb, "-D", data, "-U", DB_USER, "-E", "UTF8",
                               "--auth=scram-sha-256", f"--pwfile={pwfile}", "--no-instructions"],
                              capture_output=True, text=True, timeout=300)
        if init.returncode != 0:
            pytest.skip(f"PostgreSQL's initdb failed here: {(init.stderr or init.stdout).strip()[-500:]}")
        os.remove(pwfile)
        port = free_port()
        # loopback TCP only (no Unix socket); a test needs no fsync
        with open(os.path.join(data, "postgresql.conf"), "a") as f:
            f.write(f"\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = ''\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")
        with open(log, "w") as out:
            proc = subprocess.Popen([*prefix, os.path.join(bindir, "postgres"), "-D", data], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline, last = time.time() + 120, None
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.skip(f"PostgreSQL did not start here: {Path(log).read_text().strip()[-500:]}")
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=port, user=DB_USER, password=password,
                                        dbname="postgres", connect_timeout=3)
                break
            except psycopg2.OperationalError as e:
                last = e
                time.sleep(0.5)
        else:
            pytest.skip(f"PostgreSQL did not answer within 120 s: {last}")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DB_NAME}")
        conn.close()
        yield {"host": "127.0.0.1", "port": port, "user": DB_USER, "password": password, "dbname": DB_NAME,
               "env": {"PGPASSWORD": password}}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # PostgreSQL's fast shutdown
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(top, ignore_errors=True)


def query(pg: dict, sql: str, *args) -> list[tuple]:
    import psycopg2

    with psycopg2.connect(host=pg["host"], port=pg["port"], user=pg["user"], password=pg["password"],
                          dbname=pg["dbname"], connect_timeout=10) as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        rows = cur.fetchall()
    conn.close()
    return rows


# --- the MLflow server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_pg_server(postgres, s3):
    """The command line README's "Run on a cluster" gives, on 127.0.0.1: the backend store is
    PostgreSQL (its password in PGPASSWORD, not in the URI), artifacts are served by the server from
    s3://<bucket>/mlflow (the server alone holds the bucket's credentials and endpoint)."""
    port = free_port()
    # +psycopg2: SQLAlchemy 2.1 (what mlflow 3.17 installs) reads a bare postgresql:// as psycopg 3
    backend = f"postgresql+psycopg2://{postgres['user']}@127.0.0.1:{postgres['port']}/{postgres['dbname']}"
    env = {**ENV, **postgres["env"], **s3["env"], "MLFLOW_S3_ENDPOINT_URL": s3["url"]}
    log = tempfile.NamedTemporaryFile(prefix="mlflow-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", backend, "--artifacts-destination", f"s3://{s3['bucket']}/mlflow",
         "--serve-artifacts", "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180  # the first start creates MLflow's tables in PostgreSQL
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"mlflow server did not start: {Path(log.name).read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": url, "log": log.name}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        os.unlink(log.name)


# the driver gets no credentials: neither the database's nor the bucket's
DRIVER_ENV = {k: v for k, v in ENV.items() if not k.startswith(("AWS_", "PG", "MLFLOW_S3_"))}


def summary_block(text: str) -> list[str]:
    """The lines from "selected per cell" up to "files:" (the study's closing lines, the report's too)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("selected per cell"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "files:")
    return lines[start:end]


def test_a_study_records_into_postgresql_and_the_bucket_and_is_read_back(tmp_path, mlflow_pg_server, postgres,
                                                                           s3):
    url = mlflow_pg_server["url"]
    storage = tmp_path / "studies"
    out = run(["--space", str(ROOT / "search_spaces/smoke.yaml"), "--storage", str(storage),
               "--mlflow-uri", url], env=DRIVER_ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + \
        Path(mlflow_pg_server["log"]).read_text()[-3000:]
    assert "goes away" not in out.stderr  # a tracking server: no warning that the record dies with the driver
    results = pd.read_csv(storage / "smoke" / "results.csv")
    trials = sorted(results.trial_id.unique())
    assert len(trials) == 4

    # --- the rows in PostgreSQL: one experiment, one parent run, 4 children with params and metrics
    (exp_id, location), = query(postgres, "SELECT experiment_id, artifact_location FROM experiments "
                                          "WHERE name = %s", "smoke")
    assert location.startswith("mlflow-artifacts:")  # proxied by the server: the driver never saw the bucket
    runs = query(postgres, "SELECT run_uuid, status, start_time, end_time FROM runs WHERE experiment_id = %s",
                 exp_id)
    assert len(runs) == 5 and {status for _, status, _, _ in runs} == {"FINISHED"}
    tags = query(postgres, "SELECT t.run_uuid, t.key, t.value FROM tags t JOIN runs r "
                           "ON r.run_uuid = t.run_uuid WHERE r.experiment_id = %s", exp_id)
    parent_of = {run: value for run, key, value in tags if key == "mlflow.parentRunId"}
    parents = [run for run, *_ in runs if run not in parent_of]
    assert len(parents) == 1 and set(parent_of.values()) == set(parents)
    parent = parents[0]
    assert ("study.parent", "true") in {(k, v) for run, k, v in tags if run == parent}
    children = sorted(parent_of)
    trial_of = {run: value for run, key, value in tags if key == "tune.trial_id"}
    assert sorted(trial_of[c] for c in children) == trials

    params = query(postgres, "SELECT run_uuid, key, value FROM params WHERE run_uuid = ANY(%s)", children)
    lrs = {run: float(value) for run, key, value in params if key == "optim.lr"}
    assert set(lrs) == set(children)
    by_trial = results.groupby("trial_id")["search.optim.lr"].first()
    for child in children:  # the params in the database are the trials' own
        assert lrs[child] == pytest.approx(by_trial[trial_of[child]], rel=1e-6)
    latest = query(postgres, "SELECT run_uuid, key, value FROM latest_metrics WHERE run_uuid = ANY(%s)",
                   children)
    val_exact = {run: value for run, key, value in latest if key == "val_exact"}
    assert set(val_exact) == set(children)
    for child in children:
        own = results[results.trial_id == trial_of[child]]
        assert val_exact[child] == pytest.approx(own.val_exact.iloc[0])
    history = query(postgres, "SELECT run_uuid, step, timestamp FROM metrics WHERE key = 'val_loss' "
                              "AND run_uuid = ANY(%s)", children)
    steps: dict[str, list[int]] = {}
    for run_id, step, _ in history:
        steps.setdefault(run_id, []).append(step)
    assert {c: sorted(s) for c, s in steps.items()} == {c: [20, 40, 60] for c in children}  # training curves
    acc = query(postgres, "SELECT DISTINCT run_uuid, step FROM metrics WHERE key = 'acc_len/k2' "
                          "AND run_uuid = ANY(%s)", children)
    assert sorted(step for _, step in acc) == sorted([8, 16, 24] * 4)  # accuracy against test length

    # two trials at a time, both logging: some two children's training curves overlap in time
    span = {}
    for run_id, _, ts in history:
        lo, hi = span.get(run_id, (ts, ts))
        span[run_id] = (min(lo, ts), max(hi, ts))
    assert any(span[a][0] <= span[b][1] and span[b][0] <= span[a][1]
               for i, a in enumerate(children) for b in children[i + 1:]), span

    # --- the artifacts are objects in the bucket, the study's own bytes
    keys = bucket_keys(s3, "mlflow/")
    results_key = f"mlflow/{exp_id}/{parent}/artifacts/results.csv"
    assert results_key in keys, keys
    body = s3["client"].get_object(Bucket=s3["bucket"], Key=results_key)["Body"].read()
    assert body == (storage / "smoke" / "results.csv").read_bytes()
    for child in children:
        assert f"mlflow/{exp_id}/{child}/artifacts/eval/records.csv" in keys

    # --- read back through the server alone: the report equals the study's
    report = subprocess.run([sys.executable, "-m", "study.report", "smoke", "--mlflow-uri", url,
                             "--out", str(tmp_path / "report")], cwd=ROOT, env=DRIVER_ENV,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.startswith(f"study smoke from MLflow run {parent} of experiment smoke: 4 trials"), \
        report.stdout[:500]
    assert summary_block(report.stdout) == summary_block(out.stdout)
    study_csv = (storage / "smoke" / "results.csv").read_bytes()
    assert (tmp_path / "report" / "results.csv").read_bytes() == study_csv
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "report" / "summary.csv"),
                                  pd.read_csv(storage / "smoke" / "summary.csv"))
