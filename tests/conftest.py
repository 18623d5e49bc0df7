"""A real S3 API on 127.0.0.1 (moto's server, a PyPI package) for the bucket-storage tests. The
cloud itself is what cannot exist here; the API, its errors and its bytes are real. Credentials
are dummies that live in the tests' environment only."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The repository root, for `tests.support` (and benchmarks/, not an installed package): `python -m
# pytest` puts the working directory on sys.path, `pytest` alone does not.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from tests.support.postgres import free_port  # noqa: E402 (after the sys.path line above)

BIN = Path(sys.executable).parent
# One ninja for every DeepSpeed op build: the tests' subprocesses put the venv's bin first on PATH,
# and in-process builds must find the same ninja. Two ninja versions (here: the venv's 1.13 and
# Debian's 1.11) each take the other's build log as stale, so every switch rebuilt the op (1-2 min
# holding its lock), and a process killed mid-build left the lock for the next trial to hang on.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"

# Under pytest-xdist (`-n 2`, pyproject's addopts) each test process gets its share of the cores
# for torch's intra-op threads, and so do the processes it starts (OMP_NUM_THREADS): two processes
# each running as many threads as there are cores spin against each other (measured: an in-process
# training test 26 s alone, 169 s beside another test at 2 threads each). Ray's trial workers inherit
# it too (Ray sets a worker's OMP_NUM_THREADS from its CPUs only where it is unset): the tests' trials
# ask for one CPU each, so they run as they would without it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    import torch

    torch.set_num_threads(THREADS)


def start_s3_server(enforce_auth: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if enforce_auth else {})}
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the S3 server (moto) did not start")


@pytest.fixture(scope="module")
def s3():
    """{"url", "env" (what a process needs to reach it), "bucket", "client" (boto3)}."""
    proc, url = start_s3_server()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url, "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        with pytest.MonkeyPatch.context() as mp:  # this process too (pyarrow and boto3 read them)
            for k, v in env.items():
                mp.setenv(k, v)
            import boto3

            client = boto3.client("s3")
            client.create_bucket(Bucket="studies")
            yield {"url": url, "env": env, "bucket": "studies", "client": client}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bucket_keys(s3: dict, prefix: str = "") -> list[str]:
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=s3["bucket"], Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def debian_package(package: str, found: Callable[[], Any]) -> Any:
    """`found()` (what the test needs: a binary's path, a folder), installing Debian's `package` with
    apt-get first where it finds nothing: the test setup for what pip cannot install (chromium,
    postgresql). One install at a time on the machine (apt-get's dpkg lock fails, not waits, when two
    test processes install at once). Skips the test, saying why, where it cannot be installed."""
    if have := found():
        return have
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        with open("/tmp/study-tests-apt.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not found():  # else another test process installed it meanwhile
                if subprocess.run(install, capture_output=True, env=env, timeout=600).returncode != 0:
                    # stale package lists
                    subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=300, check=True)
                    subprocess.run(install, capture_output=True, env=env, timeout=600, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"no {package}, and `apt-get install {package}` failed here ({type(e).__name__}: {e})")
    return found() or pytest.skip(f"`apt-get install {package}` installed nothing this test can use")


def pytest_collection_modifyitems(config, items):
    """The files holding end-to-end (`slow`) tests first. pytest-xdist's worksteal scheduler hands
    each worker a contiguous half of this order and lets an idle worker take the tail of the other's
    queue, so with the minutes-long tests at the front the last tests of both queues are short ones
    and neither worker finishes minutes after the other. Whole files move, in their own order, so a
    module's fixtures start once."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
