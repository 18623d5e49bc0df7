"""How the operands of the arithmetic tasks (addition, multiplication) are written: most significant
digit first, as Cho et al. write them, or least significant first, as Abacus (McLeish et al. 2024)
and Zhou et al. 2024's FIRE addition were measured (`operand_order`), and without the zeros that pad
the shorter operand (addition's `operands: unpadded`, as the Abacus reference draws them)."""

from __future__ import annotations

import numpy as np

from .base import Batch, TaskParamError

OPERAND_ORDERS = ("msb_first", "lsb_first")


def check_operand_order(value: object) -> str:
    """A task's `operand_order` param, checked: how the operands of the prompt are written."""
    if value not in OPERAND_ORDERS:
        raise TaskParamError("operand_order", f"expected one of {list(OPERAND_ORDERS)}, got {value!r}")
    return str(value)


def operands_lsb_first(batch: Batch, digit_ids: np.ndarray) -> Batch:
    """The batch with each operand (a run of digits in the prompt) written least significant digit
    first, as Abacus (McLeish et al. 2024) and Zhou et al. 2024 write addition: every digit keeps its
    token, its id and what depends on it, only its column moves (and `meta["deps"]` with it)."""
    cols = np.broadcast_to(np.arange(batch.tokens.shape[1]), batch.tokens.shape)
    digit = np.isin(batch.tokens, digit_ids) & (cols < batch.prompt_len[:, None])
    before = np.pad(digit, ((0, 0), (1, 0)))[:, :-1]
    after = np.pad(digit, ((0, 0), (0, 1)))[:, 1:]
    start = np.maximum.accumulate(np.where(digit & ~before, cols, 0), axis=1)  # of the run a column is in
    end = np.minimum.accumulate(np.where(digit & ~after, cols, cols.shape[1])[:, ::-1], axis=1)[:, ::-1]
    # the old column of each new one; a reversal is its own inverse, so also the new column of each old one
    order = np.where(digit, start + end - cols, cols)
    rows = np.arange(len(batch))[:, None]
    meta = [dict(m, deps=[[int(order[b, p]) for p in d] for d in m["deps"]]) if "deps" in m else m
            for b, m in enumerate(batch.meta)]
    return Batch(tokens=batch.tokens[rows, order], position_ids=batch.position_ids[rows, order],
                 loss_mask=batch.loss_mask, answer_mask=batch.answer_mask, prompt_len=batch.prompt_len,
                 seq_len=batch.seq_len, answers=batch.answers, meta=meta)


def drop_tokens(batch: Batch, drop: np.ndarray) -> Batch:
    """The batch without the tokens `drop` marks (bool [B, T]; prompt tokens only): the others move
    left in order, with their ids, masks and `meta["deps"]`, and the padding follows them."""
    B, T = batch.tokens.shape
    cols = np.arange(T)[None, :]
    keep = ~drop & (cols < batch.seq_len[:, None])
    order = np.argsort(~keep, axis=1, kind="stable")  # kept columns first, in their order
    new_col = np.cumsum(keep, axis=1) - 1  # where each kept column lands
    seq_len = keep.sum(1)
    prompt_len = (keep & (cols < batch.prompt_len[:, None])).sum(1)
    valid = cols < seq_len[:, None]

    def move(a: np.ndarray, fill) -> np.ndarray:
        return np.where(valid, np.take_along_axis(a, order, axis=1), fill)

    meta = [dict(m, deps=[[int(new_col[b, p]) for p in d if keep[b, p]] for d in m["deps"]]) if "deps" in m else m
            for b, m in enumerate(batch.meta)]  # a dropped token is nothing to depend on
    width = int(seq_len.max())
    return Batch(tokens=move(batch.tokens, 0)[:, :width], position_ids=move(batch.position_ids, 0)[:, :width],
                 loss_mask=move(batch.loss_mask, False)[:, :width], answer_mask=move(batch.answer_mask, False)[:, :width],
                 prompt_len=prompt_len, seq_len=seq_len, answers=batch.answers, meta=meta)
