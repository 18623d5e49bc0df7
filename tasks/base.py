"""Shared pieces of every task: the parameter error, the vocabulary, the batch and the Task base.

Tasks produce right-padded numpy batches together with *coupled position ids*: ids that tie
each output token to the input token(s) it depends on, so that a model using them sees a
sparse, length-independent dependency pattern (Golowich et al. 2025, Cho et al. 2024).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, ClassVar

import numpy as np

PAD = "<pad>"
PAD_ID = 0  # every vocabulary's `<pad>`, so padding (and an encoder's placeholder) is one id
EOS = "<eos>"
BOS = "<bos>"
# Symbols a task parameter may ask for (copy's `alphabet`, variable_assignment's `num_vars`): the
# vocabulary is built when a config is validated, and a billion symbols would exhaust memory there.
MAX_SYMBOLS = 2**16


class TaskParamError(ValueError):
    """A task parameter (or evaluation point) is impossible; `param` names the culprit.

    Callers (the CLI, the study sweep) report or skip by parameter name, so the name is an
    attribute as well as the first word of the message.
    """

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.detail = message
        super().__init__(f"{param}: {message}")


class Vocab:
    """Token strings <-> ids. `<pad>` is always id 0 and `<eos>` id 1 so padding is uniform."""

    def __init__(self, symbols: Sequence[str]) -> None:
        tokens = [PAD, EOS, *symbols]
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"duplicate tokens in vocabulary: {tokens}")
        self.tokens: list[str] = tokens
        self.stoi: dict[str, int] = {tok: i for i, tok in enumerate(tokens)}
        self.pad_id: int = PAD_ID
        self.eos_id: int = 1
        self._itos = np.array(tokens, dtype=object)

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self.stoi

    def __getitem__(self, token: str) -> int:
        return self.stoi[token]

    def ids(self, tokens: Sequence[str]) -> np.ndarray:
        """Id lookup table for a list of tokens (index it with small ints to vectorise)."""
        return np.array([self.stoi[t] for t in tokens], dtype=np.int64)

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        return self.ids(tokens)

    def decode(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return list(self._itos[np.asarray(ids, dtype=np.int64)])


@dataclass
class Batch:
    """A right-padded batch; see the field comments for the exact conventions."""

    tokens: np.ndarray  # int64 [B, T], right-padded with vocab.pad_id
    position_ids: np.ndarray  # int64 [B, T], the task's coupled ids (0 on padding)
    loss_mask: np.ndarray  # bool [B, T], True where tokens[b, t] is a target (predicted from t-1)
    answer_mask: np.ndarray  # bool [B, T], True on the answer token(s) (subset of loss_mask)
    prompt_len: np.ndarray  # int64 [B], index of the first target token
    seq_len: np.ndarray  # int64 [B], number of tokens before padding
    answers: list[str]  # the answer as a string, per sample
    meta: list[dict]  # per-sample metadata (JSON-serialisable)
    digit_places: np.ndarray | None = None  # int64 [B, T], set for Abacus trials (Task.digit_places)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def make_batch(
    tokens: np.ndarray,
    position_ids: np.ndarray,
    prompt_len: np.ndarray,
    seq_len: np.ndarray,
    answer_mask: np.ndarray,
    answers: list[str],
    meta: list[dict],
    pad_id: int = 0,
    loss_mask: np.ndarray | None = None,
) -> Batch:
    """Assemble a Batch, enforcing padding conventions in one place (pad tokens, id 0, no masks).

    The default loss mask is every token from the prompt end to the sequence end.
    """
    cols = np.arange(tokens.shape[1])[None, :]
    valid = cols < seq_len[:, None]
    if loss_mask is None:
        loss_mask = (cols >= prompt_len[:, None]) & valid
    return Batch(
        tokens=np.where(valid, tokens, pad_id).astype(np.int64),
        position_ids=np.where(valid, position_ids, 0).astype(np.int64),
        loss_mask=(loss_mask & valid).astype(bool),
        answer_mask=(answer_mask & valid).astype(bool),
        prompt_len=prompt_len.astype(np.int64),
        seq_len=seq_len.astype(np.int64),
        answers=answers,
        meta=meta,
    )


def with_bos(batch: Batch, bos_id: int) -> Batch:
    """The batch with a `<bos>` token at position 0 and id 0 before every sequence (as in the
    reference implementation of position coupling); every other id moves up by one, and the
    positions in `meta["deps"]` with it."""
    B = len(batch)

    def prepend(a: np.ndarray, value) -> np.ndarray:
        return np.concatenate([np.full((B, 1), value, dtype=a.dtype), a], axis=1)

    meta = [dict(m, deps=[[p + 1 for p in d] for d in m["deps"]]) if "deps" in m else m for m in batch.meta]
    return Batch(
        tokens=prepend(batch.tokens, bos_id),
        position_ids=prepend(_shift_ids(batch), 0),
        loss_mask=prepend(batch.loss_mask, False),
        answer_mask=prepend(batch.answer_mask, False),
        prompt_len=batch.prompt_len + 1,
        seq_len=batch.seq_len + 1,
        answers=batch.answers,
        meta=meta,
    )


def _shift_ids(batch: Batch) -> np.ndarray:
    """Ids + 1 on real tokens, 0 on padding (make_batch's convention)."""
    valid = np.arange(batch.tokens.shape[1])[None, :] < batch.seq_len[:, None]
    return np.where(valid, batch.position_ids + 1, 0)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def require_int(param: str, value: object, minimum: int, maximum: int | None = None,
                bound: str = "") -> int:
    """Validate an integer parameter, naming it on failure (bools are rejected on purpose);
    `bound` names the constant `maximum` comes from, for the error."""
    if not _is_int(value):
        raise TaskParamError(param, f"expected an integer, got {value!r}")
    if value < minimum:  # type: ignore[operator]
        raise TaskParamError(param, f"{value} is smaller than {minimum}")
    if maximum is not None and value > maximum:  # type: ignore[operator]
        named = f" ({bound})" if bound else ""
        raise TaskParamError(param, f"{value} is larger than the bound of {maximum}{named}")
    return int(value)  # type: ignore[arg-type]


class Task(ABC):
    """A synthetic task: a training distribution over (length, k) plus exact evaluation points.

    Subclasses take their own keyword parameters, pass the common ones to this constructor
    and implement `_generate`, which receives per-sample lengths (and ks) and must be
    vectorised over the batch.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    uses_k: ClassVar[bool]
    # how an evaluation point is scored: "generate" (greedy decoding of the targets, answer accuracy)
    # or "loss" (teacher-forced loss per token, for language modeling)
    evaluation: ClassVar[str] = "generate"
    default_train_length: ClassVar[int]
    default_train_k: ClassVar[int | None] = None
    # whether the coupled ids are local (Golowich et al.'s Definition 4.1): the token that predicts a target finds every
    # token the target depends on (meta["deps"]) at an id offset that does not grow with the length
    local_coupling: ClassVar[bool] = False

    def __init__(
        self,
        train_length: int | None = None,
        min_length: int | None = None,
        train_k: int | None = None,
        min_k: int = 1,
        bos: bool = False,
        priming_samples: int = 0,
        priming_length: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            param = sorted(unknown)[0]
            raise TaskParamError(param, f"unknown parameter for task {self.name!r}")
        if train_length is None:
            train_length = self.default_train_length
        self.train_length = require_int("train_length", train_length, 1)
        if self.uses_k:
            if train_k is None:
                train_k = self.default_train_k
            self.train_k: int | None = require_int("train_k", train_k, 1)
            self.min_k: int | None = require_int("min_k", min_k, 1)
            if self.train_k > self.train_length:
                raise TaskParamError(
                    "train_k", f"{self.train_k} is larger than train_length {self.train_length}"
                )
            if self.min_k > self.train_k:
                raise TaskParamError("min_k", f"{self.min_k} is larger than train_k {self.train_k}")
            # Short samples cannot hold many marked items, so by default start at train_k.
            default_min_length = self.train_k
        else:
            # k means nothing here: a k given anyway is a mistake, not something to drop silently.
            if train_k is not None or min_k != 1:
                param = "train_k" if train_k is not None else "min_k"
                raise TaskParamError(param, f"task {self.name!r} has no k axis")
            self.train_k = None
            self.min_k = None
            default_min_length = 1
        if min_length is None:
            min_length = default_min_length
        self.min_length = require_int("min_length", min_length, 1)
        if self.min_length > self.train_length:
            raise TaskParamError(
                "min_length", f"{self.min_length} is larger than train_length {self.train_length}"
            )
        if self.uses_k and self.min_k > self.min_length:  # type: ignore[operator]
            raise TaskParamError(
                "min_k", f"{self.min_k} is larger than min_length {self.min_length}"
            )
        if not isinstance(bos, bool):
            raise TaskParamError("bos", f"expected true or false, got {bos!r}")
        self.bos = bos
        self._check_priming_params(priming_samples, priming_length)
        self.vocab = self._build_vocab()
        if bos:
            # `<bos>` goes last, so every other token keeps its id; the bounds grow by one token
            self.vocab = Vocab([*self.vocab.tokens[2:], BOS])
            inner_id, inner_len = self.max_position_id, self.max_seq_len
            self.max_position_id = lambda length, k: inner_id(length, k) + 1  # type: ignore[method-assign]
            self.max_seq_len = lambda length, k: inner_len(length, k) + 1  # type: ignore[method-assign]

    def _check_priming_params(self, samples: object, length: object) -> None:
        """Train set priming (tasks/priming.py): `priming_samples` samples of `priming_length`."""
        self.priming_samples = require_int("priming_samples", samples, 0)
        self.priming_length: int | None = None
        if (length is None) == (self.priming_samples > 0):  # a length without samples, or samples without one
            raise TaskParamError("priming_length", "the primed samples' length: give it with priming_samples > 0, "
                                                   "and only then")
        if self.priming_samples:
            self.priming_length = require_int("priming_length", length, 1)
            if self.priming_length <= self.train_length:
                raise TaskParamError("priming_length", f"{self.priming_length} is not longer than train_length "
                                                       f"{self.train_length}")
            if self.evaluation == "loss":  # lm: a window longer than training comes from the validation split
                raise TaskParamError("priming_samples", f"task {self.name!r} would prime with held-out text")

    @property
    def fixed_prefix(self) -> int:
        """Leading tokens whose ids are never shifted in training (the `<bos>` at id 0)."""
        return 1 if self.bos else 0

    # --- subclass hooks -------------------------------------------------------------------

    @abstractmethod
    def _build_vocab(self) -> Vocab:
        """The task's vocabulary (called at the end of base construction)."""

    @abstractmethod
    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        """Build a batch for per-sample `lengths` (and `ks`), vectorised over the batch."""

    def _check_point(self, length: int, k: int | None) -> None:  # noqa: B027 (optional hook: most tasks have none)
        """Task-specific impossibility checks for one cell (length and k already validated)."""

    def value_classes(self) -> list[list[str]]:
        """Groups of tokens that can stand in for one another without changing a sample's structure
        (0 <-> 1, A <-> B: a marked bit stays marked). The sparsity meter's `resample` ablation
        redraws a token inside its group to make the model ignorant of its value; tokens in no
        group (`=`, separators) are never redrawn. Empty: the task has no such structure (text)."""
        return []

    @abstractmethod
    def max_position_id(self, length: int, k: int | None) -> int:
        """Largest coupled position id any sample of this cell can have."""

    @abstractmethod
    def max_seq_len(self, length: int, k: int | None) -> int:
        """Longest sequence (tokens before padding) any sample of this cell can have.

        For k-tasks, k=None means the largest k the training distribution uses at this length.
        """

    # --- public API ------------------------------------------------------------------------

    def check(self, length: int, k: int | None) -> None:
        """Raise TaskParamError if no sample of this (length, k) point can exist."""
        require_int("length", length, 1)
        if self.uses_k and k is not None:
            require_int("k", k, 1)
            if k > length:
                raise TaskParamError("k", f"{k} is larger than length {length}")
        self._check_point(int(length), None if (k is None or not self.uses_k) else int(k))

    def sample(
        self,
        batch_size: int,
        rng: np.random.Generator,
        length: int | None = None,
        k: int | None = None,
    ) -> Batch:
        """Draw a batch: the training distribution when length/k are None, else one cell.

        Training: length ~ U[min_length, train_length], k ~ U[min_k, min(train_k, length)].
        A fixed length (or k) replaces the corresponding draw for every sample.
        """
        batch_size = require_int("batch_size", batch_size, 1)
        if not self.uses_k:
            k = None
        if length is not None:
            self.check(length, k)
            lengths = np.full(batch_size, int(length), dtype=np.int64)
        else:
            lo = self.min_length
            if k is not None:
                # Only lengths that can hold k items; the longest must be possible.
                self.check(self.train_length, k)
                lo = max(lo, int(k))
            lengths = rng.integers(lo, self.train_length + 1, size=batch_size, dtype=np.int64)
        ks: np.ndarray | None = None
        if self.uses_k:
            if k is not None:
                ks = np.full(batch_size, int(k), dtype=np.int64)
            else:
                hi = np.minimum(self.train_k, lengths)  # type: ignore[arg-type]
                if np.any(hi < self.min_k):
                    raise TaskParamError(
                        "length", f"{int(lengths.min())} is smaller than min_k {self.min_k}"
                    )
                ks = rng.integers(self.min_k, hi + 1, dtype=np.int64)  # type: ignore[arg-type]
        batch = self._generate(lengths, ks, rng)
        return with_bos(batch, self.vocab[BOS]) if self.bos else batch

    def validation_sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """A batch for the held-out in-distribution validation set (the training loop uses it).

        By default a fresh draw from the training distribution: synthetic samples are generated
        on the fly, so new ones are held out by construction. Tasks over a fixed dataset (the
        `lm` corpus) override this to draw from their validation split instead, since fresh
        draws of training data would not be held out.
        """
        return self.sample(batch_size, rng)

    @property
    def longest_train_length(self) -> int:
        """The length of the longest samples training sees (the primed ones', where there are any)."""
        return self.priming_length or self.train_length

    def digit_places(self, batch: Batch) -> np.ndarray | None:
        """Which token is which digit, for Abacus embeddings (models/encodings/abacus.py): int64
        [B, T], 0 where a token is not a digit (and on padding), p >= 1 where it is the p-th least
        significant digit of its number. None: the task has no numbers (the default)."""
        return None

    def to_records(self, batch: Batch) -> list[dict]:
        """One JSON-ready dict per sample, padding stripped (the CLI's output format)."""
        records = []
        for b in range(len(batch)):
            n = int(batch.seq_len[b])
            records.append(
                {
                    "tokens": self.vocab.decode(batch.tokens[b, :n]),
                    "position_ids": [int(x) for x in batch.position_ids[b, :n]],
                    "loss_mask": [int(x) for x in batch.loss_mask[b, :n]],
                    "answer": batch.answers[b],
                    "meta": batch.meta[b],
                }
            )
        return records

    def __repr__(self) -> str:
        params = ", ".join(
            f"{key}={value!r}" for key, value in vars(self).items() if key != "vocab" and not key.startswith("_")
        )
        return f"{type(self).__name__}({params})"
