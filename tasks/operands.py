"""How the operands of the arithmetic tasks (addition, multiplication) are written: most significant
digit first, as Cho et al. write them, or least significant first, as Abacus (McLeish et al. 2024)
and Zhou et al. 2024's FIRE addition were measured (`operand_order`)."""

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
    tokens, ids = batch.tokens.copy(), batch.position_ids.copy()
    meta = []
    for b in range(len(batch)):
        order = np.arange(tokens.shape[1])  # the old column of each new one
        digit = np.isin(batch.tokens[b, : batch.prompt_len[b]], digit_ids)
        start = None
        for col in range(len(digit) + 1):
            if col < len(digit) and digit[col]:
                start = col if start is None else start
            elif start is not None:
                order[start:col] = order[start:col][::-1]
                start = None
        tokens[b], ids[b] = batch.tokens[b, order], batch.position_ids[b, order]
        new_col = np.argsort(order)
        m = batch.meta[b]
        meta.append(dict(m, deps=[[int(new_col[p]) for p in d] for d in m["deps"]]) if "deps" in m else m)
    return Batch(tokens=tokens, position_ids=ids, loss_mask=batch.loss_mask, answer_mask=batch.answer_mask,
                 prompt_len=batch.prompt_len, seq_len=batch.seq_len, answers=batch.answers, meta=meta)
