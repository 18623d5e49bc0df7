"""Tune's trial events as a Recorder's (study/record/recorder.py): the one place that reads Tune's
Trial objects for the record, so a recorder sees plain data and never imports Tune."""

from __future__ import annotations

import os

from ray.tune import Callback

from study.record.recorder import Recorder, TrialInfo
from trial.storage import uri_of


def trial_info(trial) -> TrialInfo:
    """What a record knows of a Tune trial (its config: study/experiment/search.py)."""
    c = trial.config
    return TrialInfo(trial.trial_id, c["cell"], c.get("role", "search"), c["trial"], c.get("params", {}),
                     c.get("scheduled_at", 0.0))


def error_reason(error) -> str:
    """The last line of a trial's error (its traceback ends with the exception and its message)."""
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class RecorderCallback(Callback):
    """Hands each trial event of the Tune experiment to the study's recorder, in Tune's order."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def on_trial_start(self, iteration, trials, trial, **info):
        self.recorder.trial_started(trial_info(trial))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.recorder.trial_result(trial_info(trial), result)

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        self.recorder.trial_checkpoint(trial_info(trial), uri_of(checkpoint.filesystem, checkpoint.path))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.recorder.trial_done(trial_info(trial), trial.last_result or {})

    def on_trial_error(self, iteration, trials, trial, **info):
        reason = ""
        if trial.error_file and os.path.exists(trial.error_file):  # written locally before this call
            with open(trial.error_file) as f:
                reason = error_reason(f.read())
        self.recorder.trial_error(trial_info(trial), reason)
