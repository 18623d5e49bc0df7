"""study/ray_compat.py against the installed Ray: every private name it uses is still there, with the
shape it expects, and each of its functions does what its caller relies on. These fail when a Ray
upgrade renames, moves or re-signs one (checked on Ray 2.60.0), before a study finds out."""

from __future__ import annotations

import inspect

import pytest
import ray

from study import ray_compat


def test_the_version_checked_is_the_one_installed_or_the_tests_below_say_what_changed():
    # pyproject.toml pins ray~=2.60.0: patch releases keep private names; a minor release is checked again
    assert ray_compat.CHECKED_ON.split(".")[:2] == ray.__version__.split(".")[:2], (
        f"Ray {ray.__version__} is installed; ray_compat was checked on {ray_compat.CHECKED_ON}: run this "
        "file, follow what fails, then set CHECKED_ON")


def test_the_restored_tuner_configs_are_the_ones_fit_reads(tmp_path):
    """study/experiment/tuning.py sets a restored Tuner's max_concurrent_trials, reuse_actors, max_failures and
    callbacks through these two objects."""
    from ray import tune

    def trainable(config):
        tune.report({"x": 1})

    tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(num_samples=1, max_concurrent_trials=3),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="t"))
    tune_config, run_config = ray_compat.restored_tuner_configs(tuner)
    assert tune_config.max_concurrent_trials == 3 and hasattr(tune_config, "reuse_actors")
    assert hasattr(run_config.failure_config, "max_failures") and isinstance(run_config.callbacks, (list, type(None)))
    tune_config.max_concurrent_trials = 5  # what fit() will read: the same object, not a copy
    assert tuner._local_tuner._get_tune_run_arguments(trainable)["max_concurrent_trials"] == 5


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_a_trial_that_failed_before_reporting_has_its_config_from_its_trial(tmp_path):
    """study/experiment/tuning.py reads each trial's config through trial_configs: a real Tune run (its
    own process, a local Ray) where one trial's process is killed before its first report (as the OOM
    killer does), whose Result then has no config."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json, os, signal, sys, ray
from ray import tune
from study import ray_compat

class Trainable(tune.Trainable):
    def setup(self, config):
        if config["cell"] == 1:  # dies while its actor starts: Tune never gets its first result
            os.kill(os.getpid(), signal.SIGKILL)

    def step(self):
        return {"x": 1, "done": True}

    def save_checkpoint(self, checkpoint_dir):
        pass

    def load_checkpoint(self, checkpoint):
        pass

ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
grid = tune.Tuner(Trainable, param_space={"cell": tune.grid_search([0, 1])},
                  run_config=tune.RunConfig(storage_path=sys.argv[1], name="t", verbose=0)).fit()
configs = ray_compat.trial_configs(grid)
print("OUT", json.dumps({"result": [r.config for r in grid], "errors": [bool(r.error) for r in grid],
                         "ids": [r.metrics.get("trial_id") for r in grid], "configs": configs}))
ray.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "OUT " in out.stdout, out.stderr[-3000:]
    seen = json.loads(out.stdout.split("OUT ", 1)[1])
    by_cell = dict(zip([c["cell"] for c in seen["configs"].values()], seen["configs"]))
    assert sorted(seen["errors"]) == [False, True] and None in seen["result"]  # why trial_configs exists
    assert sorted(seen["ids"]) == sorted(seen["configs"]) and set(by_cell) == {0, 1}
    assert all(seen["configs"][tid] == {"cell": cell} for cell, tid in by_cell.items())


def test_the_controller_checkpoint_is_wrapped_and_put_back():
    from ray.tune.execution.tune_controller import TuneController

    original = TuneController.checkpoint
    seen = []
    with ray_compat.controller_checkpoint_wrapped(lambda orig: seen.append(orig) or (lambda self, force=False, wait=False: None)):
        assert TuneController.checkpoint is not original and seen == [original]
    assert TuneController.checkpoint is original


def test_checkpoint_deletion_is_replaced_and_put_back():
    from ray.train._internal import checkpoint_manager

    original = checkpoint_manager._delete_fs_path
    assert list(inspect.signature(original).parameters) == ["fs", "fs_path"]
    replacement = lambda fs, fs_path: None  # noqa: E731
    with ray_compat.checkpoint_deletion_replaced(replacement):
        assert checkpoint_manager._delete_fs_path is replacement
    assert checkpoint_manager._delete_fs_path is original


def test_the_storage_context_names_snapshots_and_retries_read_are_there():
    """The controller's StorageContext (experiment_state_paths, controller_storage) and the session
    index a retried upload keeps (report_retrying_under_one_index)."""
    from ray.train._internal import session
    from ray.train._internal.storage import StorageContext
    from ray.tune.execution.tune_controller import TuneController

    assert callable(session.get_session)
    assert "experiment_state_file_name" in dir(TuneController)
    for name in ("storage_filesystem", "experiment_fs_path", "experiment_driver_staging_path"):
        assert name in inspect.getsource(StorageContext), name
    assert "current_checkpoint_index" in inspect.signature(StorageContext.__init__).parameters
    # the index names the checkpoint folder and advances by one per reported checkpoint
    assert "self.current_checkpoint_index += 1" in inspect.getsource(StorageContext._update_checkpoint_index)
    assert "current_checkpoint_index" in inspect.getsource(StorageContext.checkpoint_dir_name.fget)


def test_a_retried_report_keeps_its_checkpoint_index(monkeypatch):
    """A report whose upload failed twice goes in under the index it first had."""
    from ray.train._internal import session

    class Storage:
        current_checkpoint_index = 7

    class Session:
        storage = Storage()

    monkeypatch.setattr(session, "get_session", lambda: Session())  # a Tune trial's session, without a trial
    used = []

    def report():
        used.append(Storage.current_checkpoint_index if "current_checkpoint_index" not in vars(Session.storage)
                    else Session.storage.current_checkpoint_index)
        Session.storage.current_checkpoint_index += 1  # Ray advances it before each upload
        if len(used) < 3:
            raise OSError("bucket down")

    def retry(call):
        for _ in range(3):
            try:
                return call()
            except OSError:
                continue

    ray_compat.report_retrying_under_one_index(report, retry)
    assert used == [7, 7, 7]


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_the_embedded_ray_starts_with_token_auth_and_no_warning_about_it_and_no_idle_workers():
    """A fresh process with RAY_AUTH_MODE unset: Ray alone turns token auth on for a new local cluster
    and warns how to opt out; with ours first, the cluster has token auth (a task runs through it)
    and nothing is printed about it. A mode the user set is kept. Ray alone prestarts an idle worker a
    CPU (2 here) as it starts; with ours, none."""
    import os
    import subprocess
    import sys

    def start(prepare: str, env_mode: str | None = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_prestart_worker_first_driver")}
        if env_mode:
            env["RAY_AUTH_MODE"] = env_mode
        code = (f"import os, time, psutil, ray\nfrom study import ray_compat\n{prepare}\n"
                "ray.init(address='local', num_cpus=2, include_dashboard=False)\n"
                "def idle():\n"
                "    names = []\n"
                "    for p in psutil.Process().children(recursive=True):\n"
                "        try:\n"
                "            names.append(p.cmdline()[:1])\n"
                "        except psutil.Error:\n"
                "            pass\n"
                "    return names.count(['ray::IDLE'])\n"
                "deadline = time.time() + 10\n"
                "while idle() < 2 and time.time() < deadline:\n"
                "    time.sleep(0.2)\n"
                "before = idle()\n"
                "print('MODE', os.environ.get('RAY_AUTH_MODE'), ray.get(ray.remote(lambda: 7).remote()), 'IDLE', before)\n"
                "ray.shutdown()")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    plain = start("")
    assert "MODE token 7 IDLE 2" in plain.stdout and "Token authentication is enabled" in plain.stderr, \
        plain.stdout + plain.stderr[-2000:]
    ours = start("ray_compat.token_auth_on_before_init()\nray_compat.no_idle_workers_at_start()")
    assert "MODE token 7 IDLE 0" in ours.stdout and "Token authentication" not in ours.stderr, \
        ours.stdout + ours.stderr[-2000:]
    kept = start("ray_compat.token_auth_on_before_init()", env_mode="disabled")
    assert "MODE disabled 7" in kept.stdout, kept.stderr[-2000:]


def test_the_torch_backend_names_the_loopback_config_relies_on_are_there():
    """study/ray_compat.py's loopback_torch_config runs Ray's own setup steps (its env vars, its
    process-group call) after making rank 0's store server on 127.0.0.1: their names and signatures,
    and the TorchConfig it subclasses, as Ray 2.60 has them."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import (
        _set_torch_distributed_env_vars,
        _setup_torch_process_group,
        _TorchBackend,
    )

    assert list(inspect.signature(_setup_torch_process_group).parameters) == [
        "backend", "world_rank", "world_size", "init_method", "timeout_s"]
    assert list(inspect.signature(_set_torch_distributed_env_vars).parameters) == []
    assert {"on_start", "on_shutdown", "on_training_start"} <= set(vars(_TorchBackend))
    config = ray_compat.loopback_torch_config("gloo")
    assert isinstance(config, TorchConfig) and config.backend == "gloo" and config.init_method == "env"
    assert issubclass(config.backend_cls, _TorchBackend) and config.backend_cls is not _TorchBackend


def test_rank_zeros_store_server_listens_on_the_loopback_only():
    """torch's env:// rendezvous in rank 0 reuses the multi-tenant server of the same port: a process
    group of one made through it, and every listening socket of this process is on 127.0.0.1."""
    import os
    import subprocess
    import sys

    code = """
import os, datetime, json, psutil, torch.distributed as dist
from study import ray_compat
port = ray_compat.serve_store_on_loopback(60)
ray_compat.set_master_on_loopback(port)
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
print("LISTEN", json.dumps({"listening": sorted(listening), "port": port}))
dist.destroy_process_group()
ray_compat.drop_loopback_stores()
"""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    seen = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("LISTEN")).split(" ", 1)[1])
    listening = [tuple(a) for a in seen["listening"]]
    assert ("127.0.0.1", seen["port"]) in listening and all(ip == "127.0.0.1" for ip, _ in listening), listening
