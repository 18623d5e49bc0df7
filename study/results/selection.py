"""Which search trial of a cell is selected, and why: the rule the searcher (its replicas rerun the
selected config) and the report (selected.csv) share.

The objective is measured on `eval.val_samples` held-out samples, so two trials whose objective
differs by less than its sampling error are not told apart by it. For a share of samples (val_exact,
val_answer_acc) trials within one standard error of the difference from the best are tied (the
one-standard-error rule); the standard error of a share p of n samples is sqrt(p'(1 - p') / n) with
p' = (p n + 1) / (n + 2), which does not vanish at 0 or 1. Other objectives tie only when equal.
Among tied trials the search's first suggestion is chosen: nothing measured prefers another, and a
second noisy number (val_loss near 0 once every sample is right) would choose on noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from study.spec.schema import Cell, StudySpec

# objectives that are a share of the validation samples, whose sampling error is binomial
PER_SAMPLE = ("val_exact", "val_answer_acc")
BY_OBJECTIVE, BY_ORDER = "objective", "first suggested"


@dataclass(frozen=True)
class Choice:
    key: Any  # the chosen trial
    tied: int  # trials within sampling error of the best, the chosen one included
    chosen_by: str  # BY_OBJECTIVE (the best alone) or BY_ORDER (the first suggested of the tied)


def standard_error(share: float, n: int) -> float:
    """The binomial standard error of a share of n samples, smoothed away from 0 and 1."""
    p = (share * n + 1) / (n + 2)
    return math.sqrt(p * (1 - p) / n)


def validation_samples(spec: StudySpec, cell: Cell) -> int | None:
    """How many samples the objective of this cell's trials is measured on, where it is a share of
    them (None otherwise): eval.val_samples, rounded up to a multiple of the workers (each takes an
    equal shard, trial/loop.py)."""
    from trial.config import EvalSpec

    if spec.objective.metric not in PER_SAMPLE:
        return None
    # the eval section alone: without the searched params the rest of the config may not validate
    # (a searched warm-up, say), and none of them changes how many samples validation draws
    val_samples = EvalSpec.model_validate(spec.trial_config(cell, {}, spec.seed)["eval"]).val_samples
    workers = spec.resources.workers_per_trial
    return -(-val_samples // workers) * workers


def choose(spec: StudySpec, scored: list[tuple[Any, float | None, Any]], n: int | None) -> Choice | None:
    """scored: (trial, objective value, order of suggestion) of a cell's finished search trials;
    None when none has a value."""
    valued = [(key, float(v), order) for key, v, order in scored if v is not None and v == v]
    if not valued:
        return None
    sign = 1.0 if spec.objective.mode == "max" else -1.0
    best = max(v * sign for _, v, _ in valued) * sign

    def tied(v: float) -> bool:
        if n is None:
            return v == best
        return abs(v - best) <= math.sqrt(standard_error(v, n) ** 2 + standard_error(best, n) ** 2)

    ties = sorted((order, key) for key, v, order in valued if tied(v))
    return Choice(ties[0][1], len(ties), BY_OBJECTIVE if len(ties) == 1 else BY_ORDER)


def tie_sentence(spec: StudySpec, choice_tied: int, n: int | None) -> str:
    """How a tie was broken, as the closing lines say it ("" without a tie)."""
    if choice_tied < 2:
        return ""
    within = f"within sampling error (n={n})" if n else "exactly"
    return f"{choice_tied} trials tied {within} on {spec.objective.metric}: chose the first suggested"
