"""W&B records of a study, offline by default: a parent run for the study (job_type "study") and a run
per trial (job_type "trial"), all in the group named after the study, written by the driver.

The runs are folders under `<study>/wandb/` (`./studies/<name>/wandb/` for a bucket storage), written
with no network and uploaded later with `wandb sync`; WANDB_MODE=online uploads them as they run
(WANDB_PROJECT names the project, default "sparsity-lengthgen"). A trial's run: its config, its
metrics over `step`, its evaluation points as the table `eval/records`, `checkpoint` and `status` in its
summary. The parent: the spec as config; its summary holds the selection (`selected`,
`cell{i}/...`), the claims' verdicts (`claim/<name>`), the study's `status` and timing, its table
`selection`, and the report files under `report/`. A `--resume` adds runs of its own (their configs
name `study.id` and `trial_id`). wandb is imported only when this recorder is chosen.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys

from study.record.identity import StudyIdentity
from study.record.recorder import Lookups, TrialInfo
from study.spec.schema import StudySpec
from trial import storage as store

PROJECT = "sparsity-lengthgen"
# Tune's bookkeeping in a result, not a quantity to plot (*_at: wall-clock times)
BOOKKEEPING = {"step", "training_iteration", "timestamp", "time_this_iter_s", "time_total_s", "pid", "done",
               "iterations_since_restore", "time_since_restore"}


def is_metric(key: str, value) -> bool:
    return (key not in BOOKKEEPING and not key.endswith("_at") and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(value))


def mode() -> str:
    """offline, unless the user asked for online with WANDB_MODE=online."""
    return "online" if os.environ.get("WANDB_MODE", "").lower() == "online" else "offline"


def record_folder(storage_or_study: str) -> str:
    """Where a study's W&B folder lives: the study's own folder, or ./studies beside the driver for a bucket."""
    return os.path.abspath("studies") if store.is_uri(storage_or_study) else storage_or_study


class WandbRecorder(Lookups):
    """The study's W&B record (a Recorder, study/record/recorder.py), one run per trial."""

    errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, spec: StudySpec, tracking_uri: str, study_dir: str, identity: StudyIdentity | None = None):
        import wandb

        self.errors = (OSError, wandb.Error)
        self.spec, self.identity = spec, identity
        base = record_folder(study_dir)
        self.dir = base if base == study_dir else os.path.join(base, spec.name)
        self.cells = {c.index: c for c in spec.cells()}
        self._runtime_state()

    def _runtime_state(self) -> None:
        self.parent = None
        self.runs: dict = {}  # Tune trial id -> its open W&B run
        self.awaiting_snapshot: list[str] = []  # trials done, finished once a snapshot says so

    def __getstate__(self):  # Tune pickles its callbacks: no runs (a restored recorder records nothing)
        return {k: v for k, v in self.__dict__.items() if k not in ("parent", "runs", "awaiting_snapshot")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._runtime_state()

    @staticmethod
    def check_flags(uri: str | None, storage: str, network: bool) -> str | None:
        if importlib.util.find_spec("wandb") is None:
            return "--recorder: wandb is not installed (pip install -e '.[wandb]')"
        if uri is not None:
            return "--mlflow-uri: --recorder wandb does not record to MLflow; leave the flag out"
        return None

    @staticmethod
    def cluster_warning(uri: str | None, address: str | None, storage: str) -> str | None:
        if address is None or mode() == "online":
            return None
        return (f"--recorder wandb: the study's W&B runs are offline folders beside the driver (under "
                f"{record_folder(storage)}); on a cluster that is the head node, and they go away with it: "
                "`wandb sync` them before, or set WANDB_MODE=online")

    def _init(self, **kwargs):
        import wandb

        os.makedirs(self.dir, exist_ok=True)
        return wandb.init(mode=mode(), dir=self.dir, project=os.environ.get("WANDB_PROJECT", PROJECT),
                          group=self.spec.name, reinit="create_new", **kwargs)

    def _study_keys(self) -> dict:
        return {"study.id": self.identity.id, "study.location": self.identity.location} if self.identity else {}

    def study_started(self) -> None:
        self.parent = self._init(job_type="study", name=self.spec.name, tags=["study"], notes=self.spec.description,
                                 config={**self.spec.model_dump(mode="json"), **self._study_keys()},
                                 settings={"quiet": True})

    def _run(self, trial: TrialInfo):
        if trial.trial_id not in self.runs:  # trials from the driver, so no trial process talks to W&B
            import wandb

            cell = self.cells[trial.cell]
            config = {**trial.config, "search": trial.params, "trial_id": trial.trial_id, "cell": cell.label,
                      "role": trial.role, "factor": cell.factors, **self._study_keys()}
            run = self._init(job_type="trial", name=f"{cell.label} #{trial.trial_id[-5:]}", config=config,
                             tags=[trial.role, f"cell{trial.cell}"],
                             settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
            run.define_metric("step")
            run.define_metric("*", step_metric="step")  # a retried trial's steps again are kept, not dropped
            self.runs[trial.trial_id] = run
        return self.runs[trial.trial_id]

    def trial_started(self, trial: TrialInfo) -> None:
        self._run(trial).summary["status"] = "RUNNING"

    def trial_result(self, trial: TrialInfo, result: dict) -> None:
        import wandb

        run = self._run(trial)
        row = {k: v for k, v in result.items() if is_metric(k, v)}
        if result.get("eval_records"):  # the last report: every evaluation point, for W&B's custom charts
            rows = result["eval_records"]
            columns = list(dict.fromkeys(k for r in rows for k in r))
            row["eval/records"] = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows],
                                              allow_mixed_types=True)
        run.log({**row, "step": int(result.get("step", result.get("training_iteration", 0)))})
        if isinstance(result.get("host/kernels"), str):  # a path, not a quantity: the run's summary
            run.summary["host/kernels"] = result["host/kernels"]

    def trial_checkpoint(self, trial: TrialInfo, uri: str) -> None:
        self._run(trial).summary["checkpoint"] = uri

    def trial_done(self, trial: TrialInfo, result: dict) -> None:
        run = self._run(trial)
        if "eval_records" not in (result or {}):  # the scheduler stopped it before its final report
            run.summary["stopped"] = f"by the scheduler at step {(result or {}).get('step', '?')}"
        self.awaiting_snapshot.append(trial.trial_id)

    def _finish(self, trial_id: str, status: str, **summary) -> None:
        run = self.runs.pop(trial_id, None)
        if run is not None:
            run.summary.update({"status": status, **summary})
            run.finish(exit_code=0 if status == "FINISHED" else 1)

    def snapshot_stored(self) -> None:
        """A snapshot is in storage: the runs of the trials done before it are finished."""
        while self.awaiting_snapshot:
            self._finish(self.awaiting_snapshot.pop(0), "FINISHED")

    def trial_error(self, trial: TrialInfo, reason: str) -> None:
        self._run(trial)
        self._finish(trial.trial_id, "FAILED", error=reason[:5000])

    def flush(self, wait_s: float | None = None) -> None:
        """Nothing is held: an offline run is written as it goes (an online one uploads on finish)."""

    def reconcile(self, terminated: set[str], known: set[str]) -> list[str]:
        """Runs of trials the restored experiment does not know end DROPPED; terminated ones FINISHED."""
        dropped = []
        for trial_id in list(self.runs):
            if trial_id not in known:
                dropped.append(self.runs[trial_id].id)
                self._finish(trial_id, "DROPPED")
            elif trial_id in terminated:
                self._finish(trial_id, "FINISHED")
        return dropped

    def selection(self, selected) -> None:
        """The parent's summary: `selected` (the trial ids), per cell `cell{i}/trial_id`, its searched
        values and its means over seeds (`cell{i}/acc_beyond`, ...); the whole table as `selection`."""
        import wandb

        if self.parent is None:
            return
        index = {c.label: c.index for c in self.cells.values()}
        rows = selected.to_dict("records") if len(selected) else []
        summary: dict = {"selected": [str(r["trial_id"]) for r in rows]}
        for row in rows:
            i = index[row["cell"]]
            summary[f"cell{i}/trial_id"], summary[f"cell{i}/seeds"] = str(row["trial_id"]), int(row["seeds"])
            for key, value in row.items():
                if (key.startswith("search.") and value == value) or (key.endswith("_mean") and is_metric(key, value)):
                    summary[f"cell{i}/{key.removesuffix('_mean')}"] = value  # value == value: not NaN
        self.parent.summary.update(summary)
        if rows:
            self.parent.log({"selection": wandb.Table(dataframe=selected, allow_mixed_types=True)})

    def claims_judged(self, verdicts: list[dict]) -> None:
        """The parent's summary `claim/<name>` (holds | fails | inconclusive) and `claim/<name>/line`."""
        if self.parent is not None:
            self.parent.summary.update({k: v for c in verdicts for k, v in
                                        ((f"claim/{c['name']}", c["verdict"]), (f"claim/{c['name']}/line", c["line"]))})

    def study_finished(self, status: str, metrics: dict[str, float] | None = None,
                       files: dict[str, str] | None = None) -> None:
        """End the study's runs: trial runs still open are KILLED (interrupted)."""
        for trial_id in list(self.runs):
            self._finish(trial_id, "KILLED")
        if self.parent is None:  # stopped before its record was made
            return
        report = os.path.join(self.parent.dir, "report")  # copies: a bucket's report is staged in a temp folder
        for path in (files or {}).values():
            os.makedirs(report, exist_ok=True)
            self.parent.save(shutil.copy(path, report), base_path=self.parent.dir, policy="now")
        self.parent.summary.update({**(metrics or {}), "status": status})
        self.parent.finish(exit_code=0 if status == "FINISHED" else 1)

    def where(self) -> list[str]:
        if self.parent is None:
            return []
        if mode() == "online":
            return [f"W&B:     {self.parent.url} (group {self.spec.name})"]
        import shlex

        wandb_bin = os.path.join(os.path.dirname(sys.executable), "wandb")
        runs = os.path.join(self.dir, "wandb")
        return [f"W&B:     offline runs in {runs} (group {self.spec.name})",
                f"         upload: {shlex.quote(wandb_bin)} sync {shlex.quote(runs)}/offline-run-*"]
