"""Train set priming (Jelassi et al. 2023): a few samples longer than training in the training set.

Every task takes `priming_samples` and `priming_length` (checked in tasks/base.py). `training_set`
draws a trial's fixed training set (`task.train_set_size`, trial/batches.py) with the primed samples
in it; fresh samples every step have no set to prime, so the trial config refuses priming without
one. Validation, the tracked lengths and the evaluation points never see them: they draw with
`Task.sample` and `Task.validation_sample`, which priming leaves as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import PAD_ID, Batch, Task, TaskParamError, require_int


def check_priming(task: Task, train_set_size: int | None) -> None:
    """Raise TaskParamError (naming `priming_samples`, `priming_length` or the param that bounds it)
    if the task's primed samples cannot go into a training set of `train_set_size` samples (None:
    fresh samples every step); nothing without priming."""
    if not task.priming_samples:
        return
    if train_set_size is None:
        raise TaskParamError("priming_samples", f"{task.priming_samples} primed samples go into a fixed training "
                                                "set, and fresh samples every step have none; set task.train_set_size")
    if task.priming_samples >= train_set_size:
        raise TaskParamError("priming_samples", f"{task.priming_samples} primed samples fill the training set of "
                                                f"{train_set_size} (task.train_set_size); prime a few of them")
    try:
        task.check(task.priming_length, None)  # type: ignore[arg-type]
    except TaskParamError as err:
        if err.param != "length":
            raise
        raise TaskParamError("priming_length", err.detail) from None


def training_set(task: Task, size: int, rng: np.random.Generator) -> Batch:
    """The fixed training set of `size` samples: draws of the training distribution, the last
    `priming_samples` of them replaced by samples of `priming_length`, drawn as evaluation points
    are. Without priming, `task.sample(size, rng)`; with it, the same draws but for the replaced
    ones, so a primed set and an unprimed one of a seed differ only there."""
    size = require_int("train_set_size", size, 1)
    if not task.priming_samples:
        return task.sample(size, rng)
    check_priming(task, size)
    plain = task.sample(size, rng)
    primed = task.sample(task.priming_samples, rng, length=task.priming_length)
    return concat_batches([take_rows(plain, np.arange(size - task.priming_samples)), primed])


def take_rows(batch: Batch, rows: np.ndarray) -> Batch:
    """The batch of these samples (rows may repeat), its padding cut to their longest sequence."""
    width = int(batch.seq_len[rows].max())
    places = None if batch.digit_places is None else batch.digit_places[rows, :width]
    return Batch(tokens=batch.tokens[rows, :width], position_ids=batch.position_ids[rows, :width],
                 loss_mask=batch.loss_mask[rows, :width], answer_mask=batch.answer_mask[rows, :width],
                 prompt_len=batch.prompt_len[rows], seq_len=batch.seq_len[rows],
                 answers=[batch.answers[i] for i in rows], meta=[batch.meta[i] for i in rows], digit_places=places)


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """The samples of every batch in one, padded to the longest (digit places where all have them)."""
    width = max(b.tokens.shape[1] for b in batches)

    def joined(field: str, fill) -> np.ndarray:
        return np.concatenate([np.pad(getattr(b, field), ((0, 0), (0, width - b.tokens.shape[1])),
                                      constant_values=fill) for b in batches])

    places = None if any(b.digit_places is None for b in batches) else joined("digit_places", 0)
    return Batch(tokens=joined("tokens", PAD_ID), position_ids=joined("position_ids", 0),
                 loss_mask=joined("loss_mask", False), answer_mask=joined("answer_mask", False),
                 prompt_len=np.concatenate([b.prompt_len for b in batches]),
                 seq_len=np.concatenate([b.seq_len for b in batches]),
                 answers=[a for b in batches for a in b.answers], meta=[m for b in batches for m in b.meta],
                 digit_places=places)
