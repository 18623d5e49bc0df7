"""rope: rotary embedding of queries and keys by their ids (depends only on id differences)."""

from __future__ import annotations

import torch

from models.encodings.base import PositionalEncoding, register


def rope_cos_sin(position_ids: torch.Tensor, d: int, base: float, dtype: torch.dtype):
    """cos and sin [B, 1, T, D/2] of the angles position_id * base^(-2i/D) (once per forward)."""
    inv_freq = base ** (-torch.arange(0, d, 2, device=position_ids.device, dtype=torch.float32) / d)
    angles = position_ids[:, None, :, None].float() * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the channel pairs (2i, 2i+1) of x [B, H, T, D] by the angles of `rope_cos_sin`."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


@register
class RoPE(PositionalEncoding):
    name = "rope"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.base = cfg.rope_base

    def rotary(self, ids, head_dim, dtype):
        return rope_cos_sin(ids, head_dim, self.base, dtype)
