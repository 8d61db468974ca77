from __future__ import annotations

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

from nori.kernels import paged_decode_attention, paged_decode_attention_reference
from nori.kernels.decode_attention import choose_num_splits

SCALE = 0.37


def _query(batch: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype).to(DEVICE)


def _lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, 3 * block_size + 5]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    lengths = _lengths(block_size)
    ctx = random_paged_context(lengths, num_kv_heads, head_dim, block_size)
    query = _query(len(lengths), num_heads, head_dim, torch.float32)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    expected = paged_decode_attention_reference(*args)
    assert_close(paged_decode_attention(*args, use_triton=True), expected)


def test_long_context_uses_several_splits() -> None:
    lengths, num_kv_heads, block_size = [2000, 37], 2, 16
    ctx = random_paged_context(lengths, num_kv_heads, 16, block_size)
    assert (
        choose_num_splits(2, num_kv_heads, ctx.block_tables.shape[1] * block_size, DEVICE, 64) > 4
    )
    query = _query(2, 8, 16, torch.float32)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    expected = paged_decode_attention_reference(*args)
    assert_close(paged_decode_attention(*args, use_triton=True), expected)
    assert_close(paged_decode_attention(*args, max_seq_len=2000, use_triton=True), expected)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_explicit_splits_including_empty_ones(num_splits: int) -> None:
    # With 16 splits over a 300-token bound, the short sequences leave most splits empty.
    lengths = [300, 1, 70]
    ctx = random_paged_context(lengths, 1, 16, 32)
    query = _query(3, 4, 16, torch.float32)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    expected = paged_decode_attention_reference(*args)
    assert_close(paged_decode_attention(*args, num_splits, use_triton=True), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    lengths = [1, 15, 100]
    ctx = random_paged_context(lengths, 2, 64, 16, dtype=dtype)
    query = _query(3, 8, 64, dtype)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    out = paged_decode_attention(*args, use_triton=True)
    assert out.dtype == dtype
    assert_close(out, paged_decode_attention_reference(*args))


@pytest.mark.parametrize("block_size", [1, 128])
def test_block_sizes_smaller_and_larger_than_a_tile(block_size: int) -> None:
    lengths = [5, 150]
    ctx = random_paged_context(lengths, 2, 16, block_size)
    query = _query(2, 4, 16, torch.float32)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    assert_close(
        paged_decode_attention(*args, use_triton=True), paged_decode_attention_reference(*args)
    )


def test_strided_query_and_odd_head_dim() -> None:
    # head_dim 80 is not a power of two; the query is a view into a fused projection output.
    lengths = [40, 9]
    ctx = random_paged_context(lengths, 2, 80, 16)
    fused = _query(2, 12, 80, torch.float32)
    query = fused[:, 4:]
    assert not query.is_contiguous()
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    assert_close(
        paged_decode_attention(*args, use_triton=True), paged_decode_attention_reference(*args)
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "lengths"),
    [
        (2, 2, [1, 7, 8, 29]),
        (4, 1, [1, 7, 8, 29]),
        # More sequences than one length group: exercises the sort-and-group path.
        (4, 2, [(i * 37) % 61 + 1 for i in range(40)]),
    ],
)
def test_reference_matches_dense_attention(
    num_heads: int, num_kv_heads: int, lengths: list[int]
) -> None:
    ctx = random_paged_context(lengths, num_kv_heads, 8, 8)
    query = _query(len(lengths), num_heads, 8, torch.float32)
    out = paged_decode_attention_reference(
        query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE
    )
    for b, length in enumerate(lengths):
        keys = dense_context(ctx.k_cache, ctx.block_tables[b], length)
        values = dense_context(ctx.v_cache, ctx.block_tables[b], length)
        expected = dense_attention(query[b : b + 1], keys, values, [length - 1], SCALE)
        torch.testing.assert_close(
            out[b : b + 1].double().cpu(), expected, atol=REFERENCE_ATOL, rtol=0
        )


def test_wrapper_without_triton_runs_the_reference() -> None:
    ctx = random_paged_context([5, 9], 1, 8, 4)
    query = _query(2, 2, 8, torch.float32)
    args = (query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE)
    assert torch.equal(
        paged_decode_attention(*args, use_triton=False), paged_decode_attention_reference(*args)
    )


def test_rejects_bad_arguments() -> None:
    ctx = random_paged_context([5, 9], 2, 8, 4)
    query = _query(2, 4, 8, torch.float32)
    k, v, tables, lens = ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens
    with pytest.raises(ValueError, match="query must have 3 dimensions"):
        paged_decode_attention(query[0], k, v, tables, lens, SCALE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(query[:, :3], k, v, tables, lens, SCALE)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query[:, :, :4], k, v, tables, lens, SCALE)
    with pytest.raises(ValueError, match="does not match cache dtype"):
        paged_decode_attention(query.half(), k, v, tables, lens, SCALE)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_decode_attention(query, k, v, tables.long(), lens, SCALE)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(query, k, v, tables[:1], lens, SCALE)
    with pytest.raises(ValueError, match="seq_lens must have 2 entries"):
        paged_decode_attention(query, k, v, tables, lens[:1], SCALE)
    with pytest.raises(ValueError, match="same shape"):
        paged_decode_attention(query, k, v[:, :2], tables, lens, SCALE)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        paged_decode_attention(query, k.transpose(0, 1), v.transpose(0, 1), tables, lens, SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(query, k, v, tables, lens, SCALE, num_splits=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        paged_decode_attention(query, k, v, tables, lens, float("nan"))
