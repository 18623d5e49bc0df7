"""How sparse is real text? The loss gap L_short - L_long and how much of it k tokens recover.

For a target token with L_bar tokens of context (after Golowich et al. 2025, Figures 4-5), L_long is
its loss with all of them visible, L_short with only the last L, and L_short,sparse(k) with the last
L plus k chosen earlier tokens; gap recovered(k) = (L_short - L_short,sparse(k)) / (L_short - L_long).
"Visible" holds for the whole computation (the model's `visible` mask, one batch row per pattern).
The k tokens are chosen by `method` (greedy, gain, occlusion, attention), and a token is taken away
by a scorer: `TargetScorer` hides it from attention, `ResampleScorer` redraws its value inside its
task's value class. The definitions, the methods and what each can find: docs/loss_gap.md, "The
analysis"; when each scorer is right: docs/sparsity.md.
"""

from __future__ import annotations

import math
import os
import time
import zlib
from typing import Annotated, ClassVar, Literal

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from trial.analyses import Analysis
from trial.limits import (
    HELD_TOKEN,
    MAX_BATCH,
    MAX_POSITION,
    MAX_SAMPLES,
    Piece,
    activation_bytes,
    logits_bytes,
)
from trial.metrics import Metric


class LossGapSpec(Analysis):
    """After training a language model: how much of the short-to-long loss gap k tokens recover
    (the trial config's `loss_gap:` section, and `python -m study.loss_gap`'s settings). long_context
    is L_bar, short_context is L."""

    name: ClassVar[str] = "loss_gap"
    metrics: ClassVar[tuple[Metric, ...]] = (Metric("loss_gap/*", "end"),)
    # results.csv's columns: the gap recovered per k, what a T4 claim reads (study/results/verdicts.py)
    report_columns: ClassVar[tuple[str, ...]] = ("loss_gap/recovered_median/*", "loss_gap/L_long", "loss_gap/L_short")
    tables: ClassVar[tuple[str, ...]] = ("summary", "records")

    long_context: int = Field(256, ge=2, le=MAX_POSITION)
    short_context: int = Field(32, ge=1)
    ks: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    method: Literal["greedy", "gain", "occlusion", "attention"] = "gain"
    targets: int = Field(64, ge=1, le=MAX_SAMPLES)
    rows_per_batch: int = Field(64, ge=1, le=MAX_BATCH, description="visibility patterns per forward pass")
    min_gap: float = Field(0.05, ge=0, description="tokens whose L_short - L_long is below this are too flat to count")
    sparse_k: int = Field(4, ge=1, description="a token is 'sparse' when k tokens recover half its gap")

    @model_validator(mode="after")
    def _fits(self) -> LossGapSpec:
        if not self.short_context < self.long_context:
            raise ValueError(f"short_context: {self.short_context} must be below long_context {self.long_context}")
        if max(self.ks) > self.long_context - self.short_context:
            raise ValueError(f"ks: each k must be in [1, long_context - short_context = "
                             f"{self.long_context - self.short_context}], got {self.ks}")
        if self.sparse_k not in self.ks:
            raise ValueError(f"sparse_k: {self.sparse_k} must be one of ks {self.ks}")
        return self

    def check(self, cfg) -> None:
        task, max_pos = cfg.task_instance, cfg.positional.max_position
        if task.evaluation != "loss":
            raise ValueError(f"loss_gap: needs a language-modeling task (task.name: lm), not {task.name!r}")
        if self.long_context >= max_pos:
            raise ValueError(f"loss_gap.long_context: {self.long_context} needs ids beyond "
                             f"positional.max_position {max_pos}")

    def memory(self, cfg, arch) -> list[Piece]:
        """Its windows (targets x long_context) and one forward batch of rows_per_batch of them."""
        seq = self.long_context + 1
        windows = self.targets * seq * HELD_TOKEN
        batch = activation_bytes(arch, self.rows_per_batch, seq, 1, False) + logits_bytes(arch, self.rows_per_batch,
                                                                                          seq, 2)
        return [Piece("loss_gap.targets" if windows > batch else "loss_gap.rows_per_batch",
                      f"loss_gap: {self.targets} windows of {seq} tokens (loss_gap.long_context) and a forward "
                      f"batch of {self.rows_per_batch} of them", windows + batch)]

    def run(self, module, task, cfg, device) -> tuple[dict, dict[str, list[dict]]]:
        """Flat `loss_gap/...` metrics; the summary per k and the token rows."""
        metrics, summary, tokens = gap_metrics(module, task, self, cfg.seed, device)
        return metrics, {"summary": summary, "records": tokens}

    def write_artifacts(self, tables: dict[str, list[dict]], folder: str, title: str) -> None:
        pd.DataFrame(tables["summary"]).to_csv(os.path.join(folder, "summary.csv"), index=False)
        pd.DataFrame(tables["records"]).to_csv(os.path.join(folder, "tokens.csv"), index=False)
        plot_gap(pd.DataFrame(tables["records"]), os.path.join(folder, "gap_scatter.png"), f"loss gap: {title}")


class TargetScorer:
    """Loss of the last token of a window under many visibility patterns, batched.

    `model(tokens, position_ids, visible=...)` returns logits first (DecoderLM and the Hugging Face
    adapter both do). Windows have L_bar + 1 tokens: the context and the target.
    """

    def __init__(self, model, device="cpu", rows_per_batch: int = 64):
        self.model, self.device, self.rows = model, torch.device(device), rows_per_batch

    @torch.no_grad()
    def losses(self, window: torch.Tensor, key_masks: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """window [L_bar + 1]; key_masks [V, L_bar] (True = visible); ids [L_bar] the context's
        position ids (default 0..L_bar-1). Returns the target's loss [V]."""
        context, target = window[:-1], window[-1]
        T = context.shape[0]
        ids = torch.arange(T, device=self.device) if ids is None else ids
        eye = torch.eye(T, dtype=torch.bool, device=self.device)
        out = []
        for chunk in key_masks.split(self.rows):
            V = chunk.shape[0]
            visible = chunk[:, None, :] | eye  # every token sees itself; hidden keys stay hidden
            logits = self.model(context.expand(V, T), ids.expand(V, T), visible=visible)[0][:, -1]
            out.append(F.cross_entropy(logits.float(), target.expand(V), reduction="none"))
        return torch.cat(out)

    @torch.no_grad()
    def attention_mass(self, window: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The target query's attention to each context position, mean over heads, sum over layers."""
        if hasattr(self.model, "attention_mass"):
            return self.model.attention_mass(window)
        attns = [m for m in self.model.modules() if hasattr(m, "record_last_query")]
        if not attns:
            raise ValueError("method: attention needs a model that exposes attention (use greedy or gain)")
        for a in attns:
            a.record_last_query = True
        try:
            context = window[:-1][None]
            ids = torch.arange(context.shape[1], device=self.device) if ids is None else ids
            self.model(context, ids[None])
            return sum(a.last_query_attention[0].mean(0) for a in attns)
        finally:
            for a in attns:
                a.record_last_query, a.last_query_attention = False, None


class ResampleScorer(TargetScorer):
    """Loss of the last token when the tokens not kept are redrawn, `draws` times, uniformly inside
    their value class (a task's `value_classes`: 0 <-> 1, A <-> B); the loss is that of the mixture
    prediction, -log mean_r p_r(target). The model sees whole, well-formed samples, so this is
    ignorance of a value, not absence of a token. Tokens in no class are never redrawn. The redraws
    depend only on the window and the seed, so every pattern of one window shares them."""

    def __init__(self, model, classes: list[list[int]], vocab_size: int, device="cpu",
                 rows_per_batch: int = 256, draws: int = 16, seed: int = 0):
        super().__init__(model, device, rows_per_batch)
        self.draws, self.seed = draws, seed
        self.class_of = np.full(vocab_size, -1)
        for c, members in enumerate(classes):
            self.class_of[members] = c
        self.members = [np.asarray(m) for m in classes]

    def resamplable(self, window: torch.Tensor) -> torch.Tensor:
        """Bool [L_bar]: which context tokens have a class to be redrawn in."""
        return torch.as_tensor(self.class_of[window[:-1].cpu().numpy()] >= 0, device=self.device)

    def redraws(self, window: torch.Tensor) -> torch.Tensor:
        context = window[:-1].cpu().numpy()
        rng = np.random.default_rng([self.seed, zlib.crc32(context.astype(np.int64).tobytes())])
        out = np.repeat(context[None], self.draws, axis=0)
        cls = self.class_of[context]
        for c, members in enumerate(self.members):
            at = np.flatnonzero(cls == c)
            out[:, at] = members[rng.integers(0, len(members), size=(self.draws, len(at)))]
        return torch.as_tensor(out, device=self.device)

    @torch.no_grad()
    def losses(self, window: torch.Tensor, key_masks: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """key_masks [V, L_bar]: True = the real token, False = redrawn. Returns the loss [V]."""
        context, target = window[:-1], window[-1]
        T, R = context.shape[0], self.draws
        ids = torch.arange(T, device=self.device) if ids is None else ids
        redraws = self.redraws(window)  # [R, T]
        out = []
        for chunk in key_masks.split(max(1, self.rows // R)):
            tokens = torch.where(chunk[:, None, :], context, redraws[None]).reshape(-1, T)  # [V*R, T]
            logits = self.model(tokens, ids.expand(tokens.shape[0], T))[0][:, -1].float()
            p = logits.log_softmax(-1)[:, target].reshape(-1, R)
            out.append(-(torch.logsumexp(p, dim=1) - math.log(R)))
        return torch.cat(out)


def analyze_window(scorer: TargetScorer, window: torch.Tensor, short_context: int, ks: list[int], method: str,
                   min_gap: float, ids: torch.Tensor | None = None) -> list[dict]:
    """All losses for one target (the last token of `window`); one record per k.

    The short window is the last `short_context` (L) tokens before the target; the context is the
    whole window before the target (L_bar = len(window) - 1), so windows may differ in length. ks
    beyond the C = L_bar - L candidates are left out."""
    Lb, L = window.shape[0] - 1, short_context
    C = Lb - L  # candidates: positions 0..C-1; the short window is C..Lb-1
    ks = [k for k in ks if k <= C]
    if not ks:
        return []
    dev = window.device
    short = torch.zeros(Lb, dtype=torch.bool, device=dev)
    short[C:] = True
    full = torch.ones(Lb, dtype=torch.bool, device=dev)
    l_long, l_short = scorer.losses(window, torch.stack([full, short]), ids).tolist()
    kmax = max(ks)
    eye = torch.eye(C, Lb, dtype=torch.bool, device=dev)  # row j unmasks candidate j
    if method == "greedy":
        chosen: list[int] = []
        path: list[float] = []
        current = short.clone()
        for _ in range(kmax):
            losses = scorer.losses(window, current | eye, ids)
            if chosen:
                losses[chosen] = math.inf
            j = int(losses.argmin())
            chosen.append(j)
            current[j] = True
            path.append(float(losses[j]))
        sparse = {k: path[k - 1] for k in ks}
        order = chosen
    else:
        if method == "gain":
            score = -scorer.losses(window, short | eye, ids)  # lower loss alone = larger gain
        elif method == "occlusion":
            score = scorer.losses(window, full & ~eye, ids)  # higher loss without it = more needed
        elif method == "attention":
            score = scorer.attention_mass(window, ids)[:C]
        else:
            raise ValueError(f"method: unknown {method!r}; expected greedy, gain, occlusion or attention")
        order = score.argsort(descending=True, stable=True)[:kmax].tolist()
        rows = torch.stack([short.clone() for _ in ks])
        for i, k in enumerate(ks):
            rows[i, order[:k]] = True
        sparse = dict(zip(ks, scorer.losses(window, rows, ids).tolist()))
    gap = l_short - l_long
    records = []
    for k in ks:
        picked = sorted(order[:k])
        records.append({
            "k": k, "L_long": l_long, "L_short": l_short, "L_sparse": sparse[k], "gap": gap,
            "recovered": (l_short - sparse[k]) / gap if gap >= min_gap else float("nan"),
            "positions": picked, "distances": [Lb - j for j in picked],  # tokens back from the target
        })
    return records


def run_analysis(model, windows: np.ndarray, cfg: LossGapSpec, device="cpu") -> tuple[pd.DataFrame, dict]:
    """windows [N, L_bar + 1] token ids. Returns per-(target, k) records and timing."""
    model.eval()
    scorer = TargetScorer(model, device, cfg.rows_per_batch)
    rows = []
    start = time.perf_counter()
    for n, window in enumerate(torch.as_tensor(windows, device=device)):
        for rec in analyze_window(scorer, window, cfg.short_context, cfg.ks, cfg.method, cfg.min_gap):
            rows.append({"target": n, **rec})
    seconds = time.perf_counter() - start
    return pd.DataFrame(rows), {"seconds": seconds, "seconds_per_1k_targets": 1000 * seconds / len(windows)}


def summarize_gap(records: pd.DataFrame, min_gap: float) -> pd.DataFrame:
    """Per k: mean and median gap recovered over tokens with a gap worth counting, how many were
    counted and how many were too flat (L_short - L_long < min_gap), and the mean losses."""
    by_k = records.groupby("k")
    counted = records[records.gap >= min_gap].groupby("k").recovered
    out = pd.DataFrame({
        "recovered_mean": counted.mean(),
        "recovered_median": counted.median(),
        "tokens_counted": counted.size(),
        "tokens_flat": records[records.gap < min_gap].groupby("k").size(),
        "L_long": by_k.L_long.mean(),
        "L_short": by_k.L_short.mean(),
        "L_sparse": by_k.L_sparse.mean(),
    }).reindex(sorted(records.k.unique()))
    out[["tokens_counted", "tokens_flat"]] = out[["tokens_counted", "tokens_flat"]].fillna(0).astype(int)
    return out.rename_axis("k").reset_index()


def sparse_vs_dense(records: pd.DataFrame, sparse_k: int, min_gap: float) -> dict[str, float]:
    """Link to length generalization: tokens whose gap k tokens mostly recover ('sparse') against
    the rest. With L_bar beyond the train length, L_short - L_long is how much a model gains from
    context it was never trained at; sparse tokens are the ones the theory expects to gain."""
    at_k = records[(records.k == sparse_k) & (records.gap >= min_gap)]
    sparse = at_k[at_k.recovered >= 0.5]
    dense = at_k[at_k.recovered < 0.5]
    benefit = lambda d: float((d.L_short - d.L_long).mean()) if len(d) else float("nan")  # noqa: E731
    return {"tokens_sparse": len(sparse), "tokens_dense": len(dense),
            "long_benefit_sparse": benefit(sparse), "long_benefit_dense": benefit(dense)}


def sample_windows(val_tokens: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """n held-out windows of `length` tokens (context + target) from a token array."""
    rng = np.random.default_rng([seed, 31337])
    starts = rng.integers(0, len(val_tokens) - length + 1, size=n)
    return np.asarray(val_tokens)[starts[:, None] + np.arange(length)].astype(np.int64)


def gap_metrics(module, task, cfg: LossGapSpec, seed: int, device) -> tuple[dict, list[dict], list[dict]]:
    """Run the analysis on a trained LM's held-out text; flat metrics, summary rows, token rows."""
    windows = sample_windows(task.val_tokens, cfg.targets, cfg.long_context + 1, seed)
    records, timing = run_analysis(module, windows, cfg, device)
    summary = summarize_gap(records, cfg.min_gap)
    metrics = {"loss_gap/seconds_per_1k_targets": timing["seconds_per_1k_targets"],
               "loss_gap/L_long": float(records.L_long.mean()), "loss_gap/L_short": float(records.L_short.mean())}
    for row in summary.itertuples():
        metrics[f"loss_gap/recovered_median/k{row.k}"] = float(row.recovered_median)
        metrics[f"loss_gap/recovered_mean/k{row.k}"] = float(row.recovered_mean)
        metrics[f"loss_gap/L_sparse/k{row.k}"] = float(row.L_sparse)
    metrics["loss_gap/tokens_flat"] = int(summary.tokens_flat.iloc[0])
    metrics.update({f"loss_gap/{k}": v for k, v in sparse_vs_dense(records, cfg.sparse_k, cfg.min_gap).items()})
    token_rows = records.assign(positions=records.positions.map(str), distances=records.distances.map(str))
    return metrics, summary.to_dict("records"), token_rows.to_dict("records")


def plot_gap(records: pd.DataFrame, path: str, title: str = "") -> str:
    """Figure 4 analogue: loss drop from k tokens against the drop from the whole distant context;
    `title` says what was measured. A PDF beside the PNG."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5), layout="constrained")
    fig.suptitle(textwrap.fill(title, 60), fontsize=9)
    for k, group in records.groupby("k"):
        ax.scatter(group.L_short - group.L_long, group.L_short - group.L_sparse, s=8, alpha=0.6, label=f"k={k}")
    lim = max(1e-3, float((records.L_short - records.L_long).abs().max()))
    ax.plot([-lim, lim], [-lim, lim], color="grey", lw=1, ls=":")
    ax.set_xlabel("L_short - L_long (whole distant context)")
    ax.set_ylabel("L_short - L_short,sparse(k) (k tokens)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=150)
    fig.set_layout_engine("none")  # the PDF keeps the PNG's layout
    fig.savefig(os.path.splitext(path)[0] + ".pdf", metadata={"CreationDate": None})
    plt.close(fig)
    return path
