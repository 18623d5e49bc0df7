"""The field's known results that the schemes benchmark checks, each with the recipe that trains its
cells (the spec, the cells of it, the steps), and the rule that judges it on the runs.

A claim is judged at the first test length >= 2x its cells' train length, on cells that fit the task
in distribution (exact >= FITS at the train length): a cell that did not says nothing about its
scheme, and the claim fails with that figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.coupling import jobs_for
from benchmarks.runs_table import FITS, per_run
from study.results.tables import mean_and_range_text
from trial.config import TrialConfig

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"


@dataclass(frozen=True)
class Recipe:
    """Cells of `search_spaces/<spec>.yaml` a claim trains, as the spec sets them up: `cells` as
    `--cells` picks them (all when empty)."""

    spec: str
    cells: tuple[str, ...] = ()


@dataclass(frozen=True)
class FieldClaim:
    """`scheme` on `task` scores `metric` >= `at_least` (mean over seeds), or above `above` by more
    than two standard errors of the paired difference (so not 0.02 over 0.00, nor one sample of 256)
    on every seed where both fit, at least two (one when one seed ran)."""

    name: str
    source: str
    task: str
    scheme: str
    recipe: tuple[Recipe, ...]
    above: str | None = None
    at_least: float | None = None
    metric: str = "exact_match"
    on_request: bool = False  # trained and judged only when named (--claims), not by the command alone


# as Ruoss et al. measured it: an encoder reads every output at once (a decoder's runs: docs/schemes.md)
REVERSAL = (Recipe("schemes_randomized_encoder", ("name=reverse",)),)
FIELD_CLAIMS = [
    # trained on 1-10 digits: on 1-5 the distances a 10-digit sum needs never meet in training (docs/schemes.md)
    FieldClaim("abacus_addition", "McLeish et al. 2024", "addition (lsb_first, unpadded)", "nope, sequential, abacus",
               (Recipe("schemes_abacus_train10", ("ids=random_shift", "abacus=True")),), above="learned, random_shift"),
    FieldClaim("coupled_multiplication", "Cho et al. 2024", "multiplication", "learned, coupled",
               (Recipe("schemes_multiplication_coupled"),), at_least=0.9),
    FieldClaim("randomized_reversal_tokens", "Ruoss et al. 2023", "reverse", "learned, randomized, encoder", REVERSAL,
               above="learned, sequential, encoder", metric="answer_token_acc"),
    FieldClaim("randomized_reversal_exact", "Ruoss et al. 2023", "reverse", "learned, randomized, encoder", REVERSAL,
               above="learned, sequential, encoder"),
    # on request: at chance in both schemes at this scale (docs/schemes.md), a fifth of the command's time
    FieldClaim("randomized_duplication_tokens", "Ruoss et al. 2023", "duplicate", "learned, randomized",
               (Recipe("schemes_randomized_published", ("name=duplicate",)),),
               above="learned, sequential", metric="answer_token_acc", on_request=True),
]


def claim_jobs(claims: list[FieldClaim], seeds: list[int], lengths: list[int] | None) -> tuple[list[dict], dict]:
    """The trials `claims` need, each once, the longest first (they finish together on N workers), and
    each spec's train length."""
    jobs, train_lengths = [], {}
    for recipe in dict.fromkeys(r for claim in claims for r in claim.recipe):  # claims may share a recipe
        found, train_lengths[recipe.spec] = jobs_for(SPACES / f"{recipe.spec}.yaml", seeds, lengths,
                                                     list(recipe.cells) or None)
        jobs += found
    return sorted(jobs, key=lambda j: -work(j["trial"])), train_lengths


def work(trial: dict) -> int:
    """Parameters x samples trained: what orders trials by their time, the longest first (4 layers of
    d 256 for 8,000 steps train 1.5-2.6x as long as 2 layers of d 128 for 12,000 in bf16 mixed
    precision, by the host, and 5x in fp32)."""
    cfg = TrialConfig.model_validate(trial)
    return cfg.n_parameters() * cfg.optim.steps * cfg.optim.batch_size


def sampling_margin(mine, other, samples: int):
    """Two standard errors of the difference of two rates each measured on `samples` test samples
    (per sample: for a per-token rate, which has more trials, it is the cautious side)."""
    return 2 * ((mine * (1 - mine) + other * (1 - other)) / samples) ** 0.5


def judge(claim: FieldClaim, table, samples: int) -> tuple[bool | None, str]:
    """(holds, the figures): None when a cell it needs was not run in its recipe's spec. `table` holds
    a row per run and length, with its spec and the train length of its cell; `samples`: test samples
    per cell."""
    schemes = [claim.scheme] + ([claim.above] if claim.above else [])
    table = table[table.spec.isin({r.spec for r in claim.recipe})]  # another spec's cells are another setup
    cells = {s: table[(table.task == claim.task) & (table.scheme == s)] for s in schemes}
    if any(c.empty for c in cells.values()) or claim.metric not in table:
        return None, "not run"
    train_length = int(cells[claim.scheme].train_length.max())
    unfit = [f"{s} did not fit ({c[c.length == train_length].exact_match.mean():.2f} exact at {train_length})"
             for s, c in cells.items() if not c[c.length == train_length].exact_match.mean() >= FITS]
    if unfit:
        return False, "; ".join(unfit)
    at = min(n for n in cells[claim.scheme].length.unique() if n >= 2 * train_length)
    runs = {s: per_run(c, at, claim.metric) for s, c in cells.items()}
    mine = runs[claim.scheme]
    if claim.above is None:
        return bool(mine.mean() >= claim.at_least), f"{claim.scheme} {mean_and_range_text(mine)} >= {claim.at_least}? at {at}"
    # a run that did not fit says nothing beyond the train length: pair only the runs where both fit
    fit = [per_run(c, train_length) >= FITS for c in cells.values()]
    difference = (mine - runs[claim.above]).dropna()
    paired = difference[fit[0].reindex(difference.index, fill_value=False)
                        & fit[1].reindex(difference.index, fill_value=False)]
    above = paired > sampling_margin(mine, runs[claim.above], samples).reindex(paired.index)
    holds = len(paired) >= min(2, len(difference)) > 0 and bool(above.all())
    return holds, (f"{claim.scheme} {mean_and_range_text(mine)} vs {claim.above} {mean_and_range_text(runs[claim.above])} at {at}, "
                   f"paired difference {mean_and_range_text(difference)}, above 2 standard errors (n={samples}) on "
                   f"{int(above.sum())}/{len(paired)} runs where both fit (of {len(difference)})")


def check_field_claims(table, samples: int, claims: list[FieldClaim] = FIELD_CLAIMS) -> tuple[list[str], list[str]]:
    """A line per claim, `claim <name>: holds (...)` / `fails (...)` / `not run`, and the failures."""
    lines, failures = [], []
    for claim in claims:
        holds, figures = judge(claim, table, samples)
        verdict = "not run" if holds is None else ("holds" if holds else "fails")
        line = f"claim {claim.name}: {verdict}" + ("" if holds is None else f" ({claim.metric}: {figures})")
        lines.append(f"{line}  [{claim.source}]")
        if holds is False:
            failures.append(line)
    return lines, failures
