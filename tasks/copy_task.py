"""Copy: repeat n random symbols after `=`.

Output i shares the coupled id of input i, so each output token depends on exactly one
id-matched input token. (Module named copy_task to avoid shadowing the stdlib `copy`.)
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Batch, make_batch
from .strings import SymbolTask


class CopyTask(SymbolTask):
    """n symbols, `=`, the same n symbols, `<eos>`."""

    name: ClassVar[str] = "copy"
    description: ClassVar[str] = "copy n random symbols after '='"
    local_coupling: ClassVar[bool] = True
    default_alphabet: ClassVar[int] = 10

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 2 * length + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        batch, n_max = len(lengths), int(lengths.max())
        symbols = self._draw(lengths, rng)
        width = 2 * n_max + 2
        cols = np.arange(width)[None, :]
        n = lengths[:, None]
        # Input at col c reads symbol c; output at col c reads symbol c - n - 1.
        src = np.where(cols < n, cols, cols - n - 1)
        is_input = cols < n
        is_output = (cols > n) & (cols <= 2 * n)
        sym_tok = self._symbol_ids[np.take_along_axis(symbols, np.clip(src, 0, n_max - 1), axis=1)]
        tokens = np.select(
            [is_input | is_output, cols == n], [sym_tok, self.vocab["="]], default=self.vocab.eos_id
        )
        position_ids = np.select([is_input | is_output, cols == n], [src + 1, 0], default=n + 1)
        answers = [self._join(symbols[b, : lengths[b]]) for b in range(batch)]
        # output i <- input i (read at offset +1 from the token that predicts it); <eos> <- nothing
        meta = [{"length": int(lengths[b]), "deps": [[i] for i in range(int(lengths[b]))] + [[]]}
                for b in range(batch)]
        return make_batch(
            tokens, position_ids, lengths + 1, 2 * lengths + 2, is_output, answers, meta,
            pad_id=self.vocab.pad_id,
        )
