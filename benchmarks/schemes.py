"""Which positional scheme extrapolates where, and whether the field's known results hold here: a row
per scheme and a column per task, beside each scheme the literature's published figure and its setup.

    python -m benchmarks.schemes --seeds 12 13 14 --docs docs/schemes.md   # the claims' cells, judged
    python -m benchmarks.schemes --claims abacus_addition --seeds 12         # one claim's cells
    python -m benchmarks.schemes search_spaces/schemes_by_task.yaml --cells name=reverse --steps 2000

Without specs or `--cells` it trains the cells each claim of benchmarks/field_claims.py needs (but
a claim on request, which `--claims NAME` names), in its recipe, and prints one line per claim, `claim <name>: holds (...)` or `fails (...)`, exiting 1
when one fails. With specs or `--cells` (of schemes_by_task and its Abacus sibling when no spec is
named) it trains those cells and judges the claims whose recipe's cells ran. Every cell trains at a
fixed learning rate (`--lr`; the study searches it per cell with Optuna) and is scored as `python -m
benchmarks.coupling` scores it (docs/schemes.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.coupling import (
    NoCellMatches,
    add_run_arguments,
    command_line,
    jobs_for,
    run_jobs,
    saved_runs,
)
from benchmarks.field_claims import FIELD_CLAIMS, check_field_claims, claim_jobs
from benchmarks.runs_table import EXTRAPOLATES, FITS, per_run

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
    "learned, sequential, encoder": "absolute ids in the Chomsky suite's encoder, every output read at once: Ruoss et "
                                    "al. 2023's baseline as they ran it (Deletang et al. 2023)",
    "learned, randomized, encoder": "Ruoss et al. 2023, as they ran it: the same encoder, ids a sorted sample of [0, "
                                    "2048); +12.0% average accuracy at unseen lengths over 15 tasks (train <= 40, "
                                    "test 41-500)",
    "nope, sequential, abacus": "McLeish et al. 2024: addition trained on 20 digits, up to 99% exact at 100 digits",
    "fire, sequential, abacus": "McLeish et al. 2024: Abacus + FIRE, addition trained on 20 digits, ~99% at 100 digits",
}


def scheme_of(factors: dict, trial: dict | None = None) -> str:
    """A cell's scheme as the table names it: encoding, ids[, abacus][, encoder]. An encoder
    (`model.output: encoder`, in the grid or the trial) reads every output at once: another model,
    so another row."""
    name = f"{factors.get('positional.encoding', 'learned')}, {factors.get('positional.ids', 'sequential')}"
    output = factors.get("model.output", ((trial or {}).get("model") or {}).get("output"))
    return name + (", abacus" if factors.get("positional.abacus") else "") + (", encoder" if output == "encoder" else "")


def task_of(task: dict) -> str:
    """A cell's task as the table names it: its name, and how the operands are written where it is
    not Cho et al.'s way (their order, drawn without padding)."""
    params = task.get("params", {})
    how = [params["operand_order"]] if params.get("operand_order", "msb_first") != "msb_first" else []
    how += ["unpadded"] if params.get("operands") == "unpadded" else []
    return task["name"] + (f" ({', '.join(how)})" if how else "")


PRECISION = {False: "fp32", True: "bf16", "mixed": "bf16 mixed"}  # deepspeed.bf16's values


def trained(rows) -> str:
    """How a scheme's runs trained (steps, learning rate, precision), each recipe with its seeds (and
    task) where they differ; blank for rows saved without it."""
    if "steps" not in rows or rows.steps.isna().all():
        return ""
    several_tasks = rows.task.nunique() > 1
    recipes = rows.groupby(["task", "steps", "lr", "bf16"], sort=False, dropna=False).seed.unique()
    texts = [(f"{task}: " if several_tasks else "") + f"{int(steps):,} steps, lr {lr:g}, {PRECISION.get(bf16, bf16)}"
             + (f" (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, sorted(seeds)))})" if len(recipes) > 1 else "")
             for (task, steps, lr, bf16), seeds in recipes.items()]
    return "; ".join(texts)


def scheme_table(table, train_length: int, metric: str = "exact_match") -> str:
    """A row per scheme, a column per task: `metric` at 2x / 3x (mean over runs), for exact match the
    runs that reach EXTRAPOLATES at 2x in parentheses; then the literature's figure and how the runs
    trained. Only runs at FITS exact or more at the train length count beyond it: a cell none of whose
    runs fit reads "did not fit (their mean exact match there)", one where some did not says how many
    and their figures; cells not run (or run before `metric` was measured) are blank."""
    import pandas as pd

    far = [n for n in sorted(table.length.unique()) if n >= 2 * train_length][:2]
    tasks = list(dict.fromkeys(table.task))
    lines = [f"| scheme | {' | '.join(tasks)} | published (setup) | trained |", "|---|" + "---|" * (len(tasks) + 2)]
    for scheme, rows in table.groupby("scheme", sort=False):
        values = []
        for task in tasks:
            cell = rows[rows.task == task]
            if cell.empty or metric not in cell or cell[metric].isna().all():
                values.append("")
                continue
            runs = [run for _, run in cell.groupby(["seed", "data_seed"], dropna=False)]
            fit = pd.Series([run[run.length == train_length].exact_match.mean() for run in runs])
            if not (fit >= FITS).any():  # beyond the train length it says nothing about the scheme
                values.append(f"did not fit ({fit.mean():.2f})")
                continue
            # a run that did not fit is left out of the figures beyond the train length, as from the claims
            cell = pd.concat([run for run, fits in zip(runs, fit >= FITS) if fits])
            means = " / ".join(f"{cell[cell.length == n][metric].mean():.2f}" for n in far)
            if metric == "exact_match":
                runs = per_run(cell, far[0]) if far else per_run(cell, train_length)
                means += f" ({int((runs >= EXTRAPOLATES).sum())}/{len(runs)})"
            unfit = fit[fit < FITS]
            if len(unfit):
                means += f"; {len(unfit)} of {len(fit)} runs did not fit ({', '.join(f'{v:.2f}' for v in unfit)})"
            values.append(means)
        lines.append(f"| {scheme} | " + " | ".join(values) + f" | {LITERATURE.get(scheme, '')} | {trained(rows)} |")
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
    parser.add_argument("specs", nargs="*", help="study specs whose cells to train (default: the claims' recipes; "
                        "with --cells, schemes_by_task and its Abacus sibling)")
    add_run_arguments(parser)
    parser.add_argument("--claims", nargs="+", choices=[c.name for c in FIELD_CLAIMS], metavar="CLAIM",
                        help=f"only these claims' cells and verdicts ({', '.join(c.name for c in FIELD_CLAIMS)}; "
                        f"default: all but {', '.join(c.name for c in FIELD_CLAIMS if c.on_request)}, on request)")
    parser.add_argument("--lr", type=float, help="the learning rate of every cell (default: the spec's "
                        "base.optim.lr, else 1e-3)")
    parser.add_argument("--steps", type=int, help="training steps of every cell (default: the spec's, or the "
                        "claim's recipe's)")
    parser.add_argument("--bf16", choices=["false", "true", "mixed"], help="the precision of every cell "
                        "(deepspeed.bf16; default: the spec's resources.bf16)")
    args = parser.parse_args(argv)
    if args.claims and (args.specs or args.cells):
        parser.error("--claims trains the claims' own cells: give it without specs or --cells")
    by_claims = not (args.specs or args.cells)
    # the command alone checks all but the claims on request; named cells are judged by every claim they serve
    claims = [c for c in FIELD_CLAIMS if (c.name in args.claims if args.claims else not (by_claims and c.on_request))]
    paths = [Path(p) for p in args.specs] or [ROOT / "search_spaces" / f"{s}.yaml" for s in SPECS]

    import pandas as pd
    from pydantic import ValidationError

    from benchmarks.docs import write_generated
    from trial.config import TrialConfig
    from trial.yaml_io import describe_errors

    jobs, train_lengths = [], {}
    if by_claims:
        try:
            jobs, train_lengths = claim_jobs(claims, args.seeds, args.lengths)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for path in [] if by_claims else paths:
        try:
            found, train_lengths[path.stem] = jobs_for(path, args.seeds, args.lengths, args.cells)
        except NoCellMatches:  # --cells picks from several specs: one may hold none of them
            continue
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        jobs += found
    for job in jobs:
        optim = job["trial"].setdefault("optim", {})
        optim["lr"] = args.lr or optim.get("lr", 1e-3)
        if args.steps:
            optim["steps"] = args.steps
        if args.bf16:
            job["trial"].setdefault("deepspeed", {})["bf16"] = {"false": False, "true": True}.get(args.bf16, args.bf16)
        try:
            TrialConfig.model_validate(job["trial"])
        except ValueError as e:
            detail = describe_errors(e) if isinstance(e, ValidationError) else str(e)
            print(f"error: {job['spec']} with --lr / --steps / --bf16: {detail}", file=sys.stderr)
            return 2
    if not jobs:
        print(f"error: --cells {args.cells}: no cell of {[p.stem for p in paths]} matches", file=sys.stderr)
        return 2
    seen, unique = {}, []  # a (scheme, task) in two specs runs once, from the first, unless set up apart
    for job in jobs:
        key = (scheme_of(job["factors"], job["trial"]), json.dumps(job["trial"]["task"], sort_keys=True), job["trial"]["seed"])
        if key not in seen:
            seen[key] = job
            unique.append(job)
        elif job["trial"]["seed"] == args.seeds[0]:  # said once per cell: a cell asked for never drops silently
            first = seen[key]
            print(f"{job['spec']} {job['cell']}: runs once, as {first['spec']} {first['cell']} (one row of the "
                  f"tables: {key[0]} on {task_of(job['trial']['task'])})", flush=True)
    lrs = "/".join(f"{lr:g}" for lr in sorted({j["trial"]["optim"]["lr"] for j in unique}))
    print(f"{len(unique)} trials, seeds {args.seeds}, lr {lrs}, {args.workers} at a time", flush=True)
    if args.from_json:
        try:
            (rows, series), seconds, wall, host = saved_runs(args.from_json, unique), [], 0.0, None
            held = sorted({s for p in args.from_json for s in json.loads(Path(p).read_text()).get("seeds", [])})
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from-json: {e}", file=sys.stderr)
            return 2
        if not rows:
            print(f"error: --from-json: no saved run of these cells at seeds {args.seeds}; the files hold seeds "
                  f"{held} (give them with --seeds)", file=sys.stderr)
            return 2
    else:
        rows, series, seconds, wall, host = run_jobs(unique, args.workers, args.json, args.seeds)
    table = pd.DataFrame(rows)
    names = {(j["spec"], j["cell"]): j for j in unique}
    table["scheme"] = [scheme_of(names[(s, c)]["factors"], names[(s, c)]["trial"]) for s, c in zip(table.spec, table.cell)]
    table["task"] = [task_of(names[(s, c)]["trial"]["task"]) for s, c in zip(table.spec, table.cell)]
    table["train_length"] = table.spec.map(train_lengths)
    table = table[table.own_ids & (table.checkpoint == "last")]
    samples = min(TrialConfig.model_validate(j["trial"]).eval.samples_per_point for j in unique)
    lines, failures = check_field_claims(table, samples, claims)
    lines += [f"claim {c.name}: not run (on request: --claims {c.name})  [{c.source}]"
              for c in FIELD_CLAIMS if c.on_request and by_claims and not args.claims]
    seeds = f" seeds {' '.join(map(str, args.seeds))}" if args.seeds != [0, 1, 2] else ""
    for train_length, group in table.groupby("train_length"):  # a table per train length: 2x means one thing
        steps = sorted(set(group.steps))
        header = (f"Exact match at {' / '.join(f'{n / train_length:g}x' for n in sorted(group.length.unique()) if n >= 2 * train_length)}"
                  f" (mean over seeds {args.seeds}), in parentheses the runs >= {EXTRAPOLATES} at 2x; train <= "
                  f"{train_length}, lr {'/'.join(f'{lr:g}' for lr in sorted(set(group.lr)))}, "
                  f"{', '.join(map(str, steps))} steps:\n\n")
        print()
        print(tables(group, train_length, header))
        if args.docs:
            # a table per tasks x steps x seeds: a run of other cells adds a table, it does not replace one
            specs = "claims" if by_claims else (
                "schemes_by_task" if not args.specs else " + ".join(p.stem for p in paths))  # the default: both
            key = f"{specs} {' '.join(sorted(set(group.task)))} steps {'/'.join(map(str, steps))}" + seeds
            write_generated(args.docs, key, ("From the runs saved by `--json` (rebuilt with `--from-json`). "
                                             if args.from_json else "") + tables(group, train_length, header),
                            argv=command_line(argv))
    print()
    print("\n".join(lines))
    if args.docs and by_claims:
        chosen = "" if args.claims is None else " " + " ".join(c.name for c in claims)
        write_generated(args.docs, f"claims{chosen}{seeds}",
                        "\n".join(f"- {line}" for line in lines), argv=command_line(argv))
    print(f"\n{len(unique)} trials in {wall:.0f}s wall, {sum(seconds):.0f}s of trial time")
    if args.json:
        # the per-trial file run_jobs kept, with the verdicts: a finished run's file holds all a stopped one's did
        Path(args.json).write_text(json.dumps({"seeds": args.seeds, "host": host, "rows": rows, "series": series,
                                               "failures": failures}, indent=1))
    for failure in failures:
        print(f"claim failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
