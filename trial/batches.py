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

from trial.evaluate import Tensors, with_places


class StepBatches(Dataset):
    """Item i is the training batch of step `first + i`: its arrays, the ids the model trains with,
    and how many tokens it holds."""

    def __init__(self, task, scheme, micro_batch: int, data_seed: int, rank: int, first: int, last: int):
        self.task, self.scheme, self.micro_batch = task, scheme, micro_batch
        self.data_seed, self.rank, self.first, self.last = data_seed, rank, first, last

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __getitem__(self, i: int) -> dict:
        step = self.first + i
        batch = with_places(self.task, self.task.sample(self.micro_batch, np.random.default_rng(
            [self.data_seed, self.rank, step])), self.scheme)
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
