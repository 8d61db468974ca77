"""Root-mean-square layer norm, as Llama-family checkpoints define it."""

from __future__ import annotations

import torch
from torch import nn

from nori.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(h), h) with h = x + residual (or x): the residual stream's next value
        comes back with it, so the decoder adds and normalises in one kernel on CPU."""
        return rms_norm(x, self.weight, self.eps, residual)
