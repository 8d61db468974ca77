"""Both sides of a transfer agree on the buffers, and the receiver's buffers are its cache."""

from __future__ import annotations

import pytest
import torch

from nori.worker.kv_layout import (
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copying_source_buffers_into_destination_buffers_fills_exactly_those_blocks(
    dtype: torch.dtype,
) -> None:
    layers, num_blocks, block_size, heads, dim = 3, 12, 4, 2, 8
    cache = torch.zeros(layers, 2, num_blocks, block_size, heads, dim, dtype=dtype)
    block_ids = [7, 8, 2, 3, 4, 10]
    exported = torch.randn(layers, 2, len(block_ids), block_size, heads, dim).to(dtype)

    sources = source_buffers(exported, block_ids)
    destinations = destination_buffers(cache, block_ids)
    assert len(sources) == len(destinations) == layers * 2 * 3
    for source, destination in zip(sources, destinations, strict=True):
        assert source.is_contiguous() and destination.is_contiguous()
        assert source.nbytes == destination.nbytes
        # A view of the cache: the transport writes straight into it.
        assert destination.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        destination.copy_(source)

    for position, block_id in enumerate(block_ids):
        assert torch.equal(cache[:, :, block_id], exported[:, :, position])
    untouched = [b for b in range(num_blocks) if b not in block_ids]
    assert not cache[:, :, untouched].any()


def test_bad_layouts_are_refused() -> None:
    cache = torch.zeros(1, 2, 4, 2, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        destination_buffers(cache, [3, 4])
    with pytest.raises(ValueError, match="2 exported blocks for 3"):
        source_buffers(torch.zeros(1, 2, 2, 2, 1, 2), [0, 1, 2])
