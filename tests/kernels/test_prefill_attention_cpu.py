"""The CPU prefill path (whole prompts batched, the rest per sequence) against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_helpers import dense_context, random_paged_context

from nori.kernels.prefill_attention import paged_prefill_attention_reference
from nori.kernels.prefill_attention_cpu import plan_cpu_prefill, run_cpu_prefill

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's path")

SCALE = 0.41
ATOL = 1e-5


def _case(
    rows: list[tuple[int, int]], num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, ...]:
    """rows: (cached prefix, new tokens) per sequence -> query, the new tokens' key/value (read
    back from the cache, where the engine also stores them), caches, tables, starts, lengths."""
    head_dim, block_size = 16, 8
    seq_lens = [prefix + new for prefix, new in rows]
    ctx = random_paged_context(seq_lens, num_kv_heads, head_dim, block_size)
    starts = [0, *itertools.accumulate(new for _, new in rows)]
    query = torch.randn(starts[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    keys, values = [], []
    for b, (prefix, new) in enumerate(rows):
        keys.append(dense_context(ctx.k_cache, ctx.block_tables[b], prefix + new)[prefix:].float())
        values.append(
            dense_context(ctx.v_cache, ctx.block_tables[b], prefix + new)[prefix:].float()
        )
    return (
        query,
        torch.cat(keys),
        torch.cat(values),
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        torch.tensor(starts, dtype=torch.int32),
        ctx.seq_lens,
    )


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 12)] * 4,  # one group of whole prompts, rows contiguous
        [(0, 5), (0, 12), (0, 5), (0, 1)],  # groups by length, rows interleaved
        [(0, 9), (16, 7), (0, 9), (3, 1), (5, 20)],  # whole prompts among chunks over prefixes
        [(8, 8), (1, 30)],  # chunks only
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_matches_reference(rows: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> None:
    query, key, value, k_cache, v_cache, tables, starts, lens = _case(rows, num_heads, num_kv_heads)
    plan = plan_cpu_prefill(starts, lens)
    assert len(plan.others) == sum(1 for prefix, _ in rows if prefix)
    out = run_cpu_prefill(query, key, value, k_cache, v_cache, tables, starts, lens, SCALE, plan)
    expected = paged_prefill_attention_reference(
        query, k_cache, v_cache, tables, starts, lens, SCALE
    )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_bfloat16_prompts_match_the_float32_reference_over_the_same_values() -> None:
    """bf16 query, key and value run the whole-prompt attention in bf16 (float32 sums): as close
    to the float32 reference over the same bf16 values as the bf16 output's rounding allows."""
    rows = [(0, 40)] * 3 + [(0, 7), (16, 9)]
    query, key, value, k_cache, v_cache, tables, starts, lens = _case(rows, 8, 2)
    as_bf16 = [t.bfloat16() for t in (query, key, value, k_cache, v_cache)]
    plan = plan_cpu_prefill(starts, lens)
    assert [g.num_prompts for g in plan.fresh] == [3, 1] and plan.others == (4,)
    out = run_cpu_prefill(*as_bf16, tables, starts, lens, SCALE, plan)
    assert out.dtype == torch.bfloat16
    exact = [t.float() for t in as_bf16]
    expected = paged_prefill_attention_reference(
        exact[0], exact[3], exact[4], tables, starts, lens, SCALE
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=1e-2)


def test_bfloat16_chunks_over_long_contexts_match_the_float32_reference() -> None:
    """Chunks that continue a prefix attend in the cache's bf16 with
    grouped-query heads and a mask: as close to the float32 reference over the same bf16 values
    as the whole prompts are, over contexts of several blocks."""
    rows = [(150, 40), (97, 1), (0, 60)]
    query, key, value, k_cache, v_cache, tables, starts, lens = _case(rows, 8, 2)
    as_bf16 = [t.bfloat16() for t in (query, key, value, k_cache, v_cache)]
    plan = plan_cpu_prefill(starts, lens)
    assert plan.others == (0, 1)
    out = run_cpu_prefill(*as_bf16, tables, starts, lens, SCALE, plan)
    assert out.dtype == torch.bfloat16
    exact = [t.float() for t in as_bf16]
    expected = paged_prefill_attention_reference(
        exact[0], exact[3], exact[4], tables, starts, lens, SCALE
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=1e-2)
