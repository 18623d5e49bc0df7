"""One driver per study: `<study>/driver.lock`, made only if absent, says who runs the study.

Two drivers on one study would share its MLflow parent, write one Tune folder and delete each
other's running child runs. The lock is created exclusively (a folder: O_EXCL; S3: a conditional
put, `If-None-Match: *`; other buckets: look, then write, which narrows the race but cannot close
it) and holds the holder's host, pid and process start time. A lock whose holder is gone (this host,
no live process of that pid and start time) is stale, left by a killed driver, and is taken over;
a lock of a live driver, or of another host, is refused with its holder.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager
from typing import Iterator

from trial import storage as store

FILE = "driver.lock"


class StudyLocked(RuntimeError):
    """Another driver runs this study; the message names it and the lock file."""


def _me() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: always for another host (we cannot look there)."""
    import psutil

    if holder.get("host") != socket.gethostname():
        return True
    try:
        return abs(psutil.Process(int(holder["pid"])).create_time() - float(holder["started"])) < 1
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def _create(path: str, data: bytes) -> bool:
    """Create `path` holding `data` unless it exists; True if created."""
    if not store.is_uri(path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    if path.startswith("s3://"):
        import boto3
        from botocore.exceptions import ClientError

        bucket, _, key = path[len("s3://"):].partition("/")
        try:  # AWS_ENDPOINT_URL is honoured by boto3 itself (an S3-compatible server)
            boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise store.StorageError(f"{path}: {e}") from None
        return True
    if store.exists(path):
        return False
    store.write_atomic(path, data)
    return True


@contextmanager
def driver_lock(study_dir: str) -> Iterator[None]:
    """Hold the study's lock while the block runs; StudyLocked if a live driver holds it."""
    path = store.join(study_dir, FILE)
    me = _me()
    data = json.dumps(me).encode()
    for _ in range(2):
        if _create(path, data):
            break
        raw = store.read_bytes(path)
        holder = json.loads(raw) if raw else {}
        if holder and _alive(holder):
            raise StudyLocked(
                f"study {study_dir} is being run by pid {holder.get('pid')} on {holder.get('host')} ({path}); "
                "wait for it to end, or stop it; if that driver is gone for good, delete the lock file")
        _remove(path)  # stale: its driver was killed
    else:
        raise StudyLocked(f"study {study_dir}: could not take {path}; another driver took it meanwhile")
    try:
        yield
    except store.StorageUnreachable as e:  # the study stopped for its storage: releasing would wait out the
        _left_in_place(path, e)  # S3 client's retries (measured: 7-12 s) only to fail
        raise
    except BaseException:
        _release(path, me)
        raise
    _release(path, me)


def _release(path: str, me: dict) -> None:
    try:
        raw = store.read_bytes(path)
        if raw and json.loads(raw) == me:
            _remove(path)
    except OSError as e:  # the storage does not answer: the lock stays, stale once this process ends
        _left_in_place(path, e)


def _left_in_place(path: str, why: OSError) -> None:
    print(f"warning: {path} is left in place ({store.first_line(why)}); the next run of this study on "
          "this host takes it over", file=sys.stderr, flush=True)


def _remove(path: str) -> None:
    fs, inner = store.resolve(path)
    try:
        fs.delete_file(inner)
    except FileNotFoundError:
        pass
