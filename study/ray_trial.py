"""A Tune trial = one Ray Train run of `train_loop_per_worker` (thin glue over Ray's APIs).

N-worker trials: the Tune function trainable `run_trial` builds a `TorchTrainer` over N workers
(ZeRO shards the model over them) and calls `fit()`; Ray Train's `TuneReportCallback` forwards the
workers' reports to Tune. The Train run is named after the Tune trial, so when Tune restarts a
trial (`--resume` after the driver died) Ray Train finds the run's checkpoints in storage, and a
failed worker group is restarted from the latest checkpoint (`FailureConfig`).

One-worker trials run the same loop directly in the Tune trial's process, reporting to Tune. This
is what Ray Train's local mode (`num_workers=0`) would do, minus what it drops: in Ray 2.60 local
mode keeps only the last report (no intermediate metrics reach Tune, so ASHA could not stop a
trial), persists no checkpoint, restores none, and destroys the process group when it returns.
Reporting to Tune keeps intermediate metrics, checkpoints and Tune's own trial retries.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import ray.train
import ray.tune
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from analysis import ANALYSES
from study import ray_compat
from trial.loop import train_loop_per_worker
from trial.storage import join, patiently


class _RaySession:
    """Reports metrics with a DeepSpeed checkpoint; restores from the latest one."""

    checkpointing = True

    def __init__(self, api):  # ray.train (worker of a TorchTrainer) or ray.tune (in the trial)
        self.api = api

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """The checkpoint's upload to the study's storage is tried again while the storage does not
        answer, so that an outage stops the study (the driver decides, study/snapshots.py) and does
        not fail the trial."""
        if not checkpoint_dir:
            self.api.report(metrics)
            return
        checkpoint = self.api.Checkpoint.from_directory(checkpoint_dir)
        if self.api is ray.tune:
            # in the trial's process the upload comes first, then the report: the whole call is tried
            # again, under the same checkpoint_NNNNNN
            ray_compat.report_retrying_under_one_index(
                lambda: self.api.report(dict(metrics), checkpoint=checkpoint),
                lambda call: patiently(call, "checkpoint upload"))
            return
        # a Ray Train worker: report is collective (the ranks agree on the checkpoint's name first),
        # so only this rank's upload is tried again (DeveloperAPI: the worker's StorageContext)
        storage = ray.train.get_context().get_storage()
        self.api.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=lambda c, name: patiently(
            lambda: storage.persist_current_checkpoint(c, name), "checkpoint upload"))

    @contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        checkpoint = self.api.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with ExitStack() as stack:  # the download, tried again like the upload
            yield patiently(lambda: stack.enter_context(checkpoint.as_directory()), "checkpoint download")


def ray_train_loop(config: dict) -> None:
    """What each Ray Train worker runs."""
    train_loop_per_worker(config, _RaySession(ray.train), ANALYSES)


def run_trial(config: dict) -> None:
    """Tune function trainable: run one trial's TorchTrainer to completion."""
    trial = config["trial"]  # the Tune config holds the full trial config under this key
    res = config["resources"]
    workers = res["workers_per_trial"]
    if workers == 1:
        train_loop_per_worker(trial, _RaySession(ray.tune), ANALYSES)
        return
    context = ray.tune.get_context()
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config=trial,
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=res["gpus_per_worker"] > 0,
            resources_per_worker={"CPU": res["cpus_per_worker"], "GPU": res["gpus_per_worker"]},
        ),
        # rank 0's TCPStore listens on every interface, even on the embedded Ray (LOCAL_ONLY_ENV,
        # study/run.py)
        torch_config=TorchConfig(backend="nccl" if res["gpus_per_worker"] > 0 else "gloo"),
        run_config=RunConfig(
            name=f"train-{context.get_trial_id()}",
            storage_path=join(res["storage"], "train"),  # a folder or a bucket URI
            callbacks=[TuneReportCallback()],
            failure_config=FailureConfig(max_failures=res["max_failures"]),
            checkpoint_config=CheckpointConfig(num_to_keep=2),  # see study/tuning.py
        ),
    )
    trainer.fit()


def trial_resources(resources: dict) -> dict:
    """What the Tune trial itself reserves: for one worker the worker's share (it trains in the
    trial's process), else nearly nothing (its TorchTrainer asks Ray for the N workers)."""
    if resources["workers_per_trial"] == 1:
        return {"CPU": resources["cpus_per_worker"], "GPU": resources["gpus_per_worker"]}
    return {"CPU": 0, "memory": 2**20}  # Tune refuses an empty request; the waiting driver needs no CPU
