"""Sparse parity with a scratchpad of running parities.

b_1 .. b_n `=` s_0 s_1 .. s_k `<eos>`: s_0 = 0 opens the scratchpad, s_i = s_{i-1} xor (the i-th
marked bit), s_k is the answer. Each step depends on two tokens, the previous step and one marked
bit whose place depends on the input.

Coupled ids are *local* (Golowich et al.'s Definition 4.1): each scratchpad token carries the
id of the marked bit consumed by the *next* step (s_{i-1} has the id of the i-th marked bit), so the
token that predicts s_i reads its bit at offset 0; s_k carries the id of `=` (no bit left), which it
reads at offset 0 to end with `<eos>`. What is not local is finding "the next marked bit after this
one": that is the id the PPC position head has to predict, a content search over a gap that grows
with the length. (Giving s_i the id of the bit it consumes instead leaves the predicting token to
cross that gap itself, and coupling then does worse than none: docs/coupling.md.)
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Batch, make_batch
from .sparse_parity import SparseParityTask


class ParityScratchpadTask(SparseParityTask):
    """Same input as sparse_parity; after `=` emit s_0 = 0 and the running parities of the marked bits."""

    name: ClassVar[str] = "parity_scratchpad"
    description: ClassVar[str] = "sparse parity with a scratchpad of running xors of the marked bits"
    local_coupling: ClassVar[bool] = True

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 2

    def max_seq_len(self, length: int, k: int | None) -> int:
        if k is None:
            k = min(self.train_k, length)  # type: ignore[type-var]
        return length + k + 3

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        assert ks is not None
        bits, marked = self._draw_input(lengths, ks, rng)
        batch, n_max, k_max = len(lengths), int(lengths.max()), int(ks.max())
        # Marked positions in left-to-right order; slots past k hold n_max (a zero bit).
        order = np.sort(np.where(marked, np.arange(n_max)[None, :], n_max), axis=1)[:, :k_max]
        marked_bits = np.take_along_axis(np.pad(bits, ((0, 0), (0, 1))), order, axis=1)
        running = np.pad(np.cumsum(marked_bits, axis=1) % 2, ((0, 0), (1, 0)))  # s_0..s_kmax

        width = n_max + k_max + 3
        cols = np.arange(width)[None, :]
        n, k = lengths[:, None], ks[:, None]
        rel = cols - (n + 1)  # scratchpad index i of s_i
        in_pad = (rel >= 0) & (rel <= k)
        idx = np.clip(rel, 0, k_max)
        pad_tokens = self._bit_ids[np.take_along_axis(running, idx, axis=1)]
        # s_i (i < k) carries the id of marked bit i+1 (1-based ids); s_k the id of `=`
        next_bit_id = np.take_along_axis(order, np.clip(rel, 0, k_max - 1), axis=1) + 1
        pad_ids = np.where(rel < k, next_bit_id, n + 1)
        inputs = np.pad(self._input_tokens(bits, marked), ((0, 0), (0, width - n_max)))

        tokens = np.where(
            cols < n,
            inputs,
            np.where(cols == n, self.vocab["="], np.where(in_pad, pad_tokens, self.vocab.eos_id)),
        )
        position_ids = np.where(cols < n, cols + 1, np.where(in_pad, pad_ids, n + 1 + (cols > n)))
        answer_mask = rel == k
        answers = [str(int(running[b, ks[b]])) for b in range(batch)]
        meta = []
        for b in range(batch):
            m, kb = int(lengths[b]), int(ks[b])
            marks = order[b, :kb].tolist()
            # s_0 <- nothing; s_i <- (marked bit i, s_{i-1}); <eos> <- `=`
            deps = [[]] + [[marks[i - 1], m + i] for i in range(1, kb + 1)] + [[m]]
            meta.append({"marked": marks, "k": kb, "length": m,
                         "scratchpad": running[b, 1: kb + 1].tolist(), "deps": deps})
        return make_batch(
            tokens, position_ids, lengths + 1, lengths + ks + 3, answer_mask, answers, meta,
            pad_id=self.vocab.pad_id,
        )
