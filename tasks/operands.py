"""How the operands of the arithmetic tasks (addition, multiplication) are written: most significant
digit first, as Cho et al. write them, or least significant first, as Abacus (McLeish et al. 2024)
and Zhou et al. 2024's FIRE addition were measured (`operand_order`), and without the zeros that pad
the shorter operand (addition's `operands: unpadded`, as the Abacus reference draws them), and with
an index hint before every digit (`index_hints`, Zhou et al. 2023; 2024)."""

from __future__ import annotations

import numpy as np

from .base import MAX_SYMBOLS, PAD_ID, Batch, TaskParamError, require_int

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


# Zhou et al. 2024 (following Zhou et al. 2023) draw their index hints from an ordered set of 102
# symbols, enough for the places of their longest (100-digit) test sums
DEFAULT_HINT_SYMBOLS = 102


def hint_names(count: int) -> list[str]:
    """The index hints' tokens, in order: a..z, then aa..az, ba.. (letters never name another token)."""
    names = []
    for i in range(count):
        name, i = "", i + 1
        while i:
            i, r = divmod(i - 1, 26)
            name = chr(ord("a") + r) + name
        names.append(name)
    return names


def check_index_hints(index_hints: object, hint_symbols: object) -> int | None:
    """A task's `index_hints` and `hint_symbols` params, checked: how many hint symbols it writes
    (None: no hints). `hint_symbols` shapes the hints, so it is refused without them."""
    if not isinstance(index_hints, bool):
        raise TaskParamError("index_hints", f"expected true or false, got {index_hints!r}")
    if not index_hints:
        if hint_symbols is not None:
            raise TaskParamError("hint_symbols", "shapes the index hints, which only index_hints: true writes")
        return None
    if hint_symbols is None:
        return DEFAULT_HINT_SYMBOLS
    return require_int("hint_symbols", hint_symbols, 1, MAX_SYMBOLS, "symbols, tasks.base.MAX_SYMBOLS")


def check_hint_places(hint_symbols: int | None, places: int, length: str) -> None:
    """Refuse a length (`length`: its name and value) whose numbers have more digit places than
    there are hint symbols."""
    if hint_symbols is not None and places > hint_symbols:
        raise TaskParamError("hint_symbols", f"{length} writes {places} digit places, more than the "
                                             f"{hint_symbols} hint symbols; raise hint_symbols to {places} or more")


def with_index_hints(batch: Batch, digit_ids: np.ndarray, hint_ids: np.ndarray, rng: np.random.Generator) -> Batch:
    """The batch with an index hint before every digit (Zhou et al. 2023; 2024): the digits of one place
    in the operands and the answer share their hint, the places' hints are consecutive symbols of
    `hint_ids` from a start drawn per sample (so that every symbol is trained), and each hint takes its
    digit's id. A digit's place is its coupled id (the batch has no `<bos>` yet). The hints of the
    answer are targets, as the model writes them, but not answer tokens: an answer is right when its
    digits are. Each answer hint depends on the hint before it in the answer; the first on the
    prompt's hints of its place (`meta["deps"]`); meta["hint_start"] is the first place's symbol."""
    B, T = batch.tokens.shape
    cols = np.arange(T)[None, :]
    valid = cols < batch.seq_len[:, None]
    digit = np.isin(batch.tokens, digit_ids) & valid
    place = np.where(digit, batch.position_ids, 0)
    # the start: any symbol whose run of consecutive hints covers the sample's places
    starts = rng.integers(0, len(hint_ids) - place.max(axis=1) + 1, dtype=np.int64)
    new_col = cols + np.cumsum(digit, axis=1)  # a hint goes in before each digit
    hint_col = new_col - 1
    seq_len = batch.seq_len + digit.sum(axis=1)
    width = int(seq_len.max())
    rows = np.broadcast_to(np.arange(B)[:, None], (B, T))
    tokens = np.full((B, width), PAD_ID, dtype=np.int64)  # padding: the pad id, id 0, no masks
    ids = np.zeros((B, width), dtype=np.int64)
    loss, answer = np.zeros((B, width), dtype=bool), np.zeros((B, width), dtype=bool)
    at = (rows[valid], new_col[valid])
    tokens[at], ids[at] = batch.tokens[valid], batch.position_ids[valid]
    loss[at], answer[at] = batch.loss_mask[valid], batch.answer_mask[valid]
    hint = (rows[digit], hint_col[digit])
    tokens[hint] = hint_ids[(starts[:, None] + place - 1)[digit]]
    ids[hint], loss[hint] = place[digit], batch.loss_mask[digit]
    prompt_len = batch.prompt_len + (digit & (cols < batch.prompt_len[:, None])).sum(axis=1)
    meta = []
    for b, m in enumerate(batch.meta):
        if "deps" in m:
            deps, before = [], None  # before: the column of the answer's last hint so far
            for t, dep in zip(np.flatnonzero(batch.loss_mask[b]), m["deps"]):
                if digit[b, t]:
                    if before is None:
                        same = digit[b] & (place[b] == place[b, t]) & (cols[0] < batch.prompt_len[b])
                        deps.append([int(c) for c in hint_col[b, same]])
                    else:
                        deps.append([before])
                    before = int(hint_col[b, t])
                deps.append([int(new_col[b, p]) for p in dep])
            m = dict(m, deps=deps)
        meta.append(dict(m, hint_start=int(starts[b])))
    return Batch(tokens=tokens, position_ids=ids, loss_mask=loss, answer_mask=answer, prompt_len=prompt_len,
                 seq_len=seq_len, answers=batch.answers, meta=meta)
