"""n-digit addition with position coupling (Cho et al. 2024).

The sum is written least significant digit first so each output digit depends only on the
operand digits of the same significance (plus a carry); giving a_j, b_j and c_j the same
coupled id j+1 exposes exactly that alignment, independent of n.

`index_hints: true` writes a hint symbol before every digit, the same for the digits of one place in
both operands and the sum, consecutive symbols for consecutive places (Zhou et al. 2023; 2024):
with `operand_order: lsb_first`, Zhou et al. 2024's reversed format with index hints,
`a6b7c5+a1b6c3=a7b3c9d0` for 576 + 361 (the sum's carry place too). Each hint takes its digit's id;
the run of symbols starts anywhere among `hint_symbols` (102 by default, as theirs) in each sample.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import BOS, Batch, Task, TaskParamError, Vocab, make_batch, require_int, with_bos
from .operands import (
    check_hint_places,
    check_index_hints,
    check_operand_order,
    drop_tokens,
    hint_names,
    operands_lsb_first,
    with_index_hints,
)

DIGITS = [str(d) for d in range(10)]
OPERAND_DRAWS = ("equal", "independent", "unpadded")


def _msb_first(digits: np.ndarray) -> str:
    """Digits stored by significance (index j = 10^j) as a normal decimal string."""
    return (digits[::-1] + ord("0")).astype(np.uint8).tobytes().decode("ascii")


class AdditionTask(Task):
    """a_{n-1}..a_0 `+` b_{n-1}..b_0 `=` c_0..c_n `<eos>` (sum reversed, n+1 digits)."""

    name: ClassVar[str] = "addition"
    description: ClassVar[str] = "n-digit addition, sum reversed, digits of equal significance share ids"
    uses_k: ClassVar[bool] = False
    local_coupling: ClassVar[bool] = True
    default_train_length: ClassVar[int] = 5

    def __init__(self, *, operands: str = "equal", operand_order: str = "msb_first", leading_zeros: bool = True,
                 index_hints: bool = False, hint_symbols: int | None = None, **common: Any) -> None:
        # an index hint before every digit, shared by the digits of a place (Zhou et al. 2023; 2024):
        # None, or how many hint symbols the vocabulary holds (tasks/operands.py, with_index_hints)
        self.hint_symbols = check_index_hints(index_hints, hint_symbols)
        super().__init__(**common)
        check_hint_places(self.hint_symbols, self.train_length + 1, f"train_length {self.train_length}")
        if not isinstance(leading_zeros, bool):
            raise TaskParamError("leading_zeros", f"expected true or false, got {leading_zeros!r}")
        # false: an operand of two or more digits never starts with 0, as the reference implementation
        # of position coupling draws them (a sum whose operands both start with 0 looks one digit shorter)
        self.leading_zeros = leading_zeros
        # msb_first as Cho et al. write them; lsb_first as Abacus and FIRE's addition results were measured
        self.operand_order = check_operand_order(operand_order)
        if operands not in OPERAND_DRAWS:
            raise TaskParamError("operands", f"expected one of {list(OPERAND_DRAWS)}, got {operands!r}")
        # training draws: both operands with the sample's length (equal), or each operand's length
        # drawn on its own from [min_length, train_length] and the shorter one zero-padded at the
        # top to the longer one (independent, as the reference implementation of position coupling
        # does) or written as it is (unpadded, as the Abacus reference draws every pair of lengths).
        # Test cells always have two operands of the cell's length.
        self.operands = operands
        self._digit_ids = self.vocab.ids(DIGITS)
        self._hint_ids = self.vocab.ids(hint_names(self.hint_symbols or 0))

    @property
    def index_hints(self) -> bool:
        return self.hint_symbols is not None

    def _check_point(self, length: int, k: int | None) -> None:
        check_hint_places(self.hint_symbols, length + 1, f"length {length}")  # the sum's n + 1 places

    def sample(self, batch_size: int, rng: np.random.Generator, length: int | None = None,
               k: int | None = None) -> Batch:
        if self.operands == "equal" or length is not None:
            return super().sample(batch_size, rng, length, k)
        batch_size = require_int("batch_size", batch_size, 1)
        digits = rng.integers(self.min_length, self.train_length + 1, size=(2, batch_size), dtype=np.int64)
        batch = self._generate(digits.max(axis=0), None, rng, digits)
        return with_bos(batch, self.vocab[BOS]) if self.bos else batch

    def _build_vocab(self) -> Vocab:
        return Vocab([*DIGITS, "+", "=", *hint_names(self.hint_symbols or 0)])

    def value_classes(self) -> list[list[str]]:
        return [DIGITS]

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + 2

    def digit_places(self, batch: Batch) -> np.ndarray:
        """a_j, b_j and c_j are the (j+1)-th least significant digits: their coupled id less the
        `<bos>` shift (independent operands' zero padding included: a digit of its number)."""
        digit = np.isin(batch.tokens, self._digit_ids) & (np.arange(batch.tokens.shape[1]) < batch.seq_len[:, None])
        return np.where(digit, batch.position_ids - self.fixed_prefix, 0).astype(np.int64)

    def max_seq_len(self, length: int, k: int | None) -> int:
        return 3 * length + 4 + (3 * length + 1 if self.index_hints else 0)  # a hint per digit

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator,
                  digits: np.ndarray | None = None) -> Batch:
        """digits [2, B]: each operand's own digit count (<= its sample's length; default: the length)."""
        batch, n_max = len(lengths), int(lengths.max())
        n = lengths[:, None]
        na, nb = (n, n) if digits is None else (digits[0][:, None], digits[1][:, None])
        sig = np.arange(n_max + 1)[None, :]  # digit significance j; column n_max is the carry-out
        a = rng.integers(0, 10, size=(batch, n_max + 1), dtype=np.int64) * (sig < na)
        b = rng.integers(0, 10, size=(batch, n_max + 1), dtype=np.int64) * (sig < nb)
        if not self.leading_zeros:  # more draws only then: the default stream is unchanged
            for digits_of, own in ((a, na), (b, nb)):
                top = (sig == own - 1) & (own >= 2)
                digits_of[top] = rng.integers(1, 10, size=int(top.sum()), dtype=np.int64)
        c = np.zeros_like(a)
        carry = np.zeros(batch, dtype=np.int64)
        for j in range(n_max + 1):  # zero digits past n make c_n the carry-out
            total = a[:, j] + b[:, j] + carry
            c[:, j] = total % 10
            carry = total // 10

        width = 3 * n_max + 4
        cols = np.arange(width)[None, :]
        # Significance read at each column (clipped where unused); MSB-first for operands.
        sig_a = np.clip(n - 1 - cols, 0, n_max)
        sig_b = np.clip(2 * n - cols, 0, n_max)
        sig_c = np.clip(cols - 2 * n - 2, 0, n_max)
        in_a = cols < n
        in_b = (cols > n) & (cols <= 2 * n)
        in_c = (cols >= 2 * n + 2) & (cols <= 3 * n + 2)

        def take(digits: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return self._digit_ids[np.take_along_axis(digits, idx, axis=1)]

        tokens = np.select(
            [in_a, cols == n, in_b, cols == 2 * n + 1, in_c],
            [take(a, sig_a), self.vocab["+"], take(b, sig_b), self.vocab["="], take(c, sig_c)],
            default=self.vocab.eos_id,
        )
        position_ids = np.select(
            [in_a, in_b, in_c, (cols == n) | (cols == 2 * n + 1)],
            [sig_a + 1, sig_b + 1, sig_c + 1, 0],
            default=n + 2,
        )

        answers, meta = [], []
        for i in range(batch):
            length = int(lengths[i])
            answers.append(_msb_first(c[i, : length + 1]))
            # c_j <- a_j, b_j (offset +1 from the predicting token), a_{j-1}, b_{j-1}, c_{j-1} (offset 0)
            col_a = lambda j: length - 1 - j  # noqa: E731  (MSB first)
            col_b = lambda j: 2 * length - j  # noqa: E731
            deps = []
            for j in range(length + 1):
                now = [col_a(j), col_b(j)] if j < length else []
                carry = [col_a(j - 1), col_b(j - 1), 2 * length + 1 + j] if j > 0 else []
                deps.append(now + carry)
            deps.append([])  # <eos>
            own = (length, length) if digits is None or self.operands != "unpadded" else (na[i, 0], nb[i, 0])
            meta.append({"a": _msb_first(a[i, :own[0]]), "b": _msb_first(b[i, :own[1]]), "length": length,
                         "deps": deps})
        batch = make_batch(
            tokens, position_ids, 2 * lengths + 2, 3 * lengths + 4, in_c, answers, meta,
            pad_id=self.vocab.pad_id,
        )
        if self.operands == "unpadded" and digits is not None:  # the padding zeros leave the prompt
            batch = drop_tokens(batch, (in_a & (sig_a >= na)) | (in_b & (sig_b >= nb)))
        if self.operand_order == "lsb_first":
            batch = operands_lsb_first(batch, self._digit_ids)
        # last, and only then drawn from rng: without hints the stream is unchanged
        return with_index_hints(batch, self._digit_ids, self._hint_ids, rng) if self.index_hints else batch
