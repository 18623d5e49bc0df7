"""One line per event a person waits for: a trial started, finished (with its objective), failed;
n of N done, time elapsed and left. A Tune `Callback`; Tune's own status tables are for `--verbose`."""

from __future__ import annotations

import time

from ray.tune import Callback

from study.spec.schema import StudySpec


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class ProgressPrinter(Callback):
    def __init__(self, spec: StudySpec, total: int):
        self.metric = spec.objective.metric
        self.labels = {c.index: c.label for c in spec.cells()}
        self.total = total
        self.done = 0
        self.counted = False
        self.t0 = time.time()

    def on_step_begin(self, iteration, trials, **info):
        if not self.counted:  # a resumed study starts from the trials its experiment has ended
            self.done = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
            self.counted = True

    def _name(self, trial) -> str:
        c = trial.config
        role = c.get("role", "search")
        params = ", ".join(f"{k.split('.')[-1]} {v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]} {v}"
                           for k, v in c.get("params", {}).items())
        what = f"seed {c['trial']['seed']}" if role == "replica" else params or f"seed {c['trial']['seed']}"
        return f"{self.labels[c['cell']]} #{trial.trial_id[-5:]} ({role}: {what})"

    def _say(self, text: str) -> None:
        print(f"[{_clock(time.time() - self.t0)}] {text}", flush=True)

    def _tally(self) -> str:
        elapsed = time.time() - self.t0
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        return f"{self.done}/{self.total} trials done, " + ("" if left != left else f"~{_clock(left)} left")

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(f"started  {self._name(trial)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.done += 1
        r = trial.last_result or {}
        score = r.get(self.metric)
        loss = r.get("val_loss")
        shown = f"{self.metric} {score:.4g}" if isinstance(score, (int, float)) else f"{self.metric} -"
        if isinstance(loss, (int, float)) and self.metric != "val_loss":
            shown += f", val_loss {loss:.3g}"
        if "eval_records" in r:
            self._say(f"finished {self._name(trial)}: {shown} | {self._tally()}")
        else:  # ASHA stopped it: its last report is all it has
            self._say(f"stopped  {self._name(trial)} by the scheduler at step {r.get('step', '?')}: {shown} | "
                      f"{self._tally()}")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.done += 1
        self._say(f"FAILED   {self._name(trial)} | {self._tally()}")
