"""The seam between a study and its record: the events a study sends, in the order it sends them,
and the registry of the records it can send them to.

A study (study/experiment/tuning.py) speaks only to a `Recorder`: it never names MLflow. MLflow is
one implementation (study/record/mlflow/), W&B offline another (study/record/wandb_recorder.py); a new
one is a class in a module of its own (the events of `Recorder`, on `Lookups`' defaults) plus its line
in `RECORDERS`, chosen with `python study/run.py --recorder NAME`. Tune's own JSON, CSV and TensorBoard
loggers and its W&B callback record a trial's results alone (no study, selection or claims): a user
who wants those adds Tune's callback, not a recorder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

# name -> "module:Class", imported only when chosen: a study that records elsewhere never imports MLflow
RECORDERS = {"mlflow": "study.record.mlflow.recorder:MlflowRecorder",
             "wandb": "study.record.wandb_recorder:WandbRecorder"}  # offline W&B runs under the study's folder


class RecordRefused(ValueError):
    """The record a study would use cannot be used (a deleted experiment, ...); one line, exit 2."""


@dataclass(frozen=True)
class TrialInfo:
    """What a record knows of a trial: Tune's id, its cell, its role (search | replica), the trial
    config it trains (trial/config.py, as JSON), its searched values, and when it was scheduled."""

    trial_id: str
    cell: int
    role: str
    config: dict[str, Any] = field(hash=False)
    params: dict[str, Any] = field(hash=False)
    scheduled_at: float = 0.0


class Lookups:
    """What a study asks of a record before and after it runs, with defaults a new recorder may keep:
    nothing to check, and nothing it can read back (the report and analysis commands then say so).
    A recorder subclasses this and implements the events (Recorder) it records."""

    @staticmethod
    def check_flags(uri: str | None, storage: str, network: bool) -> str | None:
        """Before any work: the first problem with where the record goes (`--mlflow-uri`, None: the
        default) as `<flag>: <what is wrong>`, or None; `network`: contact it (not on --dry-run)."""
        return None

    @staticmethod
    def cluster_warning(uri: str | None, address: str | None, storage: str) -> str | None:
        """Why the record would not outlive the cluster at `address` (None: the embedded Ray), or None."""
        return None

    @classmethod
    def check(cls, spec, study_dir: str, uri: str, identity) -> None:
        """Before Ray starts: raise RecordRefused if the record cannot take this study (a record
        that does not answer now is not refused: its events wait for it)."""

    @staticmethod
    def stored_study(uri: str, name: str, into: str) -> tuple[str, str]:
        """For `python -m study.report NAME`: the newest study `name`'s report files (results.csv,
        study_spec.json) downloaded into `into`, and where they came from; LookupError if none."""
        raise LookupError(f"error: {name}: this record keeps no study to read back; give the study's folder")

    @staticmethod
    def trial_model(uri: str, run: str) -> str:
        """For the analysis commands: where trial run `run` stored its model (a checkpoint folder or
        bucket URI); a ValueError naming the flag if the record has no such run or no model."""
        raise ValueError(f"--mlflow-run: {run}: this record keeps no trial's model; give the checkpoint folder")

    @staticmethod
    def analysis_measured(uri: str, run: str, name: str, metrics: dict[str, float], tags: dict[str, str],
                          folder: str) -> None:
        """An analysis command's measurement of trial run `run`: its metrics and tags, and the files
        in `folder`, under the analysis's `name` (by default not recorded)."""


class Recorder(Protocol):
    """What a study tells its record: the events, each required, in the order they happen, from the
    driver (what it asks of a record is Lookups'); `errors` are what a record that does not answer
    raises (the study goes on without it: its results are in storage). `trial_done` of a trial comes before the `snapshot_stored` that makes
    it resumable; a record that marks runs finished waits for that."""

    errors: ClassVar[tuple[type[BaseException], ...]]

    def study_started(self) -> None: ...
    def trial_started(self, trial: TrialInfo) -> None: ...
    def trial_result(self, trial: TrialInfo, result: dict[str, Any]) -> None: ...
    def trial_checkpoint(self, trial: TrialInfo, uri: str) -> None: ...
    def trial_done(self, trial: TrialInfo, result: dict[str, Any]) -> None: ...
    def trial_error(self, trial: TrialInfo, reason: str) -> None: ...
    def snapshot_stored(self) -> None: ...

    def flush(self, wait_s: float | None = None) -> None:
        """Record every event held, trying for up to `wait_s`; raise one of `errors` if it cannot."""

    def reconcile(self, terminated: set[str], known: set[str]) -> list[str]:
        """Agree with the experiment Tune finished with (a resume redoes trials a killed driver
        started): drop the records of unknown trials; returns what was dropped."""

    def selection(self, selected) -> None:
        """The trial each cell selected, and its means over seeds (study/results/tables.py's table)."""

    def claims_judged(self, verdicts: list[dict]) -> None:
        """The spec's claims, judged: each one's `name`, `verdict` (holds | fails | inconclusive) and
        `line` (study/results/verdicts.py); the table behind them is the report's claims.csv."""

    def study_finished(self, status: str, metrics: dict[str, float] | None = None,
                       files: dict[str, str] | None = None) -> None:
        """FINISHED, FAILED or KILLED, with the study's own metrics and its report files."""

    def where(self) -> list[str]:
        """Lines for the terminal that say where to look at the record."""


def recorder_class(name: str) -> type[Recorder]:
    """The registered recorder `name` (a KeyError names the known ones)."""
    if name not in RECORDERS:
        raise KeyError(f"--recorder: {name!r} is not one of {sorted(RECORDERS)}")
    module, _, cls = RECORDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
