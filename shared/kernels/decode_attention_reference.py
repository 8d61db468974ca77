"""Decode attention without Triton: the PyTorch reference (ground truth, and the CPU engine's
fallback, batching sequences of similar length: `plan_reference_decode`) and the C++ entry point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.kernels._common import (
    cdiv,
)
from nori.kernels.cpu_build import required_cpu_kernels
from nori.kernels.kv_quant import dequantize_kv_reference

# Rows join a group while its padding stays small: a context at least this share of the group's
# padded length, or missing fewer than _REFERENCE_SLACK_TOKENS of it.
_REFERENCE_FILL = 0.75
_REFERENCE_SLACK_TOKENS = 64


@dataclass(frozen=True)
class ReferenceDecodeGroup:
    rows: torch.Tensor | None
    block_ids: torch.Tensor
    num_rows: int
    num_blocks: int
    # [rows, 1, 1, num_blocks * block_size], True where a row may attend; None: no padding.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class ReferenceDecodePlan:
    """How the CPU reference gathers one decode step's contexts; shared by every layer."""

    groups: tuple[ReferenceDecodeGroup, ...]
    num_rows: int


def plan_reference_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> ReferenceDecodePlan:
    lengths: list[int] = seq_lens.tolist()
    batch = len(lengths)
    order = sorted(range(batch), key=lambda row: -lengths[row])
    members: list[list[int]] = []
    padded = 0
    for row in order:
        length = lengths[row]
        if members and (
            length >= _REFERENCE_FILL * padded or padded - length < _REFERENCE_SLACK_TOKENS
        ):
            members[-1].append(row)
        else:
            members.append([row])
            padded = cdiv(length, block_size) * block_size
    device = block_tables.device
    groups = []
    for rows in members:
        num_blocks = cdiv(lengths[rows[0]], block_size)
        if len(members) == 1:
            rows = list(range(batch))  # one group: keep the batch's order, no scatter
            row_index = None
            tables = block_tables
            group_lens = seq_lens
        else:
            row_index = torch.tensor(rows, dtype=torch.long, device=device)
            tables = block_tables.index_select(0, row_index)
            group_lens = seq_lens.index_select(0, row_index)
        mask = None
        padded_len = num_blocks * block_size
        if any(lengths[row] != padded_len for row in rows):
            positions = torch.arange(padded_len, device=device)
            mask = positions[None, :] < group_lens[:, None].to(positions.dtype)
            mask = mask[:, None, None, :]
        groups.append(
            ReferenceDecodeGroup(
                rows=row_index,
                block_ids=tables[:, :num_blocks].reshape(-1),
                num_rows=len(rows),
                num_blocks=num_blocks,
                mask=mask,
            )
        )
    return ReferenceDecodePlan(groups=tuple(groups), num_rows=batch)


def run_reference_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ReferenceDecodePlan,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] over the contexts `plan` describes -> [B, Hq, D]; k_scale/v_scale
    [num_blocks, block_size, Hkv] float16 go with an 8-bit cache."""
    batch, num_heads, head_dim = query.shape
    if batch == 0:
        return torch.empty_like(query)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    output = None if len(plan.groups) == 1 else torch.empty_like(query)
    for part in plan.groups:
        rows = part.num_rows
        shape = (rows, part.num_blocks * block_size, num_kv_heads, head_dim)
        keys = _gather_blocks(k_cache, k_scale, part.block_ids).view(shape).transpose(1, 2)
        values = _gather_blocks(v_cache, v_scale, part.block_ids).view(shape).transpose(1, 2)
        q = query if part.rows is None else query.index_select(0, part.rows)
        # The query heads sharing a kv head go in as its "query positions": K/V never expanded.
        attended = torch.nn.functional.scaled_dot_product_attention(
            q.float().reshape(rows, num_kv_heads, group, head_dim),
            keys.float(),
            values.float(),
            attn_mask=part.mask,
            scale=scale,
        )
        result = attended.reshape(rows, num_heads, head_dim).to(query.dtype)
        if output is None:
            return result
        assert part.rows is not None
        output.index_copy_(0, part.rows, result)
    assert output is not None
    return output


def _gather_blocks(
    cache: torch.Tensor, cache_scale: torch.Tensor | None, block_ids: torch.Tensor
) -> torch.Tensor:
    """The cache blocks `block_ids`, dequantized to float32 when the cache is 8-bit."""
    # index_select copies whole blocks, far faster than advanced indexing.
    if cache_scale is None:
        return cache.index_select(0, block_ids)
        # Raw bytes: index_select has no float8 implementation on CPU.
    codes = cache.view(torch.uint8).index_select(0, block_ids).view(cache.dtype)
    return dequantize_kv_reference(codes, cache_scale.index_select(0, block_ids))


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gathers each context into a padded [B, L, Hkv, D] view and masks the padding, in groups
    of similar length; an 8-bit cache's blocks are dequantized to float32 first.
    """
    plan = plan_reference_decode(block_tables, seq_lens, k_cache.shape[1])
    return run_reference_decode(query, k_cache, v_cache, plan, scale, k_scale, v_scale)


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ kernel (decode_attention_cpu.cpp), the reference's contract for CPU tensors,
    reading each context in place; RuntimeError where it is not built."""
    arguments = (query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    return required_cpu_kernels().paged_decode_attention(*arguments)
