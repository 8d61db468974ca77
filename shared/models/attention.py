"""The one seam between model code and the KV cache.

Model layers compute q, k, v (after bias, Q/K norm and RoPE) and hand them to an `Attention`
callable; the engine supplies one that writes k, v into the paged cache and attends over it. Model
code never sees blocks, slots or sequences, so the same module runs in the engine and in tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (layer_index, query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], scale) -> output [T, Hq, D],
# for the T new tokens of a step. The engine's implementation is `nori.engine.paged_attention.PagedAttention`;
# model tests use a dense one over a single sequence.
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
