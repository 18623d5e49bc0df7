"""Tune experiment snapshots on the events a resume depends on, not on every controller step.

Tune (Ray 2.60) saves its experiment state (trial statuses, the searcher, the callbacks) and
uploads the driver's staging folder to the study's storage from its controller loop, on a timer
(`TUNE_GLOBAL_CHECKPOINT_S`); it has no event hook. On a timer a killed driver's restored state
lags what MLflow already shows (a trial finished in MLflow, unknown or running for Tune, redone as
a new trial: a duplicate run). With the timer at 0 (a snapshot every controller step, ~10 a
second) the lag was small but the writes were not: ~150 MB per smoke study, ~15 GB per default
study, a request storm on a bucket.

What a resume needs durable is small: a trial completed or errored (its status), and a trial's new
checkpoint (the state must name a checkpoint that still exists; with `num_to_keep=2` the one it
named before is deleted at the next). So in any controller step in which one of these happened the
controller snapshots and waits for the upload; the timer is only a backstop. The listener (the
study's tracker) is told after each snapshot that is in storage: it marks a trial's MLflow run
FINISHED only then, so "finished in MLflow" implies "terminated in the state a resume reads".

Private API: this wraps `TuneController.checkpoint(force, wait)`, the one call through which the
controller snapshots (its loop, and the final save in `ray.tune.tune.run`). Ray has no public way
to snapshot on demand. tests/test_snapshots.py fails if the method, its arguments, or what a
forced, waited snapshot leaves in storage change.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator, Protocol

# a backstop only: the events above are what resume needs (Tune's own default is "auto", >= 10 s)
BACKSTOP_PERIOD_S = "900"


class SnapshotListener(Protocol):
    def snapshot_due(self) -> bool:
        """True when something happened since the last snapshot that a resume must see."""

    def on_snapshot(self) -> None:
        """Called after a snapshot that is in storage."""


@contextmanager
def snapshots_on_events(listener: SnapshotListener) -> Iterator[None]:
    """While Tune runs inside this block, its controller snapshots (and waits for the upload) in
    every step in which `listener.snapshot_due()`, and calls `listener.on_snapshot()` after every
    snapshot it waited for."""
    from ray.tune.execution.tune_controller import TuneController

    original = TuneController.checkpoint
    if list(inspect.signature(original).parameters) != ["self", "force", "wait"]:
        raise RuntimeError("ray.tune's TuneController.checkpoint(force, wait) changed; "
                           "study/snapshots.py must follow it")

    def checkpoint(self, force: bool = False, wait: bool = False):
        due = listener.snapshot_due()
        original(self, force=force or due, wait=wait or due)
        # Tune logs a failed upload and goes on: only a state read back from storage counts, and
        # until one does, `due` stays true and every controller step tries again
        if (due or (force and wait)) and in_storage(self):
            listener.on_snapshot()

    TuneController.checkpoint = checkpoint
    try:
        yield
    finally:
        TuneController.checkpoint = original


def in_storage(controller) -> bool:
    """Whether the experiment state the controller just saved is in the study's storage, byte for
    byte. Private API, like the wrap above: the controller's `_storage` (a StorageContext) and
    `experiment_state_file_name`; tests/test_snapshots.py fails if they change."""
    from pathlib import Path

    name = controller.experiment_state_file_name
    staged = Path(controller._storage.experiment_driver_staging_path, name)
    remote = f"{controller._storage.experiment_fs_path}/{name}"
    try:
        with controller._storage.storage_filesystem.open_input_stream(remote) as f:
            stored = f.read()
    except OSError as e:
        _warn(f"the experiment state is not in storage ({remote}: {str(e).splitlines()[0]}); "
              "trials stay unfinished in MLflow until a snapshot reaches it")
        return False
    if stored != staged.read_bytes():
        _warn(f"the experiment state in storage ({remote}) is not the one just saved; trying again")
        return False
    return True


def _warn(text: str) -> None:
    import sys

    print(f"warning: {text}", file=sys.stderr, flush=True)
