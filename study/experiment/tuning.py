"""The study as one Ray Tune experiment: Tuner (or Tuner.restore), searcher, scheduler, recorder."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pandas as pd

from study import ray_compat
from study.experiment.recording import RecorderCallback, error_reason
from study.experiment.snapshots import (
    BACKSTOP_PERIOD_S,
    SnapshotGate,
    UnsafeSnapshot,
    restore_complete_snapshot,
    snapshots_on_events,
)
from study.record.recorder import Recorder
from study.results.series import series_frame
from study.results.tables import report_from_results, results_frame
from study.results.verdicts import judge
from study.spec.schema import StudySpec
from trial import storage as store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_ray(address: str | None) -> None:
    """Join the cluster at `address`, or start a Ray of our own that only 127.0.0.1 can reach.

    `ray.init()` without an address would attach to the last `ray start` cluster on this machine
    (its address file in Ray's temp dir): "local" always starts a new one.
    """
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level="WARNING", log_to_driver=False, configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
        print(f"ray: cluster at {store.redact(address)}", flush=True)
        return
    from trial.session import loopback_interface

    ray_compat.token_auth_on_before_init()
    ray_compat.no_idle_workers_at_start()

    # workers import the project from this checkout even if not installed
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    lo = loopback_interface()
    if lo:  # N-worker trials: Ray Train's gloo groups (NCCL's bootstrap) on loopback
        env.update(GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo)
    # one machine is never drained: no preemption watcher (a Ray actor, so a process) per Train run
    env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # no dashboard: it slows every study's start (docs/speed.md); the study prints its progress and
    # its record holds the rest. For the dashboard, `ray start --head` a Ray and pass --address.
    info = ray.init(address="local", runtime_env={"env_vars": env}, include_dashboard=False,
                    dashboard_host="127.0.0.1", **quiet)
    ip = info.address_info["node_ip_address"]
    if ip != "127.0.0.1":  # see LOCAL_ONLY_ENV in study/run.py
        ray.shutdown()
        raise RuntimeError(f"the embedded Ray is on {ip}, reachable from the network, not on 127.0.0.1: "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before ray is imported")
    print(f"ray: embedded local Ray on 127.0.0.1, GCS {info.address_info['gcs_address']}, "
          f"session {info.address_info['session_dir']}", flush=True)


def run_study(
    spec: StudySpec, study_dir: str, recorder: Recorder, address: str | None,
    max_concurrent: int | None, resume: bool, verbose: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame, list[str], list[dict], str | None]:
    """Run (or resume) the study, telling `recorder` as it goes; write the report; return the
    per-cell selection, the per-length summary over seeds, the files written, the failed trials
    ({trial_id, cell, reason}) and what the record could not take (None: everything)."""
    from ray import tune

    from study.experiment.progress import ProgressPrinter
    from study.experiment.ray_trial import NoRetryOnDivergence, run_trial, trial_resources

    if resume:  # before Ray starts or MLflow is touched: a refused snapshot leaves everything as it was
        _put_back_complete_snapshot(store.join(study_dir, "tune"))
    _tune_settings()
    start_ray(address)
    terminated = stop_like_ctrl_c_on_sigterm()
    ray_started = time.time()
    # the objective: a diverged trial's last report must carry it (study/experiment/ray_trial.py)
    resources = {**spec.resources.model_dump(), "storage": study_dir, "objective": spec.objective.metric}
    trainable = tune.with_resources(run_trial, trial_resources(resources))
    progress = ProgressPrinter(spec, len(spec.cells()) * spec.trials_per_cell)
    gate = SnapshotGate(followers=[recorder])
    callbacks = (gate, RecorderCallback(recorder), progress, NoRetryOnDivergence())
    try:
        recorder.study_started()
        if resume:
            tuner = _restored_tuner(spec, store.join(study_dir, "tune"), trainable, callbacks, max_concurrent, verbose)
        else:
            tuner = _new_tuner(spec, study_dir, trainable, resources, callbacks, max_concurrent, verbose)
        result_grid = _fit(tuner, gate)
        # on Ctrl-C Tune stops the trials, saves the experiment and returns: what it returns then
        # holds trials that did not end (or fewer than planned); they must not read as a result
        configs = ray_compat.trial_configs(result_grid)
        trials = []
        for res in result_grid:
            tid = _trial_id(res)
            trials.append({"trial_id": tid, "config": configs[tid], "metrics": res.metrics,
                           "status": trial_status(res), "reason": error_reason(res.error)})
        planned = len(spec.cells()) * spec.trials_per_cell - _replicas_not_run(spec, trials)
        if len(result_grid) < planned or result_grid.num_terminated + result_grid.num_errors < len(result_grid):
            raise Terminated if terminated else KeyboardInterrupt
        timing = time_in_steps(trials, time.time() - ray_started, max_concurrent)
        return _report_and_record(spec, study_dir, trials, result_grid, recorder, timing)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM (Terminated), or an exit
        _finish_if_reachable(recorder, "KILLED")
        print(f"interrupted: no results written; continue with --resume (study {study_dir})",
              file=sys.stderr)
        raise
    except BaseException as e:  # stopped for its storage (not answering, full): resumable, as on Ctrl-C
        stopped = isinstance(e, store.StorageError) or store.disk_full(study_dir, e)
        _finish_if_reachable(recorder, "KILLED" if stopped else "FAILED")
        raise


def _tune_settings() -> None:
    """Tune's settings a study needs (set unless the user set them)."""
    # one experiment snapshot per checkpoint is what resume needs; don't warn about it
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # snapshots on the events a resume needs, not on a timer (study/experiment/snapshots.py)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", BACKSTOP_PERIOD_S)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic table, with the columns we choose
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no TensorBoard; JSON/CSV below


def _new_tuner(spec: StudySpec, study_dir: str, trainable, resources: dict, callbacks: tuple,
               max_concurrent: int | None, verbose: bool):
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    searcher, scheduler = build_search(spec, resources)
    r = spec.resources
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            scheduler=scheduler,
            num_samples=len(spec.cells()) * spec.trials_per_cell,
            max_concurrent_trials=max_concurrent,
            # a finished trial's process takes the next trial: its imports, its process group and
            # DeepSpeed's loaded ops are ready (the start-up it saves: docs/speed.md)
            reuse_actors=r.warm_processes,
            trial_name_creator=_trial_name,
            trial_dirname_creator=_trial_name,
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=study_dir,
            failure_config=tune.FailureConfig(max_failures=r.max_failures),
            # 2, not 1: on a bucket Tune uploads its experiment state in the background, and with 1
            # the checkpoint that state names is deleted as soon as the next one lands, before the
            # new state is up; a driver killed then cannot resume that trial ("does not exist on
            # storage anymore", seen in tests/test_storage.py)
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            callbacks=[*callbacks, JsonLoggerCallback(), CSVLoggerCallback()],
            verbose=1 if verbose else 0,  # Tune's status tables; our own lines: study/experiment/progress.py
            progress_reporter=tune.CLIReporter(
                metric_columns={"step": "step", spec.objective.metric: spec.objective.metric,
                                "acc_beyond": "acc_beyond"},
                parameter_columns={"params": "searched"},
                max_report_frequency=15,
                max_column_length=40,
            ),
        ),
    )


def _restored_tuner(spec: StudySpec, tune_dir: str, trainable, callbacks: tuple, max_concurrent: int | None,
                    verbose: bool):
    """The study's Tuner from its last complete snapshot (put back by run_study), with this run's
    callbacks and the resumable changes of study/record/identity.py applied (nothing else)."""
    from ray import tune

    # a failed trial stays failed: it ran out of retries (resources.max_failures), and a
    # deterministic failure (Diverged) would fail again; rerun search trials could also change a
    # selection whose replicas already ran
    tuner = tune.Tuner.restore(tune_dir, trainable, resume_errored=False)
    # a restored Tuner keeps the callbacks it was pickled with; use this run's (of the same types)
    tune_config, run_config = ray_compat.restored_tuner_configs(tuner)
    tune_config.max_concurrent_trials = max_concurrent
    tune_config.reuse_actors = spec.resources.warm_processes
    run_config.failure_config.max_failures = spec.resources.max_failures
    by_type = {type(c): c for c in callbacks}
    run_config.callbacks[:] = [by_type.get(type(c), c) for c in run_config.callbacks]
    for c in callbacks:  # a study started before progress lines existed has none to replace
        if c not in run_config.callbacks:
            run_config.callbacks.append(c)
    run_config.verbose = 1 if verbose else 0
    return tuner


def _put_back_complete_snapshot(tune_dir: str) -> None:
    """restore_complete_snapshot; a record that names files it must not (the storage is not trusted
    with paths) stops the study as bad input: exit 2, one line naming the object and the file."""
    try:
        torn = restore_complete_snapshot(tune_dir)
    except UnsafeSnapshot as e:
        print(f"error: --resume: {e}; nothing was written. Restore that object from a backup, or start a "
              "new study", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if torn:  # a driver stopped half-way through uploading a snapshot (study/experiment/snapshots.py)
        print(f"note: the last snapshot in storage was incomplete; resuming from the last complete "
              f"one ({', '.join(torn)} put back)", flush=True)


def _fit(tuner, gate: SnapshotGate):
    """tuner.fit() with snapshots on the gate's events; a storage that stopped answering ends it as
    StorageUnreachable (the trials that did not end continue on --resume)."""
    with snapshots_on_events(gate) as watch:
        try:
            result_grid = tuner.fit()
        except BaseException:  # stopped for the storage, Tune's last read of it fails too
            if watch.lost:
                raise (store.StorageFull if watch.full else store.StorageUnreachable)(watch.lost) from None
            raise
    if watch.lost:  # stopped as on Ctrl-C
        raise (store.StorageFull if watch.full else store.StorageUnreachable)(watch.lost)
    return result_grid


def _report_and_record(spec: StudySpec, study_dir: str, trials: list[dict], result_grid, recorder: Recorder,
                       timing: dict) -> tuple[pd.DataFrame, pd.DataFrame, list[str], list[dict], str | None, list[str]]:
    """Write the report into storage, judge the spec's claims, then the record's end of the study
    (which may fail without losing the results)."""
    cells = {c.index: c.label for c in spec.cells()}
    failed = [{"trial_id": t["trial_id"], "cell": cells[t["config"]["cell"]], "reason": t["reason"]}
              for t in trials if t["status"] == "ERROR"]
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:  # a bucket: written here, then copied
        remote = store.is_uri(study_dir)
        results = results_frame(spec, trials)
        series = series_frame(spec, trials, {_trial_id(res): res.metrics_dataframe for res in result_grid})
        verdicts = judge(spec, results)
        selected, summary, files = report_from_results(spec, results, tmp if remote else study_dir, series, verdicts)
        if remote:  # each object whole; the marker (report.json) last, as in a folder
            for _key, path in sorted(files.items(), key=lambda kv: kv[0] == "marker"):
                _upload(path, store.join(study_dir, os.path.basename(path)))
        unrecorded = None
        try:
            recorder.flush()
            dropped = recorder.reconcile({_trial_id(res) for res in result_grid if not res.error},
                                         {_trial_id(res) for res in result_grid})
            if dropped:
                print(f"record: dropped {len(dropped)} run(s) of trials started before the interruption "
                      "and not in the restored experiment (their work was redone)", flush=True)
            recorder.selection(selected)
            if verdicts:
                recorder.claims_judged([v.record() for v in verdicts])
            recorder.study_finished("FAILED" if failed else "FINISHED", timing, files)
        except recorder.errors as e:
            unrecorded = (f"{e}. The results are complete in {study_dir}; the record of study "
                          f"{spec.name} is not")
    written = [store.join(study_dir, os.path.basename(path)) for path in files.values()]
    return selected, summary, written, failed, unrecorded, [v.line for v in verdicts]


def _upload(path: str, uri: str) -> None:
    """A report file into the bucket, waiting for it as a study does (STUDY_STORAGE_WAIT_S)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        store.retry_through_outage(lambda: store.write_atomic(uri, data), f"writing {uri}", wait_s=store.WAIT_S)
    except OSError as e:
        why = store.first_line(e)
        raise store.StorageError(f"{store.redact(uri)}: cannot write the report: {why}") from None


def _finish_if_reachable(recorder: Recorder, status: str) -> None:
    """End the study's record; a record that does not answer must not hide why the study ended."""
    try:
        recorder.flush(wait_s=0)
        recorder.study_finished(status)
    except recorder.errors as e:
        print(f"warning: record: the study could not be marked {status}: {e}", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
    """The study was stopped by SIGTERM (a scheduler, `kill`, a node shutting down), as by Ctrl-C."""


def stop_like_ctrl_c_on_sigterm() -> list[int]:
    """SIGTERM stops the study as Ctrl-C does: Tune stops the trials and saves the experiment, the
    MLflow runs end KILLED, `--resume` continues. It replaces the handler `ray.init` installs, which
    kills the local Ray at once and exits (no state saved). Returns a list that holds the signal
    once it came."""
    import signal

    received: list[int] = []

    def on_sigterm(signum, frame):
        if not received:
            received.append(signum)
            signal.raise_signal(signal.SIGINT)  # Tune's own graceful stop

    signal.signal(signal.SIGTERM, on_sigterm)
    return received


def build_search(spec: StudySpec, resources: dict):
    """The study's searcher and scheduler (None: FIFO). `--dry-run` builds them too, so a spec
    whose scheduler cannot be built fails there, not on the cluster."""
    from study.experiment.search import CellASHA, CellSearcher, reports_per_trial

    scheduler = None
    if spec.scheduler.type == "asha":
        reports = {cell.index: reports_per_trial(spec.checked_config(cell)) for cell in spec.cells()}
        scheduler = CellASHA(spec.objective.metric, spec.objective.mode, spec.scheduler.grace_period,
                             spec.scheduler.reduction_factor, reports)
    return CellSearcher(spec, resources), scheduler


def time_in_steps(trials: list[dict], wall_s: float, slots: int | None) -> dict[str, float]:
    """How much of the study's wall time since Ray started its trials spent training and
    evaluating (their own clocks, `time/train_s` and `time/eval_s`), out of `slots` trials at a time;
    the rest is overhead: start-up, scheduling, snapshots, reporting. Printed and logged."""
    in_steps = sum((t["metrics"] or {}).get("time/train_s", 0) + (t["metrics"] or {}).get("time/eval_s", 0)
                   for t in trials)
    slots = max(1, min(slots or 1, len(trials)))
    share = in_steps / max(wall_s * slots, 1e-9)
    print(f"time: {wall_s:.0f} s since Ray started; trials trained and evaluated for {in_steps:.0f} s, "
          f"{share:.0%} of {slots} trial slot(s) x the wall time", flush=True)
    return {"time/wall_since_ray_s": wall_s, "time/trials_in_steps_s": in_steps, "time/in_steps_share": share}


def _replicas_not_run(spec: StudySpec, trials: list[dict]) -> int:
    """Replicas a searched cell never hands out: every one of its search trials failed, so no
    config was selected (study/experiment/search.py)."""
    if spec.search is None or spec.replicas == 1:
        return 0
    search_ok: dict[int, bool] = {c.index: False for c in spec.cells()}
    for t in trials:
        if t["config"].get("role") == "search" and t["status"] != "ERROR":
            search_ok[t["config"]["cell"]] = True
    return sum(spec.replicas - 1 for ok in search_ok.values() if not ok)


def trial_status(result) -> str:
    """ERROR (failed), STOPPED (stopped early by the scheduler: it never made its final report,
    which holds the evaluation points) or TERMINATED (ran to the end)."""
    if result.error:
        return "ERROR"
    return "TERMINATED" if "eval_records" in (result.metrics or {}) else "STOPPED"


def _trial_id(result) -> str:
    """A Tune result's trial id (from its directory, cell{i}-{id}, when it reported nothing)."""
    if result.metrics and result.metrics.get("trial_id"):
        return result.metrics["trial_id"]
    return os.path.basename(result.path).split("-", 1)[-1]


def _trial_name(trial) -> str:
    return f"cell{trial.config['cell']}-{trial.trial_id}"
