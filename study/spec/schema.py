"""The study spec: one YAML file that says which trials a study runs and how they are chosen.

- `grid`: scientific factors, run exhaustively; each combination is a *cell*.
- `search`: nuisance hyperparameters, searched by Optuna inside every cell (or `none`).
- `objective`: what selects and early-stops: in-distribution validation unless the spec says
  `extrapolation: true`.
Keys of `grid` and `search.params` are dotted paths into the trial config (trial/config.py), e.g.
`task.params.train_k`, `optim.lr`, or `positional` (a whole group, given as a mapping).
Every trial config the study can produce is validated when the spec is loaded (and each cell's kept,
typed): each cell with every `choice` value and both ends of every search range, so a typo, an unknown
scheme, a test length beyond `max_position` or a searched value out of range fails before Ray
starts, naming the field. So do settings that would be silently overridden or conflict (a grid and
a search on one path, `base.seed`, `base.deepspeed` against `resources`).
"""

from __future__ import annotations

import builtins
import copy
import fnmatch
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
from study.spec.claims import ClaimSpec, pick_cell
from study.spec.plan_bounds import check_plan_size
from trial import metrics
from trial.analyses import REGISTERED
from trial.config import TaskSpec, TrialConfig, selectable_metrics
from trial.limits import MAX_SEED, Bf16, Strict, fits, refuse_non_finite
from trial.yaml_io import RENAMED, describe_errors, load_yaml

EXTRAPOLATION_METRICS = metrics.EXTRAPOLATION
KINDS = ("loguniform", "uniform", "int", "choice")
# names of what a study's storage holds besides the studies' folders (lower case: a case-insensitive
# filesystem mixes MLflow.db and mlflow.db up); `<name>-...` too (SQLite's -journal, -wal, -shm)
RESERVED_NAMES = {"mlflow.db": "the default MLflow database (sqlite:///<storage>/mlflow.db)",
                  "mlartifacts": "MLflow's artifacts of a study in a bucket (<storage>/mlartifacts/<name>)"}
MAX_POINT_PRODUCT = 256  # a search's points checked as one product while this small (else one by one)


class Distribution(Strict):
    """Exactly one of: loguniform/uniform/int: [low, high], choice: [values...]."""

    loguniform: tuple[float, float] | None = None
    uniform: tuple[float, float] | None = None
    # `int` names the field, so the annotation must name the builtin explicitly
    int: tuple[builtins.int, builtins.int] | None = None
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Distribution:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of loguniform, uniform, int, choice (got {given or 'none'})")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("choice: needs at least one value")
            return self
        low, high = getattr(self, given[0])
        if not low < high:
            raise ValueError(f"{given[0]}: low {low} must be below high {high}")
        if given[0] == "loguniform" and low <= 0:
            raise ValueError("loguniform: low must be > 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def to_tune(self):
        from ray import tune

        if self.loguniform:
            return tune.loguniform(*self.loguniform)
        if self.uniform:
            return tune.uniform(*self.uniform)
        if self.int:
            return tune.randint(self.int[0], self.int[1] + 1)
        return tune.choice(self.choice)

    def points(self) -> list[Any]:
        """The values validation must see: every choice, both ends of a range."""
        return list(getattr(self, self.kind))


class SearchSpec(Strict):
    trials_per_cell: int = Field(4, ge=1)
    sampler: Literal["tpe", "random", "qmc"] = Field("tpe", description="tpe's first 10 trials are random; qmc spreads a few")
    seed: int = Field(0, ge=0, le=MAX_SEED // 1000 - 1, description="cell c's sampler: seed * 1000 + c")
    params: dict[str, Distribution] = Field(min_length=1)


class ObjectiveSpec(Strict):
    metric: str = "val_exact"
    mode: Literal["max", "min"] = "max"
    extrapolation: bool = Field(False, description="allow selecting on beyond-train-length metrics")

    @model_validator(mode="after")
    def _in_distribution_by_default(self) -> ObjectiveSpec:
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
    # Ray takes fractions of a CPU (also above 1) down to 0.0001, fractions of one GPU, whole GPUs
    cpus_per_worker: float = Field(1, ge=0.0001)
    gpus_per_worker: float = Field(0, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: Bf16 = False
    max_concurrent_trials: int | None = Field(None, ge=1, description="default: what the cluster fits")
    max_failures: int = Field(1, ge=0, description="retries of a failed trial from its last checkpoint")
    warm_processes: bool = Field(True, description="a trial's process takes the study's next trial (its "
                                 "imports and process group are ready); false: a fresh process per trial")

    @model_validator(mode="after")
    def _ray_accepts(self) -> ResourcesSpec:
        gpus = self.gpus_per_worker
        if (gpus > 1 and not float(gpus).is_integer()) or 0 < gpus < 0.0001:
            raise ValueError(
                f"gpus_per_worker: {gpus:g}: Ray gives a fraction (>= 0.0001) of one GPU or whole GPUs")
        return self


@dataclass(frozen=True)
class Cell:
    index: int
    factors: dict[str, Any]  # flattened: dotted leaf path -> value
    hidden: frozenset[str] = frozenset()  # leaves a linked factor sets along with the one that names it

    @property
    def label(self) -> str:
        shown = (f"{k.split('.')[-1]}={v}" for k, v in self.factors.items() if k not in self.hidden)
        return ",".join(shown) or "all"


def is_linked(key: str) -> bool:
    """A grid key that names a *linked factor* instead of a path into the trial config: each of its
    values maps several dotted paths to values set together (a train length with its test lengths)."""
    return "." not in key and key not in TRIAL_ROOTS


TRIAL_ROOTS = {*TrialConfig.model_fields, *REGISTERED} - {"analyses"}


class StudySpec(Strict):
    # the folder <storage>/<name> and the MLflow experiment: a plain file name, not . or ..
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    description: str = ""
    task: TaskSpec
    base: dict[str, Any] = Field(default_factory=dict, description="the fixed rest of the trial config")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    search: SearchSpec | None = None
    objective: ObjectiveSpec = ObjectiveSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    replicas: int = Field(1, ge=1, description="seeds of each cell's chosen config: without a search, the "
                          "cell's trials; with one, the selected trial and replicas - 1 reruns of its config")
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = Field(0, ge=0, le=MAX_SEED)
    claims: list[ClaimSpec] = Field(default_factory=list, max_length=100, description="rules judged on the "
                                    "study's record when it ends (study/spec/claims.py)")
    _checked: dict[int, TrialConfig] = PrivateAttr(default_factory=dict)  # checked_config's

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        return refuse_non_finite(data)

    @field_validator("name")
    @classmethod
    def _not_a_relative_folder(cls, name):
        if name in (".", ".."):
            raise ValueError(f"{name!r} would put the study's folder outside --storage")
        low = name.lower()
        taken = next((r for r in RESERVED_NAMES if low == r or r == "mlflow.db" and low.startswith(r + "-")), None)
        if taken:
            raise ValueError(f"{name!r} is taken in --storage by {RESERVED_NAMES[taken]}; choose another name")
        return name

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
            if is_linked(path):
                for value in values:
                    if not isinstance(value, dict) or not value or not all(isinstance(k, str) for k in value):
                        raise ValueError(f"{path}: is no path into the trial config (its roots: "
                                         f"{', '.join(sorted(TRIAL_ROOTS))}), so it is a linked factor, whose "
                                         f"every value maps dotted paths to values; got {value!r}")
            seen = set()
            for value in values:  # two equal values would make two cells with one label
                key = json.dumps(value, sort_keys=True, default=str)
                if key in seen:
                    raise ValueError(f"{path}: duplicate value {value!r}")
                seen.add(key)
        return grid

    @model_validator(mode="after")
    def _every_point_is_a_valid_trial(self, info: ValidationInfo) -> StudySpec:
        if self.scheduler.type == "asha" and self.search is None and self.replicas == 1:
            raise ValueError("scheduler.type: asha needs several trials per cell to compare")
        if self.scheduler.type == "asha" and self.search is not None:
            for path in self.search.params:  # ASHA compares a cell's trials report by report
                if path in ("optim.steps", "eval.every_steps"):
                    raise ValueError(f"search.params.{path}: with scheduler.type asha a cell's trials must "
                                     "report equally often; make it a grid factor or fix it in base")
        self._no_setting_twice()
        if self.seed + self.replicas - 1 > MAX_SEED:
            raise ValueError(f"seed: replicas use seeds {self.seed}..{self.seed + self.replicas - 1}, "
                             f"beyond {MAX_SEED}")
        points = list(_points(self.search.params if self.search else {}))
        check_plan_size(self.grid, self.trials_per_cell, len(points), searched=self.search is not None)
        for cell in self.cells():  # bounded now: the product is not built before the check
            for point, blame in points:
                self._check_trial(cell, point, blame, bool((info.context or {}).get("trials_run_here")))
        self._check_claims()
        return self

    def _check_claims(self) -> None:
        names = [c.name for c in self.claims]
        if len(set(names)) != len(names):
            raise ValueError(f"claims: a name given twice ({sorted({n for n in names if names.count(n) > 1})})")
        cells = self.cells()
        for i, claim in enumerate(self.claims):
            if not claim.is_rate and not any(claim.metric == c or c.endswith("/*") and claim.metric.startswith(c[:-1])
                                             for c in metrics.OPTIONAL):
                raise ValueError(f"claims.{i}.metric: {claim.metric!r} is neither a rate of the evaluation points "
                                 f"(exact_match, answer_token_acc, answer_acc) nor a column results.csv keeps "
                                 f"({', '.join(metrics.OPTIONAL)})")
            picked = [pick_cell(cells, claim.cell, f"claims.{i}.cell")]
            if claim.baseline is not None:
                picked.append(pick_cell(cells, claim.baseline, f"claims.{i}.baseline"))
                if picked[0] is picked[1] and claim.baseline_k in (None, claim.k):
                    raise ValueError(f"claims.{i}.baseline: picks the claim's own cell ({picked[0].label}) "
                                     "at the same k_test")
            for cell in picked:
                cfg = self._checked[cell.index]
                if cfg.task_instance.evaluation == "loss" and claim.is_rate:
                    raise ValueError(f"claims.{i}.metric: cell {cell.label} is scored by its loss on text, which has "
                                     f"no {claim.metric}; judge one of its run's metrics (loss_gap/...)")

    def claim_cells(self, claim: ClaimSpec) -> tuple[Cell, Cell | None]:
        """The claim's cell and its baseline's (None for a bound)."""
        cells = self.cells()
        mine = pick_cell(cells, claim.cell, "cell")
        if claim.baseline is not None:
            return mine, pick_cell(cells, claim.baseline, "baseline")
        return mine, (mine if claim.baseline_k is not None else None)

    def _no_setting_twice(self) -> None:
        """Refuse what trial_config would silently override or leave ambiguous."""
        for key, top in (("seed", "seed (and replicas for several seeds per cell)"), ("task", "task")):
            if key in self.base:
                raise ValueError(f"base.{key}: set by the study's top-level {top}; remove it from base")
        ds = self.base.get("deepspeed")
        if isinstance(ds, dict):
            for key in ("zero_stage", "bf16"):
                if key in ds and ds[key] != getattr(self.resources, key):
                    raise ValueError(f"base.deepspeed.{key}: {ds[key]!r} contradicts resources.{key} "
                                     f"{getattr(self.resources, key)!r}; set it once, in resources")
        searched = list(self.search.params) if self.search else []
        paths = [("grid", p) for p in self.grid if not is_linked(p)] + [("search.params", p) for p in searched]
        paths += [(f"grid.{p}", inner) for p in self.grid if is_linked(p)
                  for inner in dict.fromkeys(k for value in self.grid[p] for k in value)]
        for where, path in paths:
            if not all(path.split(".")):
                raise ValueError(f"{where}: {path!r} is not a dotted path into the trial config")
            root = path.split(".")[0]
            if root == "seed":
                raise ValueError(f"{where}.{path}: every trial's seed is the study's seed; for several "
                                 "seeds per cell use replicas")
            if root == "deepspeed":
                raise ValueError(f"{where}.{path}: ZeRO stage and bf16 are resources.zero_stage and "
                                 "resources.bf16, one for the whole study")
        fixed = {f"base.{k}": k for k in flatten(self.base)}
        fixed.update({f"task.params.{k}": f"task.params.{k}" for k in flatten(self.task.params)})
        for where, path in paths:  # a fixed value a factor or the search would silently replace
            values = (self.grid[path] if where == "grid" else
                      [v[path] for v in self.grid[where[5:]] if path in v] if where.startswith("grid.") else [None])
            leaves = {path} | {lp for v in values if isinstance(v, dict) for lp in flatten(v, path + ".")}
            for name, fixed_path in fixed.items():
                if fixed_path in leaves or fixed_path.startswith(path + ".") and where == "search.params":
                    raise ValueError(f"{name}: also set by {where}.{path}, which would replace it; set it "
                                     "in one place")
        for (w1, p1), (w2, p2) in itertools.combinations(paths, 2):
            if p1 == p2 or p2.startswith(p1 + ".") or p1.startswith(p2 + "."):
                raise ValueError(f"{w2}.{p2}: also set by {w1}.{p1}; a setting is either a factor "
                                 "(grid) or searched, once")

    def _check_trial(self, cell: Cell, point: dict[str, Any], blame: str | None, here: bool) -> None:
        """Validate the trial config of one cell at one search point and that it fits (`here`: this machine;
        trial/limits.py); errors name the field, the cell and, for a searched value, its search parameter."""
        where = f" (cell {cell.label})" if cell.factors else ""
        if blame is None:  # the values of base and grid
            prefix = ""
        elif blame == "search.params":  # a combination of searched values
            prefix = f"search.params: at {point}: "
        else:
            prefix = f"{blame}: at {point[blame.removeprefix('search.params.')]!r}: "
        try:
            cfg = TrialConfig.model_validate(self.trial_config(cell, point, self.seed))
        except ValidationError as e:
            raise ValueError(prefix + "; ".join(describe_errors(e).splitlines()) + where) from None
        for path, _value in point.items():
            dist = self.search.params[path]
            if dist.kind in ("uniform", "loguniform") and isinstance(_get_path(cfg, path), int):
                raise ValueError(f"search.params.{path}: {dist.kind} draws real numbers but {path} is an "
                                 "integer (or a bool); use int: [low, high] or choice")
        self._checked.setdefault(cell.index, cfg)
        problem = fits(cfg, self.resources.workers_per_trial, self.resources.gpus_per_worker, here)
        if problem:
            raise ValueError(f"{prefix}{problem}{where}")
        self._check_objective(cfg, prefix, where)

    def _check_objective(self, cfg: TrialConfig, prefix: str, where: str) -> None:
        metric = self.objective.metric
        every, last = selectable_metrics(cfg)
        at_end = any(fnmatch.fnmatchcase(metric, pattern) for pattern in last)
        if metric in every or at_end and cfg.eval.every_steps >= cfg.optim.steps:
            return
        if at_end:  # Tune's searcher and scheduler need the metric in every report
            raise ValueError(
                f"{prefix}objective.metric: {metric} is reported only after training, but the objective "
                f"must be in every report (every eval.every_steps {cfg.eval.every_steps} of optim.steps "
                f"{cfg.optim.steps}); select on one of {', '.join(every)}{where}")
        raise ValueError(f"{prefix}objective.metric: no {cfg.task.name} trial reports {metric!r}; "
                         f"it reports {', '.join([*every, *sorted(last)])}{where}")

    # --- the plan -------------------------------------------------------------------------
    def cells(self) -> list[Cell]:
        paths = list(self.grid)
        cells = []
        for i, values in enumerate(itertools.product(*(self.grid[p] for p in paths))):
            factors: dict[str, Any] = {}
            hidden: set[str] = set()
            for path, value in zip(paths, values):
                if is_linked(path):  # named by its first path; the rest ride along
                    for n, (inner, v) in enumerate(value.items()):
                        leaves = flatten({inner: v})
                        factors.update(leaves)
                        hidden |= set(leaves) if n else set()
                else:
                    factors.update(flatten({path: value}))
            cells.append(Cell(i, factors, frozenset(hidden)))
        return cells

    def factor_leaves(self, factor: str) -> set[str]:
        """The leaf paths a grid factor sets: under its path, or every path of a linked factor."""
        if is_linked(factor):
            return {leaf for value in self.grid[factor] for k, v in value.items() for leaf in flatten({k: v})}
        return {leaf for c in self.cells() for leaf in c.factors if leaf == factor or leaf.startswith(factor + ".")}

    def checked_config(self, cell: Cell) -> TrialConfig:
        """The cell's trial config, typed, as the check validated it (the search's first point, the
        study's seed): what the driver reads of a cell, without validating it again."""
        return self._checked[cell.index]

    @property
    def trials_per_cell(self) -> int:
        """Every trial a cell runs: its search, then replicas - 1 reruns of the selected config (or,
        without a search, `replicas` seeds)."""
        return self.search.trials_per_cell + self.replicas - 1 if self.search else self.replicas

    def trial_config(self, cell: Cell, params: dict[str, Any], seed: int) -> dict:
        """The full trial config of one trial: base, then the cell's factors, then searched params."""
        cfg = copy.deepcopy(self.base)
        cfg["task"] = self.task.model_dump()
        for path, value in {**cell.factors, **params}.items():
            set_path(cfg, path, value)
        ds = cfg.setdefault("deepspeed", {})
        if isinstance(ds, dict):  # anything else is refused by TrialConfig
            ds.setdefault("zero_stage", self.resources.zero_stage)
            ds.setdefault("bf16", self.resources.bf16)
        cfg["seed"] = seed
        return cfg


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf path -> value; also what a resume compares (study/record/identity.py)."""
    out = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _points(params: dict[str, Distribution]):
    """(point, blame) pairs to validate: the first point (blame None: base and grid), each
    parameter's other points with the rest at their first (blame: that parameter), then every
    combination while there are few (blame: the whole search)."""
    values = {path: dist.points() for path, dist in params.items()}
    first = {path: v[0] for path, v in values.items()}
    candidates = [(first, None)]
    for path, vs in values.items():
        candidates += [({**first, path: v}, f"search.params.{path}") for v in vs[1:]]
    if len(values) > 1 and math.prod(map(len, values.values())) <= MAX_POINT_PRODUCT:
        combos = itertools.product(*values.values())
        candidates += [(dict(zip(values, combo)), "search.params") for combo in combos]
    seen = set()
    for point, blame in candidates:
        key = json.dumps(point, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            yield point, blame


def _get_path(cfg: TrialConfig, path: str) -> Any:
    """The validated value at a dotted path (None where the path leads into no field)."""
    node: Any = cfg
    for part in RENAMED.get(path, path).split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            node = getattr(node, part, None)
    return node


def set_path(cfg: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"{path}: {p} is not a group")
    node[leaf] = value


def load_spec(path: str, here: bool = False, overrides: list[str] | None = None) -> StudySpec:
    """Read and validate a study spec; errors name the field (`describe_errors`); an alias bomb is
    refused before it is loaded (load_yaml). `here`: trials run on this machine (its memory bounds theirs).
    `overrides`: `--set KEY=VALUE` items, set before the spec is validated (study/spec/overrides.py)."""
    from study.spec import overrides as override

    data = override.apply(load_yaml(path, "a study spec"), overrides or [], override.SPEC_PATH_KEYS)
    return StudySpec.model_validate(data, context={"trials_run_here": bool(here)})


def flat_params(trial_config: dict) -> dict[str, Any]:
    """Readable flat parameter names for MLflow and results.csv (task.params.train_k, optim.lr...)."""
    return {k: v for k, v in flatten(trial_config).items() if not re.match(r"eval\.", k)}
