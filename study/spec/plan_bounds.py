"""How large a study's plan may be: cells, trials, and trial configs validated when a spec loads.
Checked from the factors' value counts before the grid's product is built, so a huge grid is
refused at once, naming the field and the bound."""

from __future__ import annotations

import math

# Cells: the search seeds cell c's sampler with seed * 1000 + c (study/experiment/search.py): beyond
# 1,000 cells two cells would share samplers (and the largest seed would pass 32 bits).
MAX_CELLS = 1_000
MAX_TRIALS = 100_000  # cells x trials per cell
# trial configs validated when a spec loads (every cell at every search point): bounded so that even
# an accepted spec is checked in about a minute
MAX_VALIDATED_CONFIGS = 50_000


def check_plan_size(grid: dict[str, list], trials_per_cell: int, points: int, searched: bool) -> None:
    """Raise naming the field and the bound if a study's plan is beyond MAX_CELLS, MAX_TRIALS or
    MAX_VALIDATED_CONFIGS; from the factors' value counts alone, so a huge grid is refused at once."""
    cells = math.prod(len(values) for values in grid.values())
    if cells > MAX_CELLS:
        sizes = " x ".join(str(len(values)) for values in grid.values())
        raise ValueError(f"grid: {cells} cells ({sizes} values), beyond the bound of {MAX_CELLS} cells "
                         "(MAX_CELLS in study/spec/plan_bounds.py); use fewer factors or values")
    if cells * trials_per_cell > MAX_TRIALS:
        each = "search.trials_per_cell + replicas - 1" if searched else "replicas"
        raise ValueError(f"{each.split(' ')[0]}: {cells} cell(s) x {trials_per_cell} trials each ({each}) = "
                         f"{cells * trials_per_cell} trials, beyond the bound of {MAX_TRIALS} trials "
                         "(MAX_TRIALS in study/spec/plan_bounds.py)")
    if cells * points > MAX_VALIDATED_CONFIGS:
        raise ValueError(f"search.params: {cells} cell(s) x {points} search points = {cells * points} trial "
                         f"configs to validate, beyond the bound of {MAX_VALIDATED_CONFIGS} "
                         "(MAX_VALIDATED_CONFIGS in study/spec/plan_bounds.py); use fewer grid values or choices")
