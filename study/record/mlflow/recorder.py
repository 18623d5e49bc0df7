"""MLflow records of a study: experiment = study, a parent run for the study, a child per trial.

The driver does all the logging (trials never talk to MLflow: any URI the driver reaches works).
Children carry `mlflow.parentRunId` and their cell's factors as tags; runs are found again by tag
on `--resume` (the parent by study, a child by Tune trial id), so nothing is duplicated.

Extrapolation is logged as `acc_len/k{K}` (and `exact_len/k{K}`) with step = test length (MLflow
plots against step) and as flat `acc_at_len{N}/k{K}`. Children are tagged `role` and `selected`; the
parent holds the study's params, per cell the selected config's means over seeds, the claims' verdicts
(`claim.<name>`) and the source tags: docs/records.md has every key.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import sys
import threading
import time

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from study.record.identity import StudyIdentity
from study.record.mlflow.experiment import (
    PARENT_TAG,
    artifact_root,
    filter_literal,
    find_runs,
    runs_link,
    source_tags,
    stored_study,
    study_experiment,
    study_params,
)
from study.record.mlflow.measured_runs import checkpoint_of_run, log_measurement
from study.record.mlflow.trial_runs import extrapolation_metrics, is_metric, log_final_artifacts
from study.record.mlflow.uri_checks import check_flags, ephemeral_record
from study.record.recorder import Lookups, TrialInfo
from study.spec.schema import StudySpec, flat_params
from trial.storage import first_line as _first_line
from trial.storage import redact

TRIAL_TAG = "tune.trial_id"


def _recording_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable or failing tracking store raises: a server down (requests' errors are
    OSErrors), and artifacts in an s3:// bucket that does not answer (boto3's errors are not)."""
    try:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return MlflowException, OSError
    return MlflowException, OSError, BotoCoreError, ClientError, Boto3Error


RECORDING_ERRORS = _recording_errors()
RETRY_S = 10.0  # while MLflow cannot be reached, events wait this long before the next try
FLUSH_WAIT_S = float(os.environ.get("STUDY_MLFLOW_WAIT_S", "60"))  # at a study's end: trying to record what it holds


def queued(hook):
    """An event whose MLflow calls may wait: it joins the backlog, which a thread records in order as
    far as MLflow answers (`MlflowRecorder.drain`), off Tune's loop (a result's writes take it
    about a second). Nothing is dropped; an event is replayed whole (runs found by tag)."""
    @functools.wraps(hook)
    def call(self, *args, **kwargs):
        if self._w_failure is not None:
            raise self._w_failure
        self.backlog.append((hook, args, kwargs, time.time()))  # when it happened: a replay keeps it
        self._wake()
    return call


class MlflowRecorder(Lookups):
    """The study's MLflow record (a Recorder, study/record/recorder.py). Its parent run is found by
    the study's identity (study/record/identity.py), never by name alone, and every child is looked up
    under that parent: a study never reads, tags, deletes or overwrites another study's runs, though
    several may share an experiment (one per artifact location: experiment.py's study_experiment);
    without an `identity`, nothing is looked up."""

    errors = RECORDING_ERRORS

    def __init__(self, spec: StudySpec, tracking_uri: str, study_dir: str,
                 identity: StudyIdentity | None = None, artifact_location: str | None = None):
        # a tracking server that is down fails a call in seconds (MLflow's default retries take
        # minutes): the event is held and tried again (drain)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        self.spec = spec
        self.tracking_uri = tracking_uri
        self.identity = identity
        # where its artifacts go: under the study's storage for SQLite (what `check` checked)
        self.artifact_location = artifact_location or artifact_root(study_dir, tracking_uri, spec.name)
        self.client = MlflowClient(tracking_uri)
        self.parent_id: str | None = None
        self.children: dict[str, str] = {}  # Tune trial id -> MLflow run id
        # runs already FINISHED when a resumed study restores their trial (the driver died between
        # MLflow's record and Tune's): their record is complete and is left exactly as it is
        self.finished_before: set[str] = set()
        self.cells = {c.index: c for c in spec.cells()}
        # runs of completed trials wait here until a snapshot in storage says so (snapshot_stored)
        self.awaiting_snapshot: list[str] = []
        self.session_start = time.time()
        self.starts: dict[str, int] = {}  # Tune trial id -> times started in this driver
        self.backlog: collections.deque = collections.deque()  # events MLflow has not taken yet
        self.retry_at = 0.0
        self.event_ms = 0  # the time of the held event being recorded (drain)
        self._writer_state()
        self.down_since: float | None = None
        self.last_error = ""  # what MLflow last answered instead of taking an event

    check_flags = staticmethod(check_flags)  # --mlflow-uri, before any work (uri_checks.py)
    cluster_warning = staticmethod(ephemeral_record)  # a SQLite record on a cluster's head node
    stored_study = staticmethod(stored_study)  # the report files of the newest study of a name
    trial_model = staticmethod(checkpoint_of_run)  # the analysis commands' --mlflow-run (measured_runs.py)
    analysis_measured = staticmethod(log_measurement)

    @classmethod
    def check(cls, spec: StudySpec, study_dir: str, uri: str, identity: StudyIdentity | None) -> None:
        """The experiment the study would record to: a deleted one is RecordRefused. MLflow not
        answering now is not refused (the events wait for it)."""
        try:
            study_experiment(MlflowClient(uri), spec, artifact_root(study_dir, uri, spec.name), identity)
        except (MlflowException, OSError):
            pass

    def study_started(self) -> None:
        """The study's experiment and parent run: found again on a resume, else made."""
        spec, identity = self.spec, self.identity
        self.experiment_id, exp_name, note = study_experiment(self.client, spec, self.artifact_location, identity,
                                                              create=True)
        if note:
            print(note, flush=True)
        self.source = source_tags()
        own = identity.tags() if identity else {}
        # never by name alone: without an identity there is nothing that could prove a parent its own
        parent = next(iter(find_runs(self.client, [self.experiment_id], {PARENT_TAG: "true", **own})), None) \
            if identity else None
        if parent is None:
            others = find_runs(self.client, [self.experiment_id], {PARENT_TAG: "true"})
            if others:
                print(f"mlflow: experiment {exp_name!r} already holds another study of this name "
                      f"({others[0].data.tags.get('study.location', 'made before study ids')}); this study "
                      f"({identity.location if identity else '?'}) records to a parent run of its own", flush=True)
            parent = self.client.create_run(
                self.experiment_id,
                run_name=spec.name,
                tags={PARENT_TAG: "true", "mlflow.note.content": spec.description, **own, **self.source},
            )
            self.client.log_dict(parent.info.run_id, spec.model_dump(mode="json"), "study_spec.json")
            self.client.log_batch(parent.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in study_params(spec).items()])
        else:
            self.client.update_run(parent.info.run_id, status="RUNNING")
        self.parent_id = parent.info.run_id

    def __getstate__(self):  # Tune pickles its callbacks with the experiment: no client, nor the URI as given
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("client", "backlog") and not k.startswith("_w")}
        return {**state, "tracking_uri": redact(self.tracking_uri)}

    def __setstate__(self, state):
        # a restored recorder records nothing: a resume replaces it with its own (study/experiment/tuning.py),
        # made from the URI as given
        self.__dict__.update(state)
        self.client, self.backlog = None, collections.deque()
        self._writer_state()

    def _writer_state(self) -> None:  # the backlog's writer, off Tune's loop; one drain at a time
        self._w_lock, self._w_event, self._writer, self._w_failure = threading.RLock(), threading.Event(), None, None

    def _wake(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="mlflow-writer", daemon=True)
            self._writer.start()
        self._w_event.set()

    def _write(self) -> None:
        while True:
            self._w_event.wait(timeout=max(0.0, self.retry_at - time.time()) if self.backlog else None)
            self._w_event.clear()
            try:
                self.drain()
            except BaseException as e:  # not an outage but a bug: raised on Tune's loop at the next event
                self._w_failure = e
                return

    # --- MLflow down: a backlog, recorded in order once it answers ------------------------------
    def drain(self, force: bool = False) -> None:
        """Record the backlog in order; stop at the first call MLflow does not take (and wait
        RETRY_S before trying again, unless `force`)."""
        with self._w_lock:
            while self.backlog and (force or time.time() >= self.retry_at):
                hook, args, kwargs, held_at = self.backlog[0]
                # a metric's timestamp is its event's, so a call replayed after MLflow took it but its
                # answer was lost logs the same metric again, which MLflow's store keeps once
                self.event_ms = int(held_at * 1000)
                try:
                    hook(self, *args, **kwargs)
                except RECORDING_ERRORS as e:
                    self.last_error = _first_line(e)  # a refusal (not an outage) is held too: say which
                    self.retry_at = time.time() + RETRY_S
                    if self.down_since is None:
                        self.down_since = time.time()
                        print(f"warning: mlflow: cannot record to {redact(self.tracking_uri)} ({_first_line(e)}); "
                              "the trials go on and their events are recorded once it answers", file=sys.stderr,
                              flush=True)
                    return
                self.backlog.popleft()
        if self.down_since is not None and not self.backlog:
            print(f"mlflow: recording again after {time.time() - self.down_since:.0f} s; every event "
                  "held meanwhile is recorded", flush=True)
            self.down_since = None

    def flush(self, wait_s: float = FLUSH_WAIT_S) -> None:
        """Record the whole backlog, trying for up to `wait_s`; raise the store's error if it is still
        down, and say what was not recorded."""
        deadline = time.time() + wait_s
        while True:
            self.drain(force=True)  # a hook that failed the writer fails here again
            if not self.backlog:
                return
            if time.time() >= deadline:
                break
            time.sleep(min(RETRY_S, max(0.0, deadline - time.time())))
        held = collections.Counter(hook.__name__ for hook, *_ in self.backlog)
        trials = sorted({a.trial_id for _, args, kw, _ in self.backlog for a in [*args, *kw.values()] if hasattr(a, "trial_id")})
        raise MlflowException(f"{redact(self.tracking_uri)} did not take {len(self.backlog)} event(s) (last "
                              f"error: {self.last_error}): not recorded "
                              f"({', '.join(f'{n} x{c}' for n, c in held.items())}; trials {', '.join(trials) or '-'})")

    # --- child runs -----------------------------------------------------------------------
    def _child(self, trial: TrialInfo) -> str:
        if trial.trial_id in self.children:
            return self.children[trial.trial_id]
        found = next(iter(find_runs(self.client, [self.experiment_id], {"mlflow.parentRunId": self.parent_id,
                                                                        TRIAL_TAG: trial.trial_id})), None)
        if found is not None:  # resumed study: keep the trial's run
            run_id = found.info.run_id
            if found.info.status == "FINISHED":
                self.finished_before.add(run_id)
            else:  # reopened: what ended its last attempt no longer holds
                self.client.update_run(run_id, status="RUNNING")
                for tag in ("error", "stopped"):
                    if tag in found.data.tags:
                        self.client.delete_tag(run_id, tag)
        else:
            cell = self.cells[trial.cell]
            tags = {"mlflow.parentRunId": self.parent_id, TRIAL_TAG: trial.trial_id, "cell": cell.label,
                    "role": trial.role,
                    "selected": "false",  # record_selection marks the selected trials
                    **self.source, **{f"factor.{k}": str(v) for k, v in cell.factors.items()}}
            run = self.client.create_run(
                self.experiment_id, run_name=f"{cell.label} #{trial.trial_id[-5:]}", tags=tags
            )
            run_id = run.info.run_id
            params = flat_params(trial.config)
            params.update({f"search.{k}": v for k, v in trial.params.items()})
            self.client.log_batch(
                run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
            )
        self.children[trial.trial_id] = run_id
        return run_id

    @queued
    def trial_started(self, trial: TrialInfo) -> None:
        self.starts[trial.trial_id] = self.starts.get(trial.trial_id, 0) + 1
        self._child(trial)

    @queued
    def trial_result(self, trial: TrialInfo, result: dict) -> None:
        run_id = self._child(trial)
        if run_id in self.finished_before:
            return
        step = int(result.get("step", result.get("training_iteration", 0)))
        now = self.event_ms
        metrics = [Metric(k, float(v), now, step) for k, v in result.items() if is_metric(k, v)]
        scheduled_at, first_step_at = trial.scheduled_at, result.get("startup/first_step_at")
        if first_step_at and scheduled_at > self.session_start and self.starts.get(trial.trial_id) == 1:
            # the whole start-up of a trial's first attempt: Ray's actor, the Ray Train workers, the loop's
            metrics.append(Metric("startup/from_schedule_s", first_step_at - scheduled_at, now, step))
        if result.get("eval_records"):
            metrics += extrapolation_metrics(result["eval_records"], now)
        log_final_artifacts(self.client, run_id, result, trial.config)
        for i in range(0, len(metrics), 900):
            self.client.log_batch(run_id, metrics=metrics[i : i + 900])

    @queued
    def trial_checkpoint(self, trial: TrialInfo, uri: str) -> None:
        run_id = self._child(trial)
        if run_id not in self.finished_before:  # `python -m study.loss_gap --mlflow-run` finds the model here
            self.client.set_tag(run_id, "checkpoint", uri)

    @queued
    def trial_done(self, trial: TrialInfo, result: dict) -> None:
        run_id = self._child(trial)
        if run_id not in self.finished_before:  # FINISHED once the snapshot saying so is in storage
            last = result or {}
            if "eval_records" not in last:  # the scheduler stopped it before its final report
                self.client.set_tag(run_id, "stopped", f"by the scheduler at step {last.get('step', '?')}")
            self.awaiting_snapshot.append(run_id)

    @queued
    def snapshot_stored(self) -> None:
        """study/experiment/snapshots.py's SnapshotGate: a snapshot is in storage. The runs of trials completed
        before it are FINISHED (a backlog is recorded in order: their completion is in `awaiting_snapshot`)."""
        while self.awaiting_snapshot:
            self.client.set_terminated(self.awaiting_snapshot[0], "FINISHED")
            self.awaiting_snapshot.pop(0)

    @queued
    def trial_error(self, trial: TrialInfo, reason: str) -> None:
        run_id = self._child(trial)
        if reason:  # MLflow drops non-finite metrics: the tag is what shows why the run failed
            self.client.set_tag(run_id, "error", reason[:5000])
        self.client.set_terminated(run_id, "FAILED")

    # --- the study ------------------------------------------------------------------------
    def reconcile(self, terminated: set[str], known: set[str]) -> list[str]:
        """Make the MLflow record agree with the experiment Tune finished with.

        A trial started after the last snapshot of a driver that was killed is unknown to the
        restored experiment, which redoes its work as a new trial: its unfinished run is deleted
        (a run is FINISHED only once a snapshot knows it, so no finished run is ever unknown). A
        driver killed between a snapshot and the FINISHED mark leaves the run of a terminated trial
        unfinished: it is marked FINISHED. Returns the deleted run ids."""
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = "
                                       f"{filter_literal(self.parent_id)}", max_results=50000)
        dropped = []
        for r in runs:
            trial_id, status = r.data.tags.get(TRIAL_TAG), r.info.status
            if trial_id not in known and status != "FINISHED":
                self.client.delete_run(r.info.run_id)
                dropped.append(r.info.run_id)
            elif trial_id in terminated and status != "FINISHED":
                self.client.set_terminated(r.info.run_id, "FINISHED")
        return dropped

    def selection(self, selected) -> None:
        """Tag each child `selected` true or false, and give the parent per-cell metrics of the
        selected config (means over its seeds): `cell{i}/acc_beyond`, ..., `cell{i}/seeds`."""
        chosen = set(selected.trial_id) if len(selected) else set()
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = "
                                       f"{filter_literal(self.parent_id)}", max_results=50000)
        for r in runs:
            flag = "true" if r.data.tags.get(TRIAL_TAG) in chosen else "false"
            if r.data.tags.get("selected") != flag:
                self.client.set_tag(r.info.run_id, "selected", flag)
        index = {c.label: c.index for c in self.cells.values()}
        now = int(time.time() * 1000)
        metrics = []
        for row in selected.to_dict("records"):
            i = index[row["cell"]]
            metrics.append(Metric(f"cell{i}/seeds", float(row["seeds"]), now, 0))
            for key, value in row.items():
                if key.endswith("_mean") and isinstance(value, (int, float)) and math.isfinite(value):
                    metrics.append(Metric(f"cell{i}/{key[:-5]}", float(value), now, 0))
        for j in range(0, len(metrics), 900):
            self.client.log_batch(self.parent_id, metrics=metrics[j : j + 900])

    def claims_judged(self, verdicts: list[dict]) -> None:
        """The parent run's tags `claim.<name>` (holds | fails | inconclusive) and `claim.<name>.line`."""
        if self.parent_id is not None:
            self.client.log_batch(self.parent_id, tags=[RunTag(f"claim.{v['name']}{key}", v[field][:4000])
                                                        for v in verdicts for key, field in (("", "verdict"),
                                                                                             (".line", "line"))])

    def study_finished(self, status: str, metrics: dict[str, float] | None = None,
                       files: dict[str, str] | None = None) -> None:
        """End the study's runs: children still running are KILLED (interrupted)."""
        if self.parent_id is None:  # stopped before its record was made
            return
        if metrics:
            self.client.log_batch(self.parent_id, metrics=[Metric(k, float(v), int(time.time() * 1000), 0)
                                                           for k, v in metrics.items()])
        for run_id in self.children.values():
            if self.client.get_run(run_id).info.status == "RUNNING":
                self.client.set_terminated(run_id, "KILLED")
        for path in (files or {}).values():
            self.client.log_artifact(self.parent_id, path)
        self.client.set_terminated(self.parent_id, status)

    def where(self) -> list[str]:
        """Where MLflow shows the study: the UI (with this venv's `mlflow` for a SQLite store) and a
        deep link to the runs table."""
        if self.parent_id is None:
            return []
        link = runs_link(self.tracking_uri, self.experiment_id)
        if self.tracking_uri.startswith("http"):
            return [f"MLflow:  {link}"]
        import shlex

        mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")  # a command to paste: quoted
        return [f"MLflow:  {shlex.quote(mlflow_bin)} ui --backend-store-uri {shlex.quote(redact(self.tracking_uri))}",
                f"         then open {link}"]


