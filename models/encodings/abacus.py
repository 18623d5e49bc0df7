"""Abacus embeddings (McLeish et al. 2024, mcleish7/arithmetic): a learned embedding of each digit's
place within its own number (1 = least significant; 0 = not a digit, a row of its own as in the
reference), added to the input. In training a random offset in [0, max_offset] is added to every
digit's place, so places beyond the trained number lengths are trained too; at evaluation no offset.
The offset is drawn once per batch (`abacus_offset: batch`, the default) or once per sample
(`sample`): the reference draws one per micro-batch of 256-512 and accumulates many micro-batches into
an update, so each of its updates mixes many offsets, as a draw per sample does.

Not an encoding of the registry but an extra input embedding (`positional.abacus: true`): the paper
combines it with an encoding (NoPE or FIRE), and the places come from the task, not the ids."""

from __future__ import annotations

import torch
import torch.nn as nn

MAX_OFFSET = 100  # the default largest offset (the reference's max_k is 99)


class Abacus(nn.Module):
    def __init__(self, max_place: int, d_model: int, max_offset: int = MAX_OFFSET, per: str = "batch") -> None:
        super().__init__()
        self.max_place, self.max_offset, self.per = max_place, max_offset, per
        self.emb = nn.Embedding(max_place + max_offset + 1, d_model)

    def indices(self, places: torch.Tensor) -> torch.Tensor:
        """The table rows of places [B, T]: the place, plus the offset on digits in training."""
        # not inside a compiled forward: reading the largest place back breaks the graph
        if not torch.compiler.is_compiling() and int(places.max()) > self.max_place:
            raise ValueError(f"digit place {int(places.max())} is beyond {self.max_place} (max_position)")
        if not self.training:
            return places
        shape = (places.shape[0], 1) if self.per == "sample" else ()
        offset = torch.randint(0, self.max_offset + 1, shape, device=places.device)
        return torch.where(places > 0, places + offset, places)

    def forward(self, places: torch.Tensor) -> torch.Tensor:
        return self.emb(self.indices(places))
