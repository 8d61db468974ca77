"""Causal paged attention for the new tokens of a batch: prefill, chunked prefill, mixed decode.

Each sequence's new tokens sit at the end of its context, whose K/V (theirs included) are
already cached. The Triton path is flash attention: one program per (query tile, kv head)."""

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
    dot_precision,
    gather_context,
    jit,
    next_power_of_2,
    should_use_triton,
    upcast_dot_operands,
)
from nori.kernels.decode_attention import (
    quantized_scores,
    quantized_softmax_step,
    token_scale_offsets,
)
from nori.kernels.kv_quant import dequantize_kv_reference

with contextlib.suppress(ImportError):
    import triton.language as tl

LOG2_E = 1.4426950408889634
MIN_DOT_DIM = 16


def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_bt_b,
    num_seqs,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANTIZED: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Binary search for the sequence owning this tile (the last b with query_start_loc[b] //
    # BLOCK_Q + b <= tile): room for one partial tile per sequence, without reading lengths.
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # Rows are (query token, head of this kv group) pairs: the group shares every K/V tile load.
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_in_seq = q_tile * BLOCK_Q + rows // BLOCK_G
    group_head = rows % BLOCK_G
    row_valid = (q_in_seq < q_len) & (group_head < GROUP)
    # Padding rows borrow the last real token's position so no row is all -inf (NaN softmax).
    q_pos = prefix + tl.minimum(q_in_seq, q_len - 1)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_tokens = (q_start + q_in_seq).to(tl.int64)
    q_heads = kv_head * GROUP + group_head
    q = load_dot_operand(
        q_ptr,
        q_tokens[:, None] * stride_q_t + q_heads[:, None] * stride_q_h + dims[None, :],
        row_valid[:, None] & dim_mask[None, :],
        UPCAST_DOT,
    )

    m_i, l_i, acc = online_softmax_start(BLOCK_Q * BLOCK_G, BLOCK_D)
    table_row = block_tables_ptr + seq * stride_bt_b
    head_columns = kv_head * HEAD_DIM + dims[None, :]
    TOKEN_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    kv_end = prefix + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        offsets, kv_mask = kv_tile(
            table_row, pos, kv_end, head_columns, dim_mask, BLOCK_SIZE, TOKEN_STRIDE
        )
        if QUANTIZED:
            token_scales = token_scale_offsets(
                table_row, pos, kv_end, kv_head, BLOCK_SIZE, NUM_KV_HEADS
            )
            k_scale = tl.load(k_scale_ptr + token_scales, mask=pos < kv_end, other=0.0)
            scores = quantized_scores(q, k_cache_ptr, offsets, kv_mask, k_scale, DOT_PRECISION)
            scores = scores * scale_log2
        else:
            k = load_dot_operand(k_cache_ptr, offsets, kv_mask, UPCAST_DOT)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(pos[None, :] <= q_pos[:, None], scores, float("-inf"))
        v_ptrs = v_cache_ptr + offsets
        if QUANTIZED:
            v_scale = tl.load(v_scale_ptr + token_scales, mask=pos < kv_end, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            m_i, l_i, acc = quantized_softmax_step(scores, m_i, l_i, acc, v, v_scale, DOT_PRECISION)
        else:
            m_i, l_i, acc = online_softmax_step(
                scores, m_i, l_i, acc, v_ptrs, kv_mask, DOT_PRECISION, UPCAST_DOT
            )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_o_t + q_heads[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One scaled_dot_product_attention per sequence, in float32, with an explicit causal mask.
    k_scale/v_scale go with an 8-bit cache: the context read is dequantized to float32 first."""
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for b, seq_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        keys = _gather_context(k_cache, k_scale, block_tables[b], seq_len)
        values = _gather_context(v_cache, v_scale, block_tables[b], seq_len)
        q = query[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        k = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, seq_len, D]
        v = values.float().transpose(0, 1).repeat_interleave(group, dim=0)
        q_positions = torch.arange(q_len, device=query.device) + (seq_len - q_len)
        k_positions = torch.arange(seq_len, device=query.device)
        mask = k_positions[None, :] <= q_positions[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        )
        out[start:end] = attended.transpose(0, 1).to(query.dtype)
    return out


def _gather_context(
    cache: torch.Tensor, cache_scale: torch.Tensor | None, table_row: torch.Tensor, length: int
) -> torch.Tensor:
    if cache_scale is None:
        return gather_context(cache, table_row, length)
        # Raw bytes: index_select has no float8 implementation on CPU.
    codes = gather_context(cache.view(torch.uint8), table_row, length).view(cache.dtype)
    blocks = table_row[: cdiv(length, cache.shape[1])]
    scales = cache_scale.index_select(0, blocks).reshape(-1, cache.shape[2])[:length]
    return dequantize_kv_reference(codes, scales)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Causal attention of the T new tokens query [T, Hq, D] -> [T, Hq, D].

    Sequence b owns query rows query_start_loc[b] .. query_start_loc[b + 1] (int32 [B + 1], 0 to
    T); seq_lens[b] (int32 [B]) counts its whole context, new tokens (whose K/V must be cached)
    included, new token i at position seq_lens[b] - q_len_b + i. k_scale/v_scale
    [num_blocks, block_size, Hkv] float16 go with an 8-bit cache (nori.kernels.kv_quant)."""
    args = check_paged_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        query_start_loc,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    query, k_cache, v_cache, block_tables, seq_lens, starts, batch = args
    assert starts is not None  # given query_start_loc, the check returns it checked
    query_start_loc = starts

    if not should_use_triton(use_triton, [query]):
        return paged_prefill_attention_reference(
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = max(next_power_of_2(head_dim), MIN_DOT_DIM)
    # Rows per program: 128 fills an SM for head_dim <= 128; larger heads would spill.
    block_m = 128 if block_d <= 128 else 64
    block_n = 64 if block_d <= 128 else 32
    block_g = next_power_of_2(group)
    block_q = max(block_m // block_g, 1)
    num_tiles = num_tokens // block_q + batch
    jit(_prefill_kernel)[(num_tiles, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        # Unread unless QUANTIZED; any tensor serves as the pointer.
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        batch,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST_DOT=upcast_dot_operands(query.dtype),
        QUANTIZED=k_scale is not None,
        num_warps=8 if block_q * block_g >= 128 else 4,
    )
    return out
