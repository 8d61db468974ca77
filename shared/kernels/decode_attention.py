"""Paged attention for decode steps: one query token per sequence over its whole cached context.

The Triton path is flash-decoding: the context is cut into splits, one program per
(sequence, kv head, split) writes an unnormalised partial result, and a small second kernel
merges the splits. Splitting keeps the GPU busy when the batch is small and contexts are long.
"""

from __future__ import annotations

import contextlib
import math

import torch

from nori.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_block_tables,
    check_kv_caches,
    check_last_dim_contiguous,
    check_query_heads,
    check_same_device,
    check_seq_lens,
    check_tensor,
    dot_precision,
    jit,
    next_power_of_2,
    should_use_triton,
    sm_count,
    upcast_dot_operands,
)
from nori.kernels.decode_attention_reference import paged_decode_attention_reference

# The CPU engine runs without Triton and only needs the reference.
with contextlib.suppress(ImportError):
    import triton.language as tl

LOG2_E = 1.4426950408889634
# Below this many tokens a split's fixed cost (query load, partial write) outweighs its work.
MIN_TOKENS_PER_SPLIT = 256
# The merge kernel holds every split's partial row at once.
MAX_SPLITS = 128
# Aim for a couple of programs per SM so that uneven sequence lengths still even out.
PROGRAMS_PER_SM = 2
# tl.dot needs every dimension to be at least 16; smaller head groups and head dims are padded.
MIN_DOT_DIM = 16


def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    context_starts_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale_log2,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    tokens_per_split,
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
    MASK_LEFT: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = 0
    if MASK_LEFT:
        context_start = tl.load(context_starts_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # All query heads sharing this kv head are handled together, so each K/V tile is read once
    # per group rather than once per query head.
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = tl.load(
        q_ptr + seq * stride_q_b + q_heads[:, None] * stride_q_h + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        tok_mask = pos < end
        # Looking the block up per token handles block sizes both smaller and larger than
        # BLOCK_N; repeated entries hit in L1.
        block_ids = tl.load(
            block_tables_ptr + seq * stride_bt_b + pos // BLOCK_SIZE, mask=tok_mask, other=0
        ).to(tl.int64)
        slots = block_ids * BLOCK_SIZE + pos % BLOCK_SIZE
        offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASK_LEFT:
            # Left padding is read and computed (as a dense padded batch would) but not seen.
            visible = tok_mask & (pos >= context_start)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A tile of padding only leaves m at -inf; exp2(-inf - -inf) would be NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            scores = tl.where(tok_mask[None, :], scores, float("-inf"))
            # Every tile holds at least one real token, so m_new is finite from the first on.
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        # P is rounded to the cache dtype so that P @ V runs on the tensor cores.
        p_dot = p.to(v_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            v = v.to(tl.float32)
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (past the end of a short sequence, or all left padding) stores m = -inf,
    # l = 0, acc = 0, which the merge weighs by zero.
    row = (seq * NUM_KV_HEADS * GROUP + q_heads) * NUM_SPLITS + split
    tl.store(m_ptr + row, m_i, mask=head_mask)
    tl.store(l_ptr + row, l_i, mask=head_mask)
    tl.store(
        acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
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
    # The split holding the last token is never empty, so m_max is finite and empty splits get
    # weight 0.
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
    context_starts: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] attends to seq_lens[b] (>= 1) cached tokens of its sequence -> [B, Hq, D].

    k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, M] int32; seq_lens [B]
    int32. num_splits=None picks a split count from the batch and context size. max_seq_len, if
    the caller knows it, sizes the splits; otherwise the block table's width bounds the context,
    which needs no device synchronisation but may leave splits empty when tables are wide.
    context_starts [B] int32 (< seq_lens[b]), if given, hides positions before it: left padding.
    """
    query = check_tensor("query", query, 3, FLOAT_DTYPES)
    k_cache, v_cache = check_kv_caches(k_cache, v_cache)
    check_query_heads(query, k_cache)
    batch, num_heads, head_dim = query.shape
    block_tables = check_block_tables(block_tables, batch)
    seq_lens = check_seq_lens(seq_lens, batch)
    tensors = {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    if context_starts is not None:
        tensors["context_starts"] = check_seq_lens(context_starts, batch, "context_starts")
    check_same_device(tensors)
    check_last_dim_contiguous("query", query)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")

    if not should_use_triton(use_triton, [query]):
        return paged_decode_attention_reference(
            query, k_cache, v_cache, block_tables, seq_lens, scale, context_starts
        )
    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_n = 64
    max_context = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, query.device, block_n)
    # A whole number of tiles per split keeps every tile but a sequence's last one full.
    tokens_per_split = cdiv(cdiv(max_context, num_splits), block_n) * block_n
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
        block_tables,
        seq_lens,
        seq_lens if context_starts is None else context_starts,
        m,
        l,
        acc,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        tokens_per_split,
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
        MASK_LEFT=context_starts is not None,
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
