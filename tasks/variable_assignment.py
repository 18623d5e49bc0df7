"""Variable assignment (pointer chasing): follow `x = y ;` statements from a queried variable.

length = number of statements m, k = chain depth d. With a scratchpad the model first repeats the
queried variable, then writes each variable of the chain and finally the digit. Coupled ids are
*local* (Golowich et al.'s Definition 4.1): every scratchpad variable carries the id of the
`x` of the statement `x = y ;` that assigns it, so the token that predicts the next step reads it at
offset +2 (the `y`); the digit carries its own statement's `y` id. Finding *which* statement assigns
a variable is a content lookup: under PPC the position head does it by predicting that id.
Without a scratchpad the answer needs d lookups in one step, which no coupling makes local.
"""

from __future__ import annotations

import string
from numbers import Real
from typing import Any, ClassVar

import numpy as np

from .base import MAX_SYMBOLS, Batch, Task, TaskParamError, Vocab, make_batch, require_int

DIGITS = [str(d) for d in range(10)]


def variable_names(num_vars: int) -> list[str]:
    """Single letters when they suffice (readable), else v0..v{num_vars-1}."""
    letters = list(string.ascii_lowercase + string.ascii_uppercase)
    if num_vars <= len(letters):
        return letters[:num_vars]
    return [f"v{i}" for i in range(num_vars)]


class VariableAssignmentTask(Task):
    """m shuffled statements, one main chain of depth d ending in a digit; query `? var`."""

    name: ClassVar[str] = "variable_assignment"
    description: ClassVar[str] = "pointer chasing: resolve '? x' through m shuffled 'x = y ;' statements"
    uses_k: ClassVar[bool] = True
    default_train_length: ClassVar[int] = 12
    default_train_k: ClassVar[int | None] = 3

    def __init__(
        self,
        *,
        scratchpad: bool = True,
        num_vars: int = 52,
        distractor_end_prob: float = 0.3,
        **common: Any,
    ) -> None:
        if not isinstance(scratchpad, bool):
            raise TaskParamError("scratchpad", f"expected true/false, got {scratchpad!r}")
        self.scratchpad = scratchpad
        self.num_vars = require_int("num_vars", num_vars, 1, MAX_SYMBOLS, "symbols, tasks.base.MAX_SYMBOLS")
        if (
            not isinstance(distractor_end_prob, Real)
            or isinstance(distractor_end_prob, bool)
            or not 0.0 <= float(distractor_end_prob) <= 1.0
        ):
            raise TaskParamError(
                "distractor_end_prob", f"expected a probability in [0, 1], got {distractor_end_prob!r}"
            )
        self.distractor_end_prob = float(distractor_end_prob)
        super().__init__(**common)
        if self.train_length > self.num_vars:
            raise TaskParamError(
                "train_length",
                f"{self.train_length} statements need distinct variables but num_vars={self.num_vars}",
            )
        self._var_ids = self.vocab.ids(variable_names(self.num_vars))
        self._digit_ids = self.vocab.ids(DIGITS)

    def _build_vocab(self) -> Vocab:
        return Vocab([*variable_names(self.num_vars), *DIGITS, "=", ";", "?"])

    def value_classes(self) -> list[list[str]]:
        return [variable_names(self.num_vars), DIGITS]

    def _check_point(self, length: int, k: int | None) -> None:
        if length > self.num_vars:
            raise TaskParamError(
                "length", f"{length} statements need distinct variables but num_vars={self.num_vars}"
            )

    @property
    def local_coupling(self) -> bool:
        return self.scratchpad

    def max_position_id(self, length: int, k: int | None) -> int:
        return 4 * length + (2 if self.scratchpad else 4)

    def max_seq_len(self, length: int, k: int | None) -> int:
        if k is None:
            k = min(self.train_k, length)  # type: ignore[type-var]
        return 4 * length + 2 + (k + 2 if self.scratchpad else 2)

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        assert ks is not None
        batch, m_max, d_max = len(lengths), int(lengths.max()), int(ks.max())
        m, d = lengths[:, None], ks[:, None]
        j = np.arange(m_max)[None, :]  # chain-order statement index

        # Distinct variables per sample, in chain order: var[j] is assigned by statement j.
        var = np.argsort(rng.random((batch, self.num_vars)), axis=1)[:, :m_max]
        digits = rng.integers(0, 10, size=(batch, m_max), dtype=np.int64)
        is_end = (j == d - 1) | (j == m - 1) | ((j >= d) & (rng.random((batch, m_max)) < self.distractor_end_prob))
        next_var = np.pad(var[:, 1:], ((0, 0), (0, 1)))
        lhs_tok = self._var_ids[var]
        rhs_tok = np.where(is_end, self._digit_ids[digits], self._var_ids[next_var])

        # Shuffle statements: perm[b, i] = chain index at slot i; slot_of is its inverse.
        perm = np.argsort(np.where(j < m, rng.random((batch, m_max)), np.inf), axis=1)
        slot_of = np.argsort(perm, axis=1)
        block = np.stack(
            [
                np.take_along_axis(lhs_tok, perm, axis=1),
                np.full((batch, m_max), self.vocab["="]),
                np.take_along_axis(rhs_tok, perm, axis=1),
                np.full((batch, m_max), self.vocab[";"]),
            ],
            axis=2,
        ).reshape(batch, 4 * m_max)

        # Targets: the query again, then the right-hand sides of chain statements 0..d-1 (scratchpad),
        # or just the last. Scratchpad variable x_j has the id of the `x` of the statement assigning
        # it (4 * slot + 1); the digit the id of its `y` (4 * slot + 3).
        if self.scratchpad:
            n_targets = ks + 1
            target_tok = np.concatenate([lhs_tok[:, :1], rhs_tok[:, :d_max]], axis=1)
            digit_ids = 4 * np.take_along_axis(slot_of, d - 1, axis=1) + 3
            target_ids = np.concatenate([4 * slot_of[:, :d_max] + 1, digit_ids], axis=1)
            target_ids = np.where(np.arange(d_max + 1)[None, :] == d, digit_ids, target_ids)
        else:
            n_targets = np.ones(batch, dtype=np.int64)
            target_tok = np.take_along_axis(rhs_tok, d - 1, axis=1)
            target_ids = 4 * m + 3

        prompt_len = 4 * lengths + 2
        seq_len = prompt_len + n_targets + 1
        width = int(seq_len.max())
        cols = np.arange(width)[None, :]
        start = prompt_len[:, None]
        rel = cols - start
        in_targets = (rel >= 0) & (rel < n_targets[:, None])
        idx = np.clip(rel, 0, target_tok.shape[1] - 1)
        block = np.pad(block, ((0, 0), (0, width - 4 * m_max)))

        tokens = np.select(
            [cols < 4 * m, cols == 4 * m, cols == 4 * m + 1, in_targets],
            [block, self.vocab["?"], lhs_tok[:, :1], np.take_along_axis(target_tok, idx, axis=1)],
            default=self.vocab.eos_id,
        )
        if self.scratchpad:  # <eos> follows the digit: the id of the statement's `;`
            out_ids = np.where(in_targets, np.take_along_axis(target_ids, idx, axis=1), digit_ids + 1)
        else:
            out_ids = np.where(in_targets, target_ids, 4 * m + 4)
        position_ids = np.where(cols < start, cols + 1, out_ids)
        answer_mask = rel == n_targets[:, None] - 1

        names = self.vocab.tokens
        answers, meta = [], []
        for b in range(batch):
            digit = str(int(digits[b, ks[b] - 1]))
            answers.append(digit)
            chain = [names[t] for t in lhs_tok[b, : ks[b]]] + [digit]
            p = int(prompt_len[b])
            rhs_col = [4 * int(slot_of[b, j]) + 2 for j in range(ks[b])]  # where each step is read
            if self.scratchpad:  # echo <- query; x_{j+1} (or the digit) <- y of x_j; <eos> <- digit
                deps = [[p - 1]] + [[c] for c in rhs_col] + [[p + int(ks[b])]]
            else:  # the digit needs every statement of the chain
                deps = [rhs_col, [p]]
            meta.append({"chain": chain, "depth": int(ks[b]), "statements": int(lengths[b]), "deps": deps})
        return make_batch(
            tokens, position_ids, prompt_len, seq_len, answer_mask, answers, meta,
            pad_id=self.vocab.pad_id,
        )
