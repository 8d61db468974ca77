"""Device functions the decode and prefill attention kernels share: where a tile of K/V tokens
lies in the paged cache, and one step of the online softmax over such a tile."""

from __future__ import annotations

import contextlib

from nori.kernels._common import device_function

with contextlib.suppress(ImportError):
    import triton.language as tl


@device_function
def online_softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m, l, acc) before the first tile."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


@device_function
def kv_tile(
    table_row_ptr,
    pos,
    end,
    head_columns,
    dim_mask,
    BLOCK_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
):
    """Element offsets and mask [tokens, BLOCK_D] of a sequence's tokens `pos` (those before
    `end`) in the paged cache; table_row_ptr: its block table row; head_columns [1, BLOCK_D]:
    the kv head's element offsets within a token."""
    tok_mask = pos < end
    # Per-token block lookup handles any block size against the tile; repeats hit in L1.
    block_ids = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    slots = block_ids * BLOCK_SIZE + pos % BLOCK_SIZE
    return slots[:, None] * TOKEN_STRIDE + head_columns, tok_mask[:, None] & dim_mask[None, :]


@device_function
def load_dot_operand(ptr, offsets, mask, UPCAST_DOT: tl.constexpr):
    """A tile for tl.dot, zero where masked, in float32 where needed (`upcast_dot_operands`)."""
    tile = tl.load(ptr + offsets, mask=mask, other=0.0)
    if UPCAST_DOT:
        tile = tile.to(tl.float32)
    return tile


@device_function
def online_softmax_step(
    scores,
    m_i,
    l_i,
    acc,
    v_ptrs,
    kv_mask,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Folds one tile into the running row maxima m_i, sums l_i and acc = sum(p * V); returns
    them. scores [rows, tokens] in log2 units, -inf where hidden; v_ptrs [tokens, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    # P is rounded to the cache dtype so that P @ V runs on the tensor cores.
    p_dot = p.to(v_ptrs.dtype.element_ty)
    if UPCAST_DOT:
        v = v.to(tl.float32)
        p_dot = p_dot.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
