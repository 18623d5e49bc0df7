"""The study spec: one YAML file that says which trials a study runs and how they are chosen.

- `grid`: scientific factors, run exhaustively; each combination is a *cell*.
- `search`: nuisance hyperparameters, searched by Optuna inside every cell (or `none`).
- `objective`: what selects and early-stops: in-distribution validation unless the spec says
  `extrapolation: true`.
Keys of `grid` and `search.params` are dotted paths into the trial config (study/config.py), e.g.
`task.params.train_k`, `optim.lr`, or `positional` (a whole group, given as a mapping).
Every cell's trial config is validated when the spec is loaded, so a typo in a path, an unknown
scheme or a test length beyond `max_position` fails before Ray starts, naming the field.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from study.config import Strict, TaskSpec, TrialConfig, describe_errors

EXTRAPOLATION_METRICS = ("acc_beyond", "exact_beyond")


class Distribution(Strict):
    """Exactly one of: loguniform/uniform/int: [low, high], choice: [values...]."""

    loguniform: tuple[float, float] | None = None
    uniform: tuple[float, float] | None = None
    int: tuple[int, int] | None = None
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "Distribution":
        given = [k for k in ("loguniform", "uniform", "int", "choice") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of loguniform, uniform, int, choice (got {given or 'none'})")
        low_high = getattr(self, given[0])
        if given[0] != "choice" and not low_high[0] < low_high[1]:
            raise ValueError(f"{given[0]}: low {low_high[0]} must be below high {low_high[1]}")
        if given[0] == "loguniform" and low_high[0] <= 0:
            raise ValueError("loguniform: low must be > 0")
        return self

    def to_tune(self):
        from ray import tune

        if self.loguniform:
            return tune.loguniform(*self.loguniform)
        if self.uniform:
            return tune.uniform(*self.uniform)
        if self.int:
            return tune.randint(self.int[0], self.int[1] + 1)
        return tune.choice(self.choice)

    def example(self) -> Any:
        """A value inside the distribution, to validate cells at load time."""
        for kind in ("loguniform", "uniform", "int"):
            if getattr(self, kind) is not None:
                return getattr(self, kind)[0]
        return self.choice[0]


class SearchSpec(Strict):
    trials_per_cell: int = Field(4, ge=1)
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int = 0
    params: dict[str, Distribution] = Field(min_length=1)


class ObjectiveSpec(Strict):
    metric: str = "val_exact"
    mode: Literal["max", "min"] = "max"
    extrapolation: bool = Field(False, description="allow selecting on beyond-train-length metrics")

    @model_validator(mode="after")
    def _in_distribution_by_default(self) -> "ObjectiveSpec":
        if self.metric in EXTRAPOLATION_METRICS and not self.extrapolation:
            raise ValueError(
                f"metric: {self.metric!r} is an extrapolation metric; selecting on it needs "
                "objective.extrapolation: true (the default objective is in-distribution validation)"
            )
        return self


class SchedulerSpec(Strict):
    type: Literal["asha", "none"] = "none"
    grace_period: int = Field(2, ge=1, description="reports before a trial may be stopped")
    reduction_factor: int = Field(2, ge=2)


class ResourcesSpec(Strict):
    workers_per_trial: int = Field(1, ge=1)
    cpus_per_worker: float = Field(1, gt=0)
    gpus_per_worker: float = Field(0, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: bool = False
    max_concurrent_trials: int | None = Field(None, ge=1, description="default: what the cluster fits")
    max_failures: int = Field(1, ge=0, description="retries of a failed trial from its last checkpoint")


@dataclass(frozen=True)
class Cell:
    index: int
    factors: dict[str, Any]  # flattened: dotted leaf path -> value

    @property
    def label(self) -> str:
        return ",".join(f"{k.split('.')[-1]}={v}" for k, v in self.factors.items()) or "all"


class StudySpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    task: TaskSpec
    base: dict[str, Any] = Field(default_factory=dict, description="the fixed rest of the trial config")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    search: SearchSpec | None = None
    objective: ObjectiveSpec = ObjectiveSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    replicas: int = Field(1, ge=1, description="seeds per cell when search is none")
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = 0

    @field_validator("search", mode="before")
    @classmethod
    def _none_string(cls, v):
        return None if v in ("none", "None") else v

    @field_validator("grid")
    @classmethod
    def _grid_values(cls, grid):
        for path, values in grid.items():
            if not values:
                raise ValueError(f"{path}: needs at least one value")
        return grid

    @model_validator(mode="after")
    def _every_cell_is_a_valid_trial(self) -> "StudySpec":
        if self.search is not None and self.replicas > 1:
            raise ValueError(
                "replicas: seeds per chosen config after a search are not supported yet; "
                "use search: none with replicas, or replicas: 1"
            )
        if self.scheduler.type == "asha" and self.search is None and self.replicas == 1:
            raise ValueError("scheduler.type: asha needs several trials per cell to compare")
        example = {p: d.example() for p, d in (self.search.params.items() if self.search else [])}
        for cell in self.cells():
            try:
                TrialConfig.model_validate(self.trial_config(cell, example, self.seed))
            except ValidationError as e:
                where = f" (cell {cell.label})" if cell.factors else ""
                raise ValueError(f"{describe_errors(e)}{where}") from None
        return self

    # --- the plan -------------------------------------------------------------------------
    def cells(self) -> list[Cell]:
        paths = list(self.grid)
        cells = []
        for i, values in enumerate(itertools.product(*(self.grid[p] for p in paths))):
            factors: dict[str, Any] = {}
            for path, value in zip(paths, values):
                factors.update(_flatten({path: value}))
            cells.append(Cell(i, factors))
        return cells

    @property
    def trials_per_cell(self) -> int:
        return self.search.trials_per_cell if self.search else self.replicas

    def trial_config(self, cell: Cell, params: dict[str, Any], seed: int) -> dict:
        """The full trial config of one trial: base, then the cell's factors, then searched params."""
        cfg = copy.deepcopy(self.base)
        cfg["task"] = self.task.model_dump()
        for path, value in {**cell.factors, **params}.items():
            _set_path(cfg, path, value)
        ds = cfg.setdefault("deepspeed", {})
        ds.setdefault("zero_stage", self.resources.zero_stage)
        ds.setdefault("bf16", self.resources.bf16)
        cfg["seed"] = seed
        return cfg


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _set_path(cfg: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"{path}: {p} is not a group")
    node[leaf] = value


def load_spec(path: str) -> StudySpec:
    """Read and validate a study spec; errors name the field (`describe_errors`)."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a study spec is a YAML mapping")
    return StudySpec.model_validate(raw)


def flat_params(trial_config: dict) -> dict[str, Any]:
    """Readable flat parameter names for MLflow and results.csv (task.params.train_k, optim.lr...)."""
    return {k: v for k, v in _flatten(trial_config).items() if not re.match(r"eval\.", k)}
