"""Sparse parity with a scratchpad of running parities.

Each scratchpad step s_i = s_{i-1} xor (i-th marked bit) depends on one input token and the
previous step; the coupled id of s_i is the id of the bit it consumes, making that sparse
dependency visible to the position encoding.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Batch, make_batch
from .sparse_parity import SparseParityTask


class ParityScratchpadTask(SparseParityTask):
    """Same input as sparse_parity; after `=` emit the running parities of the marked bits."""

    name: ClassVar[str] = "parity_scratchpad"
    description: ClassVar[str] = "sparse parity with a scratchpad of running xors of the marked bits"

    def max_seq_len(self, length: int, k: int | None) -> int:
        if k is None:
            k = min(self.train_k, length)  # type: ignore[type-var]
        return length + k + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        assert ks is not None
        bits, marked = self._draw_input(lengths, ks, rng)
        batch, n_max, k_max = len(lengths), int(lengths.max()), int(ks.max())
        # Marked positions in left-to-right order; slots past k hold n_max (a zero bit).
        order = np.sort(np.where(marked, np.arange(n_max)[None, :], n_max), axis=1)[:, :k_max]
        marked_bits = np.take_along_axis(np.pad(bits, ((0, 0), (0, 1))), order, axis=1)
        running = np.cumsum(marked_bits, axis=1) % 2  # [B, k_max]

        width = n_max + k_max + 2
        cols = np.arange(width)[None, :]
        n, k = lengths[:, None], ks[:, None]
        rel = cols - (n + 1)  # index into the scratchpad
        in_pad = (rel >= 0) & (rel < k)
        idx = np.clip(rel, 0, k_max - 1)
        pad_tokens = self._bit_ids[np.take_along_axis(running, idx, axis=1)]
        pad_ids = np.take_along_axis(order, idx, axis=1) + 1
        inputs = np.pad(self._input_tokens(bits, marked), ((0, 0), (0, width - n_max)))

        tokens = np.where(
            cols < n,
            inputs,
            np.where(cols == n, self.vocab["="], np.where(in_pad, pad_tokens, self.vocab.eos_id)),
        )
        position_ids = np.where(cols < n, cols + 1, np.where(in_pad, pad_ids, n + 1))
        answer_mask = rel == k - 1
        answers = [str(int(running[b, ks[b] - 1])) for b in range(batch)]
        meta = [
            {
                "marked": order[b, : ks[b]].tolist(),
                "k": int(ks[b]),
                "length": int(lengths[b]),
                "scratchpad": running[b, : ks[b]].tolist(),
            }
            for b in range(batch)
        ]
        return make_batch(
            tokens, position_ids, lengths + 1, lengths + ks + 2, answer_mask, answers, meta,
            pad_id=self.vocab.pad_id,
        )
