"""The seam between the training loop and whoever runs it.

The loop calls `session.report(metrics, checkpoint_dir)` and asks `session.restore_dir()` for a
checkpoint to resume from. In-process (`python -m study.train`) a `LocalSession` prints progress;
under Ray (study/experiment/ray_trial.py) a session forwards to Ray Tune or Ray Train's report and checkpoint
APIs. The loop itself never imports Ray.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

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


def loopback_interface() -> str | None:
    """The network interface holding 127.0.0.1 (`lo` on Linux, `lo0` on macOS): gloo listens on the
    interface GLOO_SOCKET_IFNAME names, else on whatever the hostname resolves to (often the LAN)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


@contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """Set environment variables for the duration (None: leave as is)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def import_deepspeed():
    """`import deepspeed` without the MLflow its autotuner imports when installed (1.5 of its 4 s on
    2 cores, in every trial process; trials never use the autotuner or MLflow). A process that
    imported MLflow already keeps it."""
    pin_extension_builds()
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


def pin_extension_builds() -> None:
    """This environment's `ninja` first on PATH and a build folder of its own (unless the user set one)
    for DeepSpeed's JIT-built ops: two ninja versions on one folder read each other's build log as
    stale and rebuild in turn, holding the lock every DeepSpeed start waits on (docs/speed.md)."""
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "ninja")) and \
            os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join(filter(None, [bin_dir, os.environ.get("PATH")]))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extension_folder())


def extension_folder() -> str:
    """The default build folder of DeepSpeed's ops: this user's, this environment's and this host's own,
    in the user's cache as torch's default is (`~/.cache/torch_extensions/<environment>-<hash of its
    path>-<host>`). Not shared: users sharing one would share its builds and their locks, and nodes
    sharing a home folder (NFS) would see each other's live locks as stale, holders no local process is."""
    import hashlib
    import socket

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"
    return os.path.join(cache, "torch_extensions", f"{os.path.basename(sys.prefix)}-{tag}-{host}")


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group (Ray Train made one for N workers; in-process we make a 1-rank one).

    Returns (rank, world_size, device). gloo on CPU, nccl with CUDA.
    """
    deepspeed = import_deepspeed()
    load_comm_op()  # DeepSpeed's init loads it next, where a lock a killed process left would hang it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not (dist.is_initialized() or "RANK" in os.environ):
        # a private one-rank group nothing on the network can reach: an in-memory store (a TCPStore
        # listens on every interface, whatever host it is given), gloo and NCCL's bootstrap on the
        # loopback interface. NCCL reads its variable at its lazy init, so it stays set (this
        # process has no other group); LOCAL_RANK too: DeepSpeed asks for it.
        os.environ.setdefault("LOCAL_RANK", "0")
        lo = loopback_interface()
        if backend == "nccl" and lo:
            os.environ["NCCL_SOCKET_IFNAME"] = lo
        with _env(GLOO_SOCKET_IFNAME=lo):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend)  # wraps the group Ray Train or we made
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def load_comm_op(recheck_s: float = 1.0) -> None:
    """Load DeepSpeed's CPU comm op (JIT-built by torch) before DeepSpeed asks for it, one process at
    a time, under an exclusive flock of ours in the op's build folder. torch holds a `lock` file
    around every load, built or not, and a process killed inside (Ray kills a stopped trial's actor)
    leaves it behind: every later load on this machine would wait on it forever. Under our flock no
    other trial is loading, so a lock no process holds open is such a leftover and is removed.
    DeepSpeed keeps the loaded op, and its own call returns it."""
    import fcntl

    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible(False):  # DeepSpeed loads no such op here
        return
    pin_extension_builds()
    folder = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "load.flock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel however this process ends
        lock = os.path.join(folder, "lock")
        if remove_stale_lock(lock, recheck_s):
            print(f"warning: removed {lock}, a torch extension lock that a process killed while it loaded "
                  "DeepSpeed's op left behind (every later load would have waited on it forever)", file=sys.stderr)
        elif os.path.exists(lock):  # held, or not ours to judge: torch waits for it
            print(f"note: waiting for {lock} (a build or load of DeepSpeed's op holds it, or it is not this "
                  "user's to remove; if no such process runs anywhere, remove the file)", file=sys.stderr,
                  flush=True)
        builder.load()  # what deepspeed.comm.torch.build_shm_op loads, kept by DeepSpeed for it


def _maybe_held(path: str, owner: int) -> bool:
    """Whether a process may hold `path` open (torch's FileBaton keeps the lock open from creating it
    until it deletes it, and a build does not touch its mtime): one that has it open, or a Python
    process (the baton's holder is the one that builds) of the lock's owner whose open files cannot be
    read (only the owner's processes made it)."""
    import psutil

    real = os.path.realpath(path)
    for proc in psutil.process_iter(["uids", "name"]):
        try:
            if any(f.path == real for f in proc.open_files()):
                return True
        except psutil.NoSuchProcess:  # gone
            continue
        except psutil.Error:  # not ours to inspect: a holder only if it runs Python as the lock's owner
            uids, name = proc.info.get("uids"), proc.info.get("name") or "python"
            if (uids is None or owner in (uids.real, uids.effective)) and "python" in name.lower():
                return True
    return False


def remove_stale_lock(path: str, recheck_s: float = 1.0) -> bool:
    """Remove a torch extension lock file of this user that no process of this machine may hold open
    and that is still the same file `recheck_s` later (a holder closes it an instant before deleting
    it). Left alone: a lock a running load or build holds, another user's (their processes cannot be
    inspected), and one a process of this user might hold but cannot be inspected. Processes in
    another pid namespace (a container sharing the folder) are not seen: the default folder is per
    user (extension_folder). Returns whether it removed one."""
    try:
        before = os.stat(path)
    except OSError:  # none, or one this user cannot even look at
        return False
    if before.st_uid != os.geteuid() or _maybe_held(path, before.st_uid):
        return False
    time.sleep(recheck_s)
    try:
        after = os.stat(path)
    except FileNotFoundError:  # released meanwhile
        return False
    if (before.st_ino, before.st_mtime_ns) != (after.st_ino, after.st_mtime_ns) or \
            _maybe_held(path, after.st_uid):
        return False
    try:
        os.remove(path)
    except OSError:  # gone meanwhile, or a folder this user may not change (PermissionError): left as it is
        return False
    return True


class FolderSession:
    """In-process runs that keep their last checkpoint in `folder`, so the trained model can be
    rebuilt afterwards (`trial.loop.load_trained(folder)`) for an analysis; no resume."""

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
