"""Test data for the paged-attention kernels and independent dense implementations to check
the references against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Triton vs reference, per output dtype. Outputs are softmax-weighted means of N(0, 1) values,
# so they are O(1) and an absolute tolerance is meaningful. Half precision loses digits where
# the kernels round the probabilities to the value dtype before the P @ V product.
ATOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
RTOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
# Reference (float32) vs the float64 dense implementations below.
REFERENCE_ATOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=ATOL[expected.dtype],
        rtol=RTOL[expected.dtype],
    )


@dataclass
class PagedContext:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def random_paged_context(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    extra_columns: int = 2,
    seed: int = 0,
) -> PagedContext:
    """Random caches with shuffled, non-contiguous block ids; unused blocks hold garbage too.

    Table padding is 0, as in the engine; block 0 belongs to some sequence or is spare.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    width = max(blocks_per_seq, default=0) + extra_columns
    num_blocks = sum(blocks_per_seq) * 2 + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    ids = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = ids[used : used + count]
        used += count
    return PagedContext(
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def dense_context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hkv, D] float64, one token at a time by the slot formula."""
    cache, table = cache.cpu(), table.cpu()
    block_size = cache.shape[1]
    rows = []
    for position in range(length):
        block = int(table[position // block_size])
        rows.append(cache[block, position % block_size])
    return torch.stack(rows).double()


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: list[int],
    scale: float,
) -> torch.Tensor:
    """query [n, Hq, D] at `positions`, keys/values [L, Hkv, D] -> [n, Hq, D] float64.

    Each query head is mapped to its kv head explicitly, and softmax written out by hand.
    """
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, position in enumerate(positions):
        for head in range(num_heads):
            kv_head = head // group
            k = keys[: position + 1, kv_head]
            v = values[: position + 1, kv_head]
            scores = (k @ query[i, head].double().cpu()) * scale
            weights = torch.exp(scores - scores.max())
            out[i, head] = (weights[:, None] * v).sum(0) / weights.sum()
    return out
