"""Which buffers carry a request's KV blocks, in the same order on both sides of a transfer.

The cache is one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]. For a fixed
layer and K/V half, a run of consecutive block ids is one contiguous region, so the receiver can
hand the transport views of its own cache (no staging copy) and a fresh pool, which hands out
consecutive ids, needs only one buffer per layer and half. The sender slices its exported copy
[layers, 2, n, ...] the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockRun:
    # Position of the run's first block in the request's block list.
    position: int
    # The receiver's first block id of the run.
    first_block_id: int
    length: int


def contiguous_runs(block_ids: list[int]) -> list[BlockRun]:
    runs: list[BlockRun] = []
    for position, block_id in enumerate(block_ids):
        last = runs[-1] if runs else None
        if last is not None and last.first_block_id + last.length == block_id:
            runs[-1] = BlockRun(last.position, last.first_block_id, last.length + 1)
        else:
            runs.append(BlockRun(position, block_id, 1))
    return runs


def source_buffers(exported: torch.Tensor, destination_block_ids: list[int]) -> list[torch.Tensor]:
    """Slices of an exported [layers, 2, n, ...] copy, matching `destination_buffers`."""
    if exported.shape[2] != len(destination_block_ids):
        raise ValueError(
            f"{exported.shape[2]} exported blocks for {len(destination_block_ids)} destinations"
        )
    runs = contiguous_runs(destination_block_ids)
    return _run_views(exported, [(run.position, run.length) for run in runs])


def destination_buffers(cache: torch.Tensor, block_ids: list[int]) -> list[torch.Tensor]:
    """Views of the receiver's own cache blocks; writing into them fills the cache."""
    num_blocks = cache.shape[2]
    if any(not 0 <= block_id < num_blocks for block_id in block_ids):
        raise ValueError(f"block ids out of range [0, {num_blocks})")
    runs = contiguous_runs(block_ids)
    return _run_views(cache, [(run.first_block_id, run.length) for run in runs])


def _run_views(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """tensor [layers, 2, blocks, ...]: each (start, length) span of blocks, layer by layer,
    K before V, the order both ends of a transfer list their buffers in."""
    return [
        tensor[layer, half, start : start + length]
        for layer in range(tensor.shape[0])
        for half in range(2)
        for start, length in spans
    ]
