"""Intervals for rates measured on n test samples that stay right at 0 and 1 (docs/statistics.md).

A Wald interval, p +- z sqrt(p(1-p)/n), has zero width at p = 0 or 1, so 4 right of 256 against 0
of 256 would look certain. Wilson's score interval does not collapse there, and Newcombe's hybrid
score interval for a difference of two rates is built from the two Wilson intervals.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


def wilson(right: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a rate `right / n` (`right` may be fractional: a rate times n)."""
    if n <= 0:
        return 0.0, 1.0
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    return (0.0 if right <= 0 else low), (1.0 if right >= n else high)  # exact at the edges, not 1 - 1e-16


def newcombe(right_a: float, n_a: int, right_b: float, n_b: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (his method 10) of the difference p_a - p_b."""
    p_a, p_b = right_a / n_a, right_b / n_b
    low_a, high_a = wilson(right_a, n_a, z)
    low_b, high_b = wilson(right_b, n_b, z)
    d = p_a - p_b
    return (d - math.sqrt((p_a - low_a) ** 2 + (high_b - p_b) ** 2),
            d + math.sqrt((high_a - p_a) ** 2 + (p_b - low_b) ** 2))
