"""Per-cell search behind Ray's interfaces, so one Tune experiment holds the whole study.

- `CellSearcher` (a Tune `Searcher`): one `OptunaSearch` per cell; cells take turns, so every cell
  gets its full budget of trials and no cell is starved by another's results. Without a search it
  hands out each cell's fixed config `replicas` times, with seeds seed, seed+1, ...
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

from study.spec import StudySpec


class CellSearcher(Searcher):
    def __init__(self, spec: StudySpec, resources: dict):
        super().__init__(metric=spec.objective.metric, mode=spec.objective.mode)
        self.spec = spec
        self.resources = resources
        self.cells = spec.cells()
        self.issued = {c.index: 0 for c in self.cells}
        self.trial_cell: dict[str, int] = {}
        self.optuna: dict[int, OptunaSearch] = {}
        if spec.search is not None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            space = OptunaSearch.convert_search_space(
                {path: dist.to_tune() for path, dist in spec.search.params.items()}
            )
            for c in self.cells:
                seed = spec.search.seed * 1000 + c.index
                sampler = (
                    optuna.samplers.TPESampler(seed=seed)
                    if spec.search.sampler == "tpe"
                    else optuna.samplers.RandomSampler(seed=seed)
                )
                self.optuna[c.index] = OptunaSearch(
                    space=space, metric=self.metric, mode=self.mode, sampler=sampler
                )

    def suggest(self, trial_id: str):
        budget = self.spec.trials_per_cell
        open_cells = [c for c in self.cells if self.issued[c.index] < budget]
        if not open_cells:
            return Searcher.FINISHED
        cell = min(open_cells, key=lambda c: (self.issued[c.index], c.index))  # take turns
        replica = self.issued[cell.index]
        params = {}
        if self.optuna:
            params = _flatten_suggestion(self.optuna[cell.index].suggest(trial_id))
        self.issued[cell.index] += 1
        self.trial_cell[trial_id] = cell.index
        # a search compares configs on common random numbers; replicas differ by seed
        seed = self.spec.seed + (0 if self.optuna else replica)
        return {
            "cell": cell.index,
            "params": params,
            "trial": self.spec.trial_config(cell, params, seed),
            "resources": self.resources,
            # with max_concurrent_trials Tune asks for a trial when a slot is free: the trial's
            # start-up is measured from here (study/tracking.py, startup/from_schedule_s)
            "scheduled_at": time.time(),
        }

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        cell = self.trial_cell.get(trial_id)
        if cell is not None and self.optuna:
            self.optuna[cell].on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        cell = self.trial_cell.get(trial_id)
        if cell is not None and self.optuna:
            self.optuna[cell].on_trial_complete(trial_id, result, error)

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
    """ASHA within each cell: routes every trial event to its cell's own ASHA instance."""

    def __init__(self, metric: str, mode: str, max_t: int, grace_period: int, reduction_factor: int):
        super().__init__(metric=metric, mode=mode)
        self._kwargs = dict(
            metric=metric, mode=mode, max_t=max_t, grace_period=min(grace_period, max_t),
            reduction_factor=reduction_factor, time_attr="training_iteration",
        )
        self._by_cell: dict[int, AsyncHyperBandScheduler] = {}

    def _asha(self, trial) -> AsyncHyperBandScheduler:
        cell = trial.config["cell"]
        if cell not in self._by_cell:
            self._by_cell[cell] = AsyncHyperBandScheduler(**self._kwargs)
        return self._by_cell[cell]

    def on_trial_add(self, tune_controller, trial):
        self._asha(trial).on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result):
        return self._asha(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result):
        self._asha(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller, trial):
        self._asha(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return f"ASHA per cell over {len(self._by_cell)} cells"
