"""Abacus embeddings (McLeish et al. 2024, mcleish7/arithmetic): a learned embedding of each digit's
place within its own number (1 = least significant; 0 = not a digit, a row of its own as in the
reference), added to the input. In training one random offset in [0, MAX_OFFSET] per batch is added
to every digit's place (the reference's `k = random.randint(0, max_k)`), so places beyond the
trained number lengths are trained too; at evaluation no offset.

Not an encoding of the registry but an extra input embedding (`positional.abacus: true`): the paper
combines it with an encoding (NoPE or FIRE), and the places come from the task, not the ids."""

from __future__ import annotations

import torch
import torch.nn as nn

MAX_OFFSET = 100  # the reference's max_k (99 there; 100 here as the "up to ~100")


class Abacus(nn.Module):
    def __init__(self, max_place: int, d_model: int) -> None:
        super().__init__()
        self.max_place = max_place
        self.emb = nn.Embedding(max_place + MAX_OFFSET + 1, d_model)

    def indices(self, places: torch.Tensor) -> torch.Tensor:
        """The table rows of places [B, T]: the place, plus this batch's offset on digits in training."""
        if int(places.max()) > self.max_place:
            raise ValueError(f"digit place {int(places.max())} is beyond {self.max_place} (max_position)")
        if not self.training:
            return places
        offset = torch.randint(0, MAX_OFFSET + 1, (), device=places.device)
        return torch.where(places > 0, places + offset, places)

    def forward(self, places: torch.Tensor) -> torch.Tensor:
        return self.emb(self.indices(places))
