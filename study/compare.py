"""`python -m study.compare A B`: two studies side by side, from what they stored (a study folder, a
bucket prefix or an MLflow experiment, as `python -m study.report` reads them); nothing is rerun
or written. First what their specs set differently, then a Markdown table: a row per cell (matched
by its factors), per study the seeds and each metric's mean [min-max] over the selected config's
seeds (docs/statistics.md)."""

from __future__ import annotations

import sys

import pandas as pd

from study.report import add_recorder_flag, read_study
from study.results.figures import describe
from study.results.tables import SHOWN, cell_mean_range, select
from study.spec.schema import StudySpec, flatten


def spec_differences(a: StudySpec, b: StudySpec) -> list[str]:
    """`field: A's value | B's value` for every spec field the two set differently (the description aside)."""
    left, right = (flatten(s.model_dump(exclude={"description"})) for s in (a, b))
    return [f"{key}: {left.get(key, '-')} | {right.get(key, '-')}" for key in dict.fromkeys([*left, *right])
            if left.get(key, "-") != right.get(key, "-")]


def side_by_side(studies: list[tuple[str, StudySpec, pd.DataFrame]]) -> str:
    """studies: (name shown, spec, selected.csv's frame) each -> the Markdown table."""
    names = {}
    for _, spec, _ in studies:
        names = {**describe(spec).labels, **names}  # the first study's name for a cell both have
    rows = {name: {r["cell"]: r for r in selected.to_dict("records")} for name, _, selected in studies}
    cells = list(dict.fromkeys(cell for by_cell in rows.values() for cell in by_cell))
    shown = [c for c in SHOWN if any(cell_mean_range(r, c) != "-" for by_cell in rows.values() for r in by_cell.values())]
    columns = [("seeds", name) for name in rows] + [(c, name) for c in shown for name in rows]
    lines = ["| cell | " + " | ".join(f"{c} ({name})" for c, name in columns) + " |", "|---|" + "---|" * len(columns)]
    for cell in cells:
        values = []
        for col, name in columns:
            row = rows[name].get(cell)
            values.append("-" if row is None else str(row["seeds"]) if col == "seeds" else cell_mean_range(row, col))
        lines.append(f"| {names.get(cell, cell)} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(prog="python -m study.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs=2, metavar="STUDY",
                   help="a study folder (<storage>/<name>), a bucket URI, or an MLflow experiment name")
    p.add_argument("--mlflow-uri", default="sqlite:///studies/mlflow.db", help="where an experiment named is")
    add_recorder_flag(p)
    args = p.parse_args(argv)
    read = []
    for i, source in enumerate(args.studies):
        with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
            try:
                spec, results, where, _folder = read_study(source, args.mlflow_uri, tmp, args.recorder)
            except SystemExit as e:  # read_study's one-line errors: bad input
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                    return 2
                raise
        name = "AB"[i]
        print(f"{name}: study {spec.name} from {where}: {results.trial_id.nunique()} trials")
        read.append((name, spec, select(spec, results)))
    differences = spec_differences(read[0][1], read[1][1])
    print("specs differ (A | B):" if differences else "specs: the same")
    print("\n".join(f"  {line}" for line in differences))
    print(f"\nmean [min-max] over the selected config's seeds:\n\n{side_by_side(read)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
