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


class Strict(BaseModel):
    # a NaN or inf anywhere in a config is a typo or an overflow, never a setting
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def refuse_non_finite(data: Any, path: str = "") -> Any:
    """Raise naming the first NaN or inf in a raw config, also where fields take any value
    (task params, study grids and base) that `allow_inf_nan` does not reach."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ValueError(f"{path or 'value'}: {data} is not a finite number")
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        refuse_non_finite(value, f"{path}.{key}" if path else str(key))
    return data
