"""A real S3 API on 127.0.0.1 (moto's server, a PyPI package) for the bucket-storage tests. The
cloud itself is what cannot exist here; the API, its errors and its bytes are real. Credentials
are dummies that live in the tests' environment only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.postgres import free_port

BIN = Path(sys.executable).parent
# One ninja for every DeepSpeed op build: the tests' subprocesses put the venv's bin first on PATH,
# and in-process builds must find the same ninja. Two ninja versions (here: the venv's 1.13 and
# Debian's 1.11) each take the other's build log as stale, so every switch rebuilt the op (1-2 min
# holding its lock), and a process killed mid-build left the lock for the next trial to hang on.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"


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
