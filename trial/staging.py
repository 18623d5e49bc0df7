"""Where a checkpoint is written before the session takes it.

Each report writes a whole DeepSpeed checkpoint (weights and optimizer state) into a local folder and
hands it to the session, which copies it to the study's storage. A process killed while it writes
(an early-stopped or preempted trial, an OOM kill) leaves that folder behind, since a
`TemporaryDirectory` cannot clean up after SIGKILL, and a node that runs many trials fills its disk.
So a staging folder holds an exclusive `flock` on its `.in-use` file for as long as it is used. The
kernel releases the lock when the process ends however it ends. `remove_abandoned` removes every
staging folder whose lock it can take. No pid or host name is consulted, since containers that
share /tmp would fool them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "ckpt-staging-"
LOCK_FILE = ".in-use"


@contextmanager
def checkpoint_staging(root: str | None = None) -> Iterator[str]:
    """A fresh folder for one checkpoint, removed on exit (or by a later `remove_abandoned`)."""
    root = root or tempfile.gettempdir()
    # set up under a name the sweep ignores, then renamed: it never sees a folder whose lock is not held yet
    setup = tempfile.mkdtemp(prefix=".ckpt-setup-", dir=root)
    lock = open(os.path.join(setup, LOCK_FILE), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        staged = os.path.join(root, PREFIX + os.path.basename(setup)[len(".ckpt-setup-"):])
        os.rename(setup, staged)
        checkpoint = os.path.join(staged, "checkpoint")
        os.mkdir(checkpoint)
        try:
            yield checkpoint
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    finally:
        shutil.rmtree(setup, ignore_errors=True)  # only if the rename never happened
        lock.close()


def remove_abandoned(root: str | None = None) -> list[str]:
    """Remove the staging folders whose process is gone (their lock is free); returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            lock = open(os.path.join(path, LOCK_FILE))
        except OSError:  # gone already, or not ours to read
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a process is writing or reporting it
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
