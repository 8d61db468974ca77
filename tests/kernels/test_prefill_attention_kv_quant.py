"""Prefill attention over an 8-bit (int8 / fp8) KV cache with float16 per token-head scales."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_helpers import ATOL, DEVICE, RTOL
from test_decode_attention_kv_quant import CACHE_DTYPES, QuantizedContext, quantized_context

from nori.kernels import paged_prefill_attention, paged_prefill_attention_reference

SCALE = 0.29
# Per row (cached prefix, new tokens): whole prompts, chunks over cached prefixes (inside a
# block, on a block boundary, several blocks) and decode rows.
MIXED_ROWS = [(0, 1), (0, 7), (5, 1), (16, 16), (13, 20), (40, 1), (3, 9)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """kernel_helpers.assert_close with the absolute tolerance scaled by the outputs' size: the
    quantized contexts' rows have magnitudes up to ~4, so outputs reach ~13 rather than O(1)."""
    size = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=ATOL[expected.dtype] * size,
        rtol=RTOL[expected.dtype],
    )


def _batch(
    rows: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, QuantizedContext]:
    """rows -> (query, query_start_loc, quantized context)."""
    lengths = [prefix + new for prefix, new in rows]
    ctx = quantized_context(lengths, num_kv_heads, head_dim, block_size, cache_dtype)
    starts = [0, *itertools.accumulate(new for _, new in rows)]
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(query_dtype)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    return query.to(DEVICE), query_start_loc, ctx


def _attend(
    query: torch.Tensor,
    query_start_loc: torch.Tensor,
    ctx: QuantizedContext,
    *,
    use_triton: bool | None,
) -> torch.Tensor:
    return paged_prefill_attention(
        query,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        query_start_loc,
        ctx.seq_lens,
        SCALE,
        k_scale=ctx.k_scale,
        v_scale=ctx.v_scale,
        use_triton=use_triton,
    )


def _reference(
    query: torch.Tensor, query_start_loc: torch.Tensor, ctx: QuantizedContext
) -> torch.Tensor:
    return paged_prefill_attention_reference(
        query,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        query_start_loc,
        ctx.seq_lens,
        SCALE,
        k_scale=ctx.k_scale,
        v_scale=ctx.v_scale,
    )


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(2, 2, 8, 8), (8, 2, 64, 16)]
)
def test_triton_matches_reference(
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    query, starts, ctx = _batch(
        MIXED_ROWS, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, query_dtype
    )
    out = _attend(query, starts, ctx, use_triton=True)
    assert out.dtype == query_dtype
    assert_close(out, _reference(query, starts, ctx))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_reference_equals_attention_over_a_dequantized_float_cache(
    cache_dtype: torch.dtype,
) -> None:
    query, starts, ctx = _batch(MIXED_ROWS, 4, 2, 16, 4, cache_dtype)
    k_cache, v_cache = ctx.dequantized()
    args = (ctx.block_tables, starts, ctx.seq_lens, SCALE)
    dense = paged_prefill_attention_reference(query, k_cache, v_cache, *args)
    torch.testing.assert_close(_reference(query, starts, ctx), dense, atol=0, rtol=0)


def test_wrapper_without_triton_runs_the_reference() -> None:
    query, starts, ctx = _batch([(3, 2), (0, 9)], 2, 1, 8, 4, torch.float8_e4m3fn)
    assert torch.equal(
        _attend(query, starts, ctx, use_triton=False), _reference(query, starts, ctx)
    )


def test_rejects_bad_arguments() -> None:
    query, starts, ctx = _batch([(0, 3), (2, 2)], 4, 2, 8, 4, torch.int8)
    k, v, tables, lens = ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens
    ks, vs = ctx.k_scale, ctx.v_scale
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        paged_prefill_attention(query, k, v, tables, starts, lens, SCALE)
    with pytest.raises(ValueError, match="must be given together"):
        paged_prefill_attention(query, k, v, tables, starts, lens, SCALE, v_scale=vs)
    with pytest.raises(ValueError, match="k_cache must have dtype"):
        paged_prefill_attention(
            query, k.float(), v.float(), tables, starts, lens, SCALE, k_scale=ks, v_scale=vs
        )
    with pytest.raises(ValueError, match="k_scale must have dtype"):
        paged_prefill_attention(
            query, k, v, tables, starts, lens, SCALE, k_scale=ks.float(), v_scale=vs
        )
    with pytest.raises(ValueError, match=r"v_scale must be \[num_blocks"):
        paged_prefill_attention(
            query, k, v, tables, starts, lens, SCALE, k_scale=ks, v_scale=vs[:1]
        )
    with pytest.raises(ValueError, match="query_start_loc must have dtype"):
        paged_prefill_attention(
            query, k, v, tables, starts.long(), lens, SCALE, k_scale=ks, v_scale=vs
        )
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_prefill_attention(
            query, k, v, tables, starts[:2], lens, SCALE, k_scale=ks, v_scale=vs
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_prefill_attention(
            query[:, :3], k, v, tables, starts, lens, SCALE, k_scale=ks, v_scale=vs
        )
