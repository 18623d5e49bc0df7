"""learned: an absolute embedding table of max_position rows added to the token embedding."""

from __future__ import annotations

import torch
import torch.nn as nn

from models.encodings.base import PositionalEncoding, register


@register
class Learned(PositionalEncoding):
    name = "learned"
    bounded_ids = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # the table is this module's own `weight` (`pos_emb.weight` in a state dict, the name
        # checkpoints hold), drawn N(0, 1) here as nn.Embedding's constructor does: the same random stream
        self.weight = nn.Parameter(torch.empty(cfg.max_position, cfg.d_model))
        nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)

    def input_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self(ids)

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)  # as DecoderLM._init_weights draws an nn.Embedding

    @torch.no_grad()
    def after_init(self, cfg) -> None:
        if cfg.pos_init_std != 0.02:
            self.weight.mul_(cfg.pos_init_std / 0.02)
        if cfg.pos_frozen:
            self.weight.requires_grad_(False)
