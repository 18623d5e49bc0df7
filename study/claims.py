"""`python -m study.claims STUDY [STUDY ...]`: judge the claims of finished studies, pooled.

Each STUDY is a study folder, a bucket prefix or an MLflow experiment name (as `python -m
study.report` reads them). Studies of one spec run on other seeds (`--set seed=3`) are pooled: a
claim is judged on every run of them all (study/results/verdicts.py). `--space FILE` judges the
claims of that spec instead of the stored one (a claim written after the runs), on the same cells.

    python -m study.claims studies/coupling_train_range /other/storage/coupling_train_range
    python -m study.claims coupling_train_range --mlflow-uri http://127.0.0.1:5000 --out claims.csv

Prints a line per claim, `claim NAME: holds|fails|inconclusive (...)`, and exits 1 when one fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import pandas as pd

from study.record.identity import changed_fields
from study.results.verdicts import judge
from study.spec.schema import StudySpec

EXIT_BAD_INPUT = 2
# what studies pooled as one may differ in: who they are, their seeds (first and how many), their claims,
# where they ran
POOLED_MAY_DIFFER = ("name", "description", "seed", "replicas", "claims")


def setup_differences(first: StudySpec, spec: StudySpec) -> list[str]:
    """The fields where `spec` is another setup than `first`, not another seed of it."""
    return [f for f in changed_fields(first.model_dump(mode="json"), spec)
            if f.split(".")[0] not in POOLED_MAY_DIFFER and not f.startswith("resources.")]


def pooled_results(specs: list[StudySpec], frames: list[pd.DataFrame], names: list[str]) -> pd.DataFrame:
    """The studies' rows with a `study` column; ValueError naming a field where two specs differ in
    more than POOLED_MAY_DIFFER (another setup is not another seed), or where two share a seed (one
    spec and seed give the same runs, so a shared seed would be counted twice)."""
    for spec, name in zip(specs[1:], names[1:]):
        differ = setup_differences(specs[0], spec)
        if differ:
            raise ValueError(f"{name}: not the spec of {names[0]} (it differs in {', '.join(differ[:6])}); "
                             "only studies of one spec, on other seeds, are pooled")
    shared = shared_seed(frames, names)
    if shared:
        name, seed, held = shared
        raise ValueError(f"{name}: seed {seed} is also {held}'s; one spec and seed give the same runs, "
                         "so only studies on other seeds are pooled")
    return pd.concat([f.assign(study=name) for f, name in zip(frames, names)], ignore_index=True)


def shared_seed(frames: list[pd.DataFrame], names: list[str]) -> tuple[str, int, str] | None:
    """(study, seed, the earlier study holding it) for the first seed two studies share, else None."""
    seen: dict[int, str] = {}
    for frame, name in zip(frames, names):
        for seed in sorted(set(frame.seed.dropna().astype(int))):
            if seed in seen:
                return name, seed, seen[seed]
            seen[seed] = name
    return None


def same_claims(specs: list[StudySpec], names: list[str]) -> None:
    """ValueError where the studies state other claims (one run before a claim was added to its spec):
    judged on the first study's, the verdicts would hang on the order the studies are named in."""
    first = [c.model_dump() for c in specs[0].claims]
    for spec, name in zip(specs[1:], names[1:]):
        if [c.model_dump() for c in spec.claims] != first:
            mine, theirs = {c.name for c in specs[0].claims}, {c.name for c in spec.claims}
            which = ", ".join(sorted(mine ^ theirs)) or "the same names, stated otherwise"
            raise ValueError(f"{name}: states other claims than {names[0]} ({which}); give --space with the "
                             "spec whose claims to judge")


def with_claims_of(spec: StudySpec, space: str) -> StudySpec:
    """The stored spec with the claims of the spec file `space`, whose cells must be the stored ones."""
    from study.spec.schema import load_spec

    other = load_spec(space)
    if [c.label for c in other.cells()] != [c.label for c in spec.cells()]:
        raise ValueError(f"--space: {space}'s cells are not the stored study's ({', '.join(c.label for c in spec.cells())})")
    return StudySpec.model_validate({**spec.model_dump(mode="json"), "claims": [c.model_dump() for c in other.claims]})


def main(argv: list[str] | None = None) -> int:
    from study.report import add_recorder_flag, read_study

    p = argparse.ArgumentParser(prog="python -m study.claims", description=__doc__.split("\n")[0])
    p.add_argument("studies", nargs="+", metavar="STUDY", help="study folders, bucket URIs or MLflow experiment names")
    p.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db", help="where named experiments are")
    add_recorder_flag(p)
    p.add_argument("--space", help="judge the claims of this spec file (its cells must be the studies')")
    p.add_argument("--out", help="write the table behind the verdicts here (CSV: a row per claim and seed)")
    args = p.parse_args(argv)
    specs, frames = [], []
    with tempfile.TemporaryDirectory(prefix="claims-") as tmp:
        try:
            for i, source in enumerate(args.studies):
                into = os.path.join(tmp, str(i))
                os.makedirs(into)
                spec, results, _where, _folder = read_study(source, args.mlflow_uri, into, args.recorder)
                specs.append(spec)
                frames.append(results)
            if not args.space:
                same_claims(specs, args.studies)
            spec = with_claims_of(specs[0], args.space) if args.space else specs[0]
            results = pooled_results(specs, frames, args.studies)
        except SystemExit as e:  # read_study's one-line errors
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                return EXIT_BAD_INPUT
            raise
        except (OSError, ValueError) as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if not spec.claims:
        print(f"error: study {spec.name} states no claims (give --space with a spec that does)", file=sys.stderr)
        return EXIT_BAD_INPUT
    verdicts = judge(spec, results)
    seeds = results.drop_duplicates(["study", "trial_id"]).groupby("study").seed.nunique().sum()
    print(f"study {spec.name}: {len(args.studies)} stud{'y' if len(args.studies) == 1 else 'ies'} pooled, "
          f"{results.trial_id.nunique()} trials, {seeds} seeds")
    print("\n".join(v.line for v in verdicts))
    if args.out:
        pd.DataFrame([row for v in verdicts for row in v.table_rows()]).to_csv(args.out, index=False)
        print(f"table: {args.out}")
    return 1 if any(v.verdict == "fails" for v in verdicts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
