"""Both sides of a transfer agree on the buffers, and the receiver's buffers are its cache."""

from __future__ import annotations

import pytest
import torch

from nori.engine.kv_cache import KVCache
from nori.models.config import ModelConfig
from nori.worker.servicer_base import (
    BlockRun,
    contiguous_runs,
    destination_buffers,
    source_buffers,
)


def test_contiguous_runs() -> None:
    assert contiguous_runs([]) == []
    assert contiguous_runs([4, 5, 6]) == [BlockRun(0, 4, 3)]
    assert contiguous_runs([9, 3, 4, 8, 2]) == [
        BlockRun(0, 9, 1),
        BlockRun(1, 3, 2),
        BlockRun(3, 8, 1),
        BlockRun(4, 2, 1),
    ]


def _cache_tensors(
    dtype: torch.dtype, layers: int, num_blocks: int, block_size: int, heads: int, dim: int
) -> tuple[torch.Tensor, ...]:
    """A fresh KVCache's tensors: one for a float cache; 8-bit codes and fp16 scales."""
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=heads * dim,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    return KVCache.allocate(model, num_blocks, block_size, dtype, torch.device("cpu")).tensors


def _random_like(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    shape = (*tensor.shape[:2], num_blocks, *tensor.shape[3:])
    if tensor.dtype in (torch.int8, torch.float8_e4m3fn):
        # Any byte but fp8's NaNs (0x7F, 0xFF).
        return torch.randint(0, 0x7F, shape, dtype=torch.uint8).view(tensor.dtype)
    return torch.randn(shape).to(tensor.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_copying_source_buffers_into_destination_buffers_fills_exactly_those_blocks(
    dtype: torch.dtype,
) -> None:
    layers, num_blocks, block_size, heads, dim = 3, 12, 4, 2, 8
    cache = _cache_tensors(dtype, layers, num_blocks, block_size, heads, dim)
    before = [tensor.clone() for tensor in cache]
    block_ids = [7, 8, 2, 3, 4, 10]
    exported = tuple(_random_like(tensor, len(block_ids)) for tensor in cache)
    # An 8-bit cache ships its codes and their scales, as stored.
    assert len(cache) == (2 if dtype in (torch.int8, torch.float8_e4m3fn) else 1)

    sources = source_buffers(exported, block_ids)
    destinations = destination_buffers(cache, block_ids)
    assert len(sources) == len(destinations) == len(cache) * layers * 2 * 3
    for source, destination in zip(sources, destinations, strict=True):
        assert source.is_contiguous() and destination.is_contiguous()
        assert source.dtype == destination.dtype and source.nbytes == destination.nbytes
        # A view of the cache: the transport writes straight into it.
        assert any(
            destination.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            for tensor in cache
        )
        destination.view(torch.uint8).copy_(source.view(torch.uint8))

    untouched = [b for b in range(num_blocks) if b not in block_ids]
    for tensor, sent, old in zip(cache, exported, before, strict=True):
        as_bytes, sent_bytes = tensor.view(torch.uint8), sent.view(torch.uint8)
        for position, block_id in enumerate(block_ids):
            assert torch.equal(as_bytes[:, :, block_id], sent_bytes[:, :, position])
        assert torch.equal(as_bytes[:, :, untouched], old.view(torch.uint8)[:, :, untouched])


def test_bad_layouts_are_refused() -> None:
    cache = torch.zeros(1, 2, 4, 2, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        destination_buffers((cache,), [3, 4])
    with pytest.raises(ValueError, match="2 exported blocks for 3"):
        source_buffers((torch.zeros(1, 2, 2, 2, 1, 2),), [0, 1, 2])
    with pytest.raises(TypeError, match="not one tensor"):
        destination_buffers(cache, [0])
