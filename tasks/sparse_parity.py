"""k-sparse planted parity: the answer is the xor of k marked bits among n.

The marked bits are visible in the input (tokens A/B instead of 0/1), so the answer depends
on exactly k input tokens however long the input is -- the sparse dependency the paper
argues makes length generalization possible.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Batch, Task, TaskParamError, Vocab, make_batch, require_int


def random_marks(
    rng: np.random.Generator, lengths: np.ndarray, ks: np.ndarray, locality: int | None
) -> np.ndarray:
    """Bool [B, max(lengths)]: exactly ks[b] distinct marked positions inside the first lengths[b].

    With `locality` w, all marks lie in one window of width min(w, n) placed uniformly.
    Vectorised: random keys, +inf outside the allowed range, then rank < k.
    """
    batch, width = len(lengths), int(lengths.max())
    cols = np.arange(width)[None, :]
    if locality is None:
        lo = np.zeros(batch, dtype=np.int64)
        hi = lengths
    else:
        window = np.minimum(locality, lengths)
        lo = rng.integers(0, lengths - window + 1, dtype=np.int64)
        hi = lo + window
    allowed = (cols >= lo[:, None]) & (cols < hi[:, None])
    keys = np.where(allowed, rng.random((batch, width)), np.inf)
    rank = np.argsort(np.argsort(keys, axis=1), axis=1)
    return rank < ks[:, None]


class SparseParityTask(Task):
    """Input bits with k marked; after `=` predict the parity of the marked bits."""

    name: ClassVar[str] = "sparse_parity"
    description: ClassVar[str] = "xor of k marked bits (A=0, B=1) among n; answer after '='"
    uses_k: ClassVar[bool] = True
    default_train_length: ClassVar[int] = 20
    default_train_k: ClassVar[int | None] = 3
    answer_chance: ClassVar[float] = 0.5  # the answer is one even bit: a guess (the figures' chance line)

    def __init__(self, *, locality: int | None = None, **common: Any) -> None:
        super().__init__(**common)
        if locality is not None:
            locality = require_int("locality", locality, 1)
            if locality < self.train_k:  # type: ignore[operator]
                raise TaskParamError(
                    "locality", f"window {locality} cannot hold train_k={self.train_k} marked bits"
                )
        self.locality: int | None = locality
        # Lookup tables: index with (marked * 2 + bit) / with a bit.
        self._input_ids = self.vocab.ids(["0", "1", "A", "B"])
        self._bit_ids = self.vocab.ids(["0", "1"])

    def _build_vocab(self) -> Vocab:
        return Vocab(["0", "1", "A", "B", "="])

    def value_classes(self) -> list[list[str]]:
        return [["0", "1"], ["A", "B"]]  # a bit's value, not whether it is marked

    def _check_point(self, length: int, k: int | None) -> None:
        if k is not None and self.locality is not None and k > self.locality:
            raise TaskParamError("locality", f"window {self.locality} cannot hold k={k} marked bits")

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        return length + 2

    def _draw_input(
        self, lengths: np.ndarray, ks: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """Uniform bits [B, N] and marks [B, N] (zero/False past each sample's length)."""
        width = int(lengths.max())
        valid = np.arange(width)[None, :] < lengths[:, None]
        bits = rng.integers(0, 2, size=(len(lengths), width), dtype=np.int64) * valid
        marked = random_marks(rng, lengths, ks, self.locality)
        return bits, marked

    def _input_tokens(self, bits: np.ndarray, marked: np.ndarray) -> np.ndarray:
        return self._input_ids[marked * 2 + bits]

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        assert ks is not None
        bits, marked = self._draw_input(lengths, ks, rng)
        parity = (bits * marked).sum(axis=1) % 2
        batch, n = len(lengths), lengths[:, None]
        width = int(lengths.max()) + 2
        cols = np.arange(width)[None, :]
        inputs = np.pad(self._input_tokens(bits, marked), ((0, 0), (0, 2)))
        tokens = np.where(
            cols < n,
            inputs,
            np.where(cols == n, self.vocab["="], self._bit_ids[parity][:, None]),
        )
        position_ids = np.where(cols < n, cols + 1, n + 1)
        answer_mask = cols == n + 1
        answers = [str(int(p)) for p in parity]
        meta = [
            {"marked": np.flatnonzero(marked[b]).tolist(), "k": int(ks[b]), "length": int(lengths[b]),
             "deps": [np.flatnonzero(marked[b]).tolist()]}  # the answer <- every marked bit
            for b in range(batch)
        ]
        return make_batch(
            tokens, position_ids, lengths + 1, lengths + 2, answer_mask, answers, meta,
            pad_id=self.vocab.pad_id,
        )
