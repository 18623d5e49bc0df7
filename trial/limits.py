"""What every config class shares: strictness (no unknown key, no NaN, frozen) and the size bounds.

Sizes beyond these bounds cannot be allocated on any one machine this platform targets; refusing
them at load time beats an out-of-memory kill (or a 2.5 TB allocation) after a cluster has started.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

MAX_SEED = 2**32 - 1  # numpy's and Optuna's seeds are 32-bit
# Sizes beyond these cannot be allocated on any one machine this platform targets; refusing them
# at load time beats an out-of-memory kill (or a 2.5 TB allocation) after a cluster has started.
MAX_POSITION = 2**20
MAX_PARAMETERS = 10**10  # 160 GB of fp32 weights, gradients and AdamW moments
MAX_BATCH = 2**20  # sequences in one batch: beyond it the activations of any model here overflow memory
MAX_SAMPLES = 10**7  # sequences generated for one evaluation set (they are held in memory)
MAX_STEPS = 10**9
# A study's plan, checked from the factors' lengths before the grid's product is built. Cells: the
# search seeds cell c's sampler with seed * 1000 + c (study/experiment/search.py): beyond 1,000 cells two search
# seeds would share samplers (and the largest would pass 32 bits); the scale benchmark (P6) runs 4.
MAX_CELLS = 1_000
MAX_TRIALS = 100_000  # cells x trials per cell (P6 measures up to 1,000)
# trial configs validated when a spec loads (every cell at every search point, ~1.5 ms each on one
# core): about a minute at the bound, so even an accepted spec is checked in bounded time
MAX_VALIDATED_CONFIGS = 50_000
# (length, k) cells of one trial's evaluation grid (eval.lengths x eval.ks), listed when a config is
# validated; the shipped specs use at most 54
MAX_EVAL_CELLS = 10_000


class Strict(BaseModel):
    # a NaN or inf anywhere in a config is a typo or an overflow, never a setting
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def check_plan_size(grid: dict[str, list], trials_per_cell: int, points: int, searched: bool) -> None:
    """Raise naming the field and the bound if a study's plan is beyond MAX_CELLS, MAX_TRIALS or
    MAX_VALIDATED_CONFIGS; from the factors' value counts alone, so a huge grid is refused at once."""
    cells = math.prod(len(values) for values in grid.values())
    if cells > MAX_CELLS:
        sizes = " x ".join(str(len(values)) for values in grid.values())
        raise ValueError(f"grid: {cells} cells ({sizes} values), beyond the bound of {MAX_CELLS} cells "
                         "(MAX_CELLS in trial/limits.py); use fewer factors or values")
    if cells * trials_per_cell > MAX_TRIALS:
        each = "search.trials_per_cell + replicas - 1" if searched else "replicas"
        raise ValueError(f"{each.split(' ')[0]}: {cells} cell(s) x {trials_per_cell} trials each ({each}) = "
                         f"{cells * trials_per_cell} trials, beyond the bound of {MAX_TRIALS} trials "
                         "(MAX_TRIALS in trial/limits.py)")
    if cells * points > MAX_VALIDATED_CONFIGS:
        raise ValueError(f"search.params: {cells} cell(s) x {points} search points = {cells * points} trial "
                         f"configs to validate, beyond the bound of {MAX_VALIDATED_CONFIGS} "
                         "(MAX_VALIDATED_CONFIGS in trial/limits.py); use fewer grid values or choices")


def refuse_non_finite(data: Any, path: str = "") -> Any:
    """Raise naming the first NaN or inf in a raw config, also where fields take any value
    (task params, study grids and base) that `allow_inf_nan` does not reach."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ValueError(f"{path or 'value'}: {data} is not a finite number")
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        refuse_non_finite(value, f"{path}.{key}" if path else str(key))
    return data
