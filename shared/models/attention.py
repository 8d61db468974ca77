"""The one seam between model code and the KV cache.

Model layers hand q, k, v (after bias, Q/K norm and RoPE) to an `Attention` callable; the engine
supplies one that writes k, v into the paged cache and attends over it."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (layer_index, query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], scale) -> output [T, Hq, D],
# for the T new tokens of a step (the engine's: `nori.engine.paged_attention.PagedAttention`).
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
