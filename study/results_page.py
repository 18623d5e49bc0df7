"""`python -m study.results_page [--docs docs/results.md [--readme README.md]]`: the one results page, from committed runs.

Every claim of every experiment spec (search_spaces/experiments/) is a row: its verdict from the one
judge (study/results/verdicts.py), exact match at the claim's test length and at 1.5x it (mean
[min-max] over seeds), the runs that fit in distribution and that extrapolate (>= 0.95) as k/n, its
setup, the published figure it is set beside, and the command that reruns it. The runs are the CSVs
in docs/results/<spec>.csv (a row per run, length and k: `python -m study.results_page --add STUDY`
copies a finished study's rows there; several studies of one spec pool). Nothing else goes into the
page, so it is the same file byte for byte on any clone: no dates, no paths outside the repository.
`--readme` puts the measured rows, short, at the top of the README.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from study.results.verdicts import FITS, baseline_points, fit_counts, judge, run_points, runs_text
from study.spec.schema import StudySpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "search_spaces" / "experiments"
DATA = ROOT / "docs" / "results"
# what a run's rows keep: enough to judge any claim of its spec again
KEEP = ["study", "trial_id", "cell", "seed", "status", "role", "selected_from", "length", "k", "ids", "checkpoint",
        "n", "exact_match", "answer_token_acc", "answer_acc", "val_exact"]


def committed_runs(name: str) -> pd.DataFrame | None:
    path = DATA / f"{name}.csv"
    return pd.read_csv(path) if path.exists() else None


def experiment_of(spec: StudySpec) -> str:
    """The experiment spec a study ran: the one it differs from only in name, seeds and claims (a part
    run with `--set seed=S --set replicas=1 --set name=...`), else its own name."""
    from study.claims import setup_differences

    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        experiment = load_spec(str(path))
        if not setup_differences(experiment, spec):
            return experiment.name
    return spec.name


def add_study(folder: str) -> Path:
    """Copy a finished study's rows (KEEP) into docs/results/<experiment>.csv, beside the studies of
    the same spec already there (a study already there is replaced)."""
    from study.report import read_study

    spec, results, _where, _folder = read_study(folder, None, folder)
    name = experiment_of(spec)
    study = Path(folder).resolve().parent.name + "/" + spec.name  # <storage>/<name>: which study of the spec
    rows = results.assign(study=study)[[c for c in KEEP if c in results.columns or c == "study"]]
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"{name}.csv"
    rows = beside(committed_runs(name), rows, study, f"docs/results/{name}.csv")
    rows.to_csv(path, index=False)
    series = Path(folder) / "series.csv"
    if series.exists():  # the tracked series, where its trials tracked lengths beyond training
        kept = pd.read_csv(series).assign(study=study)
        out = DATA / f"{name}_series.csv"
        if out.exists():
            before = pd.read_csv(out)
            kept = pd.concat([before[before.study != study], kept], ignore_index=True)
        kept.round(4).to_csv(out, index=False)
    return path


def beside(old: pd.DataFrame | None, rows: pd.DataFrame, study: str, where: str) -> pd.DataFrame:
    """A study's rows beside the other studies' in `old` (its own earlier rows replaced); ValueError
    where it holds a seed another study there holds: the judge keys runs by (study, seed), and one spec
    and seed give the same runs, so a seed added twice would count as two."""
    if old is None:
        return rows
    from study.claims import shared_seed

    others = old[old.study != study]
    held = [others[others.study == s] for s in others.study.unique()]
    shared = shared_seed([*held, rows], [*others.study.unique(), study])
    if shared:
        raise ValueError(f"--add: {shared[0]}: seed {shared[1]} is already in {where} (study {shared[2]}); each "
                         "seed of a spec is added once")
    return pd.concat([others, rows], ignore_index=True)


def claim_row(spec: StudySpec, claim, runs: pd.DataFrame | None) -> dict[str, str]:
    cfg = spec.checked_config(spec.claim_cells(claim)[0])
    prior = " (`id_window`: our prior)" if cfg.positional.id_window is not None and "id_window" not in claim.setup else ""
    # the page shows the baseline's raw figure: say how it was judged
    chance = f"; a baseline below chance ({claim.chance:g}) judged as chance" if claim.chance is not None else ""
    command = f"`python study/run.py --space search_spaces/experiments/{spec.name}.yaml`"
    row = {"claim": f"`{claim.name}` ({claim.source})", "setup": f"{claim.setup}{prior}{chance}",
           "published": claim.published or "-", "rerun": command}
    if runs is None:
        return {**row, "verdict": "not run here", "2x": "-", "3x": "-", "fit": "-", "extrapolate": "-"}
    verdict = next(v for v in judge(spec, runs) if v.claim.name == claim.name)
    cell = spec.claim_cells(claim)[0]
    if not claim.is_rate:  # a run's own number: no test length, no fit
        values = [r["rate"] for r in verdict.rows]
        return {**row, "verdict": f"**{verdict.verdict}**", "2x": f"{runs_text(values)} ({claim.metric})",
                "3x": "-", "fit": "-", "extrapolate": "-", "setup": row["setup"] + f"; {len(values)} seeds"}
    points = {}
    for times in (claim.times, claim.times * 1.5):
        judged = claim.model_copy(update={"times": times})
        points[times] = run_points(spec, cell, judged, claim.k, runs)
    at, none_fit = fitting(points[claim.times])
    baseline_fit = against = ""
    base_none_fit = False
    if claim.compares:  # a comparison says nothing where its baseline did not fit: count those too
        base = baseline_points(spec, claim, runs)
        fit, judged = fit_counts(base)
        baseline_fit = f" (baseline {fit}/{judged})"
        base_at, base_none_fit = fitting(base)
        against = f" against {runs_text([p.rate for p in base_at])}" if base_at else ""
    further, _ = fitting(points[claim.times * 1.5])
    seeds = len({key for key in points[claim.times]})
    fitted = [p for p in at if p.fit]
    return {**row, "verdict": f"**{verdict.verdict}**",
            "2x": f"{runs_text([p.rate for p in at])}{against} ({claim.metric}, {at[0].length if at else '-'}"
                  f"{'; no run fit' if none_fit else ''}{'; no baseline run fit' if base_none_fit else ''})",
            "3x": f"{runs_text([p.rate for p in further])} ({further[0].length})" if further else "-",
            "fit": f"{len(fitted)}/{seeds}{baseline_fit}",
            "extrapolate": f"{sum(p.rate >= FITS for p in fitted)}/{len(fitted)}" if claim.metric == "exact_match"
            else "-",
            "setup": row["setup"] + f"; {seeds} seeds"}


def fitting(points: dict) -> tuple[list, bool]:
    """The runs a figure speaks of: those that fit in distribution (one that did not says nothing of
    its scheme), or, where none did, every run; and whether none did."""
    runs = [p for p in points.values() if not isinstance(p, str)]
    fit = [p for p in runs if p.fit]
    return (fit, False) if fit or not runs else (runs, True)


def claim_rows() -> list[dict[str, str]]:
    """Every claim's row, the measured ones first."""
    rows = []
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        spec = load_spec(str(path))
        runs = committed_runs(spec.name)
        rows += [claim_row(spec, claim, runs) for claim in spec.claims]
    rows.sort(key=lambda r: (r["verdict"] == "not run here", r["claim"]))
    return rows


def top_rows(rows: list[dict[str, str]]) -> str:
    """The measured rows, short (claim, verdict, figure, runs): the README's view of the page."""
    measured = [r for r in rows if r["verdict"] != "not run here"]
    head = "| claim | verdict | at the test length | runs fit | extrapolate (>= 0.95) |\n|---|---|---|---|---|"
    body = [f"| {r['claim']} | {r['verdict']} | {r['2x']} | {r['fit']} | {r['extrapolate']} |" for r in measured]
    return "\n".join([head, *body])


def fill(text: str, marker: str, body: str, where: str) -> str:
    """`text` with `body` between `<!-- marker -->` and `<!-- end marker -->`."""
    start, end = f"<!-- {marker} -->", f"<!-- end {marker} -->"
    if start not in text or end not in text:
        raise SystemExit(f"error: {where} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def page(rows: list[dict[str, str]] | None = None) -> str:
    rows = claim_rows() if rows is None else rows
    head = ("| claim | verdict | at the test length | at 1.5x it | runs fit | extrapolate (>= 0.95) | setup | "
            "published | rerun |\n|---|---|---|---|---|---|---|---|---|")
    body = "\n".join(f"| {r['claim']} | {r['verdict']} | {r['2x']} | {r['3x']} | {r['fit']} | {r['extrapolate']} | "
                     f"{r['setup']} | {r['published']} | {r['rerun']} |" for r in rows)
    return f"""# Results

*Generated by `python -m study.results_page --docs docs/results.md --readme README.md` from the runs
in [docs/results/](results/); do not edit by hand. The [README](../README.md) is the map.*

Every claim an experiment spec states (search_spaces/experiments/), judged by the one judge on the
committed runs (docs/statistics.md): a comparison **holds** when, on every seed where both cells fit
in distribution (exact >= {FITS}) and on at least two, Newcombe's 95% interval of the difference is
above 0 and its point estimate reaches the claim's effect; a bound holds when every run that fit
reaches it, on at least two. A claim whose cells did not fit on two seeds is **inconclusive**: such a run says
nothing about its scheme. **fails** says the claim was not shown on those seeds, not that its
opposite was: where both cells score near 0 (or near chance), the test cannot tell them apart.
Figures are the claim's metric (exact match of the whole output unless it says otherwise) at its
test length (2x the train length unless it says otherwise) and at 1.5x that, mean [min-max] over
the runs that fit (over every run, marked "no run fit", where none did), a comparison's "against"
its baseline's runs that fit; the last checkpoint, unless the claim names `best`: the one its spec
selects, on a length beyond training where the spec says so, as the reference implementation
selects. "runs fit" counts the claim's cell's seeds that fit, and "extrapolate" those of them that
reach 0.95 at the test length, as k/n. Rows "not run here" have no committed runs yet: the command
reruns them.

{head}
{body}
"""


def curve(spec: StudySpec, runs: pd.DataFrame, series: pd.DataFrame | None) -> str:
    """Exact match at 1x each cell's train length over all its seeds, and at 2x and 3x (last and best
    checkpoint) over the seeds that fit (>= FITS at 1x), mean [min-max]; the runs that fit and that
    reach 0.95 at 2x; the answer alone (its end token not counted) at 2x and 3x, last checkpoint; and
    (from the series) the tracked teacher-forced exact match at 2x of the runs that fit: its peak and
    last, mean over them."""
    head = ("| cell | runs fit | 1x (all runs) | 2x, last | 2x, best | 3x, last | 3x, best | >= 0.95 at 2x (last / best) | "
            "answer right at 2x / 3x, last | tracked at 2x: peak (step) / last |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for cell in spec.cells():
        cfg = spec.checked_config(cell)
        train = cfg.task_instance.train_length
        rows = runs[(runs.cell == cell.label) & (runs.status == "TERMINATED")]
        if rows.empty:
            lines.append(f"| `{cell.label}` | not run | | | | | | | | |")
            continue
        rows = rows.assign(run=run_keys(rows), checkpoint=checkpoints(rows))
        seeds = sorted(rows.run.unique())

        def at(times: float, checkpoint: str, among=None, metric: str = "exact_match") -> list[float]:
            pick = rows[(rows.length == round(times * train)) & (rows.checkpoint == checkpoint)]
            return [float(pick[pick.run == r][metric].iloc[0]) for r in (among or seeds) if (pick.run == r).any()]

        fit_at = {r: v for r in seeds for v in at(1, "last", [r])}
        fitted = [r for r, v in fit_at.items() if v >= FITS]  # only runs that fit say anything beyond
        fit = len(fitted)
        solved = "/".join(str(sum(v >= FITS for v in at(2, c, fitted))) if fitted else "0" for c in ("last", "best"))
        tracked = "-"
        metric = f"track/len{2 * train}/exact"
        if series is not None and metric in series and fitted:
            kept = series[(series.cell == cell.label) & run_keys(series).isin(fitted)]
            mean = kept.groupby("step")[metric].mean().dropna()
            if not mean.empty:
                tracked = f"{mean.max():.2f} ({int(mean.idxmax()):,}) / {mean.iloc[-1]:.2f}"
        cells = [runs_text(at(1, "last"))] + [runs_text(at(t, c, fitted)) if fitted else "-"
                                                for t, c in ((2, "last"), (2, "best"), (3, "last"), (3, "best"))]
        answer = " / ".join(runs_text(at(t, "last", fitted, "answer_acc")) for t in (2, 3)) \
            if fitted and "answer_acc" in rows else "-"
        lines.append(f"| `{cell.label}` | {fit}/{len(seeds)} | " + " | ".join(cells) + f" | {solved} of {len(seeds)} | "
                     f"{answer} | {tracked} |")
    return "\n".join(lines)


def run_keys(rows: pd.DataFrame) -> pd.Series:
    """A run of pooled studies: its study and seed (two studies of one spec hold other seeds)."""
    study = rows.study.astype(str) if "study" in rows else pd.Series("", index=rows.index)
    return study + "#" + rows.seed.astype(int).astype(str)


def checkpoints(rows: pd.DataFrame) -> pd.Series:
    """Which checkpoint a row measured: `last` where the study kept no other."""
    return rows.checkpoint.fillna("last") if "checkpoint" in rows else pd.Series("last", index=rows.index)


def write_curve(name: str, page: Path) -> None:
    """The curve of experiment `name` between its markers in `page`, from its committed runs and series."""
    spec = load_spec(str(EXPERIMENTS / f"{name}.yaml"))
    runs = committed_runs(name)
    if runs is None:
        raise SystemExit(f"error: --curve: no committed runs of {name} (docs/results/{name}.csv)")
    series_path = DATA / f"{name}_series.csv"
    series = pd.read_csv(series_path) if series_path.exists() else None
    page.write_text(fill(page.read_text(), f"curve: {name}", curve(spec, runs, series), f"--page: {page}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m study.results_page", description=__doc__.split("\n")[0])
    p.add_argument("--docs", help="write the page here (default: print it)")
    p.add_argument("--add", nargs="+", metavar="STUDY", default=[], help="first copy these finished studies' rows "
                   "(and tracked series) into docs/results/")
    p.add_argument("--curve", metavar="SPEC", help="write this experiment's curve over its cells into --page")
    p.add_argument("--page", help="with --curve: the docs page whose curve markers it fills")
    p.add_argument("--readme", help="with --docs: also fill this README's `results: top` markers with the "
                   "measured rows, short")
    args = p.parse_args(argv)
    if args.readme and not args.docs:
        p.error("--readme: needs --docs (the README shows the page's rows)")
    for folder in args.add:
        try:
            print(f"runs: {add_study(folder).relative_to(ROOT)}")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.curve:
        write_curve(args.curve, Path(args.page or "docs/coupling.md"))
        print(f"curve: {args.curve} in {args.page or 'docs/coupling.md'}")
        return 0
    rows = claim_rows()
    text = page(rows)
    if args.docs:
        # filled first: a README without its markers leaves both files as they were
        top = fill(Path(args.readme).read_text(), "results: top", top_rows(rows), f"--readme: {args.readme}") \
            if args.readme else None
        Path(args.docs).write_text(text)
        print(f"page: {args.docs}")
        if top is not None:
            Path(args.readme).write_text(top)
            print(f"top rows: {args.readme}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
