"""Prefill attention on CPU: whole new prompts batched, chunks one by one.

Whole new prompts of equal length share one causal SDPA call; a chunk gathers its context from
the cache, one call each (docs/benchmarks.md#cpu-prefill-attention). 8-bit caches: the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.kernels._common import gather_context
from nori.kernels.prefill_attention import paged_prefill_attention_reference


@dataclass(frozen=True)
class FreshPromptGroup:
    rows: torch.Tensor  # the group's query rows, prompt after prompt
    num_prompts: int
    length: int
    # When the rows are one contiguous run, slices replace the gather and the scatter.
    contiguous: slice | None


@dataclass(frozen=True)
class CpuPrefillPlan:
    fresh: tuple[FreshPromptGroup, ...]
    # Sequences (indexes into the step's prefill sequences) that take the reference.
    others: tuple[int, ...]


def plan_cpu_prefill(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> CpuPrefillPlan:
    """query_start_loc [B + 1] and seq_lens [B] as the kernels take them (rows start at 0)."""
    starts: list[int] = query_start_loc.tolist()
    lengths: list[int] = seq_lens.tolist()
    by_length: dict[int, list[int]] = {}
    others: list[int] = []
    for index, seq_len in enumerate(lengths):
        new_tokens = starts[index + 1] - starts[index]
        if new_tokens == seq_len:
            by_length.setdefault(seq_len, []).append(index)
        elif new_tokens > 0:
            others.append(index)
    fresh = []
    for length, members in by_length.items():
        rows = [row for index in members for row in range(starts[index], starts[index] + length)]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        fresh.append(
            FreshPromptGroup(
                rows=torch.tensor(rows, dtype=torch.long, device=query_start_loc.device),
                num_prompts=len(members),
                length=length,
                contiguous=slice(rows[0], rows[-1] + 1) if contiguous else None,
            )
        )
    return CpuPrefillPlan(fresh=tuple(fresh), others=tuple(others))


def _prompt_major(
    x: torch.Tensor, group: FreshPromptGroup, heads: int, dtype: torch.dtype
) -> torch.Tensor:
    """The group's rows of x [T, heads, D] as [prompts, heads, length, D] in `dtype`."""
    rows = x[group.contiguous] if group.contiguous else x.index_select(0, group.rows)
    shape = (group.num_prompts, group.length, heads, x.shape[-1])
    return rows.reshape(shape).transpose(1, 2).to(dtype)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """bfloat16 where query, key and value all are (bf16 products, float32 sums: faster, and no
    less accurate for a bf16 output); otherwise float32."""
    if all(tensor.dtype == torch.bfloat16 for tensor in tensors):
        return torch.bfloat16
    return torch.float32


def run_cpu_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: CpuPrefillPlan,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention_reference`'s result, given the new tokens' own key/value
    [T, Hkv, D] (also in the caches; with an 8-bit cache, the stored rows dequantized)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dtype = _compute_dtype(query, key, value)
    for group in plan.fresh:
        attended = torch.nn.functional.scaled_dot_product_attention(
            _prompt_major(query, group, num_heads, dtype),
            _prompt_major(key, group, num_kv_heads, dtype),
            _prompt_major(value, group, num_kv_heads, dtype),
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        result = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
        if group.contiguous:
            output[group.contiguous] = result
        else:
            output.index_copy_(0, group.rows, result.to(query.dtype))
    if plan.others:
        starts: list[int] = query_start_loc.tolist()
        lengths: list[int] = seq_lens.tolist()
        for index in plan.others:
            begin, end = starts[index], starts[index + 1]
            if k_scale is None:
                output[begin:end] = _continued_chunk(
                    query[begin:end],
                    gather_context(k_cache, block_tables[index], lengths[index]),
                    gather_context(v_cache, block_tables[index], lengths[index]),
                    scale,
                )
                continue
            output[begin:end] = paged_prefill_attention_reference(
                query[begin:end],
                k_cache,
                v_cache,
                block_tables[index : index + 1],
                torch.tensor([0, end - begin], dtype=torch.int32, device=query.device),
                seq_lens[index : index + 1],
                scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
    return output


def _continued_chunk(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence's query [q, Hq, D] over its whole context [L, Hkv, D] (new tokens last),
    masked as the reference: causal."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    dtype = _compute_dtype(query, keys, values)
    k_positions = torch.arange(seq_len, device=query.device)
    q_positions = k_positions[seq_len - q_len :]
    mask = k_positions[None, :] <= q_positions[:, None]
    # [1, heads, tokens, D]: with no batch dimension torch takes its math path, not the flash one.
    attended = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0).to(dtype),
        keys.transpose(0, 1).unsqueeze(0).to(dtype),
        values.transpose(0, 1).unsqueeze(0).to(dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return attended[0].transpose(0, 1).to(query.dtype)
