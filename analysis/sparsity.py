"""The sparsity meter: how many earlier tokens a trained model's prediction of each target needs.

Per target token (an answer or scratchpad token of a synthetic task, a text token of `lm`): take
the context away (L_short), give back the k tokens a method ranks first (L_short,sparse(k)) for
k = 1..k_max, and record the smallest k that recovers `recover` (90%) of the gap L_short - L_long,
with the positions it chose. Where a synthetic task plants the answer (`meta["deps"]`), the meter
reports whether its k equals the planted k and the precision and recall of its chosen tokens. A
token is taken away by `hide` (it leaves attention: the paper's truncation, the only choice for
text) or `resample` (its value is redrawn inside its value class: the default on synthetic tasks).
The machinery is analysis/loss_gap.py's. Why hiding cannot find a parity's plant, the short window
each ablation keeps, and what the meter measured: docs/sparsity.md.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from analysis.loss_gap import ResampleScorer, TargetScorer, analyze_window, sample_windows
from models.positions import PositionalScheme
from tasks import TaskParamError
from trial.analyses import Analysis
from trial.limits import MAX_BATCH, MAX_POSITION, MAX_SAMPLES, Piece, activation_bytes, logits_bytes
from trial.metrics import Metric


class SparsitySpec(Analysis):
    """After training: the sparsity meter (analysis/sparsity.py), per target token the smallest k of
    earlier tokens that recovers `recover` of its loss gap, checked against the planted
    dependencies on synthetic tasks (the trial config's `sparsity:` section, and `python -m
    study.sparsity`'s settings)."""

    name: ClassVar[str] = "sparsity"
    metrics: ClassVar[tuple[Metric, ...]] = (
        Metric("sparsity/k_match", "end", True), Metric("sparsity/precision", "end", True),
        Metric("sparsity/recall", "end", True), Metric("sparsity/*", "end"))
    report_columns: ClassVar[tuple[str, ...]] = (
        "sparsity/k_median", "sparsity/k_p90", "sparsity/k_match", "sparsity/precision", "sparsity/recall",
        "sparsity/targets_flat")
    tables: ClassVar[tuple[str, ...]] = ("targets",)

    method: Literal["occlusion", "greedy", "gain", "attention"] = Field(
        "occlusion", description="how the k tokens are ranked (greedy and gain cannot find an xor's bits)")
    ablation: Literal["auto", "resample", "hide"] = Field(
        "auto", description="how a token is taken away: resample its value (synthetic tasks, the default "
        "there) or hide it from attention (the paper's truncation; text)")
    targets: int = Field(256, ge=1, le=MAX_SAMPLES)
    k_max: int = Field(8, ge=1, le=4096)
    recover: float = Field(0.9, gt=0, le=1, description="share of the gap k tokens must recover")
    min_gap: float = Field(0.1, ge=0, description="targets with a smaller gap are counted as flat")
    draws: int = Field(16, ge=1, le=4096, description="resample: redraws per visibility pattern")
    short_context: int | None = Field(
        None, ge=0, description="tokens before the target always kept (default: 0 resample, 1 hide, 32 text)")
    long_context: int = Field(256, ge=2, le=MAX_POSITION, description="text: context before each target")
    length: int | None = Field(None, ge=1, description="synthetic: measure at this length (default: training mix)")
    k: int | None = Field(None, ge=1, description="synthetic k-tasks: measure at this k")
    rows_per_batch: int = Field(256, ge=1, le=MAX_BATCH)

    def resolve(self, task) -> tuple[str, int]:
        """(ablation, short_context) after the defaults: resample where the task has value classes."""
        ablation = self.ablation
        if ablation == "auto":
            ablation = "resample" if task.value_classes() else "hide"
        if ablation == "resample" and not task.value_classes():
            raise ValueError(f"sparsity.ablation: resample needs value classes; task {task.name!r} has none "
                             "(use hide)")
        short = self.short_context
        if short is None:
            short = 32 if task.evaluation == "loss" else (0 if ablation == "resample" else 1)
        if ablation == "hide" and short < 1:
            raise ValueError("sparsity.short_context: hide needs >= 1 (the predicting token sees itself)")
        return ablation, short

    def check(self, cfg) -> None:
        """That this section can measure trial config `cfg`'s task with its ids, or a ValueError
        naming the field."""
        s, task, max_pos, ids_needed = self, cfg.task_instance, cfg.positional.max_position, cfg.ids_needed
        _, short = s.resolve(task)  # raises naming sparsity.ablation / sparsity.short_context
        if task.evaluation == "loss":
            for name in ("length", "k"):
                if getattr(s, name) is not None:
                    raise ValueError(f"sparsity.{name}: for synthetic tasks only; text uses sparsity.long_context")
            if s.long_context >= max_pos:
                raise ValueError(f"sparsity.long_context: {s.long_context} needs ids beyond "
                                 f"positional.max_position {max_pos}")
            if short >= s.long_context:
                raise ValueError(f"sparsity.short_context: {short} must be below long_context {s.long_context}")
            if s.k_max > s.long_context - short:
                raise ValueError(f"sparsity.k_max: {s.k_max} is more than the {s.long_context - short} "
                                 "tokens before the short window")
            return
        if s.k is not None and not task.uses_k:
            raise ValueError(f"sparsity.k: task {task.name!r} has no k axis")
        if s.length is not None:
            try:
                task.check(s.length, s.k)
            except TaskParamError as e:
                raise ValueError(f"sparsity.{'length' if e.param == 'length' else 'k'}: {e.detail}") from None
            need = ids_needed(s.length, s.k)
            if need >= max_pos:
                raise ValueError(f"sparsity.length: {s.length} needs position id {need}, beyond "
                                 f"positional.max_position {max_pos}")
        elif s.k is not None:
            try:
                task.check(task.train_length, s.k)
            except TaskParamError as e:
                raise ValueError(f"sparsity.k: {e.detail}") from None

    def memory(self, cfg, arch) -> list[Piece]:
        """One forward batch of rows_per_batch sequences."""
        task = cfg.task_instance
        train_k = task.train_k if task.uses_k else None
        seq = self.long_context + 1 if task.evaluation == "loss" else task.max_seq_len(
            self.length or task.train_length, self.k or train_k)
        return [Piece("sparsity.rows_per_batch", f"sparsity: a forward batch of {self.rows_per_batch} "
                      f"sequences of {seq} tokens", activation_bytes(arch, self.rows_per_batch, seq, 1, False)
                      + logits_bytes(arch, self.rows_per_batch, seq, 2))]

    def run(self, module, task, cfg, device) -> tuple[dict, dict[str, list[dict]]]:
        """Flat `sparsity/...` metrics, and the per-target rows."""
        table, info = run_meter(module, task, cfg.positional.scheme, self, cfg.seed, device)
        metrics = {f"sparsity/{k}": v for k, v in summarize(table, self.k_max).items()}
        metrics["sparsity/seconds_per_1k_targets"] = info["seconds_per_1k_targets"]
        return metrics, {"targets": csv_ready(table).to_dict("records")}

    def write_artifacts(self, tables: dict[str, list[dict]], folder: str, title: str) -> None:
        rows = pd.DataFrame(tables["targets"])
        rows.to_csv(os.path.join(folder, "targets.csv"), index=False)
        plot_k(rows, self.k_max, os.path.join(folder, "k_hist.png"), f"sparsity meter: {title}")


@dataclass
class Target:
    """One target token: the window ending with it, the context's ids, the planted dependencies."""

    window: np.ndarray  # [L_bar + 1] tokens, the target last
    ids: np.ndarray  # [L_bar] position ids of the context
    kind: str  # answer | scratchpad | eos | text
    planted: list[int] | None  # positions (in the window) the target depends on; None for text
    length: int | None = None
    k_task: int | None = None


def synthetic_targets(task, scheme: PositionalScheme, n: int, seed: int, length: int | None = None,
                      k: int | None = None) -> list[Target]:
    """The first n target tokens of samples drawn from the training distribution (or one cell),
    each with its planted dependency set."""
    rng = np.random.default_rng([seed, 4241])
    out: list[Target] = []
    while len(out) < n:
        batch = task.sample(min(64, n), rng, length=length, k=k)
        ids = scheme.inference_ids(batch.position_ids)
        for b in range(len(batch)):
            cols = np.flatnonzero(batch.loss_mask[b])
            for j, t in enumerate(cols):
                kind = ("answer" if batch.answer_mask[b, t] else
                        "eos" if batch.tokens[b, t] == task.vocab.eos_id else "scratchpad")
                out.append(Target(batch.tokens[b, : t + 1], ids[b, :t], kind, list(batch.meta[b]["deps"][j]),
                                  batch.meta[b].get("length", None), batch.meta[b].get("k", None)))
                if len(out) == n:
                    return out
    return out


def text_targets(tokens: np.ndarray, n: int, long_context: int, seed: int) -> list[Target]:
    windows = sample_windows(tokens, n, long_context + 1, seed)
    return [Target(w, np.arange(long_context), "text", None) for w in windows]


def measure(model, targets: list[Target], *, ablation: str, short_context: int, k_max: int, method: str,
            recover: float, min_gap: float, classes: list[list[int]] | None = None, vocab_size: int = 0,
            draws: int = 16, rows_per_batch: int = 256, seed: int = 0, device="cpu",
            progress: Callable[[int, int, float], None] | None = None) -> tuple[pd.DataFrame, dict]:
    """One row per target: the losses, the smallest k recovering `recover` of the gap, the tokens
    chosen for it, and against the planted set (synthetic tasks) k_planted, precision and recall."""
    model.eval()
    if ablation == "resample":
        scorer = ResampleScorer(model, classes, vocab_size, device, rows_per_batch, draws, seed)
    else:
        scorer = TargetScorer(model, device, rows_per_batch)
    ks = list(range(1, k_max + 1))
    rows, start, last = [], time.perf_counter(), time.perf_counter()
    for i, tgt in enumerate(targets):
        window = torch.as_tensor(tgt.window, device=device)
        ids = torch.as_tensor(tgt.ids, device=device)
        recs = analyze_window(scorer, window, short_context, ks, method, min_gap, ids)
        rows.append({"target": i, "kind": tgt.kind, "length": tgt.length, "k_task": tgt.k_task,
                     **_k_needed(recs, recover, min_gap, k_max),
                     **_against_plant(tgt, scorer, window, short_context)})
        if progress is not None and (time.perf_counter() - last > 10 or i + 1 == len(targets)):
            last = time.perf_counter()
            progress(i + 1, len(targets), last - start)
    seconds = time.perf_counter() - start
    return pd.DataFrame(rows), {"seconds": seconds, "seconds_per_1k_targets": 1000 * seconds / max(len(targets), 1)}


def _k_needed(recs: list[dict], recover: float, min_gap: float, k_max: int) -> dict:
    if not recs:
        return {"L_long": math.nan, "L_short": math.nan, "gap": math.nan, "flat": True, "k": math.nan,
                "recovered": math.nan, "chosen": []}
    gap = recs[0]["gap"]
    base = {"L_long": recs[0]["L_long"], "L_short": recs[0]["L_short"], "gap": gap}
    if gap < min_gap:  # the short window already predicts it: nothing to recover
        return {**base, "flat": True, "k": math.nan, "recovered": math.nan, "chosen": []}
    for r in recs:
        if r["recovered"] >= recover:
            return {**base, "flat": False, "k": r["k"], "recovered": r["recovered"], "chosen": r["positions"]}
    return {**base, "flat": False, "k": k_max + 1, "recovered": recs[-1]["recovered"], "chosen": recs[-1]["positions"]}


def _against_plant(tgt: Target, scorer, window: torch.Tensor, short_context: int) -> dict:
    """The planted tokens the meter can find: among its candidates (before the short window) and,
    for resample, tokens with a value class."""
    if tgt.planted is None:
        return {}
    C = len(tgt.window) - 1 - short_context
    findable = set(p for p in tgt.planted if p < C)
    if isinstance(scorer, ResampleScorer):
        can = scorer.resamplable(window).tolist()
        findable = {p for p in findable if can[p]}
    return {"planted": sorted(findable), "k_planted": len(findable)}


def add_plant_scores(table: pd.DataFrame) -> pd.DataFrame:
    """precision, recall of the chosen tokens and whether k equals the planted k (counted targets)."""
    if "planted" not in table:
        return table
    t = table.copy()
    hit = [len(set(c) & set(p)) for c, p in zip(t.chosen, t.planted)]
    t["precision"] = [h / len(c) if len(c) else math.nan for h, c in zip(hit, t.chosen)]
    t["recall"] = [h / len(p) if len(p) else math.nan for h, p in zip(hit, t.planted)]
    t["k_match"] = (t.k == t.k_planted).where(~t.flat)
    return t


def summarize(table: pd.DataFrame, k_max: int) -> dict[str, float]:
    """The distribution of k over targets with a gap (k_max + 1 stands for 'not within k_max'),
    and the planted-truth scores where there is a plant."""
    counted = table[~table.flat]
    ks = counted.k.to_numpy(dtype=float)
    out = {
        "targets": len(table), "targets_counted": len(counted), "targets_flat": int(table.flat.sum()),
        "k_median": float(np.median(ks)) if len(ks) else math.nan,
        "k_p90": float(np.percentile(ks, 90)) if len(ks) else math.nan,
        "k_mean": float(ks.mean()) if len(ks) else math.nan,
        "unrecovered": float((ks > k_max).mean()) if len(ks) else math.nan,
    }
    if "k_match" in table:
        planted = counted[counted.k_planted > 0]
        out.update({
            "k_match": float(planted.k_match.mean()) if len(planted) else math.nan,
            "precision": float(planted.precision.mean()) if len(planted) else math.nan,
            "recall": float(planted.recall.mean()) if len(planted) else math.nan,
            "k_planted_median": float(planted.k_planted.median()) if len(planted) else math.nan,
        })
    return out


def by_kind(table: pd.DataFrame, k_max: int) -> pd.DataFrame:
    """summarize() per target kind (answer, scratchpad, eos, text) and over all of them."""
    parts = {kind: summarize(g, k_max) for kind, g in table.groupby("kind", sort=False)}
    if len(parts) > 1:
        parts["all"] = summarize(table, k_max)
    return pd.DataFrame(parts).T.rename_axis("kind").reset_index()


def run_meter(model, task, scheme: PositionalScheme, spec, seed: int, device="cpu", progress=None,
              text_tokens: np.ndarray | None = None) -> tuple[pd.DataFrame, dict]:
    """The meter on one trained model as a `sparsity:` section asks (spec: SparsitySpec, above);
    text_tokens: the text for a language model (default: the task's validation split)."""
    ablation, short = spec.resolve(task)
    if task.evaluation == "loss":
        tokens = task.val_tokens if text_tokens is None else text_tokens
        targets = text_targets(tokens, spec.targets, spec.long_context, seed)
    else:
        targets = synthetic_targets(task, scheme, spec.targets, seed, spec.length, spec.k)
    classes = [task.vocab.ids(c).tolist() for c in task.value_classes()]
    table, timing = measure(model, targets, ablation=ablation, short_context=short, k_max=spec.k_max,
                            method=spec.method, recover=spec.recover, min_gap=spec.min_gap, classes=classes,
                            vocab_size=len(task.vocab), draws=spec.draws, rows_per_batch=spec.rows_per_batch,
                            seed=seed, device=device, progress=progress)
    table = add_plant_scores(table)
    return table, {**timing, "ablation": ablation, "short_context": short}


def csv_ready(table: pd.DataFrame) -> pd.DataFrame:
    lists = [c for c in ("chosen", "planted") if c in table]
    return table.assign(**{c: table[c].map(lambda v: " ".join(map(str, v))) for c in lists})


def plot_k(table: pd.DataFrame, k_max: int, path: str, title: str = "") -> str:
    """How many targets needed each k; the planted k beside it where there is one; `title` says what
    was measured. A PDF beside the PNG."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = table[~table.flat.astype(bool)]
    bins = np.arange(0.5, k_max + 2.5)
    fig, ax = plt.subplots(figsize=(5, 3.4), layout="constrained")
    fig.suptitle(textwrap.fill(title, 60), fontsize=9)
    ax.hist(counted.k, bins=bins, alpha=0.7, label="measured k")
    if "k_planted" in counted:
        ax.hist(counted.k_planted, bins=bins, histtype="step", lw=2, color="k", label="planted k")
    ax.set_xticks(range(1, k_max + 2), [*map(str, range(1, k_max + 1)), f">{k_max}"])
    ax.set_xlabel("tokens needed to recover the gap (k)")
    ax.set_ylabel("targets")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=150)
    fig.set_layout_engine("none")  # the PDF keeps the PNG's layout
    fig.savefig(os.path.splitext(path)[0] + ".pdf", metadata={"CreationDate": None})
    plt.close(fig)
    return path
