"""Which positional scheme extrapolates where: the schemes_by_task specs' cells, a row per scheme and a
column per task, beside each scheme the literature's published figure and its setup.

    python -m benchmarks.schemes --docs docs/schemes.md         # every cell of both specs, 3 seeds
    python -m benchmarks.schemes --cells name=reverse name=duplicate --seeds 5 6 7 --steps 2000

Each cell is trained at a fixed learning rate (`--lr`; the study, `python study/run.py --space
search_spaces/schemes_by_task.yaml`, searches it per cell with Optuna) and scored as
`python -m benchmarks.coupling` scores it: exact match at the spec's test lengths (or `--lengths`),
mean over seeds, and the runs that reach 0.95 at 2x. The claims of benchmarks/coupling.py's CLAIMS
for these specs (the field's known results, in direction) are checked; the command exits 1 if one
fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.coupling import (
    NoCellMatches,
    add_run_arguments,
    command_line,
    jobs_for,
    run_jobs,
    saved_runs,
)
from benchmarks.runs_table import EXTRAPOLATES, FITS, per_run
from study.results.tables import mean_and_range_text

ROOT = Path(__file__).resolve().parents[1]
SPECS = ["schemes_by_task", "schemes_by_task_abacus"]

# The published figure beside each scheme, with the setup it was measured in (the papers cited); a
# laptop-scale row checks the direction, not the number.
LITERATURE = {
    "learned, random_shift": "absolute ids, shifted in training: the baseline that fails beyond the train length "
                             "(Cho et al. 2024; Golowich et al. 2025)",
    "learned, sequential": "absolute ids: ids beyond the train length are never trained (Ruoss et al. 2023's baseline)",
    "learned, coupled": "Cho et al. 2024: addition 1-30 -> 200 digits, >= 95% exact (1 layer, full attention); "
                        "N x 2 multiplication trained on N <= 40, extrapolating to N = 100s",
    "rope, sequential": "Kazemnejad et al. 2023: fails beyond the train length on arithmetic / string tasks",
    "alibi, sequential": "Press et al. 2022 (language modeling); weak on algorithmic tasks (Kazemnejad et al. 2023)",
    "nope, sequential": "Kazemnejad et al. 2023: NoPE extrapolates better than RoPE / ALiBi on small algorithmic tasks",
    "fire, sequential": "Li et al. 2023; Zhou et al. 2024: with a reversed format and index hints, 40 -> 100 digit "
                        "addition > 98%, swinging with the init and data-order seeds",
    "t5_bias, sequential": "Raffel et al. 2020: the relative baseline of most of these papers",
    "learned, randomized": "Ruoss et al. 2023: +12.0% average accuracy at unseen lengths over 15 algorithmic tasks "
                           "(reversal, duplication and bucket sort among them; train <= 40, test 41-500)",
    "nope, sequential, abacus": "McLeish et al. 2024: addition trained on 20 digits, up to 99% exact at 100 digits",
    "fire, sequential, abacus": "McLeish et al. 2024: Abacus + FIRE, addition trained on 20 digits, ~99% at 100 digits",
}


@dataclass(frozen=True)
class FieldClaim:
    """A known result of the field, checked at the first test length >= 2x train: `scheme` on `task`
    scores `metric` >= `at_least` (mean over seeds), or above `above` by more than two standard errors
    of the paired difference (so not 0.02 over 0.00, nor one sample of 256) on every seed where both
    fit, at least two. Only cells that fit the task in
    distribution (exact >= FITS at the train length) are compared: a cell that did not says nothing
    about its scheme, and the claim fails with that figure."""

    name: str
    source: str
    task: str
    scheme: str
    above: str | None = None
    at_least: float | None = None
    metric: str = "exact_match"


FIELD_CLAIMS = [
    FieldClaim("abacus_addition", "McLeish et al. 2024", "addition (lsb_first, unpadded)", "nope, sequential, abacus",
               above="learned, random_shift"),
    FieldClaim("coupled_multiplication", "Cho et al. 2024", "multiplication", "learned, coupled", at_least=0.9),
    FieldClaim("randomized_reversal_tokens", "Ruoss et al. 2023", "reverse", "learned, randomized",
               above="learned, sequential", metric="answer_token_acc"),
    FieldClaim("randomized_reversal_exact", "Ruoss et al. 2023", "reverse", "learned, randomized",
               above="learned, sequential"),
    FieldClaim("randomized_duplication_tokens", "Ruoss et al. 2023", "duplicate", "learned, randomized",
               above="learned, sequential", metric="answer_token_acc"),
]


def sampling_margin(mine, other, samples: int):
    """Two standard errors of the difference of two rates each measured on `samples` test samples
    (per sample: for a per-token rate, which has more trials, it is the cautious side)."""
    return 2 * ((mine * (1 - mine) + other * (1 - other)) / samples) ** 0.5


def judge(claim: FieldClaim, table, train_length: int, samples: int) -> tuple[bool | None, str]:
    """(holds, the figures): None when a cell it needs was not run. `samples`: test samples per cell."""
    schemes = [claim.scheme] + ([claim.above] if claim.above else [])
    cells = {s: table[(table.task == claim.task) & (table.scheme == s)] for s in schemes}
    if any(c.empty for c in cells.values()) or claim.metric not in table:
        return None, "not run"
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


def check_field_claims(table, train_length: int, samples: int) -> list[str]:
    """Print `claim <name>: holds (...)` / `fails (...)` / `not run` for each; returns the failures."""
    failures = []
    for claim in FIELD_CLAIMS:
        holds, figures = judge(claim, table, train_length, samples)
        verdict = "not run" if holds is None else ("holds" if holds else "fails")
        line = f"claim {claim.name}: {verdict}" + ("" if holds is None else f" ({claim.metric}: {figures})")
        print(f"{line}  [{claim.source}]")
        if holds is False:
            failures.append(line)
    return failures


def scheme_of(factors: dict) -> str:
    """A cell's scheme as the table names it: encoding, ids[, abacus]."""
    name = f"{factors.get('positional.encoding', 'learned')}, {factors.get('positional.ids', 'sequential')}"
    return name + (", abacus" if factors.get("positional.abacus") else "")


def task_of(task: dict) -> str:
    """A cell's task as the table names it: its name, and how the operands are written where it is
    not Cho et al.'s way (their order, drawn without padding)."""
    params = task.get("params", {})
    how = [params["operand_order"]] if params.get("operand_order", "msb_first") != "msb_first" else []
    how += ["unpadded"] if params.get("operands") == "unpadded" else []
    return task["name"] + (f" ({', '.join(how)})" if how else "")


def scheme_table(table, train_length: int, metric: str = "exact_match") -> str:
    """A row per scheme, a column per task: `metric` at 2x / 3x (mean over runs), for exact match the
    runs that reach EXTRAPOLATES at 2x in parentheses; then the literature's figure. A cell below FITS
    exact at the train length reads "did not fit (its exact match there)"; cells not run (or run before
    `metric` was measured) are blank."""
    far = [n for n in sorted(table.length.unique()) if n >= 2 * train_length][:2]
    tasks = list(dict.fromkeys(table.task))
    lines = [f"| scheme | {' | '.join(tasks)} | published (setup) |", "|---|" + "---|" * (len(tasks) + 1)]
    for scheme, rows in table.groupby("scheme", sort=False):
        values = []
        for task in tasks:
            cell = rows[rows.task == task]
            if cell.empty or metric not in cell or cell[metric].isna().all():
                values.append("")
                continue
            fit = cell[cell.length == train_length].exact_match.mean()
            if not fit >= FITS:  # beyond the train length it says nothing about the scheme
                values.append(f"did not fit ({fit:.2f})")
                continue
            means = " / ".join(f"{cell[cell.length == n][metric].mean():.2f}" for n in far)
            if metric == "exact_match":
                runs = per_run(cell, far[0]) if far else cell.groupby(["seed", "data_seed"], dropna=False).exact_match.mean()
                means += f" ({int((runs >= EXTRAPOLATES).sum())}/{len(runs)})"
            values.append(means)
        lines.append(f"| {scheme} | " + " | ".join(values) + f" | {LITERATURE.get(scheme, '')} |")
    return "\n".join(lines)


def in_distribution(table, train_length: int, metric: str = "exact_match") -> str:
    """The same rows at the train length: a scheme that does not fit cannot extrapolate."""
    fit = table[table.length == train_length]
    pivot = fit.groupby(["scheme", "task"], sort=False)[metric].mean().unstack("task")
    return pivot.round(2).to_string()


def tables(table, train_length: int, header: str) -> str:
    """What the docs page and the terminal show: exact match beyond the train length, answer-token
    accuracy beyond it (Ruoss et al.'s metric; runs saved before it was measured have none), and both
    in distribution."""
    tokens = "answer_token_acc" in table and table.answer_token_acc.notna().any()
    text = header + scheme_table(table, train_length)
    if tokens:
        text += ("\n\nAnswer-token accuracy at the same lengths (the share of answer tokens generated right; "
                 "Ruoss et al. 2023 score this, on outputs not fed back):\n\n"
                 + scheme_table(table, train_length, "answer_token_acc"))
    text += f"\n\nIn distribution ({train_length}), exact match:\n\n```\n{in_distribution(table, train_length)}\n```"
    if tokens:
        text += (f"\n\nIn distribution ({train_length}), answer-token accuracy:\n\n```\n"
                 f"{in_distribution(table, train_length, 'answer_token_acc')}\n```")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.schemes", description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", help="study specs (default: schemes_by_task and its Abacus sibling)")
    add_run_arguments(parser)
    parser.add_argument("--lr", type=float, help="the learning rate of every cell (default: the spec's "
                        "base.optim.lr, else 1e-3)")
    parser.add_argument("--steps", type=int, help="training steps of every cell (default: the spec's)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.specs] or [ROOT / "search_spaces" / f"{s}.yaml" for s in SPECS]

    import pandas as pd
    from pydantic import ValidationError

    from benchmarks.docs import write_generated
    from trial.config import TrialConfig
    from trial.yaml_io import describe_errors

    jobs, train_lengths = [], {}
    for path in paths:
        try:
            found, train_lengths[path.stem] = jobs_for(path, args.seeds, args.lengths, args.cells)
        except NoCellMatches:  # --cells picks from several specs: one may hold none of them
            continue
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        for job in found:
            optim = job["trial"].setdefault("optim", {})
            optim["lr"] = args.lr or optim.get("lr", 1e-3)
            if args.steps:
                job["trial"]["optim"]["steps"] = args.steps
            try:
                TrialConfig.model_validate(job["trial"])
            except ValueError as e:
                detail = describe_errors(e) if isinstance(e, ValidationError) else str(e)
                print(f"error: {path} with --lr / --steps: {detail}", file=sys.stderr)
                return 2
        jobs += found
    if not jobs:
        print(f"error: --cells {args.cells}: no cell of {[p.stem for p in paths]} matches", file=sys.stderr)
        return 2
    seen, unique = set(), []  # a (scheme, task) in two specs runs once, from the first, unless set up apart
    for job in jobs:
        key = (scheme_of(job["factors"]), json.dumps(job["trial"]["task"], sort_keys=True), job["trial"]["seed"])
        if key not in seen:
            seen.add(key)
            unique.append(job)
    lrs = "/".join(f"{lr:g}" for lr in sorted({j["trial"]["optim"]["lr"] for j in unique}))
    print(f"{len(unique)} trials, seeds {args.seeds}, lr {lrs}, {args.workers} at a time", flush=True)
    if args.from_json:
        try:
            (rows, _), seconds, wall = saved_runs(args.from_json, unique), [], 0.0
            held = sorted({s for p in args.from_json for s in json.loads(Path(p).read_text()).get("seeds", [])})
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from-json: {e}", file=sys.stderr)
            return 2
        if not rows:
            print(f"error: --from-json: no saved run of these cells at seeds {args.seeds}; the files hold seeds "
                  f"{held} (give them with --seeds)", file=sys.stderr)
            return 2
    else:
        rows, _, seconds, wall = run_jobs(unique, args.workers, args.json, args.seeds)
    table = pd.DataFrame(rows)
    names = {(j["spec"], j["cell"]): j for j in unique}
    table["scheme"] = [scheme_of(names[(s, c)]["factors"]) for s, c in zip(table.spec, table.cell)]
    table["task"] = [task_of(names[(s, c)]["trial"]["task"]) for s, c in zip(table.spec, table.cell)]
    table = table[table.own_ids & (table.checkpoint == "last")]
    train_length = max(train_lengths.values())
    steps = {j["trial"]["optim"].get("steps") for j in unique}
    header = (f"Exact match at {' / '.join(f'{n / train_length:g}x' for n in sorted(table.length.unique()) if n >= 2 * train_length)}"
              f" (mean over seeds {args.seeds}), in parentheses the runs >= {EXTRAPOLATES} at 2x; train <= "
              f"{train_length}, lr {lrs}, {', '.join(map(str, sorted(steps)))} steps:\n\n")
    print()
    print(tables(table, train_length, header))
    if args.docs:
        # a table per tasks x steps x seeds: a run of other cells adds a table, it does not replace one
        specs = "schemes_by_task" if not args.specs else " + ".join(p.stem for p in paths)  # the default: both
        key = f"{specs} {' '.join(sorted(set(table.task)))} steps {'/'.join(map(str, sorted(steps)))}" + (
            f" seeds {' '.join(map(str, args.seeds))}" if args.seeds != [0, 1, 2] else "")
        write_generated(args.docs, key, ("From the runs saved by `--json` (rebuilt with `--from-json`). "
                                         if args.from_json else "") + tables(table, train_length, header),
                        argv=command_line(argv))
    print()
    samples = min(TrialConfig.model_validate(j["trial"]).eval.samples_per_point for j in unique)
    failures = check_field_claims(table, train_length, samples)
    print(f"\n{len(unique)} trials in {wall:.0f}s wall, {sum(seconds):.0f}s of trial time")
    if args.json:
        Path(args.json).write_text(json.dumps({"seeds": args.seeds, "rows": rows, "failures": failures}, indent=1))
    for failure in failures:
        print(f"claim failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
