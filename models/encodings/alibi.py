"""alibi: a per-head linear penalty -slope * |id_q - id_k| on the attention scores (ids, not
indices, so coupled ids work; the absolute value because coupled ids need not be monotone)."""

from __future__ import annotations

import torch

from models.encodings.base import PositionalEncoding, register


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Geometric slopes 2^(-8h/H) of Press et al. (2022)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


@register
class ALiBi(PositionalEncoding):
    name = "alibi"
    adds_score_bias = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def score_bias(self, q_ids, k_ids, dtype):
        dist = (q_ids[:, :, None] - k_ids[:, None, :]).abs().to(dtype)  # [B, Tq, Tk]
        return -self.slopes.to(dtype)[None, :, None, None] * dist[:, None]
