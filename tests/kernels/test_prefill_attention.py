from __future__ import annotations

import itertools

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
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

SCALE = 0.29


def _batch(
    rows: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """rows: (cached prefix length, new tokens) per sequence -> reference/kernel arguments."""
    seq_lens = [prefix + new for prefix, new in rows]
    ctx = random_paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype=dtype)
    starts = [0, *itertools.accumulate(new for _, new in rows)]
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    return (
        query.to(DEVICE),
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        query_start_loc,
        ctx.seq_lens,
    )


# A mixed batch: whole prompts, chunks over cached prefixes of assorted lengths (inside a block,
# on a block boundary, several blocks), and decode rows (one new token).
MIXED_ROWS = [(0, 1), (0, 7), (5, 1), (0, 16), (16, 16), (13, 20), (40, 1), (3, 9)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    args = _batch(MIXED_ROWS, num_heads, num_kv_heads, head_dim, block_size)
    expected = paged_prefill_attention_reference(*args, SCALE)
    assert_close(paged_prefill_attention(*args, SCALE, use_triton=True), expected)


def test_several_query_tiles_per_sequence() -> None:
    # 300 new tokens with no grouping span three 128-row query tiles; the long prefix needs many
    # K/V tiles per query tile.
    args = _batch([(0, 300), (200, 130), (7, 1)], 2, 2, 16, 16)
    expected = paged_prefill_attention_reference(*args, SCALE)
    assert_close(paged_prefill_attention(*args, SCALE, use_triton=True), expected)


@pytest.mark.parametrize("block_size", [1, 128])
def test_block_sizes_smaller_and_larger_than_a_tile(block_size: int) -> None:
    args = _batch([(0, 5), (70, 90)], 4, 1, 16, block_size)
    expected = paged_prefill_attention_reference(*args, SCALE)
    assert_close(paged_prefill_attention(*args, SCALE, use_triton=True), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    args = _batch(MIXED_ROWS, 8, 2, 64, 16, dtype=dtype)
    out = paged_prefill_attention(*args, SCALE, use_triton=True)
    assert out.dtype == dtype
    assert_close(out, paged_prefill_attention_reference(*args, SCALE))


def test_strided_query_and_odd_head_dim() -> None:
    query, *rest = _batch([(0, 9), (21, 4)], 12, 2, 80, 16)
    view = torch.cat([query, query[:, :4]], dim=1)[:, :8]
    assert not view.is_contiguous()
    args = (view, *rest)
    expected = paged_prefill_attention_reference(*args, SCALE)
    assert_close(paged_prefill_attention(*args, SCALE, use_triton=True), expected)


def test_sequences_without_new_tokens_are_skipped() -> None:
    args = _batch([(5, 0), (0, 3), (9, 0)], 2, 1, 16, 8)
    expected = paged_prefill_attention_reference(*args, SCALE)
    assert_close(paged_prefill_attention(*args, SCALE, use_triton=True), expected)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1)])
def test_reference_matches_dense_attention(num_heads: int, num_kv_heads: int) -> None:
    rows = [(0, 1), (0, 6), (5, 4), (8, 1)]
    query, k_cache, v_cache, tables, starts, lens = _batch(rows, num_heads, num_kv_heads, 8, 4)
    out = paged_prefill_attention_reference(query, k_cache, v_cache, tables, starts, lens, SCALE)
    for b, (prefix, new) in enumerate(rows):
        start = int(starts[b])
        keys = dense_context(k_cache, tables[b], prefix + new)
        values = dense_context(v_cache, tables[b], prefix + new)
        positions = list(range(prefix, prefix + new))
        expected = dense_attention(query[start : start + new], keys, values, positions, SCALE)
        torch.testing.assert_close(
            out[start : start + new].double().cpu(), expected, atol=REFERENCE_ATOL, rtol=0
        )


def test_single_token_rows_agree_with_decode_reference() -> None:
    rows = [(0, 1), (6, 1), (31, 1)]
    query, k_cache, v_cache, tables, starts, lens = _batch(rows, 4, 2, 16, 8)
    prefill = paged_prefill_attention_reference(
        query, k_cache, v_cache, tables, starts, lens, SCALE
    )
    decode = paged_decode_attention_reference(query, k_cache, v_cache, tables, lens, SCALE)
    torch.testing.assert_close(prefill, decode, atol=REFERENCE_ATOL, rtol=0)


def test_rejects_bad_arguments() -> None:
    query, k, v, tables, starts, lens = _batch([(0, 3), (2, 2)], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="query must have 3 dimensions"):
        paged_prefill_attention(query[0], k, v, tables, starts, lens, SCALE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_prefill_attention(query[:, :3], k, v, tables, starts, lens, SCALE)
    with pytest.raises(ValueError, match="query_start_loc must have dtype"):
        paged_prefill_attention(query, k, v, tables, starts.long(), lens, SCALE)
    with pytest.raises(ValueError, match="B \\+ 1 entries"):
        paged_prefill_attention(query, k, v, tables[:0], starts[:0], lens[:0], SCALE)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_prefill_attention(query, k, v, tables, starts[:2], lens, SCALE)
    with pytest.raises(ValueError, match="seq_lens must have 2 entries"):
        paged_prefill_attention(query, k, v, tables, starts, lens[:1], SCALE)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_prefill_attention(query, k, v.half(), tables, starts, lens, SCALE)
    with pytest.raises(ValueError, match="k_cache must have 4 dimensions"):
        paged_prefill_attention(query, k[0], v, tables, starts, lens, SCALE)
