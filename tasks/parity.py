"""Parity of all n bits with a scratchpad of running parities (the known result of Cho et al. 2024).

b_1 .. b_n `=` s_1 .. s_n `<eos>`, s_i = b_1 xor .. xor b_i, so s_n is the answer. Each step
depends on two tokens, the previous step and the next bit. The coupled ids make that dependency
*local* (Golowich et al.'s Definition 4.1): b_i has id i, `=` shares id 1 with b_1, and s_i
has id i + 1, so the token that predicts s_i (s_{i-1}, or `=` for s_1) carries id i and finds b_i
at offset 0. s_n (id n + 1) finds no input bit at its own id: that is where `<eos>` goes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Batch, Task, Vocab, make_batch


class ParityTask(Task):
    """n bits, `=`, the running parities s_1..s_n (s_n is the answer), `<eos>`."""

    name: ClassVar[str] = "parity"
    description: ClassVar[str] = "parity of n bits with a scratchpad of running parities (Cho et al. 2024)"
    uses_k: ClassVar[bool] = False
    local_coupling: ClassVar[bool] = True
    default_train_length: ClassVar[int] = 20
    answer_chance: ClassVar[float] = 0.5  # the answer is one even bit: a guess (the figures' chance line)

    def __init__(self, **common: Any) -> None:
        super().__init__(**common)
        self._bit_ids = self.vocab.ids(["0", "1"])

    def _build_vocab(self) -> Vocab:
        return Vocab(["0", "1", "="])

    def value_classes(self) -> list[list[str]]:
        return [["0", "1"]]

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 2

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 2 * length + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        batch, n_max = len(lengths), int(lengths.max())
        n = lengths[:, None]
        bits = rng.integers(0, 2, size=(batch, n_max), dtype=np.int64) * (np.arange(n_max)[None, :] < n)
        running = np.cumsum(bits, axis=1) % 2
        width = 2 * n_max + 2
        cols = np.arange(width)[None, :]
        is_input, is_pad = cols < n, (cols > n) & (cols <= 2 * n)
        # input col c holds b_{c+1}; scratchpad col c holds s_{c-n}
        src = np.clip(np.where(is_input, cols, cols - n - 1), 0, n_max - 1)
        tokens = np.select(
            [is_input, cols == n, is_pad],
            [self._bit_ids[np.take_along_axis(bits, src, 1)], self.vocab["="],
             self._bit_ids[np.take_along_axis(running, src, 1)]],
            default=self.vocab.eos_id,
        )
        position_ids = np.select([is_input, cols == n], [cols + 1, 1], default=cols - n + 1)
        answers = [str(int(running[b, lengths[b] - 1])) for b in range(batch)]
        meta = []
        for b in range(batch):
            m = int(lengths[b])
            # target s_i (col m+i) depends on b_i (col i-1) and s_{i-1} (col m+i-1, `=` for i=1)
            deps = [[i - 1, m + i - 1] for i in range(1, m + 1)] + [[]]
            meta.append({"length": m, "scratchpad": running[b, :m].tolist(), "deps": deps})
        return make_batch(
            tokens, position_ids, lengths + 1, 2 * lengths + 2, cols == 2 * n, answers, meta,
            pad_id=self.vocab.pad_id,
        )
