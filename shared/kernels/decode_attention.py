"""Paged attention for decode steps: one query token per sequence over its cached context.

The Triton path is flash-decoding: one program per (sequence, kv head, split) writes an
unnormalised partial result, and a second kernel merges the splits."""

from __future__ import annotations

import contextlib

import torch

from nori.kernels._attention_tiles import (
    kv_tile,
    load_dot_operand,
    online_softmax_start,
    online_softmax_step,
)
from nori.kernels._common import (
    cdiv,
    check_paged_attention_args,
    device_function,
    dot_precision,
    jit,
    next_power_of_2,
    should_use_triton,
    sm_count,
    upcast_dot_operands,
)
from nori.kernels.decode_attention_reference import paged_decode_attention_reference

with contextlib.suppress(ImportError):
    import triton.language as tl

LOG2_E = 1.4426950408889634
# Below this many tokens a split's fixed cost (query load, partial write) outweighs its work.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 128
PROGRAMS_PER_SM = 2
# tl.dot needs every dimension to be at least 16; smaller ones are padded.
MIN_DOT_DIM = 16


@device_function
def token_scale_offsets(
    table_row_ptr, pos, end, kv_head, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr
):
    """Where the scales of a sequence's tokens `pos` for `kv_head` lie in an 8-bit cache's
    [num_blocks, block_size, Hkv] scale tensor (tokens at or past `end` point at slot 0)."""
    block_ids = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
    return (block_ids * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head


@device_function
def quantized_scores(q, k_cache_ptr, offsets, kv_mask, k_scale, DOT_PRECISION: tl.constexpr):
    """q @ K^T for a tile of 8-bit K codes whose per-token scales are k_scale [tokens]: each
    scale multiplies its score column (the codes are exact in every float dtype)."""
    # Masked codes must be zeros: a stray fp8 byte 0x7F is NaN, and NaN * 0 is NaN.
    k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return scores * k_scale.to(tl.float32)[None, :]


@device_function
def quantized_softmax_step(scores, m_i, l_i, acc, v, v_scale, DOT_PRECISION: tl.constexpr):
    """`online_softmax_step` for a tile of 8-bit V codes v [tokens, BLOCK_D] (already in the
    dot dtype) and per-token scales v_scale [tokens], folded into p (l_i sums the unscaled p)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_dot = (p * v_scale.to(tl.float32)[None, :]).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    row_sequences_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale_log2,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANTIZED: tl.constexpr,
    ROW_SEQUENCES: tl.constexpr,
) -> None:
    # A query row: sequence `row`'s table unless ROW_SEQUENCES maps rows; seq_lens is per row.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = row
    if ROW_SEQUENCES:
        seq = tl.load(row_sequences_ptr + row)
    seq_len = tl.load(seq_lens_ptr + row)
    # Each row splits its own context into NUM_SPLITS runs of whole tiles: the split length is
    # read from the device, so a captured CUDA graph stays right as contexts grow.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # All query heads sharing this kv head are handled together: each K/V tile is read once.
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = load_dot_operand(
        q_ptr,
        row * stride_q_b + q_heads[:, None] * stride_q_h + dims[None, :],
        head_mask[:, None] & dim_mask[None, :],
        UPCAST_DOT,
    )

    m_i, l_i, acc = online_softmax_start(BLOCK_H, BLOCK_D)
    table_row = block_tables_ptr + seq * stride_bt_b
    head_columns = kv_head * HEAD_DIM + dims[None, :]
    TOKEN_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        offsets, kv_mask = kv_tile(
            table_row, pos, end, head_columns, dim_mask, BLOCK_SIZE, TOKEN_STRIDE
        )
        if QUANTIZED:
            token_scales = token_scale_offsets(
                table_row, pos, end, kv_head, BLOCK_SIZE, NUM_KV_HEADS
            )
            k_scale = tl.load(k_scale_ptr + token_scales, mask=pos < end, other=0.0)
            scores = quantized_scores(q, k_cache_ptr, offsets, kv_mask, k_scale, DOT_PRECISION)
        else:
            k = load_dot_operand(k_cache_ptr, offsets, kv_mask, UPCAST_DOT)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        scores = tl.where((pos < end)[None, :], scores, float("-inf"))
        # Every tile holds a real token, so m is finite from the first on.
        v_ptrs = v_cache_ptr + offsets
        if QUANTIZED:
            v_scale = tl.load(v_scale_ptr + token_scales, mask=pos < end, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            m_i, l_i, acc = quantized_softmax_step(scores, m_i, l_i, acc, v, v_scale, DOT_PRECISION)
        else:
            m_i, l_i, acc = online_softmax_step(
                scores, m_i, l_i, acc, v_ptrs, kv_mask, DOT_PRECISION, UPCAST_DOT
            )

    # An empty split stores m = -inf, l = 0, acc = 0, which the merge weighs by zero.
    partial = (row * NUM_KV_HEADS * GROUP + q_heads) * NUM_SPLITS + split
    tl.store(m_ptr + partial, m_i, mask=head_mask)
    tl.store(l_ptr + partial, l_i, mask=head_mask)
    tl.store(
        acc_ptr + partial[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
        acc,
        mask=head_mask[:, None] & dim_mask[None, :],
    )


def _decode_merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    dim_mask = dims < HEAD_DIM
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(m_ptr + row, mask=split_mask, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=split_mask, other=0.0)  # noqa: E741
    acc = tl.load(
        acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    # The split holding the last token is never empty, so m_max is finite.
    m_max = tl.max(m, axis=0)
    weights = tl.exp2(m - m_max)
    denominator = tl.sum(weights * l, axis=0)
    out = tl.sum(weights[:, None] * acc, axis=0) / denominator
    tl.store(
        out_ptr + seq * stride_o_b + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device, block_n: int
) -> int:
    """Enough splits to give every SM work, but none shorter than MIN_TOKENS_PER_SPLIT."""
    programs = max(batch * num_kv_heads, 1)
    wanted = cdiv(PROGRAMS_PER_SM * sm_count(device), programs)
    useful = cdiv(max_context, max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, useful, MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] attends to seq_lens[b] (>= 1) cached tokens of its sequence -> [B, Hq, D].

    k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, M] int32; seq_lens [B]
    int32. num_splits=None picks one from max_seq_len, if known (else from the table's width,
    without a device sync); the launch depends only on shapes (CUDA-graph safe).
    k_scale/v_scale [num_blocks, block_size, Hkv] float16 go with an 8-bit cache (kv_quant.py)."""
    args = check_paged_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    query, k_cache, v_cache, block_tables, seq_lens, _, _ = args
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")

    if not should_use_triton(use_triton, [query]):
        return paged_decode_attention_reference(
            query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=k_scale, v_scale=v_scale
        )
    kernel_args = (num_splits, max_seq_len, k_scale, v_scale)
    return launch_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, *kernel_args)


def launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    max_seq_len: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    row_sequences: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels on checked arguments; row r reads sequence row_sequences[r] (int32
    [R]), or sequence r when it is None."""
    batch, num_heads, head_dim = query.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_n = 64
    max_context = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, query.device, block_n)
    block_d = max(next_power_of_2(head_dim), MIN_DOT_DIM)

    m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)  # noqa: E741
    acc = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
    )
    jit(_decode_split_kernel)[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        # Unread unless QUANTIZED; any tensor serves as the pointer.
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        block_tables,
        seq_lens,
        seq_lens if row_sequences is None else row_sequences,
        m,
        l,
        acc,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(next_power_of_2(group), MIN_DOT_DIM),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST_DOT=upcast_dot_operands(query.dtype),
        QUANTIZED=k_scale is not None,
        ROW_SEQUENCES=row_sequences is not None,
        num_warps=4,
    )
    jit(_decode_merge_kernel)[(batch, num_heads)](
        m,
        l,
        acc,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )
    return out
