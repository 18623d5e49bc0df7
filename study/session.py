"""The seam between the training loop and whoever runs it.

The loop calls `session.report(metrics, checkpoint_dir)` and asks `session.restore_dir()` for a
checkpoint to resume from. In-process (`python -m study.train`) a `LocalSession` prints progress;
under Ray (study/trial.py) a session forwards to Ray Tune or Ray Train's report and checkpoint
APIs. The loop itself never imports Ray.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Protocol

import torch
import torch.distributed as dist


class Session(Protocol):
    checkpointing: bool

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None: ...

    @contextmanager
    def restore_dir(self) -> Iterator[str | None]: ...


class LocalSession:
    """In-process runs: progress lines on stderr, no checkpoints."""

    checkpointing = False

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.start = time.time()

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        keys = ("step", "loss", "val_loss", "val_exact", "val_answer_acc", "acc_in_dist", "acc_beyond")
        shown = "  ".join(
            f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
            for k in keys if k in metrics
        )
        print(f"[{time.time() - self.start:6.1f}s] {shown}", file=self.stream, flush=True)

    @contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        yield None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group (Ray Train made one for N workers; in-process we make a 1-rank one).

    Returns (rank, world_size, device). gloo on CPU, nccl with CUDA.
    """
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized() or "RANK" in os.environ:  # Ray Train / a launcher set up the group
        deepspeed.init_distributed(dist_backend=backend)
    else:  # a private one-rank group on a free port; only LOCAL_RANK (DeepSpeed asks) goes to env
        os.environ.setdefault("LOCAL_RANK", "0")
        deepspeed.init_distributed(
            dist_backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
            auto_mpi_discovery=False,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


class FolderSession:
    """In-process runs that keep their last checkpoint in `folder`, so the trained model can be
    rebuilt afterwards (`study.train.load_trained(folder)`) for an analysis; no resume."""

    checkpointing = True

    def __init__(self, folder: str):
        self.folder = folder

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        import shutil

        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, self.folder, dirs_exist_ok=True)

    @contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        yield None
