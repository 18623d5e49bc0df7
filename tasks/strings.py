"""String reversal and duplication, as in the Chomsky-hierarchy suite (Deletang et al. 2023,
google-deepmind/neural_networks_chomsky_hierarchy: `reverse_string`, `duplicate_string`).

There, length n is the input string's length, the alphabet is binary (`vocab_size=2`) and the
output (n symbols reversed, 2n symbols duplicated, no separator) comes without a prompt token. Here
the input is followed by `=`, the output and `<eos>`, as in `copy`. Coupled ids give each output
token the id of the input token it copies (duplicate: all but one, see there), so the token that
predicts it reads it at one fixed offset, whatever n (Golowich et al.'s Definition 4.1).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import MAX_SYMBOLS, Batch, Task, Vocab, make_batch, require_int


class SymbolTask(Task):
    """Shared by the tasks over a string of random symbols 0..alphabet-1 (also `sort`)."""

    uses_k: ClassVar[bool] = False
    default_train_length: ClassVar[int] = 10
    default_alphabet: ClassVar[int] = 2

    def __init__(self, *, alphabet: int | None = None, **common: Any) -> None:
        if alphabet is None:
            alphabet = self.default_alphabet
        self.alphabet = require_int("alphabet", alphabet, 1, MAX_SYMBOLS, "symbols, tasks.base.MAX_SYMBOLS")
        super().__init__(**common)
        self._symbol_ids = self.vocab.ids(self._symbols())
        # multi-character symbols would make a joined answer ambiguous
        self._sep = "" if self.alphabet <= 10 else " "

    def _symbols(self) -> list[str]:
        return [str(i) for i in range(self.alphabet)]

    def _build_vocab(self) -> Vocab:
        return Vocab([*self._symbols(), "="])

    def value_classes(self) -> list[list[str]]:
        return [self._symbols()]

    def _draw(self, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Symbols [B, n_max] (values 0..alphabet-1; past a sample's length unused)."""
        return rng.integers(0, self.alphabet, size=(len(lengths), int(lengths.max())), dtype=np.int64)

    def _join(self, symbols: np.ndarray) -> str:
        names = self._symbols()
        return self._sep.join(names[s] for s in symbols)


class ReverseTask(SymbolTask):
    """x_0 .. x_{n-1} `=` x_{n-1} .. x_0 `<eos>`.

    Ids: x_i has i + 1, `=` n + 1, output i (a copy of x_{n-1-i}) the id of the input it copies,
    n - i, and `<eos>` 0: 1..n, n+1, n..1, 0. The token that predicts output i (output i-1, id
    n - i + 1, or `=` for i = 0) finds x_{n-1-i} at offset -1 whatever n and i: *local*, with the
    one offset -1. The last output (id 1) finds no input at id 0: that is where `<eos>` goes.
    """

    name: ClassVar[str] = "reverse"
    description: ClassVar[str] = "reverse n random symbols (Chomsky suite); output i has the id of the input it copies"
    local_coupling: ClassVar[bool] = True

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 2 * length + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        symbols, n_max = self._draw(lengths, rng), int(lengths.max())
        n = lengths[:, None]
        cols = np.arange(2 * n_max + 2)[None, :]
        is_input, is_output = cols < n, (cols > n) & (cols <= 2 * n)
        # input col c holds x_c; output col c (output i = c - n - 1) holds x_{n-1-i} = x_{2n-c}
        src = np.clip(np.where(is_input, cols, 2 * n - cols), 0, n_max - 1)
        sym_tok = self._symbol_ids[np.take_along_axis(symbols, src, axis=1)]
        tokens = np.select([is_input | is_output, cols == n], [sym_tok, self.vocab["="]],
                           default=self.vocab.eos_id)
        # every symbol has the id of the input it is (or copies): src + 1; `=` n + 1; `<eos>` 0
        position_ids = np.select([is_input | is_output, cols == n], [src + 1, n + 1], default=0)
        answers, meta = [], []
        for b in range(len(lengths)):
            m = int(lengths[b])
            answers.append(self._join(symbols[b, :m][::-1]))
            # output i <- x_{n-1-i} (offset -1 from its predicting token); <eos> <- nothing
            meta.append({"length": m, "deps": [[m - 1 - i] for i in range(m)] + [[]]})
        return make_batch(tokens, position_ids, lengths + 1, 2 * lengths + 2, is_output, answers, meta,
                          pad_id=self.vocab.pad_id)


class DuplicateTask(SymbolTask):
    """x_0 .. x_{n-1} `=` x_0 .. x_{n-1} x_0 .. x_{n-1} `<eos>` (the Chomsky suite's output: the
    input twice, nothing between).

    Ids: inputs 1..n, `=` 0, the first copy 1 .. n-1 and then 0, the second copy 1..n, `<eos>` n + 1.
    Each symbol has the id of the input it copies, except the first copy's last one: it precedes a
    copy, like `=`, and takes `=`'s id 0, so that the token predicting the second copy's first symbol
    finds x_0 at +1. Had it kept x_{n-1}'s id n, that read would be at offset 1 - n, growing with n:
    the one non-local target of the plain layout. With it, every output token is read at offset +1
    from the token that predicts it: *local*, offset +1 only. `<eos>` goes where the second copy's
    last symbol (id n) finds no input at id n + 1; the first copy's last symbol is itself read at +1
    by its predecessor (id n - 1), whose next id has no input either: under PPC, where the copy ends.
    """

    name: ClassVar[str] = "duplicate"
    description: ClassVar[str] = "write n random symbols twice (Chomsky suite); copies share the inputs' ids"
    local_coupling: ClassVar[bool] = True

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 3 * length + 2

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        symbols, n_max = self._draw(lengths, rng), int(lengths.max())
        n = lengths[:, None]
        cols = np.arange(3 * n_max + 2)[None, :]
        first, second = (cols > n) & (cols <= 2 * n), (cols > 2 * n) & (cols <= 3 * n)
        is_symbol = (cols < n) | first | second
        # which x_i each symbol column holds
        src = np.clip(np.select([cols < n, first], [cols, cols - n - 1], default=cols - 2 * n - 1), 0, n_max - 1)
        tokens = np.select([is_symbol, cols == n], [self._symbol_ids[np.take_along_axis(symbols, src, axis=1)],
                                                    self.vocab["="]], default=self.vocab.eos_id)
        # the first copy's last symbol (col 2n) shares `=`'s id 0: both precede a copy
        position_ids = np.select([cols == 2 * n, is_symbol, cols == 3 * n + 1], [0, src + 1, n + 1], default=0)
        answers, meta = [], []
        for b in range(len(lengths)):
            m = int(lengths[b])
            copy = self._join(symbols[b, :m])
            answers.append(copy + self._sep + copy)
            # output i of either copy <- x_i (offset +1 from its predicting token); <eos> <- nothing
            meta.append({"length": m, "deps": 2 * [[i] for i in range(m)] + [[]]})
        return make_batch(tokens, position_ids, lengths + 1, 3 * lengths + 2, first | second, answers, meta,
                          pad_id=self.vocab.pad_id)
