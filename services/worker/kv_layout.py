"""Which buffers carry a request's KV blocks, in the same order on both sides of a transfer.

The cache is one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim], and for an
8-bit cache a second one, its scales [layers, 2, num_blocks, block_size, kv_heads]
(`KVCache.tensors`). For a fixed tensor, layer and K/V half, a run of consecutive block ids is
one contiguous region, so the receiver can hand the transport views of its own cache (no staging
copy) and a fresh pool, which hands out consecutive ids, needs only one buffer per tensor, layer
and half. The sender slices its exported copies [layers, 2, n, ...] the same way. The codes and
scales travel as they are stored: nothing is dequantized or requantized on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockRun:
    # Position of the run's first block in the request's block list.
    position: int
    # The receiver's first block id of the run.
    first_block_id: int
    length: int


@dataclass(frozen=True)
class BlockLayout:
    """One KV tensor's layout with its block dimension left out ([layers, 2, block_size, heads,
    ...]): what a staging copy of n blocks is made of."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def allocate(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((*self.shape[:2], num_blocks, *self.shape[2:]), dtype=self.dtype)


def staging_buffers(
    layouts: Sequence[BlockLayout], block_ids: list[int]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Fresh tensors for a request's blocks, in the request's order, and their views matching the
    sender's `source_buffers` (a receiver that cannot take the bytes into its cache in place:
    a tensor-parallel one, whose cache is split over processes)."""
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
    """Views of the receiver's own cache blocks (every tensor of `KVCache.tensors`); writing
    into them fills the cache."""
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
    """tensor [layers, 2, blocks, ...]: each (start, length) span of blocks, layer by layer,
    K before V, the order both ends of a transfer list their buffers in."""
    return [
        tensor[layer, half, start : start + length]
        for layer in range(tensor.shape[0])
        for half in range(2)
        for start, length in spans
    ]
