"""A Tune trial = one Ray Train run of `train_loop_per_worker` (thin glue over Ray's APIs).

N-worker trials: the Tune function trainable `run_trial` builds a `TorchTrainer` over N workers and
calls `fit()`; the Train run is named after the Tune trial, so a trial Tune restarts finds its
checkpoints in storage. One-worker trials run the same loop directly in the Tune trial's process,
reporting to Tune, which keeps what Ray Train's local mode would drop (intermediate metrics,
checkpoints, Tune's own retries). Retries are Tune's alone, so a trial runs at most max_failures + 1
times, and a trial that diverged is not retried at all (`NoRetryOnDivergence`). The Tune config
holds the trial config as the record's plain dict; `run_trial` validates it, once, and the loop and
its workers get the typed config. The details and why: docs/trial.md, "A trial on Ray".
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import ray.train
import ray.tune
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
from study import ray_compat
from trial.config import TrialConfig
from trial.loop import Diverged, train_loop_per_worker
from trial.storage import join, retry_through_outage


class _RaySession:
    """Reports metrics with a DeepSpeed checkpoint; restores from the latest one."""

    checkpointing = True

    def __init__(self, api):  # ray.train (worker of a TorchTrainer) or ray.tune (in the trial)
        self.api = api

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """The checkpoint's upload to the study's storage is tried again while the storage does not
        answer, so that an outage stops the study (the driver decides, study/experiment/snapshots.py) and does
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
                lambda call: retry_through_outage(call, "checkpoint upload"))
            return
        # a Ray Train worker: report is collective (the ranks agree on the checkpoint's name first),
        # so only this rank's upload is tried again (DeveloperAPI: the worker's StorageContext)
        storage = ray.train.get_context().get_storage()
        self.api.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=lambda c, name: retry_through_outage(
            lambda: storage.persist_current_checkpoint(c, name), "checkpoint upload"))

    @contextmanager
    def restore_dir(self) -> Iterator[str | None]:
        checkpoint = self.api.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with ExitStack() as stack:  # the download, tried again like the upload
            yield retry_through_outage(lambda: stack.enter_context(checkpoint.as_directory()), "checkpoint download")


def ray_train_loop(config: dict) -> None:
    """What each Ray Train worker runs: the trial's typed config under "trial"."""
    train_loop_per_worker(config["trial"], _RaySession(ray.train))


def run_trial(config: dict) -> None:
    """Tune function trainable: run one trial's TorchTrainer to completion."""
    res = config["resources"]
    try:
        _run(TrialConfig.model_validate(config["trial"]), res)  # the full trial config, validated once
    except Exception as e:
        diverged = _diverged(e)
        if diverged is None:
            raise
        # a study whose resources lack `objective` (recorded by an older version): its objective is
        # unknown here, and Tune's metric check needs it in every report, so that trial is retried
        if res.get("objective"):
            ray.tune.report({res["objective"]: math.nan, "diverged": str(diverged)})
        raise diverged from None


def _run(trial: TrialConfig, res: dict) -> None:
    workers = res["workers_per_trial"]
    if workers == 1:
        train_loop_per_worker(trial, _RaySession(ray.tune))
        return
    context = ray.tune.get_context()
    # Ray Train's controller polls its workers this often, and only then takes their reports and
    # sees the train function end (its default delays every report and every trial's end: docs/speed.md,
    # P2); propagated by Ray Train from this process to the controller and workers
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"trial": trial},
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=res["gpus_per_worker"] > 0,
            resources_per_worker={"CPU": res["cpus_per_worker"], "GPU": res["gpus_per_worker"]},
        ),
        torch_config=_torch_config("nccl" if res["gpus_per_worker"] > 0 else "gloo"),
        run_config=RunConfig(
            name=f"train-{context.get_trial_id()}",
            storage_path=join(res["storage"], "train"),  # a folder or a bucket URI
            callbacks=[TuneReportCallback()],
            failure_config=FailureConfig(max_failures=0),  # Tune's retries only (the module's docstring)
            checkpoint_config=CheckpointConfig(num_to_keep=2),  # see study/experiment/tuning.py
        ),
    )
    trainer.fit()


def _torch_config(backend: str) -> TorchConfig:
    """On the embedded Ray (its node is 127.0.0.1, LOCAL_ONLY_ENV in study/run.py: every worker on this
    machine) the process group meets on 127.0.0.1 too; on a cluster, at rank 0's node address."""
    if ray.util.get_node_ip_address() == "127.0.0.1":
        return ray_compat.loopback_torch_config(backend)
    return TorchConfig(backend=backend)


def _diverged(error: BaseException) -> Diverged | None:
    """The Diverged a trial failed with: raised here, or by a Ray Train worker (WorkerGroupError)."""
    if isinstance(error, Diverged):
        return error
    for failure in getattr(error, "worker_failures", {}).values():
        for candidate in (failure, getattr(failure, "cause", None)):
            if isinstance(candidate, Diverged):
                return Diverged(*candidate.args)
    return None


class NoRetryOnDivergence(ray.tune.Callback):
    """A trial that reported `diverged` is not retried (its error follows that report)."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("diverged"):
            trial.max_failures = 0  # Trial's public attribute, read by Trial.should_recover()


def trial_resources(resources: dict) -> dict:
    """What the Tune trial itself reserves: for one worker the worker's share (it trains in the
    trial's process), else nearly nothing (its TorchTrainer asks Ray for the N workers)."""
    if resources["workers_per_trial"] == 1:
        return {"CPU": resources["cpus_per_worker"], "GPU": resources["gpus_per_worker"]}
    return {"CPU": 0, "memory": 2**20}  # Tune refuses an empty request; the waiting driver needs no CPU
