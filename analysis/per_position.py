"""Where in the output does length generalization break: teacher-forced accuracy per target position.

A trial config's `per_position:` section runs it after training, at each evaluation point (eval.lengths
x eval.ks): per position of the answer, the share of samples whose token there is right (the model fed
the true prefix, its inference ids) beside the largest id distance the predicting token sees to any
key it may attend to, and the largest such distance of any training sequence. Metrics
`per_position/worst_len{N}` (the lowest accuracy over positions) and `per_position/first_unseen_len{N}`
(the first position whose query sees a distance no training sequence had; -1 for none); the rows as
`per_position.csv`. `python -m study.per_position CONFIG` trains one trial and prints the same table.
"""

from __future__ import annotations

import os
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from trial.analyses import Analysis
from trial.evaluate import with_places
from trial.limits import MAX_BATCH, Piece, activation_bytes, logits_bytes
from trial.metrics import Metric


def id_span(ids: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
    """[B, T]: the largest |id_t - id_j| over the keys j <= t a query at t may attend to."""
    T = ids.shape[1]
    valid = np.arange(T)[None, :] < seq_len[:, None]
    diff = np.abs(ids[:, :, None] - ids[:, None, :])
    causal = np.tril(np.ones((T, T), dtype=bool))[None] & valid[:, None, :]
    return np.where(causal, diff, 0).max(axis=2)


def trained_span(task, scheme, seed: int, samples: int = 4096) -> int:
    """The largest id distance any of `samples` training sequences shows a query."""
    rng = np.random.default_rng([seed, 31337])
    train = task.sample(samples, rng)
    ids = scheme.training_ids(train.position_ids, train.seq_len, rng, task.fixed_prefix)
    return int(id_span(ids, train.seq_len).max())


def position_rows(module, task, scheme, length: int, k: int | None, samples: int, seed: int, trained: int,
                  device) -> list[dict]:
    """One evaluation point's rows: per answer position, accuracy and the id distance its query sees."""
    rng = np.random.default_rng([seed, 31337, length, 0 if k is None else k])
    batch = with_places(task, task.sample(samples, rng, length=length, k=k), scheme)
    ids = scheme.inference_ids(batch.position_ids)
    places = None if batch.digit_places is None else torch.from_numpy(batch.digit_places[:, :-1]).to(device)
    with torch.no_grad():
        logits = module(torch.from_numpy(batch.tokens[:, :-1]).to(device), torch.from_numpy(ids[:, :-1]).to(device),
                        digit_places=places)[0]
    right = (logits.argmax(-1).cpu().numpy() == batch.tokens[:, 1:]) & batch.loss_mask[:, 1:]
    prompt, answer = int(batch.prompt_len[0]), int(batch.seq_len[0] - batch.prompt_len[0])
    accuracy = right[:, prompt - 1: prompt - 1 + answer].mean(0)
    span = id_span(ids, batch.seq_len)[:, prompt - 1: prompt - 1 + answer].max(0)
    return [{"length": length, "k": k, "position": i, "accuracy": float(accuracy[i]), "id_distance": int(span[i]),
             "trained_distance": trained} for i in range(answer)]


class PerPositionSpec(Analysis):
    """`per_position: {samples: 256}`: accuracy per answer position at every evaluation point."""

    name: ClassVar[str] = "per_position"
    metrics: ClassVar[tuple[Metric, ...]] = (Metric("per_position/*", "end"),)
    tables: ClassVar[tuple[str, ...]] = ("positions",)

    samples: int = Field(256, ge=1, le=MAX_BATCH, description="samples per evaluation point (one forward batch)")

    def check(self, cfg) -> None:
        task = cfg.task_instance
        if task.evaluation == "loss":
            raise ValueError(f"per_position: for tasks scored by their answers, not {task.name!r}'s loss on text")
        if cfg.model.output != "autoregressive":
            raise ValueError("per_position: measures a decoder's next-token predictions (model.output: autoregressive)")

    def memory(self, cfg, arch) -> list[Piece]:
        task = cfg.task_instance
        seq = max(task.max_seq_len(n, k) for n, k in cfg.eval_points())
        return [Piece("per_position.samples", f"per_position: a forward batch of {self.samples} sequences of {seq} "
                      "tokens", activation_bytes(arch, self.samples, seq, 1, False)
                      + logits_bytes(arch, self.samples, seq, 2))]

    def run(self, module, task, cfg, device) -> tuple[dict, dict[str, list[dict]]]:
        scheme = cfg.positional.scheme
        was_training = module.training
        module.eval()
        trained = trained_span(task, scheme, cfg.seed)
        rows = [row for n, k in cfg.eval_points()
                for row in position_rows(module, task, scheme, n, k, self.samples, cfg.seed, trained, device)]
        module.train(was_training)
        metrics = {}
        for (n, k), group in pd.DataFrame(rows).groupby(["length", "k"], dropna=False, sort=False):
            at = f"len{n}" + ("" if pd.isna(k) else f"/k{int(k)}")
            metrics[f"per_position/worst_{at}"] = float(group.accuracy.min())
            unseen = group[group.id_distance > trained]
            metrics[f"per_position/first_unseen_{at}"] = int(unseen.position.min()) if len(unseen) else -1
        return metrics, {"positions": rows}

    def write_artifacts(self, tables: dict[str, list[dict]], folder: str, title: str) -> None:
        pd.DataFrame(tables["positions"]).to_csv(os.path.join(folder, "per_position.csv"), index=False)
