"""Which buffers carry a request's KV blocks, in the same order on both sides of a transfer.

The cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim] (plus its scales for an
8-bit cache: `KVCache.tensors`). A run of consecutive block ids in one tensor, layer and half is
one contiguous region, so the receiver hands the transport views of its own cache; the sender
slices its exported [layers, 2, n, ...] copies the same way. Codes and scales move as stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockRun:
    position: int  # of the run's first block in the request's block list
    first_block_id: int  # the receiver's
    length: int


@dataclass(frozen=True)
class BlockLayout:
    """One KV tensor's layout without its block dimension: what a staging copy is made of."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def allocate(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((*self.shape[:2], num_blocks, *self.shape[2:]), dtype=self.dtype)


def staging_buffers(
    layouts: Sequence[BlockLayout], block_ids: list[int]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Fresh tensors for a request's blocks and their views matching the sender's
    `source_buffers`, for a receiver whose cache is split over processes."""
    staged = tuple(layout.allocate(len(block_ids)) for layout in layouts)
    return staged, source_buffers(staged, block_ids)


def contiguous_runs(block_ids: list[int]) -> list[BlockRun]:
    runs: list[BlockRun] = []
    for position, block_id in enumerate(block_ids):
        last = runs[-1] if runs else None
        if last is not None and last.first_block_id + last.length == block_id:
            runs[-1] = BlockRun(last.position, last.first_block_id, last.length + 1)
        else:
            runs.append(BlockRun(position, block_id, 1))
    return runs


def source_buffers(
    exported: Sequence[torch.Tensor], destination_block_ids: list[int]
) -> list[torch.Tensor]:
    """Slices of the exported [layers, 2, n, ...] copies, matching `destination_buffers`."""
    for tensor in _tensors(exported):
        if tensor.shape[2] != len(destination_block_ids):
            raise ValueError(
                f"{tensor.shape[2]} exported blocks for {len(destination_block_ids)} destinations"
            )
    runs = contiguous_runs(destination_block_ids)
    spans = [(run.position, run.length) for run in runs]
    return [view for tensor in exported for view in _run_views(tensor, spans)]


def destination_buffers(cache: Sequence[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Views of the receiver's own cache blocks; writing into them fills the cache."""
    cache = _tensors(cache)
    num_blocks = cache[0].shape[2]
    if any(not 0 <= block_id < num_blocks for block_id in block_ids):
        raise ValueError(f"block ids out of range [0, {num_blocks})")
    runs = contiguous_runs(block_ids)
    spans = [(run.first_block_id, run.length) for run in runs]
    return [view for tensor in cache for view in _run_views(tensor, spans)]


def _tensors(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    # A bare tensor is a sequence too (of its layers): refuse it rather than slice it wrongly.
    if isinstance(tensors, torch.Tensor) or not tensors:
        raise TypeError("expected the KV cache's tensors (KVCache.tensors), not one tensor")
    return tensors


def _run_views(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """tensor [layers, 2, blocks, ...]: each span of blocks, layer by layer, K before V."""
    return [
        tensor[layer, half, start : start + length]
        for layer in range(tensor.shape[0])
        for half in range(2)
        for start, length in spans
    ]
