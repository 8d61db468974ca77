"""The C++ CPU decode kernel against the PyTorch reference and the float64 dense attention."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    REFERENCE_ATOL,
    dense_attention,
    dense_context,
    random_paged_context,
)

from nori.kernels import paged_decode_attention_cpu, paged_decode_attention_reference
from nori.kernels.cpu_build import cpu_kernels

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or cpu_kernels() is None,
    reason="the C++ CPU kernel runs on CPU tensors and needs a C++ compiler",
)

SCALE = 0.37
# float32 vs float32, summed in a different order (the Triton kernels' float32 tolerance).
ATOL = 1e-5


def _query(batch: int, num_heads: int, head_dim: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(batch, num_heads, head_dim, generator=generator)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])
# 32, 64 and 128 take the compiled-in head sizes; 8 and 48 the generic loop.
@pytest.mark.parametrize("head_dim", [8, 32, 48, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    lengths = [1, block_size - 1, block_size, 3 * block_size + 5, 200]
    ctx = random_paged_context(lengths, num_kv_heads, head_dim, block_size)
    query = _query(len(lengths), num_heads, head_dim)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    expected = paged_decode_attention_reference(*args)
    torch.testing.assert_close(paged_decode_attention_cpu(*args), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3, 40])
def test_matches_dense_attention_at_any_batch_and_thread_count(batch: int, threads: int) -> None:
    """Small batches are cut by kv head across threads, large ones by sequence."""
    lengths = [(i * 37) % 61 + 1 for i in range(batch)]
    ctx = random_paged_context(lengths, 2, 16, 8)
    query = _query(batch, 4, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(
            query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE
        )
    finally:
        torch.set_num_threads(before)
    for b, length in enumerate(lengths):
        keys = dense_context(ctx.k_cache, ctx.block_tables[b], length)
        values = dense_context(ctx.v_cache, ctx.block_tables[b], length)
        expected = dense_attention(query[b : b + 1], keys, values, [length - 1], SCALE)
        torch.testing.assert_close(out[b : b + 1].double(), expected, atol=REFERENCE_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype: torch.dtype) -> None:
    lengths = [5, 40, 17]
    ctx = random_paged_context(lengths, 2, 32, 16, dtype=dtype)
    query = _query(len(lengths), 4, 32).to(dtype)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    out = paged_decode_attention_cpu(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.float(), paged_decode_attention_reference(*args).float(), atol=1e-2, rtol=0
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 8), (7, 1), (32, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_query_over_a_bfloat16_cache(
    head_dim: int, num_heads: int, num_kv_heads: int, threads: int
) -> None:
    """bf16 on both sides takes the AVX-512 BF16 task where the CPU has it: 16-token tiles (the
    lengths cross their edges), output rows in registers 8 / (head_dim / 32) query heads at a time
    (the groups leave every remainder), and both task splits (by kv head at 6 rows,
    by sequence at 40). Against the float32 reference over the same bf16 values: only the
    output's rounding to bf16 may differ."""
    lengths = [1, 15, 16, 17, 33, 200] + [(i * 37) % 61 + 1 for i in range(34)] * (threads - 1)
    ctx = random_paged_context(lengths, num_kv_heads, head_dim, 16, dtype=torch.bfloat16)
    query = _query(len(lengths), num_heads, head_dim).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged = (ctx.block_tables, ctx.seq_lens, SCALE)
        out = paged_decode_attention_cpu(query, ctx.k_cache, ctx.v_cache, *paged)
        exact = (query.float(), ctx.k_cache.float(), ctx.v_cache.float())
        expected = paged_decode_attention_reference(*exact, *paged)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=8e-3)
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_an_error_not_a_crash() -> None:
    ctx = random_paged_context([5, 9], 2, 8, 4)
    query = _query(2, 4, 8)
    k, v, tables, lens = ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens
    bad_tables = tables.clone()
    bad_tables[1, 0] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode_attention_cpu(query, k, v, bad_tables, lens, SCALE)
    too_long = torch.tensor([5, tables.shape[1] * 4 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside its block table"):
        paged_decode_attention_cpu(query, k, v, tables, too_long, SCALE)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention_cpu(query, k, v, tables.long(), lens, SCALE)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        paged_decode_attention_cpu(query[:, :3], k, v, tables, lens, SCALE)
