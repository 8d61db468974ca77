"""Multi-query decode (speculative verification rows) on every path: the PyTorch reference against
the float64 dense attention and the prefill reference, then the Triton and C++ CPU paths against
the reference, over float, bfloat16 and 8-bit caches."""

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
    paged_multi_query_decode_attention,
    paged_multi_query_decode_attention_cpu,
    paged_multi_query_decode_attention_reference,
    paged_prefill_attention_reference,
    quantize_kv_reference,
)
from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.multi_query_decode_attention import multi_query_rows

SCALE = 0.37
BLOCK_SIZE = 8
# Rows per sequence and contexts that cross block boundaries (a sequence's rows straddle one).
Q_LENS = [5, 1, 3, 2, 4]
SEQ_LENS = [5, 9, 3 * BLOCK_SIZE + 2, 70, BLOCK_SIZE + 1]
needs_cpu_kernel = pytest.mark.skipif(
    torch.cuda.is_available() or cpu_kernels() is None,
    reason="the C++ CPU kernel runs on CPU tensors and needs a C++ compiler",
)


@dataclass
class VerifyBatch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def args(self) -> tuple[torch.Tensor | float, ...]:
        return (
            *(self.query, self.k_cache, self.v_cache, self.block_tables),
            *(self.query_start_loc, self.seq_lens, SCALE),
        )

    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def _verify_batch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
) -> VerifyBatch:
    ctx = random_paged_context(SEQ_LENS, num_kv_heads, head_dim, BLOCK_SIZE, dtype=dtype)
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(sum(Q_LENS), num_heads, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    batch = VerifyBatch(
        query.to(DEVICE),
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        starts.to(DEVICE),
        ctx.seq_lens,
    )
    if cache_dtype is not None:
        batch.k_cache, batch.k_scale = _quantize(ctx.k_cache * 3, cache_dtype)
        batch.v_cache, batch.v_scale = _quantize(ctx.v_cache, cache_dtype)
    return batch


def _quantize(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    codes, scale = quantize_kv_reference(cache.reshape(-1, num_kv_heads, head_dim), dtype)
    return codes.view(cache.shape), scale.view(num_blocks, block_size, num_kv_heads)


def _dense(batch: VerifyBatch) -> torch.Tensor:
    """Float64 attention written out: row i of a sequence at position seq_len - q_len + i."""
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if batch.k_scale is not None and batch.v_scale is not None:
        k_cache = dequantize_kv_reference(k_cache, batch.k_scale)
        v_cache = dequantize_kv_reference(v_cache, batch.v_scale)
    parts = []
    starts = batch.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(zip(Q_LENS, SEQ_LENS, strict=True)):
        keys = dense_context(k_cache, batch.block_tables[b], seq_len)
        values = dense_context(v_cache, batch.block_tables[b], seq_len)
        positions = list(range(seq_len - q_len, seq_len))
        query = batch.query[starts[b] : starts[b + 1]]
        parts.append(dense_attention(query, keys, values, positions, SCALE))
    return torch.cat(parts)


def test_rows_are_decode_rows_of_growing_context() -> None:
    starts = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    rows = multi_query_rows(starts, torch.tensor([10, 1, 20], dtype=torch.int32), 6)
    assert rows.sequences.tolist() == [0, 0, 0, 1, 2, 2]
    assert rows.seq_lens.tolist() == [8, 9, 10, 1, 19, 20]


@pytest.mark.parametrize("cache_dtype", [None, *KV_CACHE_DTYPES.values()])
def test_reference_matches_dense_and_prefill_reference(cache_dtype: torch.dtype | None) -> None:
    batch = _verify_batch(6, 2, 16, cache_dtype=cache_dtype)
    out = paged_multi_query_decode_attention_reference(*batch.args(), **batch.scales())
    torch.testing.assert_close(out.double(), _dense(batch), atol=REFERENCE_ATOL, rtol=0)
    # The prefill kernels compute these rows too (a chunk at the end of its context).
    prefill = paged_prefill_attention_reference(*batch.args(), **batch.scales())
    torch.testing.assert_close(out, prefill, atol=REFERENCE_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [(9, 3, torch.float32), (4, 4, torch.float32), (8, 2, torch.bfloat16)],
)
def test_triton_matches_reference(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    batch = _verify_batch(num_heads, num_kv_heads, 16, dtype)
    expected = paged_multi_query_decode_attention_reference(*batch.args())
    out = paged_multi_query_decode_attention(*batch.args(), use_triton=True)
    assert out.dtype == dtype
    assert_close(out, expected)
    # Several context splits per row, some of them empty for the short rows.
    assert_close(paged_multi_query_decode_attention(*batch.args(), 3, use_triton=True), expected)


@pytest.mark.parametrize("cache_dtype", list(KV_CACHE_DTYPES.values()))
def test_triton_8bit_cache_matches_reference(cache_dtype: torch.dtype) -> None:
    batch = _verify_batch(6, 2, 16, cache_dtype=cache_dtype)
    expected = paged_multi_query_decode_attention_reference(*batch.args(), **batch.scales())
    out = paged_multi_query_decode_attention(*batch.args(), use_triton=True, **batch.scales())
    assert_close(out, expected)


@needs_cpu_kernel
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "cache_dtype"),
    [
        (9, 3, 64, torch.float32, None),
        (6, 2, 48, torch.float32, None),
        # head_dim 64 in bfloat16 takes the AVX-512 BF16 task where the CPU has it.
        (8, 2, 64, torch.bfloat16, None),
        (6, 2, 32, torch.float32, torch.int8),
        (6, 2, 32, torch.bfloat16, torch.float8_e4m3fn),
    ],
)
def test_cpu_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
) -> None:
    batch = _verify_batch(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    expected = paged_multi_query_decode_attention_reference(*batch.args(), **batch.scales())
    out = paged_multi_query_decode_attention_cpu(*batch.args(), **batch.scales())
    assert out.dtype == dtype
    assert_close(out, expected)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), _dense(batch), atol=REFERENCE_ATOL, rtol=0)
