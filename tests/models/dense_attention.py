"""A cache-free `Attention` for testing model code on its own."""

from __future__ import annotations

import torch


class SingleSequenceCausalAttention:
    """Dense causal attention over one sequence, all tokens at once, no cache.

    Tests model code in isolation, without the engine's paged cache.
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
