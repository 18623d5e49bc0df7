"""The seam between the decoder and a positional encoding: how an id enters the model.

An encoding is an nn.Module registered by name (`@register`). The decoder asks it four things and
compares no names: an embedding added to the input, a rotation of queries and keys, a per-head bias
added to the attention scores, and whether it adds such a bias (which rules out SDPA's fused causal
path). Adding an encoding is one module under models/encodings/ and its tests.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

# name -> class; models/positions.py's Encoding choices and the trial config's are read from it
ENCODINGS: dict[str, type[PositionalEncoding]] = {}


def register(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
    if cls.name in ENCODINGS and ENCODINGS[cls.name] is not cls:
        raise ValueError(f"encoding {cls.name!r} is registered twice")
    ENCODINGS[cls.name] = cls
    return cls


class PositionalEncoding(nn.Module):
    """No positional signal (every hook answers None); subclasses override what they use.

    Built with the model's ModelConfig and registered in DecoderLM as `pos_emb` (the name the
    learned table's checkpoints carry), before the blocks, so its weights are drawn second."""

    name: ClassVar[str]
    adds_score_bias: ClassVar[bool] = False  # True: score_bias returns a tensor
    bounded_ids: ClassVar[bool] = False  # True: ids must be < max_position (a table is indexed by them)

    def __init__(self, cfg) -> None:
        super().__init__()
        self.max_position = cfg.max_position

    def input_embedding(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Added to the token embedding: [B, T, d_model] for ids [B, T]."""
        return None

    def rotary(self, ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [B, 1, T, head_dim/2] that rotate queries and keys (models.decoder.apply_rope)."""
        return None

    def score_bias(self, q_ids: torch.Tensor, k_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Added to every layer's attention scores: [B, H, Tq, Tk] for q_ids [B, Tq], k_ids [B, Tk]
        (k_ids include cached keys)."""
        return None

    def init_weights(self) -> None:
        """The model's init at this module's turn (after its children's): draw own parameters here."""

    @torch.no_grad()
    def after_init(self, cfg) -> None:
        """Called once the model's common N(0, 0.02) draw is done (rescales, freezes; no new draws
        here unless the encoding is new: the draws of the others must stay where they were)."""

    def check_ids(self, ids: torch.Tensor) -> None:
        # not inside a compiled forward, where reading the largest id breaks the graph and waits on the
        # device every step; a trial's config is checked to need no id beyond the table (ids_needed)
        if self.bounded_ids and not torch.compiler.is_compiling() and int(ids.max()) >= self.max_position:
            raise ValueError(f"position id {int(ids.max())} is beyond max_position {self.max_position}")
