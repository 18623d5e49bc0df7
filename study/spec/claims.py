"""A claim: a rule in a study spec, judged on the study's record when it ends (study/results/verdicts.py).

```yaml
claims:
  - name: abacus_beats_absolute
    source: McLeish et al. 2024
    setup: addition, train 1-10 digits, 4 layers of d 256, 8,000 steps x 64
    cell: {abacus: true}                       # factor values: a leaf path, or its last name
    baseline: {ids: random_shift}              # a cell to beat (or at_least / at_most: a bound)
    metric: exact_match                        # or answer_token_acc, answer_acc
    times: 2                                   # the test length, as a multiple of the train length
    effect: 0.10                               # the smallest difference (or margin) that counts
```
Cells are named by factor values (so a grid can grow without touching its claims), each exactly one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from trial.limits import Strict

CLAIM_METRICS = ("exact_match", "answer_token_acc", "answer_acc")


class ClaimSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    source: str = Field("ours", max_length=200, description="who published the result (or `ours`)")
    setup: str = Field("", max_length=300, description="one line: the setup the claim is judged in")
    published: str = Field("", max_length=300, description="the published figure it is set beside, with its setup")
    cell: dict[str, Any] = Field(default_factory=dict, description="the cell the claim is about, by factor values")
    baseline: dict[str, Any] | None = Field(None, description="the cell it must beat, by factor values")
    baseline_k: int | None = Field(None, ge=1, description="the baseline's k_test (alone: the claim's own cell "
                                   "at another k_test, as T1 compares them)")
    at_least: float | None = Field(None, ge=0, le=1, description="or: the rate it must reach")
    at_most: float | None = Field(None, ge=0, le=1, description="or: the rate it must stay under")
    metric: str = Field("exact_match", max_length=200, pattern=r"^[A-Za-z0-9_./-]+$", description="a rate of the evaluation points (exact_match, "
                        "answer_token_acc, answer_acc), or a run's own metric in results.csv (loss_gap/...): a "
                        "bound, judged per run")
    times: float = Field(2.0, gt=0, le=1000, description="the test length, as a multiple of each cell's "
                         "train length (the nearest evaluated length at or above it)")
    k: int | None = Field(None, ge=1, description="the evaluation point's k_test (default: the cell's train k)")
    checkpoint: Literal["last", "best"] = Field("last", description="which checkpoint is judged (eval.select)")
    effect: float = Field(0.10, ge=0, le=1, description="the smallest difference to the baseline that counts")
    chance: float | None = Field(None, ge=0, lt=1, description="the rate a guess reaches on this metric (a "
                                 "one-bit answer: 0.5); a comparison's baseline below it is judged as chance")
    from_seed: int | None = Field(None, ge=0, description="judged on seeds >= this only: a claim stated after "
                                  "earlier seeds were seen is tested by the seeds that did not inform it")

    @model_validator(mode="after")
    def _one_rule(self) -> ClaimSpec:
        rules = [r for r in ("baseline", "at_least", "at_most") if getattr(self, r) is not None]
        if self.baseline is None and self.baseline_k is not None:
            rules.append("baseline_k")
        if len(rules) != 1:
            raise ValueError(f"claim {self.name}: give exactly one of baseline (or baseline_k), at_least, at_most "
                             f"(got {', '.join(rules) or 'none'})")
        if self.metric not in CLAIM_METRICS and (self.compares or self.k is not None):
            raise ValueError(f"claim {self.name}: metric: {self.metric!r} is a run's own metric, judged against a "
                             f"bound (at_least / at_most) only; rates to compare: {', '.join(CLAIM_METRICS)}")
        if self.chance is not None and not (self.compares and self.is_rate):
            raise ValueError(f"claim {self.name}: chance: floors a comparison's baseline; give it with baseline "
                             f"and a rate metric ({', '.join(CLAIM_METRICS)})")
        if self.baseline_k is not None and self.baseline is None and self.baseline_k == self.k:
            raise ValueError(f"claim {self.name}: baseline_k: {self.baseline_k} is the claim's own k")
        return self

    @property
    def is_rate(self) -> bool:
        """A rate of n test samples (an interval per seed) rather than a run's own number."""
        return self.metric in CLAIM_METRICS

    @property
    def compares(self) -> bool:
        """A comparison with a baseline (another cell, or the same cell at another k_test)."""
        return self.baseline is not None or self.baseline_k is not None

    @property
    def rule(self) -> str:
        if self.compares:
            other = label_of(self.baseline) if self.baseline is not None else "its own cell"
            at_k = f" at k_test {self.baseline_k}" if self.baseline_k is not None else ""
            floor = f" (or chance, {self.chance:g}, where it is below)" if self.chance is not None else ""
            rule = f"above {other}{at_k}{floor} by >= {self.effect:g}"
        else:
            rule = f">= {self.at_least:g}" if self.at_least is not None else f"<= {self.at_most:g}"
        return rule + (f" on seeds >= {self.from_seed}" if self.from_seed is not None else "")


def label_of(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items()) or "the one cell"


def matches(factors: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a cell's factors (dotted leaf paths) hold every wanted value; a wanted key is a leaf
    path, or the part of one after a dot (`ids` for `positional.ids`); a wanted null: the cell does not
    set that factor (`id_window: null`, full attention beside a cell with `id_window: 1`)."""
    for key, value in wanted.items():
        found = [v for path, v in factors.items() if path == key or path.endswith("." + key)]
        if value is None and not found:
            continue
        if not found or any(_norm(v) != _norm(value) for v in found):
            return False
    return True


def _norm(value: Any) -> str:
    return repr(value) if not isinstance(value, float) or not value.is_integer() else repr(int(value))


def pick_cell(cells: list, wanted: dict[str, Any], field: str):
    """The one cell whose factors hold `wanted`; ValueError naming `field` otherwise."""
    found = [c for c in cells if matches(c.factors, wanted)]
    if len(found) != 1:
        which = "no cell" if not found else f"{len(found)} cells ({', '.join(c.label for c in found[:4])})"
        raise ValueError(f"{field}: {label_of(wanted)} picks {which}; it must pick exactly one "
                         f"(cells: {', '.join(c.label for c in cells[:6])}{', ...' if len(cells) > 6 else ''}); "
                         "change the claim, or drop the claims (--set claims=[])")
    return found[0]
