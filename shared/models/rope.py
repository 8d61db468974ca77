"""Rotary position embedding in the Hugging Face "rotate_half" layout; each token carries its own
position, so tokens of many sequences flattened into one axis are rotated right."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nori.kernels.rotary import rotary
from nori.models.config import ModelConfig, RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | str | None
) -> torch.Tensor:
    """float32 [head_dim / 2], computed exactly as transformers does so logits match bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: stretch wavelengths longer than the original context by `factor`, keep
    short ones, and blend linearly in between."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class RotaryTables:
    """One step's rotation: each token's cos and sin, [T, head_dim / 2], shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> x rotated by each token's position (possibly x itself, in place)."""
        return rotary(x, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    """Turns position ids [T] into the rotation tables shared by every layer of one step."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        # Not persistent: derived from the config, never read from or written to checkpoints.
        self.register_buffer(
            "inv_freq", inverse_frequencies(self.head_dim, self.theta, self.scaling, device), False
        )

    def reset_buffers(self) -> None:
        """Recomputes `inv_freq` in place, for modules built on the meta device then `to_empty`."""
        with torch.no_grad():
            fresh = inverse_frequencies(
                self.head_dim, self.theta, self.scaling, self.inv_freq.device
            )
            self.inv_freq.copy_(fresh)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        # Angles in float32 whatever the model dtype: bf16 positions lose whole units past 256.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return RotaryTables(cos=freqs.cos().to(dtype), sin=freqs.sin().to(dtype))
