"""Which position id each token gets: the *ids* half of a positional scheme.

Tasks supply coupled ids; a scheme decides what the model sees in training and at inference:

| ids          | training                                        | inference (prompt / generated)  |
|--------------|-------------------------------------------------|---------------------------------|
| sequential   | 0..T-1                                          | 0..T-1 / continue               |
| random_shift | 0..T-1 plus a random offset per sample          | 0..T-1 / continue               |
| pose         | 0..T-1 cut into chunks with random skips (PoSE) | 0..T-1 / continue               |
| coupled      | the task's ids (plus a random offset if shift)  | task's ids / task's (oracle)    |
| predicted    | as coupled; the model also learns the next id   | task's ids / its own prediction |
| randomized   | a sorted random sample of [0, max_position)     | the same, drawn afresh / its tail |

How offsets, skips and randomized samples stay below `max_position`: docs/trial.md, "Position ids".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from models.encodings import ENCODINGS as REGISTRY

# the registry's names, as the schema's choices (a Literal over a tuple lists each name)
Encoding = Literal[tuple(REGISTRY)]  # type: ignore[valid-type]
ENCODINGS: tuple[str, ...] = tuple(REGISTRY)
IdScheme = Literal["sequential", "random_shift", "pose", "coupled", "predicted", "randomized"]
ID_SCHEMES: tuple[str, ...] = get_args(IdScheme)
GenerationIds = Literal["sequential", "coupled", "predicted", "randomized"]
# the seed of inference ids drawn without a generator (validation): the same ids each time
INFERENCE_SEED = 0


@dataclass(frozen=True)
class PositionalScheme:
    """A positional scheme, encoding x ids, with the settings that go with them: the one place that
    knows which ids a model trains and is evaluated with, how generated tokens get theirs, whether
    the model has a position head, and the largest id a cell needs. The trial config, the training
    loop, the evaluation and the analyses ask it; nothing else switches on the ids' name."""

    encoding: Encoding = "learned"
    ids: IdScheme = "sequential"
    max_position: int = 128
    shift: bool = True
    pose_chunks: int = 2
    abacus: bool = False  # the model also takes each digit's place (Task.digit_places)

    @property
    def label(self) -> str:
        return f"{self.encoding}+{self.ids}"

    @property
    def uses_task_ids(self) -> bool:
        """The task's coupled ids (coupled, predicted) rather than 0..T-1 (shifted or skipped)."""
        return uses_task_ids(self.ids)

    @property
    def has_position_head(self) -> bool:
        """PPC: the model also predicts the next token's id."""
        return self.ids == "predicted"

    @property
    def generation_modes(self) -> list[GenerationIds]:
        """How generated tokens get ids at evaluation; the first is the model's own (its score)."""
        return generation_modes(self.ids)

    @property
    def own_ids(self) -> GenerationIds:
        return self.generation_modes[0]

    def training_ids(self, coupled_ids: np.ndarray, seq_len: np.ndarray, rng: np.random.Generator,
                     fixed_prefix: int = 0) -> np.ndarray:
        return training_ids(self.ids, coupled_ids, seq_len, self.max_position, rng, self.shift,
                            self.pose_chunks, fixed_prefix)

    def inference_ids(self, coupled_ids: np.ndarray, rng: np.random.Generator | None = None,
                      seq_len: np.ndarray | None = None) -> np.ndarray:
        return inference_ids(self.ids, coupled_ids, self.max_position, rng, seq_len)

    def largest_id(self, task, length: int, k: int | None) -> int:
        """Largest position id the model sees in a cell (length, k) of `task` (it needs
        max_position > this)."""
        if self.uses_task_ids:
            return task.max_position_id(length, k)
        return task.max_seq_len(length, k) - 1


def uses_task_ids(scheme: IdScheme) -> bool:
    return scheme in ("coupled", "predicted")


def training_ids(
    scheme: IdScheme,
    coupled_ids: np.ndarray,
    seq_len: np.ndarray,
    max_position: int,
    rng: np.random.Generator,
    shift: bool = True,
    pose_chunks: int = 2,
    fixed_prefix: int = 0,
) -> np.ndarray:
    """Position ids [B, T] the model is trained with (padding positions are clamped in range).

    The first `fixed_prefix` tokens (a `<bos>`) keep their task ids (0): never shifted, so they are
    seen at every id distance; the other ids then start at fixed_prefix."""
    if fixed_prefix:
        rest = training_ids(scheme, coupled_ids[:, fixed_prefix:] - fixed_prefix, seq_len - fixed_prefix,
                            max_position - fixed_prefix, rng, shift, pose_chunks)
        return np.concatenate([coupled_ids[:, :fixed_prefix].astype(np.int64), rest + fixed_prefix], axis=1)
    B, T = coupled_ids.shape
    seq = np.broadcast_to(np.arange(T), (B, T))
    if scheme == "sequential":
        ids = seq.copy()
    elif scheme == "random_shift":
        ids = seq + _offsets(max_position - seq_len, rng)[:, None]
    elif scheme == "pose":
        ids = seq + _pose_skips(seq_len, T, max_position, pose_chunks, rng)
    elif scheme in ("coupled", "predicted"):
        valid = seq < seq_len[:, None]
        top = np.where(valid, coupled_ids, 0).max(axis=1)
        ids = coupled_ids + (_offsets(max_position - 1 - top, rng)[:, None] if shift else 0)
    elif scheme == "randomized":
        ids = randomized_ids(seq_len, T, max_position, rng)
    else:
        raise ValueError(f"ids: unknown scheme {scheme!r}; expected one of {ID_SCHEMES}")
    return np.minimum(ids, max_position - 1).astype(np.int64)


def inference_ids(scheme: IdScheme, coupled_ids: np.ndarray, max_position: int | None = None,
                  rng: np.random.Generator | None = None, seq_len: np.ndarray | None = None) -> np.ndarray:
    """Ids of the whole sequence at evaluation: the task's ids for coupled schemes, a fresh sorted
    sample for randomized (from `rng`, default one seeded INFERENCE_SEED; over seq_len tokens, default
    all T), else 0..T-1 (no shift, no skips; a `<bos>` is token 0 and gets id 0 either way)."""
    if uses_task_ids(scheme):
        return coupled_ids.astype(np.int64)
    if scheme == "randomized":
        assert max_position is not None, "randomized ids are drawn below max_position"
        B, T = coupled_ids.shape
        rng = np.random.default_rng(INFERENCE_SEED) if rng is None else rng
        return randomized_ids(np.full(B, T) if seq_len is None else seq_len, T, max_position, rng)
    return np.broadcast_to(np.arange(coupled_ids.shape[1]), coupled_ids.shape).astype(np.int64)


def generation_modes(scheme: IdScheme) -> list[GenerationIds]:
    """How generated tokens get ids. PPC is reported both with its own ids and the oracle's;
    randomized takes the tail of the sample drawn for the whole sequence (generate's oracle_ids)."""
    if scheme == "predicted":
        return ["predicted", "coupled"]
    if scheme in ("coupled", "randomized"):
        return [scheme]
    return ["sequential"]


def randomized_ids(seq_len: np.ndarray, T: int, max_position: int, rng: np.random.Generator) -> np.ndarray:
    """Per sequence, seq_len distinct ids drawn uniformly from [0, max_position) and sorted; padding
    repeats the last id. One draw per sequence: the reference draws one per batch (its sequences have
    one length), whose prefix would not be a uniform sample for the shorter sequences here."""
    if int(np.max(seq_len)) > max_position:
        raise ValueError(f"randomized ids: {int(np.max(seq_len))} tokens need max_position >= that, "
                         f"not {max_position}")
    ids = np.empty((len(seq_len), T), dtype=np.int64)
    for b, n in enumerate(np.asarray(seq_len, dtype=np.int64)):
        ids[b, :n] = np.sort(rng.choice(max_position, size=int(n), replace=False))
        ids[b, n:] = ids[b, n - 1] if n else 0
    return ids


def _offsets(room: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Uniform offsets in [0, room] per sample (room < 0 is treated as 0)."""
    return rng.integers(0, np.maximum(room, 0) + 1)


def _pose_skips(
    seq_len: np.ndarray, T: int, max_position: int, chunks: int, rng: np.random.Generator
) -> np.ndarray:
    """PoSE: split each sequence into `chunks` pieces at random points; piece i is shifted by a
    nondecreasing cumulative skip, the largest at most max_position - seq_len. Returns [B, T]."""
    B = len(seq_len)
    budget = np.maximum(max_position - seq_len, 0)
    # chunk boundaries: chunks-1 sorted cut points in [1, seq_len)
    cuts = np.sort(rng.integers(1, np.maximum(seq_len, 2)[:, None], size=(B, chunks - 1)), axis=1)
    # cumulative skips: sorted draws in [0, budget], the first chunk also gets a random start
    skips = np.sort(rng.integers(0, budget[:, None] + 1, size=(B, chunks)), axis=1)
    chunk_of = (np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(axis=2)  # [B, T]
    return np.take_along_axis(skips, chunk_of, axis=1)
