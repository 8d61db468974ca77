"""The engine's `PagedAttention` on a step of decodes, speculative verifications and prompt
chunks, on each attention backend: every row must be what the prefill reference computes for it
over the same cache (the prefill kernels treat any row as the end of a causal chunk)."""

from __future__ import annotations

import pytest
import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.kv_cache import KVCache
from nori.engine.paged_attention import PagedAttention
from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.kv_quant import KV_SCALE_DTYPE, quantize_kv_reference
from nori.kernels.prefill_attention import paged_prefill_attention_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = 0.25
# (q_len, seq_len) of each sequence; contexts cross block boundaries.
DECODES = [(1, 17), (1, 4)]
VERIFIES = [(3, 9), (5, 2 * BLOCK_SIZE + 3), (1, 30)]
# A chunk after a cached prefix, and a fresh prompt.
PROMPTS = [(6, 20), (7, 7)]
STEPS = {
    "decodes, verifications and prompts": (DECODES, VERIFIES, PROMPTS),
    "verifications only": ([], VERIFIES, []),
    "decodes and verifications": (DECODES, VERIFIES, []),
    "verifications and prompts": ([], VERIFIES, PROMPTS),
}


def _backends() -> list[str]:
    backends = ["reference", "triton"]
    if not torch.cuda.is_available() and cpu_kernels() is not None:
        backends.append("cpu")
    return backends


def _kv_cache(num_blocks: int, cache_dtype: torch.dtype) -> KVCache:
    """Two layers of random K/V (the context before this step's rows)."""
    generator = torch.Generator().manual_seed(11)
    shape = (2, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    data = torch.randn(shape, generator=generator)
    if cache_dtype == torch.float32:
        return KVCache(data.to(DEVICE))
    codes, scales = quantize_kv_reference(data.view(-1, NUM_KV_HEADS, HEAD_DIM), cache_dtype)
    return KVCache(
        codes.view(shape).to(DEVICE), scales.view(shape[:-1]).to(KV_SCALE_DTYPE).to(DEVICE)
    )


def _metadata(step: str) -> AttentionMetadata:
    """Each sequence's blocks at shuffled ids; its new rows are the last of its context."""
    decodes, verifies, prompts = STEPS[step]
    q_lens, seq_lens = zip(*decodes, *verifies, *prompts, strict=True)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(sum(blocks_per_seq) + 2, generator=torch.Generator().manual_seed(2))
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        tables[b, : blocks_per_seq[b]] = ids[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        for position in range(seq_len - q_len, seq_len):
            block = int(tables[b, position // BLOCK_SIZE])
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        num_decodes=len(decodes),
        num_verifies=len(verifies),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_seq_len=max(seq_lens),
    )


@pytest.mark.parametrize(
    ("step", "cache_dtype"),
    [
        ("decodes, verifications and prompts", torch.float32),
        ("decodes, verifications and prompts", torch.int8),
        ("verifications only", torch.float32),
        ("decodes and verifications", torch.float32),
        ("verifications and prompts", torch.float32),
    ],
)
@pytest.mark.parametrize("backend", _backends())
def test_step_matches_the_prefill_reference(
    backend: str, step: str, cache_dtype: torch.dtype
) -> None:
    metadata = _metadata(step)
    kv_cache = _kv_cache(int(metadata.block_tables.max()) + 1, cache_dtype)
    attention = PagedAttention(kv_cache, metadata, backend)
    generator = torch.Generator().manual_seed(4)
    num_rows = metadata.slot_mapping.shape[0]
    for layer in range(2):  # the second layer reuses the first's plans
        query, key, value = (
            torch.randn(num_rows, heads, HEAD_DIM, generator=generator).to(DEVICE)
            for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
        )
        out = attention(layer, query, key, value, SCALE)
        k_cache, v_cache = kv_cache.layer(layer)
        k_scale, v_scale = kv_cache.layer_scales(layer)
        expected = paged_prefill_attention_reference(
            *(query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc),
            *(metadata.seq_lens, SCALE),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
