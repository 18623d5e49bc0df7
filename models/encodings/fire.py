"""fire: FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions"), a learned per-head
bias f(psi(|i - j|) / psi(max(L, i))) on the scores, psi(x) = log(|c x| + 1), f a small MLP of one
input, c and the threshold L learned (progressive interpolation: beyond L the distance is read as a
fraction of the query's position, so longer sequences map into the trained range [0, 1]).

As the paper's reference code: |i - j| (so coupled ids, which need not be monotone, are read as a
distance, as alibi does), L = |L_multiplier * init_L| with init_L fixed, eps in the normaliser,
an MLP 1 -> width -> ReLU -> heads. i and j are the query's and the key's ids."""

from __future__ import annotations

import torch
import torch.nn as nn

from models.encodings.base import PositionalEncoding, register

INIT_C, INIT_L, MLP_WIDTH, EPS = 0.1, 512.0, 32, 1e-6  # the paper's defaults


def fire_input(q_ids: torch.Tensor, k_ids: torch.Tensor, c: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The MLP's input psi(|i - j|) / (psi(max(L, i)) + eps): [B, Tq, Tk] in float32."""
    i = q_ids.float()[:, :, None]
    dist = (i - k_ids.float()[:, None, :]).abs()
    psi = lambda x: torch.log((c * x).abs() + 1)  # noqa: E731
    return psi(dist) / (psi(torch.maximum(i, threshold)) + EPS)


@register
class FIRE(PositionalEncoding):
    name = "fire"
    adds_score_bias = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.mlp = nn.Sequential(nn.Linear(1, MLP_WIDTH), nn.ReLU(), nn.Linear(MLP_WIDTH, cfg.n_heads))
        self.c = nn.Parameter(torch.tensor([INIT_C]))  # 1-d: DeepSpeed cannot flatten 0-d parameters
        self.register_buffer("init_L", torch.tensor(INIT_L))
        self.L_multiplier = nn.Parameter(torch.tensor([1.0]))

    @property
    def threshold(self) -> torch.Tensor:
        return (self.L_multiplier * self.init_L).abs()

    def score_bias(self, q_ids, k_ids, dtype):
        x = fire_input(q_ids, k_ids, self.c.float(), self.threshold.float())
        return self.mlp(x[..., None].to(self.mlp[0].weight.dtype)).permute(0, 3, 1, 2).to(dtype)  # [B, H, Tq, Tk]

    def init_weights(self) -> None:
        # PyTorch's default Linear init (the paper's), not the model's N(0, 0.02): a bias that varies
        # with the distance from the start
        for layer in (self.mlp[0], self.mlp[2]):
            layer.reset_parameters()
