"""Per-cell search behind Ray's interfaces, so one Tune experiment holds the whole study.

- `CellSearcher` (a Tune `Searcher`): one `OptunaSearch` per cell; cells take turns, so every cell
  gets its full budget of trials and no cell is starved by another's results. Once a cell's search
  trials have all ended, it hands out `replicas - 1` reruns of the selected config (in-distribution
  objective; trials within its sampling error are tied and the first suggested is chosen:
  study/results/selection.py) with seeds seed+1, seed+2, ...; the study's figures and spreads over
  seeds come from those seeds. Without a search it hands out each cell's
  fixed config `replicas` times, with seeds seed, seed+1, ...
- `CellASHA` (a Tune scheduler): one ASHA per cell, so trials compete only with trials of their own
  cell (an easy cell's good scores must not stop a hard cell's trials).
Both save and restore with the experiment, so `--resume` continues the same searches.
"""

from __future__ import annotations

import pickle
import time

from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from study.results.selection import choose, validation_samples
from study.spec.schema import StudySpec
from trial.config import TrialConfig


def make_sampler(name: str, seed: int):
    """The spec's `search.sampler` as Optuna's sampler. TPE draws its first 10 trials at random, so
    a cell of 4 trials is 4 random draws, which may cluster; qmc (scrambled Sobol) spreads them."""
    import warnings

    import optuna

    if name == "qmc":
        with warnings.catch_warnings():  # QMCSampler is marked experimental since Optuna 3.0
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(seed=seed, scramble=True)
    return {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}[name](seed=seed)


class CellSearcher(Searcher):
    def __init__(self, spec: StudySpec, resources: dict):
        super().__init__(metric=spec.objective.metric, mode=spec.objective.mode)
        self.spec = spec
        self.resources = resources
        self.cells = spec.cells()
        self.issued = {c.index: 0 for c in self.cells}
        self.trial_cell: dict[str, int] = {}
        # with a search: each cell's ended search trials {trial id: (params, objective, val_loss)}
        # and its replicas handed out so far
        self.ended: dict[int, dict[str, tuple]] = {c.index: {} for c in self.cells}
        self.params_of: dict[str, dict] = {}
        self.search_index: dict[str, int] = {}
        self.replicas_issued = {c.index: 0 for c in self.cells}
        self.optuna: dict[int, OptunaSearch] = {}
        self.samples: dict[int, int | None] = {}
        if spec.search is not None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            space = OptunaSearch.convert_search_space(
                {path: dist.to_tune() for path, dist in spec.search.params.items()}
            )
            for c in self.cells:
                sampler = make_sampler(spec.search.sampler, spec.search.seed * 1000 + c.index)
                self.optuna[c.index] = OptunaSearch(
                    space=space, metric=self.metric, mode=self.mode, sampler=sampler
                )

    def suggest(self, trial_id: str):
        if self.optuna:
            ready = [c for c in self.cells if self.selected(c.index) and self.replicas_left(c.index)]
            if ready:  # a cell's search is over: rerun its selected config with the next seed
                cell = ready[0]
                chosen = self.selected(cell.index)
                self.replicas_issued[cell.index] += 1
                self.trial_cell[trial_id] = cell.index
                return self._config(cell, self.params_of[chosen], self.spec.seed + self.replicas_issued[cell.index],
                                    role="replica", selected_from=chosen)
        budget = self.spec.search.trials_per_cell if self.optuna else self.spec.trials_per_cell
        open_cells = [c for c in self.cells if self.issued[c.index] < budget]
        if not open_cells:  # None: Tune asks again later (a search still running may select a config)
            waiting = self.optuna and any(not self.search_ended(c.index) or
                                          (self.selected(c.index) and self.replicas_left(c.index))
                                          for c in self.cells)
            return None if waiting else Searcher.FINISHED
        cell = min(open_cells, key=lambda c: (self.issued[c.index], c.index))  # take turns
        replica = self.issued[cell.index]
        params = {}
        if self.optuna:
            params = _flatten_suggestion(self.optuna[cell.index].suggest(trial_id))
            self.params_of[trial_id] = params
            self.search_index[trial_id] = replica  # the order of suggestion within the cell
        self.issued[cell.index] += 1
        self.trial_cell[trial_id] = cell.index
        # a search compares configs on common random numbers; replicas differ by seed
        return self._config(cell, params, self.spec.seed + (0 if self.optuna else replica),
                            role="search" if self.optuna else "replica", search_index=replica)

    def _config(self, cell, params: dict, seed: int, role: str, selected_from: str | None = None,
                search_index: int | None = None) -> dict:
        return {
            "cell": cell.index,
            "params": params,
            "trial": self.spec.trial_config(cell, params, seed),
            "resources": self.resources,
            "role": role,  # search | replica (of the selected config; without a search, every trial)
            "selected_from": selected_from,
            "search_index": search_index,  # breaks a tie on the objective (study/results/selection.py)
            # with max_concurrent_trials Tune asks for a trial when a slot is free: the trial's
            # start-up is measured from here (study/record/mlflow/recorder.py, startup/from_schedule_s)
            "scheduled_at": time.time(),
        }

    def search_ended(self, cell: int) -> bool:
        return len(self.ended[cell]) >= self.spec.search.trials_per_cell

    def replicas_left(self, cell: int) -> bool:
        return self.replicas_issued[cell] < self.spec.replicas - 1

    def selected(self, cell: int) -> str | None:
        """The selected search trial of a cell whose search has ended (study/results/selection.py); None
        before, or when none of its search trials reported the objective (nothing to replicate)."""
        if not self.search_ended(cell):
            return None
        if cell not in self.samples:  # the number of validation samples behind the objective's sampling error
            self.samples[cell] = validation_samples(self.spec, self.cells[cell])
        chosen = choose(self.spec, [(t, m, self.search_index[t]) for t, (m, _loss) in self.ended[cell].items()],
                        self.samples[cell])
        return chosen.key if chosen else None

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        cell = self.trial_cell.get(trial_id)
        if cell is not None and self.optuna and trial_id in self.params_of:
            self.optuna[cell].on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        cell = self.trial_cell.get(trial_id)
        if cell is not None and self.optuna and trial_id in self.params_of:  # a search trial
            self.optuna[cell].on_trial_complete(trial_id, result, error)
            # only a trial that ran to its final report can be selected: one stopped early by the
            # scheduler (no "eval_records") or failed has no evaluation of the evaluation points
            result = result if result and not error and "eval_records" in result else {}
            self.ended[cell][trial_id] = (result.get(self.spec.objective.metric), result.get("val_loss"))

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def _flatten_suggestion(config: dict, prefix: str = "") -> dict:
    """OptunaSearch nests keys that contain '/'; ours are flat dotted paths, but be safe."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten_suggestion(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


class CellASHA(FIFOScheduler):
    """ASHA within each cell: routes every trial event to its cell's own ASHA instance.

    Time is counted in reports (`training_iteration`): one per `eval.every_steps` and the final one,
    `ceil(optim.steps / eval.every_steps)` in all, `reports` per cell index (a grid may vary either).
    A trial the scheduler stops keeps its last report; study/results/tables.py counts it as
    STOPPED and never selects it (it has no evaluation of the evaluation points)."""

    def __init__(self, metric: str, mode: str, grace_period: int, reduction_factor: int,
                 reports: dict[int, int]):
        super().__init__()  # FIFOScheduler takes no settings: each cell's ASHA holds them
        self._metric, self._mode, self.reports = metric, mode, reports  # per trial, by cell index
        self._kwargs = dict(metric=metric, mode=mode, grace_period=grace_period,
                            reduction_factor=reduction_factor, time_attr="training_iteration",
                            stop_last_trials=False)  # a trial ends by itself after its final report
        self._by_cell: dict[int, AsyncHyperBandScheduler] = {}

    def _asha(self, trial) -> AsyncHyperBandScheduler:
        cell = trial.config["cell"]
        if cell not in self._by_cell:
            reports = self.reports[cell]
            self._by_cell[cell] = AsyncHyperBandScheduler(
                **{**self._kwargs, "max_t": reports, "grace_period": min(self._kwargs["grace_period"], reports)})
        return self._by_cell[cell]

    # replicas of a selected config run to the end: stopping an unlucky seed would bias the interval
    def on_trial_add(self, tune_controller, trial):
        if trial.config.get("role") != "replica":
            self._asha(trial).on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result):
        if trial.config.get("role") == "replica":
            return self.CONTINUE
        return self._asha(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result):
        if trial.config.get("role") != "replica":
            self._asha(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller, trial):
        if trial.config.get("role") != "replica":
            self._asha(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return f"ASHA per cell over {len(self._by_cell)} cells"


def reports_per_trial(cfg: TrialConfig) -> int:
    """How many times a trial reports: at every eval.every_steps before the last step, then once at
    the end (trial/loop.py)."""
    return -(-cfg.optim.steps // cfg.eval.every_steps)
