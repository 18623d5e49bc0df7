"""Where studies live: a local folder or an object-store URI (`s3://bucket/prefix`, `gs://bucket/prefix`,
or any URI pyarrow.fs knows).

Ray Tune and Ray Train take the URI itself as their storage path (pyarrow.fs underneath); what the
platform writes beside them (results.csv, summary.csv, figures) and reads back (the `--resume`
check, checkpoints for an analysis) goes through these few helpers, so nothing assumes a local
folder. Credentials and endpoints are the cloud SDKs' own (instance roles, service accounts,
AWS_* / GOOGLE_APPLICATION_CREDENTIALS; AWS_ENDPOINT_URL for an S3-compatible server), never a file
of this project's.
"""

from __future__ import annotations

import errno
import os
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from trial.uri_secrets import redact, scrub, secret_keys, userinfo  # noqa: F401  (re-exported: printed URIs are masked)

# pyarrow's filesystem type names -> URI schemes (for paths Ray hands back without one)
SCHEMES = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs"}


# How long a study waits for its storage when it stops answering (a bucket unreachable): the driver
# stops the study after this long (exit 1, resumable; study/experiment/snapshots.py), and a trial waits longer for
# its checkpoint (twice this plus 2 minutes), so that a study stops, it never fails a trial, for it.
WAIT_S = float(os.environ.get("STUDY_STORAGE_WAIT_S", "300"))

T = TypeVar("T")


class StorageError(OSError):
    """The storage cannot be used; the message names the URI and what the store answered."""


class StorageUnreachable(StorageError):
    """The study's storage did not answer for longer than STUDY_STORAGE_WAIT_S; the study stopped."""


class StorageFull(StorageError):
    """The study's storage (or the driver's staging disk) is full, or refused a write; the study stopped
    at once."""


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


# what a storage answers (a missing object, a refusal, a full or read-only disk): not worth waiting for
DEFINITE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def is_outage(error: OSError) -> bool:
    """Whether an OSError says the storage did not answer (pyarrow's S3 and GCS errors, which carry no
    errno; a connection refused or timed out), not what it answered."""
    return not isinstance(error, DEFINITE_ERRORS) and error.errno not in NO_SPACE_ERRNOS


def retry_through_outage(call: Callable[[], T], what: str, wait_s: float | None = None, pause_s: float = 5.0) -> T:
    """`call()`, tried again while it raises an OSError that says the storage did not answer, for up
    to `wait_s` (default: a trial's wait, 2 x WAIT_S + 120 s); then the last error. Says so once on
    stderr (a trial's: its Ray worker log)."""
    deadline = time.monotonic() + (2 * WAIT_S + 120 if wait_s is None else wait_s)
    since = None
    while True:
        try:
            result = call()
        except OSError as e:
            if not is_outage(e) or time.monotonic() >= deadline:
                raise
            if since is None:
                since = time.monotonic()
                print(f"warning: {what}: the storage does not answer ({first_line(e)}); trying again",
                      file=sys.stderr, flush=True)
            time.sleep(pause_s)
            continue
        if since is not None:
            print(f"{what}: done after {time.monotonic() - since:.0f} s", file=sys.stderr, flush=True)
        return result


def is_uri(path: str) -> bool:
    return "://" in str(path)


def local_path_of(uri: str) -> str | None:
    """The path a `file:` URI names on this machine (`file:///x`, `file://localhost/x`), else None."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        return None
    return unquote(parts.path) or None


def absolute(storage: str) -> str:
    """A URI as given (less a trailing slash), a local path made absolute; a `file:` URI is the
    local path it names (so `file:///new-dir` is created like `/new-dir`)."""
    if is_uri(storage):
        local = local_path_of(storage)
        return os.path.abspath(local) if local else storage.rstrip("/")
    return os.path.abspath(storage)


def join(base: str, *parts: str) -> str:
    """`base/part/...`; a URI's query string (if any) stays at the end, where it belongs."""
    if is_uri(base):
        head, sep, query = base.partition("?")
        return "/".join([head.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query
    return os.path.join(base, *parts)


def unlockable(uri: str) -> str | None:
    """Why a study in this bucket cannot hold a driver lock (study/experiment/lock.py), or None: the lock needs
    a write the store refuses when the object is there (S3's If-None-Match, GCS's generation match
    through google-cloud-storage); no other store offers one here."""
    scheme = uri.partition("://")[0].lower()
    if scheme == "s3":
        return None
    if scheme in ("gs", "gcs"):
        try:
            import google.cloud.storage  # noqa: F401
        except ImportError:
            return ("the driver lock of a gs:// study needs google-cloud-storage (pip install -e '.[gcp]'), "
                    "whose generation preconditions take it atomically; it is not installed")
        return None
    return (f"{scheme}:// storage offers no conditional write here, so no driver lock can be taken "
            "atomically (two drivers could run one study); use a folder, s3:// or gs://")


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a URI or a local path."""
    if is_uri(path):
        try:
            return pafs.FileSystem.from_uri(path)
        except (ValueError, OSError) as e:  # pyarrow: ArrowInvalid (a ValueError) or an OSError
            raise StorageError(f"{redact(path)}: {scrub(str(e), path)}") from None
    return pafs.LocalFileSystem(), os.path.abspath(path)


def exists(path: str) -> bool:
    fs, inner = resolve(path)
    try:
        return fs.get_file_info(inner).type != pafs.FileType.NotFound
    except OSError as e:
        raise StorageError(f"{redact(path)}: {scrub(str(e), path)}") from None


def upload_dir(local_dir: str, dest: str) -> None:
    """Copy a local folder's files to `dest` (a URI or a local folder)."""
    fs, inner = resolve(dest)
    fs.create_dir(inner, recursive=True)
    pafs.copy_files(local_dir, inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download_dir(source: str, local_dir: str) -> str:
    """Copy the files under `source` into `local_dir`; returns local_dir."""
    fs, inner = resolve(source)
    os.makedirs(local_dir, exist_ok=True)
    pafs.copy_files(inner, local_dir, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return local_dir


def check_writable(path: str) -> None:
    """Write, read back and delete a small probe object under `path`, so that an unreachable or
    unauthorised bucket stops a study before any trial starts (not after its first checkpoint)."""
    fs, inner = resolve(path)
    probe = f"{inner.rstrip('/')}/.write-probe-{uuid.uuid4().hex}"
    try:
        if not is_uri(path):  # a folder must exist to hold the probe
            fs.create_dir(inner, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        with fs.open_input_stream(probe) as f:
            if f.read() != b"ok":
                raise OSError("the probe object read back different bytes")
        fs.delete_file(probe)
    except OSError as e:
        raise StorageError(f"{redact(path)}: cannot write there: {scrub(str(e).splitlines()[0], path)}") from None


@contextmanager
def weights_only_loads():
    """Every `torch.load` inside reads tensors and plain data only, whatever `weights_only` its caller
    passes (DeepSpeed's ZeRO-3 reader passes False): a checkpoint is found through an MLflow tag
    anyone with write access to the tracking store can set, and a pickle may run any code. The two
    DeepSpeed classes its optimizer states hold are allowed (restored as data, no code of theirs runs)."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address  # ZeRO-1/2 optimizer states hold it

    saved = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # torch reads it at every load
    try:
        with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, fragment_address]):
            yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved


def uri_of(filesystem: pafs.FileSystem | None, path: str) -> str:
    """A full URI for a path Ray reports together with its filesystem (a checkpoint on S3 comes
    back as `bucket/prefix/...`): what an MLflow tag must hold to be found again."""
    if filesystem is None or isinstance(filesystem, pafs.LocalFileSystem) or is_uri(path):
        return path
    scheme = SCHEMES.get(filesystem.type_name, filesystem.type_name)
    return f"{scheme}://{path}"


def write_atomic(path: str, data: bytes) -> None:
    """Write a whole file or object, never a part of one: a folder's file is written under a
    temporary name and renamed over the old one (a crash leaves the old file or the new, nothing
    between); a bucket's object is put in one request, which object stores make visible whole."""
    fs, inner = resolve(path)
    if is_uri(path):
        with fs.open_output_stream(inner) as out:
            out.write(data)
        return
    os.makedirs(os.path.dirname(inner), exist_ok=True)
    tmp = f"{inner}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, inner)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_bytes(path: str) -> bytes | None:
    """A file's or object's bytes; None when there is none."""
    fs, inner = resolve(path)
    try:
        with fs.open_input_stream(inner) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        try:
            if fs.get_file_info(inner).type == pafs.FileType.NotFound:
                return None
        except OSError:
            pass
        raise StorageError(f"{redact(path)}: {scrub(first_line(e), path)}") from None


FULL_BELOW_BYTES = 8 << 20  # a folder's disk with less free space than this counts as full


def disk_full(path: str, error: BaseException | None = None) -> str | None:
    """Why the disk under a local `path` is full (out of space: ENOSPC somewhere in `error`'s chain,
    or under FULL_BELOW_BYTES free), or None; for a bucket, the driver's local staging (_staging_full)."""
    import shutil

    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            break
        e = e.__cause__ or e.__context__
    if is_uri(path):
        return _staging_full(path, e)
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if e is not None or free < FULL_BELOW_BYTES:
        return f"the disk under {path} is full ({free / 2**20:.1f} MiB free)"
    return None


def _staging_full(uri: str, enospc: OSError | None) -> str | None:
    """disk_full for a bucket: the study is in the bucket, but the driver stages on its own disk (its
    MLflow SQLite store in ./studies, Tune's and the report's temporary files): the folder the full
    write named, else the first of those folders under FULL_BELOW_BYTES free."""
    import shutil
    import tempfile

    named = getattr(enospc, "filename", None)
    folders = [os.path.dirname(os.path.abspath(named))] if isinstance(named, str) else [
        os.path.abspath("studies"), tempfile.gettempdir()]
    free = {}
    for folder in folders:
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        free[folder] = shutil.disk_usage(folder).free
    folder = min(free, key=free.get)  # the fullest
    if enospc is None and free[folder] >= FULL_BELOW_BYTES:
        return None
    return (f"the local disk under {folder}, where the driver stages the study for {redact(uri)}, is full "
            f"({free[folder] / 2**20:.1f} MiB free)")
