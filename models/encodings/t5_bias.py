"""t5_bias: T5's relative attention bias (Raffel et al. 2020): a learned scalar per head per bucket
of the distance n = id_q - id_k, shared by every layer. Half the buckets are exact (n < B/2), the
rest log-spaced from B/2 up to max_distance, beyond which every n shares the last bucket. One-sided
by default, as T5's decoder: n < 0 (a key whose id is above the query's, which coupled ids allow) is
bucket 0. Two-sided (`t5_buckets: two_sided`) is T5's encoder bucketing: half the buckets for n >= 0,
half for n < 0, each split exact then log-spaced, so coupled ids' keys ahead of the query keep their
distance."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.encodings.base import PositionalEncoding, register

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # T5's defaults


def t5_bucket(n: torch.Tensor, num_buckets: int = NUM_BUCKETS, max_distance: int = MAX_DISTANCE,
              two_sided: bool = False) -> torch.Tensor:
    """T5's _relative_position_bucket(bidirectional=two_sided) of n = id_q - id_k (any integer tensor)."""
    if two_sided:
        num_buckets //= 2
        return torch.where(n < 0, num_buckets, 0) + t5_bucket(n.abs(), num_buckets, max_distance)
    n = n.clamp(min=0)
    exact = num_buckets // 2
    # log(n / exact) / log(max_distance / exact) of the log-spaced half; n < exact takes the other branch
    log_part = torch.log(n.float().clamp(min=exact) / exact) / math.log(max_distance / exact)
    large = (exact + (log_part * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


@register
class T5Bias(PositionalEncoding):
    name = "t5_bias"
    adds_score_bias = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.bias = nn.Embedding(NUM_BUCKETS, cfg.n_heads)  # drawn N(0, 0.02) with the model's tables
        self.two_sided = cfg.t5_buckets == "two_sided"

    def score_bias(self, q_ids, k_ids, dtype):
        buckets = t5_bucket(q_ids[:, :, None] - k_ids[:, None, :], two_sided=self.two_sided)  # [B, Tq, Tk]
        return self.bias(buckets).permute(0, 3, 1, 2).to(dtype)
