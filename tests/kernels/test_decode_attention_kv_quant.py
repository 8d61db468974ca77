"""Decode attention over an 8-bit (int8 / fp8) KV cache with float16 per token-head scales."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_helpers import (
    DEVICE,
    REFERENCE_ATOL,
    assert_close,
    dense_attention,
    dense_context,
    random_paged_context,
)

from nori.kernels import (
    KV_CACHE_DTYPES,
    dequantize_kv_reference,
    paged_decode_attention,
    paged_decode_attention_reference,
    quantize_kv_reference,
)

SCALE = 0.37
CACHE_DTYPES = list(KV_CACHE_DTYPES.values())


@dataclass
class QuantizedContext:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_kv_reference(self.k_cache, self.k_scale),
            dequantize_kv_reference(self.v_cache, self.v_scale),
        )


def _quantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    codes, scale = quantize_kv_reference(cache.reshape(-1, num_kv_heads, head_dim), dtype)
    return codes.view(cache.shape), scale.view(num_blocks, block_size, num_kv_heads)


def quantized_context(
    lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> QuantizedContext:
    ctx = random_paged_context(lengths, num_kv_heads, head_dim, block_size)
    # Rows of different magnitudes, so that the per token-head scales matter.
    generator = torch.Generator().manual_seed(7)
    magnitudes = torch.rand(ctx.k_cache.shape[:3], generator=generator)[..., None] * 4 + 0.1
    k_cache, k_scale = _quantize_cache(ctx.k_cache * magnitudes.to(DEVICE), dtype)
    v_cache, v_scale = _quantize_cache(ctx.v_cache * magnitudes.flip(0).to(DEVICE), dtype)
    return QuantizedContext(k_cache, v_cache, k_scale, v_scale, ctx.block_tables, ctx.seq_lens)


def _query(batch: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype).to(DEVICE)


def _attend(
    query: torch.Tensor,
    ctx: QuantizedContext,
    *,
    use_triton: bool | None,
    num_splits: int | None = None,
) -> torch.Tensor:
    return paged_decode_attention(
        query,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        ctx.seq_lens,
        SCALE,
        num_splits,
        k_scale=ctx.k_scale,
        v_scale=ctx.v_scale,
        use_triton=use_triton,
    )


def _reference(query: torch.Tensor, ctx: QuantizedContext) -> torch.Tensor:
    return paged_decode_attention_reference(
        query,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        ctx.seq_lens,
        SCALE,
        ctx.k_scale,
        ctx.v_scale,
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
    lengths = [1, block_size - 1, 3 * block_size + 5, 100]
    ctx = quantized_context(lengths, num_kv_heads, head_dim, block_size, cache_dtype)
    query = _query(len(lengths), num_heads, head_dim, query_dtype)
    out = _attend(query, ctx, use_triton=True)
    assert out.dtype == query_dtype
    assert_close(out, _reference(query, ctx))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_several_splits(cache_dtype: torch.dtype) -> None:
    lengths = [300, 37, 9]
    ctx = quantized_context(lengths, 2, 16, 16, cache_dtype)
    query = _query(len(lengths), 4, 16, torch.float32)
    expected = _reference(query, ctx)
    got = _attend(query, ctx, use_triton=True, num_splits=4)
    assert_close(got, expected)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_reference_matches_dense_attention_over_the_dequantized_cache(
    cache_dtype: torch.dtype,
) -> None:
    lengths = [1, 7, 8, 29]
    ctx = quantized_context(lengths, 2, 8, 8, cache_dtype)
    query = _query(len(lengths), 4, 8, torch.float32)
    out = _reference(query, ctx)
    k_cache, v_cache = ctx.dequantized()
    for b, length in enumerate(lengths):
        keys = dense_context(k_cache, ctx.block_tables[b], length)
        values = dense_context(v_cache, ctx.block_tables[b], length)
        expected = dense_attention(query[b : b + 1], keys, values, [length - 1], SCALE)
        # Values reach a few units here, so the float32 reference gets a relative margin too.
        torch.testing.assert_close(
            out[b : b + 1].double().cpu(), expected, atol=REFERENCE_ATOL, rtol=1e-5
        )


def test_reference_equals_attention_over_a_dequantized_float_cache() -> None:
    ctx = quantized_context([5, 20], 1, 16, 4, torch.int8)
    query = _query(2, 2, 16, torch.float32)
    k_cache, v_cache = ctx.dequantized()
    dense = paged_decode_attention_reference(
        query, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, SCALE
    )
    torch.testing.assert_close(_reference(query, ctx), dense, atol=0, rtol=0)


def test_wrapper_without_triton_runs_the_reference() -> None:
    ctx = quantized_context([5, 9], 1, 8, 4, torch.float8_e4m3fn)
    query = _query(2, 2, 8, torch.float32)
    assert torch.equal(_attend(query, ctx, use_triton=False), _reference(query, ctx))


def test_rejects_bad_arguments() -> None:
    ctx = quantized_context([5, 9], 2, 8, 4, torch.int8)
    query = _query(2, 4, 8, torch.float32)
    k, v, tables, lens = ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens
    ks, vs = ctx.k_scale, ctx.v_scale
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        paged_decode_attention(query, k, v, tables, lens, SCALE)
    with pytest.raises(ValueError, match="must be given together"):
        paged_decode_attention(query, k, v, tables, lens, SCALE, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale must have dtype"):
        paged_decode_attention(query, k, v, tables, lens, SCALE, k_scale=ks.float(), v_scale=vs)
    with pytest.raises(ValueError, match=r"v_scale must be \[num_blocks"):
        paged_decode_attention(query, k, v, tables, lens, SCALE, k_scale=ks, v_scale=vs[:1])
    with pytest.raises(ValueError, match="k_cache must have dtype"):
        paged_decode_attention(
            query, k.float(), v.float(), tables, lens, SCALE, k_scale=ks, v_scale=vs
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(query[:, :3], k, v, tables, lens, SCALE, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query[:, :, :4], k, v, tables, lens, SCALE, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="seq_lens must have 2 entries"):
        paged_decode_attention(query, k, v, tables, lens[:1], SCALE, k_scale=ks, v_scale=vs)
