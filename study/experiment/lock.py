"""One driver per study: `<study>/driver.lock` says who runs the study.

Two drivers on one study would share its MLflow parent, write one Tune folder and delete each
other's running child runs. Taking the lock, and taking over a killed driver's, is one atomic step:
an exclusive `flock` in a folder, a conditional put on S3 (a store that ignores the conditional
headers is found out by a probe and refused), generation preconditions on GCS; any other store is
refused. The lock names its holder, and a holder is known dead only where this process can see it
(the same boot and pid namespace, no process of that pid and start time); any other is taken to be
alive and refused. How each store's step works, and why: docs/records.md, "One driver per study".
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from trial import storage as store

FILE = "driver.lock"


class StudyLocked(RuntimeError):
    """Another driver runs this study; the message names it and the lock file."""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _kernel() -> dict:
    """What tells this kernel boot and this pid namespace from any other (None where unreadable)."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def this_driver() -> dict:
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time(),
            **_kernel()}


def _visible(holder: dict) -> bool:
    """Whether the holder ran on this boot of this kernel, in this pid namespace: the only holder
    whose process this one can look up."""
    here = _kernel()
    return None not in here.values() and all(holder.get(k) == v for k, v in here.items())


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: always, unless it is visible from here and its process is gone."""
    import psutil

    if not _visible(holder):
        return True
    try:
        return abs(psutil.Process(int(holder["pid"])).create_time() - float(holder["started"])) < 1
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, KeyError, ValueError, TypeError):
        return True  # cannot tell: conservative


def _refusal(study_dir: str, path: str, holder: dict) -> StudyLocked:
    who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unknown driver"
    return StudyLocked(f"study {study_dir} is being run by {who} ({path}); wait for it to end, or stop it; if that "
                       "driver is gone for good, delete the lock file")


def _holder(raw: bytes | None) -> dict:
    try:
        holder = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):  # not a lock of ours (run.py refuses such a file first)
        return {}
    return holder if isinstance(holder, dict) else {}


@contextmanager
def driver_lock(study_dir: str) -> Iterator[None]:
    """Hold the study's lock while the block runs; StudyLocked if a live driver holds it, or if the
    store cannot take a lock atomically."""
    path = store.join(study_dir, FILE)
    if not store.is_uri(path):
        with _folder_lock(study_dir, path):
            yield
        return
    refused = store.unlockable(path)
    if refused:
        raise StudyLocked(f"study {store.redact(study_dir)}: {refused}")
    if path.startswith("s3://"):
        _check_s3_conditions(study_dir, path)
    me = this_driver()
    data = json.dumps(me).encode()
    _take(study_dir, path, data)
    try:
        yield
    except store.StorageUnreachable as e:  # the study stopped for its storage: releasing would wait out the
        _left_in_place(path, e)  # S3 client's retries only to fail
        raise
    except BaseException:
        _release(path, me)
        raise
    _release(path, me)


# --- a folder: flock ---------------------------------------------------------------------------
@contextmanager
def _folder_lock(study_dir: str, path: str) -> Iterator[None]:
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes it starts
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(_read_fd(fd))
            os.close(fd)
            raise _refusal(study_dir, path, holder) from None
        try:  # the file locked must still be the one at `path`: an ending driver deletes its lock (while
            same = os.stat(path).st_ino == os.fstat(fd).st_ino  # holding it), and one opened before is no lock
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    holder = _holder(_read_fd(fd))
    # the flock was free, so no process of this kernel holds the study; a holder elsewhere (another
    # machine sharing the folder, where flock may not reach) cannot be ruled out
    if holder and not _visible(holder):
        os.close(fd)
        raise _refusal(study_dir, path, holder)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_driver()).encode(), 0)
        yield
    finally:
        try:
            os.remove(path)  # while still locked: a driver that opens it meanwhile finds it gone and retries
        finally:
            os.close(fd)


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


# --- a bucket: conditional puts ----------------------------------------------------------------
GCS = ("gs://", "gcs://")


def _check_s3_conditions(study_dir: str, path: str) -> None:
    """StudyLocked if the S3 store ignores If-None-Match: a probe object written twice, the second time
    only if none is there, must be refused the second time."""
    import uuid

    from botocore.exceptions import BotoCoreError, ClientError

    client, bucket, key = _s3(f"{path}.probe-{uuid.uuid4().hex[:12]}")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"1")
        try:
            client.put_object(Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
            ignored = "it took a put under If-None-Match: * over an object that was there"
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code not in LOST_RACE and code != "NotImplemented":
                raise
            ignored = None if code in LOST_RACE else "it does not implement If-None-Match"
        client.delete_object(Bucket=bucket, Key=key)
    except (ClientError, BotoCoreError) as e:
        raise store.StorageError(f"{store.redact(path)}: {e}") from None
    if ignored:
        raise StudyLocked(f"study {store.redact(study_dir)}: this S3 store ignores conditional writes ({ignored}), "
                          "so no driver lock can be taken atomically there (two drivers could run this study); "
                          "use a store that honours If-None-Match (AWS S3 does), or a folder")


def _take(study_dir: str, path: str, data: bytes) -> None:
    for _ in range(3):
        if put_version(path, data, None):
            return
        raw, etag = read_version(path)
        if raw is None:
            continue  # released meanwhile: create it again
        holder = _holder(raw)
        if _alive(holder):
            raise _refusal(study_dir, path, holder)
        if put_version(path, data, etag):  # stale: replace exactly the object judged stale, or lose to whoever did
            return
    raise StudyLocked(f"study {study_dir}: could not take {path}; another driver took it meanwhile")


def _s3(path: str):
    import boto3

    bucket, _, key = path[len("s3://"):].partition("/")
    return boto3.client("s3"), bucket, key  # AWS_ENDPOINT_URL is honoured by boto3 (an S3-compatible server)


LOST_RACE = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey")


def put_version(path: str, data: bytes, etag: str | None) -> bool:
    """Create the lock (`etag` None) or replace the object whose version (S3's ETag, GCS's generation)
    is `etag`; False if it is not there as expected (another driver was first)."""
    if path.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError

        client, bucket, key = _s3(path)
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, **condition)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in LOST_RACE:
                return False
            raise store.StorageError(f"{path}: {e}") from None
        except BotoCoreError as e:
            raise store.StorageError(f"{path}: {e}") from None
        return True
    from google.api_core.exceptions import GoogleAPIError, NotFound, PreconditionFailed

    try:  # GCS: generation 0 means "no such object"; an object's generation changes with every write
        _gcs(path).upload_from_string(data, if_generation_match=0 if etag is None else int(etag))
    except (PreconditionFailed, NotFound):
        return False
    except GoogleAPIError as e:
        raise store.StorageError(f"{path}: {e}") from None
    return True


def _gcs(path: str):
    from google.cloud import storage

    bucket, _, key = path.partition("://")[2].partition("/")
    return storage.Client().bucket(bucket).blob(key)


def read_version(path: str) -> tuple[bytes | None, str | None]:
    """The lock's bytes and its version (S3: the ETag; GCS: the generation); (None, None) if there is none."""
    if path.startswith(GCS):
        from google.api_core.exceptions import GoogleAPIError, NotFound, PreconditionFailed

        blob = _gcs(path)
        try:
            blob.reload()  # its generation, then exactly that generation's bytes
            return blob.download_as_bytes(if_generation_match=blob.generation), str(blob.generation)
        except (NotFound, PreconditionFailed):  # none, or replaced meanwhile: the caller reads again
            return None, None
        except GoogleAPIError as e:
            raise store.StorageError(f"{path}: {e}") from None
    from botocore.exceptions import BotoCoreError, ClientError

    client, bucket, key = _s3(path)
    try:
        answer = client.get_object(Bucket=bucket, Key=key)
        return answer["Body"].read(), answer["ETag"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None, None
        raise store.StorageError(f"{path}: {e}") from None
    except BotoCoreError as e:  # no answer at all (a refused or cut connection, a timeout)
        raise store.StorageError(f"{path}: {e}") from None


def _release(path: str, me: dict) -> None:
    try:
        raw, etag = read_version(path)
        if raw and _holder(raw) == me:
            remove_version(path, etag)
    except OSError as e:  # the storage does not answer: the lock stays, stale once this process ends
        _left_in_place(path, e)


def _left_in_place(path: str, why: OSError) -> None:
    print(f"warning: {path} is left in place ({store.first_line(why)}); the next run of this study on "
          "this host takes it over", file=sys.stderr, flush=True)


def remove_version(path: str, etag: str | None = None) -> None:
    if etag and path.startswith(GCS):  # only the generation read as ours
        from google.api_core.exceptions import GoogleAPIError, NotFound, PreconditionFailed

        try:
            _gcs(path).delete(if_generation_match=int(etag))
        except (PreconditionFailed, NotFound):
            pass
        except GoogleAPIError as e:
            raise store.StorageError(f"{path}: {e}") from None
        return
    if etag and path.startswith("s3://"):  # only the object read as ours, not one a takeover put since
        from botocore.exceptions import BotoCoreError, ClientError

        client, bucket, key = _s3(path)
        try:
            client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in LOST_RACE:
                raise store.StorageError(f"{path}: {e}") from None
        except BotoCoreError as e:
            raise store.StorageError(f"{path}: {e}") from None
        return
    fs, inner = store.resolve(path)
    try:
        fs.delete_file(inner)
    except FileNotFoundError:
        pass
