"""A real PostgreSQL server on 127.0.0.1 and an `mlflow server` on it, for the tests that need a
tracking server like a cluster's (docs/cluster.md, "A record that outlives the cluster"):
tests/test_mlflow_postgres.py records a study into it and points benchmarks/mlflow_ui.py at the
same server (`--tracking-uri`).

    with running_postgres() as pg, running_mlflow_server(backend_uri(pg), {**os.environ, **pg["env"]}) as server:
        MlflowClient(server["url"]) ...

PostgreSQL's data lives in a temporary folder removed afterwards; it listens on loopback TCP only,
password-authenticated (scram-sha-256), with fsync off (nothing here needs to survive a crash).
Where it cannot be started (no server binaries, root with no user to run it as, initdb or the
server failing) `PostgresUnavailable` says why: tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
DB_USER, DB_NAME = "mlflow", "mlflow"


class PostgresUnavailable(RuntimeError):
    """PostgreSQL cannot be started on this machine; the message says why and what would fix it."""


class ServerFailed(RuntimeError):
    """The mlflow server did not come up; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
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
        raise PostgresUnavailable("PostgreSQL refuses to run as root, and there is no runuser to run it as "
                                  "another user")
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return [runuser, "-u", name, "--"], name
    raise PostgresUnavailable("PostgreSQL refuses to run as root, and there is no `postgres` or `nobody` user "
                              "to run it as")


def stop(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """Signal a process's group (started with start_new_session), then kill it after `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def running_postgres() -> Iterator[dict]:
    """{"host", "port", "user", "password", "dbname", "env" (PGPASSWORD)}: a PostgreSQL server on
    127.0.0.1, password-authenticated (scram-sha-256), no Unix socket, its data in a temporary folder
    removed afterwards. Raises PostgresUnavailable where it cannot be started."""
    bindir = postgres_bindir()
    if bindir is None:
        raise PostgresUnavailable("no PostgreSQL server binaries (initdb, postgres) on this machine; on "
                                  "Debian/Ubuntu: apt-get install postgresql")
    try:
        import psycopg2
    except ImportError:
        raise PostgresUnavailable("no psycopg2 (MLflow's PostgreSQL driver): pip install -e '.[test]'") from None
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
                              capture_output=True, text=True, timeout=300, check=False)
        if init.returncode != 0:
            raise PostgresUnavailable(f"PostgreSQL's initdb failed here: {(init.stderr or init.stdout).strip()[-500:]}")
        os.remove(pwfile)
        port = free_port()
        # loopback TCP only (no Unix socket); nothing here needs fsync
        with open(os.path.join(data, "postgresql.conf"), "a") as f:
            f.write(f"\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = ''\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")
        with open(log, "w") as out:
            proc = subprocess.Popen([*prefix, os.path.join(bindir, "postgres"), "-D", data], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline, last = time.time() + 120, None
        while time.time() < deadline:
            if proc.poll() is not None:
                raise PostgresUnavailable(f"PostgreSQL did not start here: {Path(log).read_text().strip()[-500:]}")
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=port, user=DB_USER, password=password,
                                        dbname="postgres", connect_timeout=3)
                break
            except psycopg2.OperationalError as e:
                last = e
                time.sleep(0.5)
        else:
            raise PostgresUnavailable(f"PostgreSQL did not answer within 120 s: {last}")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DB_NAME}")
        conn.close()
        yield {"host": "127.0.0.1", "port": port, "user": DB_USER, "password": password, "dbname": DB_NAME,
               "env": {"PGPASSWORD": password}}
    finally:
        if proc is not None:
            stop(proc, signal.SIGINT, 60)  # SIGINT: PostgreSQL's fast shutdown
        shutil.rmtree(top, ignore_errors=True)


def backend_uri(pg: dict) -> str:
    """The server's backend store; the password stays in PGPASSWORD (pg["env"]), not in the URI.
    +psycopg2: SQLAlchemy 2.1 (what mlflow 3.17 installs) reads a bare postgresql:// as psycopg 3."""
    return f"postgresql+psycopg2://{pg['user']}@{pg['host']}:{pg['port']}/{pg['dbname']}"


def query(pg: dict, sql: str, *args) -> list[tuple]:
    import psycopg2

    with psycopg2.connect(host=pg["host"], port=pg["port"], user=pg["user"], password=pg["password"],
                          dbname=pg["dbname"], connect_timeout=10) as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        rows = cur.fetchall()
    conn.close()
    return rows


@contextlib.contextmanager
def running_mlflow_server(backend_uri: str, env: dict, artifacts_destination: str | None = None,
                          workers: int = 1, timeout: float = 180) -> Iterator[dict]:
    """`mlflow server` on 127.0.0.1 as docs/cluster.md gives it: this backend store,
    artifacts served by the server from `artifacts_destination` (s3://..., or when None a folder of
    its own). `env` is the server's whole environment (PGPASSWORD, the bucket's credentials). Yields
    {"url", "log" (its output, removed afterwards with the folder), "pid"}; raises ServerFailed if it
    does not answer /health within `timeout` (the first start creates MLflow's tables)."""
    port = free_port()
    top = tempfile.mkdtemp(prefix="mlflow-server-")
    log = os.path.join(top, "server.log")
    if artifacts_destination is None:
        artifacts_destination = os.path.join(top, "artifacts")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", backend_uri, "--artifacts-destination", artifacts_destination,
             "--serve-artifacts", "--workers", str(workers)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise ServerFailed(f"mlflow server did not start: {Path(log).read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield {"url": url, "log": log, "pid": proc.pid}
    finally:
        stop(proc, signal.SIGTERM, 30)
        shutil.rmtree(top, ignore_errors=True)
