"""Tune experiment snapshots on the events a resume depends on (a trial that ended, a trial's
checkpoint), not on Tune's timer: `snapshots_on_events` wraps the controller's one snapshot call
(private: study/ray_compat.py) so that a snapshot is taken, uploaded and read back when the
SnapshotGate says one is due, and its followers are told only then. A verified snapshot is also
written as one object (`last-complete-snapshot.json`), from which `--resume` starts. Why each part
is as it is, with the measurements: docs/records.md, "Snapshots on events"."""

from __future__ import annotations

import base64
import errno
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import pyarrow.fs as pafs
from ray.tune import Callback

from study import ray_compat
from trial import storage as store

# a backstop only: the events above are what resume needs (Tune's own default is "auto", >= 10 s)
BACKSTOP_PERIOD_S = "900"
PROBE_S = 10.0  # storage not read from for this long is probed (one HEAD), so that an outage is seen
PROBE_DOWN_S = 5.0  # while it does not answer, it is probed this often
COMPLETE = "last-complete-snapshot.json"  # beside Tune's state files, in the experiment's folder
# Tune's state files, one set per driver session (its start time, "%Y-%m-%d_%H-%M-%S"): a resume
# reads the newest of each kind by name
STATE_FILE = re.compile(r"^(experiment_state|search_gen_state|searcher-state|callback-states|"
                        r"basic-variant-state)-(?P<session>\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d)\.(json|pkl)$")


COALESCE_S = float(os.environ.get("STUDY_SNAPSHOT_COALESCE_S", "5"))
SNAPSHOT_SHARE = 0.1  # and longer while snapshots take more than this share of the driver's time


class SnapshotDue:
    """When the next snapshot is due: at once (`checkpoint(first=False)`), or once COALESCE_S have
    passed since the last one (`after_coalescing()`, `checkpoint(first=True)`), or longer, so that snapshots take
    at most SNAPSHOT_SHARE of the driver's time whatever the number of trials."""

    def __init__(self):
        self.at = math.inf  # the monotonic time it is due
        self.last = time.monotonic()
        self.wait = COALESCE_S
        self.asked: float | None = None  # when `is_due()` last said it was due

    def after_coalescing(self) -> None:
        self.at = min(self.at, self.last + self.wait)

    def checkpoint(self, first: bool) -> None:
        self.at = min(self.at, self.last + self.wait) if first else -math.inf

    def is_due(self) -> bool:
        if time.monotonic() < self.at:
            return False
        self.asked = time.monotonic()
        return True

    def snapshot_taken(self) -> None:
        done = time.monotonic()
        if self.asked is not None:
            self.wait = max(COALESCE_S, (done - self.asked) * (1 - SNAPSHOT_SHARE) / SNAPSHOT_SHARE)
        self.at, self.last, self.asked = math.inf, done, None


class SnapshotListener(Protocol):
    def snapshot_due(self) -> bool:
        """True when something happened since the last snapshot that a resume must see."""

    def on_snapshot(self) -> None:
        """Called after a snapshot that is in storage."""


class SnapshotFollower(Protocol):
    def snapshot_stored(self) -> None:
        """A snapshot is in storage: what it records as terminated, a resume will not run again."""


class SnapshotGate(Callback):
    """The study's SnapshotListener: Tune's events a resume depends on (a trial that completed or
    errored, a trial's checkpoint) make a snapshot due (SnapshotDue); each snapshot in storage is
    passed on to the followers (the MLflow record marks a trial's run FINISHED only then)."""

    def __init__(self, followers: list[SnapshotFollower] | tuple[SnapshotFollower, ...] = ()):
        self.due = SnapshotDue()
        self.followers = list(followers)

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        self.due.checkpoint(first=trial.checkpoint is None)  # Tune registers this one after the callbacks

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.due.after_coalescing()

    def on_trial_error(self, iteration, trials, trial, **info):
        self.due.after_coalescing()

    def snapshot_due(self) -> bool:
        return self.due.is_due()

    def on_snapshot(self) -> None:
        self.due.snapshot_taken()
        for follower in self.followers:
            follower.snapshot_stored()


class StorageWatch:
    """Whether the study's storage answers, as the controller sees it; `lost` says why the study was
    stopped (None: it was not), `full` whether for a full (or read-only) disk, which stops it at once."""

    def __init__(self, wait_s: float | None = None):
        self.wait_s = store.WAIT_S if wait_s is None else wait_s
        self.checked = time.monotonic()  # the last read (a snapshot or a probe), answered or not
        self.down_since: float | None = None
        self.lost: str | None = None
        self.full = False

    def refused(self, uri: str, error: OSError) -> None:
        """The storage answered a write with a refusal (a full or read-only disk, no permission):
        waiting frees no space, so the study stops now, saying which."""
        self.checked = time.monotonic()
        if self.lost is None:
            self.full = error.errno in store.NO_SPACE_ERRNOS
            self.lost = store.disk_full(uri, error) if self.full else None
            self.lost = self.lost or f"{uri} refused a write: {store.first_line(error)}"

    def answered(self) -> None:
        if self.down_since is not None:
            print(f"storage: answering again after {time.monotonic() - self.down_since:.0f} s; "
                  "the study goes on", flush=True)
            self.down_since = None
        self.checked = time.monotonic()

    def failed(self, uri: str, error: BaseException) -> None:
        self.checked = time.monotonic()
        if self.down_since is None:
            self.down_since = self.checked
            _warn(f"--storage: {uri} does not answer ({store.first_line(error)}); the trials wait for it, "
                  f"and the study stops if it does not answer within {self.wait_s:g} s "
                  "(STUDY_STORAGE_WAIT_S)")
        elif self.checked - self.down_since >= self.wait_s and self.lost is None:
            self.lost = (f"{uri} did not answer for {self.checked - self.down_since:.0f} s "
                         f"(STUDY_STORAGE_WAIT_S {self.wait_s:g}); last: {store.first_line(error)}")

    def probe_due(self) -> bool:
        return time.monotonic() - self.checked >= (PROBE_S if self.down_since is None else PROBE_DOWN_S)


class _StorageNoise(logging.Filter):
    """Ray logs each failed storage call of the controller with a traceback, at every try, and a study
    stopped for its storage as if by Ctrl-C ("the most recent state was saved"): the watch says what
    happened, once, with the URI."""

    LOGGERS = ray_compat.STORAGE_LOGGERS
    STOPPED = ("Stop signal received", "Experiment has been interrupted")

    def __init__(self, watch: StorageWatch):
        super().__init__()
        self.watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Saving experiment state to storage"):
            return False
        if record.exc_info and isinstance(record.exc_info[1], OSError):
            return False
        return not (self.watch.lost and message.startswith(self.STOPPED))


@contextmanager
def snapshots_on_events(listener: SnapshotListener) -> Iterator[StorageWatch]:
    """While Tune runs inside this block, its controller snapshots (and waits for the upload) in
    every step in which `listener.snapshot_due()`, and calls `listener.on_snapshot()` after every
    snapshot it waited for. Yields the storage's watch: its `lost` is set when the study was stopped
    because the storage did not answer."""
    watch = StorageWatch()
    stopping: list[bool] = []

    def wrap(original):
        def checkpoint(self, force: bool = False, wait: bool = False):
            if watch.lost and force and wait:  # Tune's final save, to a storage given up on: each of its
                return  # calls would wait out the S3 client's retries; a resume reads the last complete one
            due = listener.snapshot_due()
            try:
                original(self, force=force or due, wait=wait or due)
            finally:
                # Tune logs a failed upload and goes on: only a state read back from storage counts, and
                # until one does, `due` stays true and every controller step tries again
                if due or (force and wait):
                    if in_storage(self, watch) and mark_complete(self, watch):
                        listener.on_snapshot()
                elif watch.probe_due():
                    probe(self, watch)
                if watch.lost and not (force and wait) and not stopping:  # not in Tune's final save
                    stopping.append(True)
                    signal.raise_signal(signal.SIGINT)  # Tune's own stop, as on Ctrl-C
        return checkpoint

    quiet = _StorageNoise(watch)
    for name in quiet.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        # a checkpoint the storage cannot delete now is left behind (only unused), not raised
        with ray_compat.checkpoint_deletion_replaced(_delete_or_leave), ray_compat.controller_checkpoint_wrapped(wrap):
            yield watch
    finally:
        for name in quiet.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)


def _delete_or_leave(fs, fs_path: str) -> None:
    """Delete a file or folder in storage; one the storage cannot delete now is left, and said so."""
    try:
        info = fs.get_file_info(fs_path)
        if info.type == pafs.FileType.File:
            fs.delete_file(fs_path)
        elif info.type == pafs.FileType.Directory:
            fs.delete_dir(fs_path)
    except OSError as e:
        _warn(f"{store.uri_of(fs, fs_path)} was not deleted ({store.first_line(e)}); it stays, unused")


def _uri(controller) -> str:
    return store.uri_of(ray_compat.controller_storage(controller).storage_filesystem, ray_compat.controller_storage(controller).experiment_fs_path)


def in_storage(controller, watch: StorageWatch | None = None) -> bool:
    """Whether the experiment state the controller just saved is in the study's storage, byte for
    byte."""
    from pathlib import Path

    staged, remote = ray_compat.experiment_state_paths(controller)
    try:
        with ray_compat.controller_storage(controller).storage_filesystem.open_input_stream(remote) as f:
            stored = f.read()
    except OSError as e:
        if watch is not None and not isinstance(e, FileNotFoundError):
            watch.failed(_uri(controller), e)
        else:
            _warn(f"the experiment state is not in storage ({remote}: {store.first_line(e)}); "
                  "trials stay unfinished in MLflow until a snapshot reaches it")
        return False
    if watch is not None:
        watch.answered()
    if stored != Path(staged).read_bytes():
        full = store.disk_full(_uri(controller))  # Tune's upload to a full disk fails in its own log only
        if full and watch is not None:
            watch.refused(_uri(controller), OSError(errno.ENOSPC, full))
        else:
            _warn(f"the experiment state in storage ({remote}) is not the one just saved; trying again")
        return False
    return True


def mark_complete(controller, watch: StorageWatch) -> bool:
    """Write the state files of the snapshot just verified in storage as one object (COMPLETE), from
    the driver's staging folder (what Tune uploaded); False if the storage did not take it."""
    from pathlib import Path

    staged, _ = ray_compat.experiment_state_paths(controller)
    session = STATE_FILE.match(Path(staged).name)
    if session is None:
        raise RuntimeError(f"ray.tune's experiment state file {Path(staged).name} is not named as "
                           "study/experiment/snapshots.py expects")
    files = {}
    for path in sorted(Path(staged).parent.iterdir()):
        match = STATE_FILE.match(path.name)
        if match and match["session"] == session["session"] and path.is_file():
            files[path.name] = base64.b64encode(path.read_bytes()).decode()
    record = json.dumps({"session": session["session"], "files": files}).encode()
    try:
        store.write_atomic(store.join(_uri(controller), COMPLETE), record)  # renamed into place, or one PUT
    except OSError as e:
        if store.is_outage(e):
            watch.failed(_uri(controller), e)
        else:  # a full disk (ENOSPC) is not an outage: said at once, not after STUDY_STORAGE_WAIT_S
            watch.refused(_uri(controller), e)
        return False
    return True


class UnsafeSnapshot(ValueError):
    """COMPLETE holds what no snapshot of ours writes (a file name that is not one of Tune's state
    files, such as `../../x`); the message names the object and the field. Nothing was written."""


def _checked_record(raw: bytes, where: str) -> tuple[str, dict[str, bytes]]:
    """(session, {file name: bytes}) of COMPLETE, every name one of Tune's state files of that session:
    the storage is not trusted with where a resume writes (a name with `/` or `..` would leave the folder)."""
    try:
        record = json.loads(raw)
        session, files = record["session"], record["files"]
        if not (isinstance(session, str) and isinstance(files, dict)):
            raise TypeError("session or files of the wrong type")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested too deeply
        raise UnsafeSnapshot(f"{where}: not a snapshot record ({' '.join(str(e).split())[:200]})") from None
    if not STATE_FILE.fullmatch(f"experiment_state-{session}.json"):  # fullmatch: `$` admits a final newline
        raise UnsafeSnapshot(f"{where}: session {session[:100]!r} is not a Tune session time")
    decoded = {}
    for name, encoded in files.items():
        match = STATE_FILE.fullmatch(name) if isinstance(name, str) else None
        if match is None or match["session"] != session:
            raise UnsafeSnapshot(f"{where}: files: {str(name)[:200]!r} is not a Tune state file of session {session}")
        try:
            decoded[name] = base64.b64decode(encoded, validate=True)
        except (ValueError, TypeError):
            raise UnsafeSnapshot(f"{where}: files: {name}: not base64") from None
    return session, decoded


def restore_complete_snapshot(tune_dir: str) -> list[str]:
    """Before a resume: make Tune's state files in `tune_dir` those of the last complete snapshot
    (COMPLETE): each one that differs is written back, and any of a later driver session is removed
    (a snapshot not known to be complete). Returns the files changed; none for a study whose
    snapshots predate COMPLETE. UnsafeSnapshot, before anything is written, if COMPLETE names a file
    that is not one of Tune's state files."""
    where = store.redact(store.join(tune_dir, COMPLETE))
    raw = store.read_bytes(store.join(tune_dir, COMPLETE))
    if raw is None:
        return []
    session, files = _checked_record(raw, where)
    changed = []
    try:
        for name, data in files.items():
            path = store.join(tune_dir, name)
            if store.read_bytes(path) != data:
                store.write_atomic(path, data)
                changed.append(name)
        fs, inner = store.resolve(tune_dir)
        for info in fs.get_file_info(pafs.FileSelector(inner)):
            match = STATE_FILE.match(info.base_name)
            if info.type == pafs.FileType.File and match and match["session"] > session:
                fs.delete_file(info.path)
                changed.append(info.base_name)
    except OSError as e:
        raise store.StorageError(f"{store.redact(tune_dir)}: cannot put back the last complete snapshot: "
                                 f"{store.first_line(e)}") from None
    return changed


def probe(controller, watch: StorageWatch) -> None:
    """One HEAD of the experiment state in storage: does the storage answer?"""
    try:
        ray_compat.controller_storage(controller).storage_filesystem.get_file_info(ray_compat.experiment_state_paths(controller)[1])
    except OSError as e:
        watch.failed(_uri(controller), e)
    else:
        watch.answered()


def _warn(text: str) -> None:
    import sys

    print(f"warning: {text}", file=sys.stderr, flush=True)
