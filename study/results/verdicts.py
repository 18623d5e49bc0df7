"""The one judge of claims (study/spec/claims.py), on the rows of results.csv of one or more studies
of one spec (other seeds are pooled).

Per run (a trial: one seed of the cell's selected config) the judge reads two points, with the
model's own ids and the claim's checkpoint:
- *fit*: exact match at the cell's longest in-distribution length reaches FITS. A run that did not fit
  says nothing about its scheme beyond the train length, so it is counted, never judged;
- *the claim's rate*: `metric` at the first evaluated length >= `times` x the cell's train length.

A comparison holds when, on every seed where both cells fit (at least MIN_SEEDS of them),
Newcombe's 95% interval of the difference lies above 0 and its point estimate reaches `effect` (a
baseline below the claim's `chance` is taken at chance: beating worse than a guess shows nothing); a
bound holds when, on every seed where the cell fit (at least MIN_SEEDS), the rate reaches the bound.
Fewer such seeds make the claim `inconclusive`, never `fails`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from study.results.intervals import newcombe, wilson
from study.results.tables import mean_and_range, mean_range, seed_runs
from study.spec.claims import ClaimSpec
from study.spec.schema import Cell, StudySpec

FITS = 0.95  # exact match in distribution a run must reach to say anything about extrapolation
MIN_SEEDS = 2
VERDICTS = ("holds", "fails", "inconclusive")


@dataclass
class Verdict:
    claim: ClaimSpec
    verdict: str  # holds | fails | inconclusive
    figures: str
    rows: list[dict] = field(default_factory=list)  # per seed: the table behind the verdict

    @property
    def line(self) -> str:
        return f"claim {self.claim.name}: {self.verdict} ({self.figures})  [{self.claim.source}]"

    def table_rows(self) -> list[dict]:
        """claims.csv's rows of this claim: one per seed judged (none judged: one row, its verdict)."""
        c = self.claim
        head = {"claim": c.name, "verdict": self.verdict, "source": c.source, "metric": c.metric, "times": c.times,
                "checkpoint": c.checkpoint, "rule": c.rule}
        return [{**head, **r} for r in self.rows] or [head]

    def record(self) -> dict:
        """What report.json and the record keep of the verdict."""
        return {"name": self.claim.name, "verdict": self.verdict, "line": self.line, "source": self.claim.source,
                "setup": self.claim.setup}


@dataclass(frozen=True)
class RunPoint:
    """One run's two readings: did it fit, and its rate (right / n) at the claim's test length."""

    fit: bool
    fit_exact: float
    rate: float
    n: int
    length: int


def judge(spec: StudySpec, results: pd.DataFrame) -> list[Verdict]:
    """Every claim of `spec` on `results` (rows of results.csv; a `study` column tells pooled studies apart)."""
    return [judge_claim(spec, claim, results) for claim in spec.claims]


def held_out(claim: ClaimSpec, seed: int) -> bool:
    """Whether a run of `seed` judges the claim: every seed, or those from `from_seed` on (the seeds that
    did not inform a claim stated after earlier ones were seen). Applied to the runs of the selected
    config, after selection: a search's trials all run on the spec's seed."""
    return claim.from_seed is None or seed >= claim.from_seed


def judge_claim(spec: StudySpec, claim: ClaimSpec, results: pd.DataFrame) -> Verdict:
    cell = spec.claim_cells(claim)[0]
    if not claim.is_rate:
        return _judge_run_metric(claim, _run_values(spec, cell, claim, results))
    mine = run_points(spec, cell, claim, claim.k, results)
    if not claim.compares:
        return _judge_bound(claim, mine)
    return _judge_comparison(claim, mine, baseline_points(spec, claim, results))


def baseline_points(spec: StudySpec, claim: ClaimSpec, results: pd.DataFrame) -> dict[tuple, RunPoint | str]:
    """A comparison's baseline runs: its baseline cell (or its own cell) at the baseline's k_test."""
    base = spec.claim_cells(claim)[1]
    return run_points(spec, base, claim, claim.baseline_k if claim.baseline_k is not None else claim.k, results)


def run_points(spec: StudySpec, cell: Cell, claim: ClaimSpec, k: int | None,
               results: pd.DataFrame) -> dict[tuple, RunPoint | str]:
    """Per run, keyed (study, seed): its RunPoint, or why it has none (not evaluated there)."""
    cfg = spec.checked_config(cell)
    task = cfg.task_instance
    k = k if k is not None else (task.train_k if task.uses_k else None)
    # a run fits in distribution: at a k_test beyond the k it trained on, its fit is read at that k
    fit_k = min(k, task.train_k) if k is not None and task.uses_k else k
    test_at = claim.times * task.train_length
    if results.empty or "cell" not in results:
        return {}
    rows = results[(results.cell == cell.label)]
    if "study" not in rows:
        rows = rows.assign(study="")
    out: dict[tuple, RunPoint | str] = {}
    for study, group in rows.groupby("study", sort=False):
        for _trial_id, run in _runs(spec, group):
            points = run[(run.ids == cfg.positional.scheme.own_ids)] if "ids" in run else run
            if "checkpoint" in points:
                points = points[points.checkpoint.fillna("last") == claim.checkpoint]
            elif claim.checkpoint != "last":
                points = points.iloc[0:0]
            key = (study, int(run.seed.iloc[0]))
            if not held_out(claim, key[1]):
                continue
            inside = _at_k(points, fit_k)
            inside = inside[inside.length <= task.train_length]
            beyond = _at_k(points, k)
            beyond = beyond[beyond.length >= test_at - 1e-9].sort_values("length")
            if inside.empty or beyond.empty or pd.isna(beyond[claim.metric].iloc[0]) or "n" not in beyond:
                out[key] = f"not evaluated at {'the train length' if inside.empty else f'{claim.times:g}x'}"
                continue
            fit_exact = float(inside.sort_values("length").exact_match.iloc[-1])
            first = beyond.iloc[0]
            out[key] = RunPoint(fit_exact >= FITS, fit_exact, float(first[claim.metric]), int(first["n"]),
                                int(first.length))
    return out


def _at_k(points: pd.DataFrame, k: int | None) -> pd.DataFrame:
    return points[points.k == k] if k is not None and "k" in points else points


def _runs(spec: StudySpec, cell_rows: pd.DataFrame):
    """(trial id, rows) of the runs a claim reads: the finished runs of the cell's selected config."""
    done = cell_rows[cell_rows.status == "TERMINATED"]
    if done.empty:
        return
    if spec.search is not None:
        from study.results.tables import select

        chosen = select(spec, cell_rows)
        if chosen.empty:
            return
        done = seed_runs(spec, cell_rows, chosen.trial_id.iloc[0])
    yield from done.groupby("trial_id", sort=False)


def fit_counts(points: dict) -> tuple[int, int]:
    """(runs that fit, runs) of a cell's points."""
    runs = [p for p in points.values() if isinstance(p, RunPoint)]
    return sum(p.fit for p in runs), len(points)


def runs_text(values: list[float]) -> str:
    """`mean [min-max]` of the runs, as every table prints it (study/results/tables.py)."""
    return mean_range(*mean_and_range(pd.Series(values, dtype=float))[:3], digits=2)


def _judge_bound(claim: ClaimSpec, mine: dict) -> Verdict:
    fit, runs = fit_counts(mine)
    judged = {key: p for key, p in mine.items() if isinstance(p, RunPoint) and p.fit}
    rows, ok = [], []
    for (study, seed), p in judged.items():
        low, high = wilson(p.rate * p.n, p.n)
        reached = p.rate >= claim.at_least if claim.at_least is not None else p.rate <= claim.at_most
        ok.append(reached)
        rows.append({"claim": claim.name, "study": study, "seed": seed, "length": p.length, "n": p.n,
                     "fit_exact": p.fit_exact, "rate": p.rate, "low": low, "high": high, "reached": reached})
    rates = [p.rate for p in judged.values()]
    length = next((p.length for p in judged.values()), None)
    figures = (f"{claim.metric} at {claim.times:g}x ({length}) {runs_text(rates)} {claim.rule}? "
               f"reached on {sum(ok)}/{len(ok)} runs that fit; runs fit {fit}/{runs}")
    if len(judged) < MIN_SEEDS:
        return Verdict(claim, "inconclusive", f"fewer than {MIN_SEEDS} runs fit in distribution; {figures}", rows)
    return Verdict(claim, "holds" if all(ok) else "fails", figures, rows)


def _run_values(spec: StudySpec, cell: Cell, claim: ClaimSpec, results: pd.DataFrame) -> dict[tuple, float]:
    """Per run, keyed (study, seed): its own value of the claim's metric (a column of results.csv)."""
    if results.empty or "cell" not in results or claim.metric not in results:
        return {}
    rows = results[results.cell == cell.label]
    rows = rows if "study" in rows else rows.assign(study="")
    out = {}
    for study, group in rows.groupby("study", sort=False):
        for _trial_id, run in _runs(spec, group):
            value, seed = run[claim.metric].dropna(), int(run.seed.iloc[0])
            if not value.empty and held_out(claim, seed):
                out[(study, seed)] = float(value.iloc[0])
    return out


def _judge_run_metric(claim: ClaimSpec, values: dict[tuple, float]) -> Verdict:
    """A bound on a run's own number (no test samples behind it: no interval), on every run."""
    rows, ok = [], []
    for (study, seed), value in values.items():
        reached = value >= claim.at_least if claim.at_least is not None else value <= claim.at_most
        ok.append(reached)
        rows.append({"claim": claim.name, "study": study, "seed": seed, "rate": value, "reached": reached})
    figures = f"{claim.metric} {runs_text(list(values.values()))} {claim.rule}? reached on {sum(ok)}/{len(ok)} runs"
    if len(values) < MIN_SEEDS:
        return Verdict(claim, "inconclusive", f"fewer than {MIN_SEEDS} runs; {figures}", rows)
    return Verdict(claim, "holds" if all(ok) else "fails", figures, rows)


def _judge_comparison(claim: ClaimSpec, mine: dict, theirs: dict) -> Verdict:
    fit_a, runs_a = fit_counts(mine)
    fit_b, runs_b = fit_counts(theirs)
    both = [key for key in mine if key in theirs and isinstance(mine[key], RunPoint)
            and isinstance(theirs[key], RunPoint) and mine[key].fit and theirs[key].fit]
    rows, ok, diffs = [], [], []
    for key in both:
        a, b = mine[key], theirs[key]
        b_rate = max(b.rate, claim.chance) if claim.chance is not None else b.rate
        low, high = newcombe(a.rate * a.n, a.n, b_rate * b.n, b.n)
        d = a.rate - b_rate
        reached = low > 0 and d >= claim.effect - 1e-12
        ok.append(reached)
        diffs.append(d)
        rows.append({"claim": claim.name, "study": key[0], "seed": key[1], "length": a.length,
                     "baseline_length": b.length, "n": a.n, "rate": a.rate, "baseline_rate": b.rate,
                     "judged_baseline_rate": b_rate, "difference": d, "low": low, "high": high, "reached": reached})
    cell_rates = [mine[k].rate for k in both]
    base_rates = [theirs[k].rate for k in both]
    floor = f" (taken at chance, {claim.chance:g}, where below)" if claim.chance is not None else ""
    figures = (f"{claim.metric} at {claim.times:g}x: {runs_text(cell_rates)} against {runs_text(base_rates)}{floor}, "
               f"difference {runs_text(diffs)}, interval above 0 and >= {claim.effect:g} on {sum(ok)}/{len(ok)} "
               f"seeds where both fit; runs fit {fit_a}/{runs_a} and {fit_b}/{runs_b} (baseline)")
    if len(both) < MIN_SEEDS:
        return Verdict(claim, "inconclusive", f"fewer than {MIN_SEEDS} seeds where both cells fit; {figures}", rows)
    return Verdict(claim, "holds" if all(ok) else "fails", figures, rows)
