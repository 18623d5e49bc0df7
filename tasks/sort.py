"""Sorting symbols from a fixed alphabet: the Chomsky-hierarchy suite's `bucket_sort` (Deletang et
al. 2023), whose inputs are n symbols drawn uniformly from 0..vocab_size-1 (5 in the paper) and whose
output is the same n symbols in increasing order.

No coupling is local here (Golowich et al.'s Definition 4.1): output i is the i-th smallest
input, which depends on every input symbol (how many of each there are), so whatever ids the inputs
get, the token that predicts it must read n tokens, a set that grows with the length. The ids are
therefore plain sequential ones, and the task declares its coupling not local.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Batch, make_batch
from .strings import SymbolTask


class SortTask(SymbolTask):
    """x_0 .. x_{n-1} `=` sorted(x) `<eos>`; ids 1 .. 2n + 2 in order (`=` n + 1, output i n + 2 + i).

    Every output token depends on all n inputs (meta["deps"]); `<eos>` on none (it comes after n
    outputs, which the length alone decides).
    """

    name: ClassVar[str] = "sort"
    description: ClassVar[str] = "sort n symbols of a fixed alphabet (Chomsky suite's bucket sort); sequential ids"
    local_coupling: ClassVar[bool] = False
    default_alphabet: ClassVar[int] = 5

    def max_position_id(self, length: int, k: int | None) -> int:
        return 2 * length + 2

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 2 * length + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        symbols, n_max = self._draw(lengths, rng), int(lengths.max())
        n = lengths[:, None]
        # columns past a sample's length sort last (alphabet is larger than every symbol)
        ranked = np.sort(np.where(np.arange(n_max)[None, :] < n, symbols, self.alphabet), axis=1)
        cols = np.arange(2 * n_max + 2)[None, :]
        is_input, is_output = cols < n, (cols > n) & (cols <= 2 * n)
        src = np.clip(np.where(is_input, cols, cols - n - 1), 0, n_max - 1)
        tokens = np.select(
            [is_input, cols == n, is_output],
            [self._symbol_ids[np.take_along_axis(symbols, src, axis=1)], self.vocab["="],
             self._symbol_ids[np.clip(np.take_along_axis(ranked, src, axis=1), 0, self.alphabet - 1)]],
            default=self.vocab.eos_id,
        )
        position_ids = cols + 1
        answers, meta = [], []
        for b in range(len(lengths)):
            m = int(lengths[b])
            answers.append(self._join(ranked[b, :m]))
            meta.append({"length": m, "deps": [list(range(m)) for _ in range(m)] + [[]]})
        return make_batch(tokens, position_ids, lengths + 1, 2 * lengths + 2, is_output, answers, meta,
                          pad_id=self.vocab.pad_id)
