"""The catalogue of what a trial reports: each metric named once, with when it is reported and what
kind of number it is.

- `every`: in every report (validation, every `eval.every_steps`), so a scheduler can stop on it;
- `end`: in the last report only (the evaluation points' summary and the analyses);
- `proportion`: a share in [0, 1], whose interval over seeds is clipped to [0, 1] (study/results/tables.py);
- `timing`: measures the machine, not the model: runs of one config and seed agree on every other
  metric.

A name ending in `/*` is a family (`sparsity/k_median`, ...). The spec's validation (which metric a
study may select on), the training loop, the tracker and the report read this table; each analysis
adds its own entries when it is registered (trial/analyses.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    when: Literal["every", "end"]
    proportion: bool = False
    timing: bool = False
    doc: str = ""


CATALOGUE: tuple[Metric, ...] = (
    # validation on held-out in-distribution samples (trial/evaluate.py `validate`)
    Metric("val_loss", "every", doc="teacher-forced loss"),
    Metric("val_token_acc", "every", True, doc="target tokens right"),
    Metric("val_exact", "every", True, doc="samples with every target (and under PPC every id) right"),
    Metric("val_answer_acc", "every", True, doc="samples with the answer right"),
    Metric("tokens_per_s", "every", timing=True),
    Metric("time/*", "every", timing=True),
    Metric("startup/*", "every", timing=True),
    Metric("host/*", "end", timing=True, doc="the host's matmul rates and (a tag) kernel path (trial/host.py)"),
    # the evaluation points, summarized for the model's own ids (trial/loop.py `summarize`)
    Metric("acc_in_dist", "end", True, doc="answer accuracy at lengths and k <= the training ones"),
    Metric("exact_in_dist", "end", True),
    Metric("loss_in_dist", "end", doc="language modeling: loss at lengths <= the train length"),
    Metric("acc_beyond", "end", True, doc="answer accuracy past the train length (k <= K_train)"),
    Metric("exact_beyond", "end", True),
    Metric("loss_beyond", "end"),
    Metric("acc_k_beyond", "end", True, doc="answer accuracy at k > K_train (any length)"),
    # one evaluation point (results.csv's rows, trial/evaluate.py)
    Metric("answer_acc", "end", True),
    Metric("exact_match", "end", True),
    # Ruoss et al. 2023's per-token accuracy, of greedy generation here (their outputs are not fed back)
    Metric("answer_token_acc", "end", True, doc="answer tokens generated right"),
    Metric("id_match", "end", True, doc="PPC: every predicted id right"),
)
ANALYSIS_METRICS: list[Metric] = []  # the registered analyses' entries (trial/analyses.py `register`)
EXTRAPOLATION = ("acc_beyond", "exact_beyond")  # need a test length past the train length
# the report's columns per trial: always, and where a trial reports them
SUMMARY = ("val_exact", "val_loss", "acc_in_dist", "acc_beyond", "acc_k_beyond", "exact_in_dist", "exact_beyond")
OPTIONAL = ["loss_beyond"]  # and the registered analyses' report columns


def add_metrics(entries: tuple[Metric, ...], report_columns: tuple[str, ...]) -> None:
    """An analysis's catalogue entries and the report columns it adds where a trial reports them."""
    ANALYSIS_METRICS.extend(m for m in entries if m not in ANALYSIS_METRICS)
    OPTIONAL.extend(c for c in report_columns if c not in OPTIONAL)


def find(name: str) -> Metric | None:
    """The catalogue's entry for a metric: by its name, else by its family (`sparsity/*`)."""
    for m in (*CATALOGUE, *ANALYSIS_METRICS):
        if m.name == name or (m.name.endswith("/*") and name.startswith(m.name[:-1])):
            return m
    return None


def is_proportion(name: str) -> bool:
    m = find(name)
    return bool(m and m.proportion)


def is_timing(name: str) -> bool:
    m = find(name)
    return bool(m and m.timing)


def reported_every_time() -> list[str]:
    """What every report holds that a study may select or stop on (timings are not objectives)."""
    return [m.name for m in CATALOGUE if m.when == "every" and not m.timing]
