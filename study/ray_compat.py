"""Every private Ray name the platform relies on, in one place. Checked on Ray 2.60.0.

Each one is here because no public API does the job (the reason is beside it), and
tests/test_ray_compat.py fails when Ray renames, moves or re-signs one, so an upgrade of Ray breaks a
test here rather than a study. Nothing else in the project may name a private Ray module or
attribute (tests/test_architecture.py).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

CHECKED_ON = "2.60.0"

# Ray's loggers that report a failed storage call of the Tune controller (study/experiment/snapshots.py quiets them)
STORAGE_LOGGERS = ("ray.tune.execution.experiment_state", "ray.train._internal.storage", "ray.tune.tune")


def ray_address_from_environment() -> str | None:
    """What `address="auto"` resolves to on this machine (RAY_ADDRESS, then the newest local cluster).
    Private: `ray.init` resolves it only by connecting, and preflight must say "no cluster" first."""
    from ray._private.services import get_ray_address_from_environment

    return get_ray_address_from_environment("auto", None)


def token_auth_on_before_init() -> None:
    """Token authentication on for the embedded Ray, as Ray turns it on for any new local cluster, but
    set before `ray.init`, so Ray does not print how to opt out of it in every study. Ray reads
    RAY_AUTH_MODE once, at import: setting it later needs Ray's cached config refreshed (private; Ray's
    own default path does the same). A mode the user set is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")


def no_idle_workers_at_start() -> None:
    """The embedded Ray starts without the idle Python worker it prestarts a CPU for its first driver's
    tasks. A study's trials never run in them (Tune's trials are actors, started when scheduled), so
    they only cost each study's start: on the smoke study, 6 CPU-s of 38 and 3 s of 16. Private: Ray's
    internal config `prestart_worker_first_driver`, which its processes read from the environment (no
    public `ray.init` argument sets it). A value the user set is left alone."""
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def cluster_config_validated(raw: dict) -> dict:
    """A cluster-launcher YAML as `ray up` checks it: merged with the installed Ray's defaults for its
    provider (no cloud call) and validated against Ray's schema; returns the merged config. Private:
    `ray up` has no dry run. The fake_multinode provider ships no defaults file: its config is checked
    as it is, as its running autoscaler does."""
    from pathlib import Path

    from ray.autoscaler._private import providers
    from ray.autoscaler._private.util import prepare_config, validate_config

    defaults_file = providers._DEFAULT_CONFIGS[raw["provider"]["type"]]()
    config = prepare_config(raw) if Path(defaults_file).exists() else raw
    validate_config(config)
    return config


def node_ip_address() -> str:
    """The address Ray's nodes on this machine advertise (what a fake cluster's gcs_address needs)."""
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


def restored_tuner_configs(tuner):
    """(TuneConfig, RunConfig) of a Tuner made by `Tuner.restore`, which Tune reads again when fit()
    starts. Private: `Tuner.restore` takes no new TuneConfig/RunConfig, and a resume must apply the
    resumable changes (concurrency, warm processes, retries, this run's callbacks)."""
    local = tuner._local_tuner
    return local._tune_config, local.get_run_config()


def trial_configs(result_grid) -> dict[str, dict]:
    """Each trial's config by trial id, from the trials a ResultGrid was made of. Private: a Result's
    `config` is read from its last report, so a trial that failed before reporting (its process killed,
    say) has None there; Tune's Trial keeps the config it was started with."""
    return {trial.trial_id: trial.config for trial in result_grid._experiment_analysis.trials}


@contextmanager
def controller_checkpoint_wrapped(make_wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """While inside, Tune's controller saves its experiment state through `make_wrapper(original)`
    (original: `TuneController.checkpoint(self, force, wait)`). Private: Tune saves on a timer only,
    and a resume depends on a save after each event (study/experiment/snapshots.py)."""
    from ray.tune.execution.tune_controller import TuneController

    original = TuneController.checkpoint
    if list(inspect.signature(original).parameters) != ["self", "force", "wait"]:
        raise RuntimeError(f"ray.tune's TuneController.checkpoint(force, wait) changed (checked on Ray "
                           f"{CHECKED_ON}); study/ray_compat.py must follow it")
    TuneController.checkpoint = make_wrapper(original)
    try:
        yield
    finally:
        TuneController.checkpoint = original


@contextmanager
def checkpoint_deletion_replaced(replacement: Callable[[object, str], None]) -> Iterator[None]:
    """While inside, Tune deletes a trial's checkpoints beyond num_to_keep with `replacement(fs,
    fs_path)`. Private: the driver calls this as it takes a trial's report, and a storage that did not
    answer raised out of the controller's loop (the study ended in a traceback)."""
    from ray.train._internal import checkpoint_manager

    delete = checkpoint_manager._delete_fs_path
    if list(inspect.signature(delete).parameters) != ["fs", "fs_path"]:
        raise RuntimeError(f"ray.train's checkpoint_manager._delete_fs_path(fs, fs_path) changed (checked "
                           f"on Ray {CHECKED_ON}); study/ray_compat.py must follow it")
    checkpoint_manager._delete_fs_path = replacement
    try:
        yield
    finally:
        checkpoint_manager._delete_fs_path = delete


def controller_storage(controller):
    """The controller's StorageContext (filesystem, experiment path, driver staging path). Private:
    snapshots check that the state just saved is the one in storage."""
    return controller._storage


def experiment_state_paths(controller) -> tuple[str, str]:
    """(the experiment state file staged on the driver, where it is in storage)."""
    from pathlib import Path

    storage, name = controller._storage, controller.experiment_state_file_name
    return str(Path(storage.experiment_driver_staging_path, name)), f"{storage.experiment_fs_path}/{name}"


def report_retrying_under_one_index(report: Callable[[], None], retry: Callable) -> None:
    """In a Tune trial's process: `retry(call)` calls again a report whose checkpoint upload failed,
    under the same checkpoint_NNNNNN. Private: the session's StorageContext advances its
    `current_checkpoint_index` before each upload, so a plain retry would skip a number."""
    from ray.train._internal.session import get_session

    storage = get_session().storage
    index = storage.current_checkpoint_index

    def report_under_the_same_index():
        storage.current_checkpoint_index = index
        report()

    retry(report_under_the_same_index)


# --- N-worker trials on one machine: the process group meets on 127.0.0.1 -------------------------------
_LOOPBACK_STORES: list = []  # rank 0's store servers: torch reuses one (by port) only while it is referenced


def loopback_torch_config(backend: str):
    """A TorchConfig for Ray Train workers that share this machine (the embedded Ray), whose process
    group meets at a TCPStore listening on 127.0.0.1 only. Private: Ray's torch backend
    (`_TorchBackend.on_start`) hands rank 0's node address and a free port to torch's env://
    rendezvous, which makes rank 0 a TCPStore server on every interface whatever MASTER_ADDR says,
    and Ray offers no store or socket of ours. This backend first makes rank 0 a TCPStore server on a
    socket bound to 127.0.0.1 (torch's `master_listen_fd`), which the rendezvous's multi-tenant store
    reuses (torch shares one server per port within a process), then runs Ray's own setup steps."""
    from ray.train.torch import TorchConfig

    class LoopbackTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return _loopback_backend()

    return LoopbackTorchConfig(backend=backend)


def _loopback_backend():
    import ray
    from ray.train.torch.config import (
        _set_torch_distributed_env_vars,
        _setup_torch_process_group,
        _TorchBackend,
    )

    class LoopbackTorchBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            port = worker_group.execute_single(0, serve_store_on_loopback, backend_config.timeout_s)
            worker_group.execute(set_master_on_loopback, port)
            worker_group.execute(_set_torch_distributed_env_vars)  # what Ray's on_start sets (RANK, ...)
            ray.get([worker_group.execute_single_async(
                i, _setup_torch_process_group, backend=backend_config.backend, world_rank=i,
                world_size=len(worker_group), init_method="env://", timeout_s=backend_config.timeout_s)
                for i in range(len(worker_group))])

        def on_shutdown(self, worker_group, backend_config):
            super().on_shutdown(worker_group, backend_config)
            worker_group.execute(drop_loopback_stores)

    return LoopbackTorchBackend


def serve_store_on_loopback(timeout_s: float) -> int:
    """In rank 0's process: a TCPStore server on a socket bound to 127.0.0.1; returns its port."""
    import datetime
    import socket

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    _LOOPBACK_STORES.append(dist.TCPStore("127.0.0.1", port, None, True,
                                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                          multi_tenant=True, master_listen_fd=sock.detach()))
    return port


def set_master_on_loopback(port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)


def drop_loopback_stores() -> None:
    _LOOPBACK_STORES.clear()
