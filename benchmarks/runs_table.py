"""The runs tables of the benchmarks: a row per cell and checkpoint, a column per test length (mean
[min-max] over the runs), then how many runs fit the train length and how many extrapolate."""

from __future__ import annotations

import re

from study.results.tables import EXTRAPOLATES  # the benchmarks count runs as the study does

FITS = 0.95  # exact match at the train length from which a run counts as having learned the task


def per_run(group, length: int, metric: str = "exact_match"):
    """A row's `metric` at one length, a value per run (seed, data seed), its ks averaged."""
    return group[group.length == length].groupby(["seed", "data_seed"], dropna=False)[metric].mean()


def counted_at(lengths, train_length: int) -> int | None:
    """The length the runs column counts at: the shortest test length >= 2x train (None: none is)."""
    return min((n for n in lengths if n >= 2 * train_length), default=None)


def extrapolating(group, train_length: int) -> str:
    """How many runs (seed, data seed) of a row reach EXTRAPOLATES at `counted_at` (mean over its
    ks), as "n/N"; "-" without such a length."""
    if (at_length := counted_at(group.length.unique(), train_length)) is None:
        return "-"
    runs = per_run(group, at_length)
    return f"{int((runs >= EXTRAPOLATES).sum())}/{len(runs)}"


def fitting(group, train_length: int) -> str:
    """How many runs of a row reach FITS at the train length, as "n/N"; "-" when it was not tested. Beyond
    the train length a run that did not fit says nothing about its scheme."""
    runs = per_run(group, train_length)
    return f"{int((runs >= FITS).sum())}/{len(runs)}" if len(runs) else "-"


def factors(label: str) -> list[str]:
    """A cell label's factors: split at the commas outside brackets (`betas=[0.9, 0.95]` is one)."""
    return re.split(r",(?![^\[]*\])", label)


def differing(cells: list[str]) -> dict[str, str]:
    """Each cell's label without the factors every cell shares (a table names what differs): "base"
    for a cell that sets nothing the others do not; a single cell keeps its whole label."""
    if len(cells) < 2:
        return {c: c for c in cells}
    parts = {c: factors(c) for c in cells}
    common = set.intersection(*(set(p) for p in parts.values()))
    return {c: ",".join(f for f in p if f not in common) or "base" for c, p in parts.items()}


def markdown(part, train_length: int) -> str:
    """One spec's table as the docs print it: a row per cell (the factors that differ), checkpoint and id mode (PPC: its own
    ids, then the same models fed the oracle's), a column per test length; mean [min-max] over the
    runs, the ks of a cell joined with " / "; last, the runs that fit the train length (`fitting`) and
    those that extrapolate (`extrapolating`)."""
    lengths = sorted(part.length.unique())

    def entry(group) -> str:
        cells = []
        for _, g in group.groupby("k", dropna=False):
            m = g.exact_match
            cells.append(f"{m.mean():.2f} [{m.min():.2f}-{m.max():.2f}]" if len(m) > 1 else f"{m.mean():.2f}")
        return " / ".join(cells)

    head = [f"{n} ({n / train_length:g}x)" if n > train_length else f"{n} (in dist.)" for n in lengths]
    at_length = counted_at(lengths, train_length)
    at = f"{at_length / train_length:g}x" if at_length else "2x"
    lines = ["| cell | ids | " + " | ".join(head) + f" | runs that fit | runs >= {EXTRAPOLATES} at {at} |",
             "|---|---|" + "---|" * (len(lengths) + 2)]
    selected = part.checkpoint.nunique() > 1
    shown = differing(list(dict.fromkeys(part.cell)))
    for (cell, checkpoint, own, ids), group in part.groupby(["cell", "checkpoint", "own_ids", "ids"], sort=False):
        label = ids + (" (own)" if own and ids == "predicted" else " (oracle)" if ids == "coupled" and not own else "")
        label += f", {checkpoint} checkpoint" if selected else ""
        values = [entry(group[group.length == n]) for n in lengths]
        lines.append(f"| `{shown[cell]}` | {label} | " + " | ".join(values)
                     + f" | {fitting(group, train_length)} | {extrapolating(group, train_length)} |")
    return "\n".join(lines)
