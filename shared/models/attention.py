"""The one seam between model code and the KV cache.

Model layers compute q, k, v (after bias, Q/K norm and RoPE) and hand them to an `Attention`
callable; the engine supplies one that writes k, v into the paged cache and attends over it. Model
code never sees blocks, slots or sequences, so the same module runs in the engine and in tests.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] for the T new tokens -> output [T, Hq, D]."""
        ...


class SingleSequenceCausalAttention:
    """Dense causal attention over one sequence, all tokens at once, no cache.

    For tests of model code in isolation; the engine never uses it.
    """

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        group = num_heads // num_kv_heads
        q = query.transpose(0, 1)  # [Hq, T, D]
        k = key.transpose(0, 1).repeat_interleave(group, dim=0)
        v = value.transpose(0, 1).repeat_interleave(group, dim=0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=scale
        )
        return out.squeeze(0).transpose(0, 1).contiguous()
