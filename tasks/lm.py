"""Byte-level language modeling over a text corpus, as a Task.

Vocabulary: `<pad>` (0), `<eos>` (1), then the 256 bytes as tokens "b000".."b255" (byte b is id
b + 2). Samples are windows of consecutive corpus tokens: training windows (length None) are
`train_length` long and drawn uniformly from the TRAIN split; an evaluation point `length=n` draws
windows of n tokens from the VALIDATION split (held-out documents). `validation_sample` draws
training-length windows from the validation split (the in-distribution held-out set).

Every next token is a target: prompt_len = 1, loss_mask = answer_mask = positions 1..n-1, and the
position ids are simply 0..n-1 (an LM has no coupling beyond position). There is no k axis.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Batch, Task, TaskParamError, Vocab, make_batch, require_int
from .corpus import BYTE_OFFSET, EOS_ID, MAX_CORPUS_BYTES, SplitCorpus, split_corpus

BYTE_TOKENS = [f"b{b:03d}" for b in range(256)]


def encode_text(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as int64 token ids (byte b -> b + 2)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_OFFSET


def decode_text(ids: Sequence[int] | np.ndarray) -> str:
    """Inverse of encode_text: `<pad>` is dropped, `<eos>` is shown as the string "<eos>",
    bytes are decoded as UTF-8 (invalid sequences, e.g. a window cut mid-character, become U+FFFD)."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    parts: list[str] = []
    is_eos = ids == EOS_ID
    for i, run in enumerate(np.split(ids, np.flatnonzero(is_eos))):
        if i > 0:
            parts.append("<eos>")
            run = run[1:]
        run = run[run >= BYTE_OFFSET]
        parts.append((run - BYTE_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
    return "".join(parts)


def _is_hub_dataset(corpus: object) -> bool:
    """`hf:<name>` naming no local folder (a name on the hub). A missing `datasets` package is
    reported at once, naming the corpus."""
    if not (isinstance(corpus, str) and corpus.startswith("hf:") and corpus[3:]):
        return False
    if importlib.util.find_spec("datasets") is None:
        raise TaskParamError("corpus", f"{corpus!r} needs the `datasets` package (pip install datasets)")
    return not os.path.exists(corpus[3:])


class LMTask(Task):
    """Next-byte prediction on windows of a text corpus split into train/validation by document."""

    name: ClassVar[str] = "lm"
    description: ClassVar[str] = "byte-level language modeling on corpus windows (train / held-out docs)"
    uses_k: ClassVar[bool] = False
    evaluation: ClassVar[str] = "loss"
    default_train_length: ClassVar[int] = 128

    def __init__(
        self,
        *,
        corpus: str = "stdlib",
        glob: str = "**/*.txt",
        text_field: str = "text",
        hf_split: str = "train",
        hf_config: str | None = None,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        if self.bos:
            raise TaskParamError("bos", "synthetic tasks only; a text window has no start token")
        if self.train_length < 2:
            raise TaskParamError("train_length", f"{self.train_length} is smaller than 2 (a window needs a target)")
        max_bytes = require_int("max_bytes", max_bytes, 1, MAX_CORPUS_BYTES, "tasks.corpus.MAX_CORPUS_BYTES")
        split_seed = require_int("split_seed", split_seed, 0)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise TaskParamError("val_fraction", f"expected a number in (0, 1), got {val_fraction!r}")
        for param, value in (("glob", glob), ("text_field", text_field), ("hf_split", hf_split)):
            if not isinstance(value, str) or not value:
                raise TaskParamError(param, f"expected a non-empty string, got {value!r}")
        if hf_config is not None and not isinstance(hf_config, str):
            raise TaskParamError("hf_config", f"expected a string or null, got {hf_config!r}")
        self.corpus = corpus
        self.glob = glob
        self.text_field = text_field
        self.hf_split = hf_split
        self.hf_config = hf_config
        self.max_bytes = max_bytes
        self.val_fraction = float(val_fraction)
        self.split_seed = split_seed
        self._loaded: SplitCorpus | None = None
        if not _is_hub_dataset(corpus):
            _ = self.split  # local corpora load (and are checked) now; a hub dataset loads on first
            # use, inside the trial on the cluster, so validating a spec downloads nothing

    @property
    def split(self) -> SplitCorpus:
        if self._loaded is None:
            split = split_corpus(
                self.corpus, val_fraction=self.val_fraction, split_seed=self.split_seed, glob=self.glob,
                text_field=self.text_field, hf_split=self.hf_split, hf_config=self.hf_config,
                max_bytes=self.max_bytes,
            )
            for name, tokens in (("train", split.train_tokens), ("validation", split.val_tokens)):
                if self.train_length > len(tokens):
                    raise TaskParamError(
                        "train_length",
                        f"{self.train_length} is longer than the {name} split ({len(tokens)} tokens) of {self.corpus}",
                    )
            self._loaded = split
        return self._loaded

    @property
    def train_tokens(self) -> np.ndarray:
        return self.split.train_tokens

    @property
    def val_tokens(self) -> np.ndarray:
        return self.split.val_tokens

    @property
    def train_docs(self) -> tuple[str, ...]:
        return self.split.train_docs

    @property
    def val_docs(self) -> tuple[str, ...]:
        return self.split.val_docs

    # --- Task hooks --------------------------------------------------------------------------

    def _build_vocab(self) -> Vocab:
        return Vocab(BYTE_TOKENS)

    def _check_point(self, length: int, k: int | None) -> None:
        if length < 2:
            raise TaskParamError("length", f"{length} is smaller than 2 (a window needs a target)")
        if self._loaded is not None and length > len(self.val_tokens):  # checked once loaded
            raise TaskParamError(
                "length", f"{length} is longer than the validation split ({len(self.val_tokens)} tokens)"
            )

    def max_position_id(self, length: int, k: int | None) -> int:
        return length - 1

    def max_seq_len(self, length: int, k: int | None) -> int:
        return length

    def _generate(self, lengths: np.ndarray, ks: np.ndarray | None, rng: np.random.Generator) -> Batch:
        """Per-sample lengths from the train split (the base-class contract; `sample` uses equal lengths)."""
        return self._windows(self.train_tokens, "train", lengths, rng)

    def _windows(
        self, source: np.ndarray, split: str, lengths: np.ndarray, rng: np.random.Generator
    ) -> Batch:
        """Uniform windows: start ~ U[0, len(source) - length], gathered with one fancy index."""
        lengths = np.asarray(lengths, dtype=np.int64)
        width = int(lengths.max())
        starts = rng.integers(0, len(source) - lengths + 1, dtype=np.int64)
        cols = np.arange(width, dtype=np.int64)[None, :]
        valid = cols < lengths[:, None]
        index = np.where(valid, starts[:, None] + cols, 0)
        tokens = source[index].astype(np.int64)
        position_ids = np.broadcast_to(cols, tokens.shape)
        loss_mask = valid & (cols >= 1)
        meta = [{"offset": int(s), "split": split} for s in starts]
        return make_batch(
            tokens, position_ids, np.ones(len(lengths), dtype=np.int64), lengths, loss_mask,
            [""] * len(lengths), meta, pad_id=self.vocab.pad_id, loss_mask=loss_mask,
        )

    # --- public API --------------------------------------------------------------------------

    def sample(
        self,
        batch_size: int,
        rng: np.random.Generator,
        length: int | None = None,
        k: int | None = None,
    ) -> Batch:
        """Training (length None): train_length windows of the train split. A cell (length n):
        n-token windows of the validation split. k is ignored (no k axis), as in other tasks."""
        batch_size = require_int("batch_size", batch_size, 1)
        if length is None:
            return self._windows(
                self.train_tokens, "train", np.full(batch_size, self.train_length, dtype=np.int64), rng
            )
        _ = self.split  # load before checking the length against the validation split
        self.check(length, None)
        return self._windows(self.val_tokens, "validation", np.full(batch_size, int(length), dtype=np.int64), rng)

    def validation_sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Training-length windows from the VALIDATION split: fresh windows of the training text
        would not be held out, so the in-distribution validation set uses held-out documents."""
        batch_size = require_int("batch_size", batch_size, 1)
        return self._windows(
            self.val_tokens, "validation", np.full(batch_size, self.train_length, dtype=np.int64), rng
        )

    def to_records(self, batch: Batch) -> list[dict]:
        """The base records plus "text": the window decoded (bytes as UTF-8, `<eos>` shown)."""
        records = super().to_records(batch)
        for b, record in enumerate(records):
            record["text"] = decode_text(batch.tokens[b, : int(batch.seq_len[b])])
        return records

    def __repr__(self) -> str:
        return (
            f"LMTask(corpus={self.corpus!r}, train_length={self.train_length}, max_bytes={self.max_bytes}, "
            f"val_fraction={self.val_fraction}, split_seed={self.split_seed}, "
            f"train_tokens={len(self.train_tokens)}, val_tokens={len(self.val_tokens)})"
        )
