"""N x M multiplication with position coupling (Cho et al. 2024; HanseulJo/position-coupling,
`NxMMultiplicationDatasetWithCoupledPositions`, run as N x 2 in scripts/Nx2multiplication).

length = N, the first operand's digits; k = M, the second operand's (1 <= M <= N), fixed at
`train_k` (2: the reference's N x 2) unless `min_k` asks for a range:

    a_{N-1} .. a_0 `*` b_{M-1} .. b_0 `=` c_0 .. c_{N+M-1} `<eos>`

Digits of equal significance share one id (significance j -> j + 1; `*`, `=`: 0; `<eos>`: N + M + 1).
The coupling is local in a and in the product, not in b, whose digits keep ids 1 .. M and are found
by content. The layout, the carry that fixes which digits each product digit depends on
(meta["deps"]) and the locality argument: docs/tasks.md, "Multiplication".

`index_hints: true`: a hint before every digit, one symbol a place, as addition writes them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Batch, Task, Vocab, make_batch
from .operands import (
    check_hint_places,
    check_index_hints,
    check_operand_order,
    hint_names,
    operands_lsb_first,
    with_index_hints,
)

DIGITS = [str(d) for d in range(10)]


def carry_window(m: int) -> int:
    """The number w of earlier product digits that fix the carry into a place of an N x m product:
    the smallest w with 10^w >= 9m (the carry is at most 9m - 1)."""
    w = 1
    while 10**w < 9 * m:
        w += 1
    return w


def product_deps(n: int, m: int) -> list[list[int]]:
    """meta["deps"] of an n x m sample: per product digit c_j, the columns of the a_i, b_i' with
    j - w <= i + i' <= j and of c_{j-w} .. c_{j-1}; then `<eos>`'s (none)."""
    w = carry_window(m)
    deps = []
    for j in range(n + m):
        pairs = [(i, s) for s in range(m) for i in range(max(0, j - w - s), min(n - 1, j - s) + 1)]
        a_places, b_places = sorted({i for i, _ in pairs}), sorted({s for _, s in pairs})
        deps.append([n - 1 - i for i in a_places] + [n + m - s for s in b_places]
                    + [n + m + 2 + p for p in range(max(0, j - w), j)])
    return deps + [[]]


def _msb_first(digits: np.ndarray) -> str:
    """Digits stored by significance (index j = 10^j) as a decimal string, most significant first."""
    return "".join(str(int(d)) for d in digits[::-1])


class MultiplicationTask(Task):
    """a (N digits) `*` b (M digits) `=` the product reversed (N + M digits) `<eos>`."""

    name: ClassVar[str] = "multiplication"
    description: ClassVar[str] = ("N x M multiplication (k = M, default N x 2), product reversed, "
                                  "digits of equal significance share ids (Cho et al. 2024)")
    uses_k: ClassVar[bool] = True
    local_coupling: ClassVar[bool] = False
    default_train_length: ClassVar[int] = 5
    default_train_k: ClassVar[int | None] = 2

    def __init__(self, *, min_k: Any = None, operand_order: str = "msb_first", index_hints: bool = False,
                 hint_symbols: int | None = None, **common: Any) -> None:
        # M is fixed unless asked otherwise: the reference trains N x 2 only, never N x 1
        if min_k is None:
            min_k = common.get("train_k") if common.get("train_k") is not None else self.default_train_k
        # index hints as addition writes them (tasks/operands.py, with_index_hints): the product's places
        self.hint_symbols = check_index_hints(index_hints, hint_symbols)
        super().__init__(min_k=min_k, **common)
        check_hint_places(self.hint_symbols, self.train_length + self.train_k, f"train_length {self.train_length}")
        self._digit_ids = self.vocab.ids(DIGITS)
        self._hint_ids = self.vocab.ids(hint_names(self.hint_symbols or 0))
        self.operand_order = check_operand_order(operand_order)  # lsb_first: as Abacus writes numbers

    def _build_vocab(self) -> Vocab:
        return Vocab([*DIGITS, "*", "=", *hint_names(self.hint_symbols or 0)])

    @property
    def index_hints(self) -> bool:
        return self.hint_symbols is not None

    def _check_point(self, length: int, k: int | None) -> None:
        check_hint_places(self.hint_symbols, length + self._m(length, k), f"length {length}")  # N + M places

    def value_classes(self) -> list[list[str]]:
        return [DIGITS]

    def _m(self, length: int, k: int | None) -> int:
        return min(self.train_k, length) if k is None else k  # type: ignore[type-var]

    def max_position_id(self, length: int, k: int | None) -> int:
        return length + self._m(length, k) + 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        digits = 2 * (length + self._m(length, k))
        return digits + 3 + (digits if self.index_hints else 0)  # a hint per digit

    def digit_places(self, batch: Batch) -> np.ndarray:
        """a_j, b_j and c_j are the (j+1)-th least significant digits of their numbers (b and the
        product with their zero padding): their coupled id, less the `<bos>` shift."""
        valid = np.arange(batch.tokens.shape[1])[None, :] < batch.seq_len[:, None]
        digit = np.isin(batch.tokens, self._digit_ids) & valid
        return np.where(digit, batch.position_ids - self.fixed_prefix, 0).astype(np.int64)

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        assert ks is not None  # uses_k: the base class always draws or fixes M
        batch, n, m = len(lengths), lengths[:, None], ks[:, None]
        width = int((lengths + ks).max())  # product digits; also holds every operand digit
        sig = np.arange(width)[None, :]
        a = rng.integers(0, 10, size=(batch, width), dtype=np.int64) * (sig < n)
        b = rng.integers(0, 10, size=(batch, width), dtype=np.int64) * (sig < m)
        partial = np.zeros_like(a)  # P_j = sum_i a_{j-i} b_i
        for i in range(int(ks.max())):
            partial[:, i:] += a[:, : width - i] * b[:, i : i + 1]
        c = np.zeros_like(a)
        carry = np.zeros(batch, dtype=np.int64)
        for j in range(width):  # the product has n + m digits, so nothing carries out of the last
            total = partial[:, j] + carry
            c[:, j], carry = total % 10, total // 10

        cols = np.arange(2 * width + 3)[None, :]
        nm = n + m
        in_a, in_b = cols < n, (cols > n) & (cols <= nm)
        in_c = (cols >= nm + 2) & (cols <= 2 * nm + 1)
        # significance read at each column (clipped where unused); operands most significant first
        sig_a = np.clip(n - 1 - cols, 0, width - 1)
        sig_b = np.clip(nm - cols, 0, width - 1)
        sig_c = np.clip(cols - nm - 2, 0, width - 1)

        def take(digits: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return self._digit_ids[np.take_along_axis(digits, idx, axis=1)]

        tokens = np.select(
            [in_a, cols == n, in_b, cols == nm + 1, in_c],
            [take(a, sig_a), self.vocab["*"], take(b, sig_b), self.vocab["="], take(c, sig_c)],
            default=self.vocab.eos_id,
        )
        position_ids = np.select(
            [in_a, in_b, in_c, (cols == n) | (cols == nm + 1)],
            [sig_a + 1, sig_b + 1, sig_c + 1, 0],
            default=nm + 1,
        )
        answers, meta = [], []
        for s in range(batch):
            ns, ms = int(lengths[s]), int(ks[s])
            answers.append(_msb_first(c[s, : ns + ms]))
            meta.append({"a": _msb_first(a[s, :ns]), "b": _msb_first(b[s, :ms]), "length": ns, "k": ms,
                         "deps": product_deps(ns, ms)})
        batch = make_batch(tokens, position_ids, lengths + ks + 2, 2 * (lengths + ks) + 3, in_c, answers, meta,
                           pad_id=self.vocab.pad_id)
        if self.operand_order == "lsb_first":
            batch = operands_lsb_first(batch, self._digit_ids)
        # last, and only then drawn from rng: without hints the stream is unchanged
        return with_index_hints(batch, self._digit_ids, self._hint_ids, rng) if self.index_hints else batch
