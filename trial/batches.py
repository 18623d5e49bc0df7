"""A trial's training batches, step by step.

A step's batch is a pure function of (data seed, rank, step), so it can be made anywhere: in the
training process (`deepspeed.data_workers: 0`, the default) or ahead of the step in worker
processes (a GPU step is milliseconds; a task's sampler in Python can take longer). Both give the
same batches, and a run resumed at step s starts the stream at s + 1.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from tasks import Batch
from tasks.priming import check_priming, training_set
from trial.evaluate import Tensors, with_places


def select_rows(batch: Batch, rows: np.ndarray) -> Batch:
    """The batch of these samples (rows may repeat), its padding cut to their longest sequence."""
    width = int(batch.seq_len[rows].max())
    places = None if batch.digit_places is None else batch.digit_places[rows, :width]
    return Batch(tokens=batch.tokens[rows, :width], position_ids=batch.position_ids[rows, :width],
                 loss_mask=batch.loss_mask[rows, :width], answer_mask=batch.answer_mask[rows, :width],
                 prompt_len=batch.prompt_len[rows], seq_len=batch.seq_len[rows],
                 answers=[batch.answers[i] for i in rows], meta=[batch.meta[i] for i in rows], digit_places=places)


class StepBatches(Dataset):
    """Item i is the training batch of step `first + i`: its arrays, the ids the model trains with,
    and how many tokens it holds. With `train_set_size`, the samples come from a fixed set drawn
    once from the data seed (the same on every rank and in every worker; tasks/priming.py, with the
    task's primed samples), the ids still per step."""

    def __init__(self, task, scheme, micro_batch: int, data_seed: int, rank: int, first: int, last: int,
                 train_set_size: int | None = None):
        self.task, self.scheme, self.micro_batch = task, scheme, micro_batch
        self.data_seed, self.rank, self.first, self.last = data_seed, rank, first, last
        self.train_set_size, self._train_set = train_set_size, None

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def _draw(self, rng: np.random.Generator) -> Batch:
        if self.train_set_size is None:
            check_priming(self.task, None)  # priming needs a fixed set (the trial config refuses it first)
            return self.task.sample(self.micro_batch, rng)
        if self._train_set is None:  # made where it is used: in a worker, not pickled to it
            # the task's primed samples (priming_samples) are part of the set
            self._train_set = training_set(self.task, self.train_set_size,
                                          np.random.default_rng([self.data_seed, 104711]))
        return select_rows(self._train_set, rng.integers(0, self.train_set_size, size=self.micro_batch))

    def __getitem__(self, i: int) -> dict:
        step = self.first + i
        batch = with_places(self.task, self._draw(np.random.default_rng([self.data_seed, self.rank, step])),
                            self.scheme)
        ids = self.scheme.training_ids(batch.position_ids, batch.seq_len,
                                       np.random.default_rng([self.data_seed, self.rank, step, 1]),
                                       self.task.fixed_prefix)
        arrays = {"tokens": batch.tokens, "ids": ids, "loss_mask": batch.loss_mask, "answer_mask": batch.answer_mask}
        if batch.digit_places is not None:
            arrays["places"] = batch.digit_places
        # only arrays cross to the training process: answers and metadata stay in the worker
        return {**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()},
                "tokens_seen": int(batch.seq_len.sum()), "step": step}


def training_batches(dataset: StepBatches, workers: int, device: torch.device):
    """Yield (step, Tensors on `device`, tokens in the batch) for every step of `dataset`, made by
    `workers` processes ahead of the step (0: here, when asked for)."""
    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                        prefetch_factor=4 if workers else None, pin_memory=device.type == "cuda",
                        persistent_workers=False)
    for item in loader:
        def on_device(name):
            return item[name].to(device, non_blocking=True) if name in item else None

        yield item["step"], Tensors(on_device("tokens"), on_device("ids"), on_device("loss_mask"),
                                    on_device("answer_mask"), on_device("places")), item["tokens_seen"]
