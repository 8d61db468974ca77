"""The prefill worker's export arena: exact ranges of its first-fit allocator, and KV copies in
shared memory that equal the private copies they replace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nori.engine.kv_cache import read_blocks
from nori.prefill import export_arena
from nori.prefill.export_arena import ALIGN, ByteRanges, ExportArena
from tests.transfer.helpers import reference_checksum


def test_ranges_are_first_fit_page_aligned_and_merge_when_freed() -> None:
    ranges = ByteRanges(10 * ALIGN + 100)  # the odd tail is never handed out
    assert ranges.capacity == 10 * ALIGN
    first = ranges.allocate(1)
    second = ranges.allocate(2 * ALIGN)
    third = ranges.allocate(ALIGN + 1)
    assert (first, second, third) == (0, ALIGN, 3 * ALIGN)
    assert ranges.free_ranges == [(5 * ALIGN, 5 * ALIGN)]
    ranges.free(second, 2 * ALIGN)
    assert ranges.free_ranges == [(ALIGN, 2 * ALIGN), (5 * ALIGN, 5 * ALIGN)]
    # First fit: the hole, when it is large enough.
    assert ranges.allocate(ALIGN) == ALIGN
    assert ranges.allocate(3 * ALIGN) == 5 * ALIGN
    assert ranges.free_ranges == [(2 * ALIGN, ALIGN), (8 * ALIGN, 2 * ALIGN)]
    assert ranges.allocate(3 * ALIGN) is None
    # Freed neighbours merge on both sides.
    ranges.free(third, ALIGN + 1)
    assert ranges.free_ranges == [(2 * ALIGN, 3 * ALIGN), (8 * ALIGN, 2 * ALIGN)]
    ranges.free(5 * ALIGN, 3 * ALIGN)
    assert ranges.free_ranges == [(2 * ALIGN, 8 * ALIGN)]
    ranges.free(first, 1)
    ranges.free(ALIGN, ALIGN)
    assert ranges.free_ranges == [(0, 10 * ALIGN)] and ranges.free_bytes == 10 * ALIGN


def test_a_range_not_handed_out_cannot_be_freed() -> None:
    ranges = ByteRanges(4 * ALIGN)
    start = ranges.allocate(ALIGN)
    assert start == 0
    ranges.free(start, ALIGN)
    with pytest.raises(ValueError, match="not an allocated range"):
        ranges.free(start, ALIGN)  # twice
    taken = ranges.allocate(2 * ALIGN)
    with pytest.raises(ValueError, match="not an allocated range"):
        ranges.free(taken, 3 * ALIGN)  # runs into free bytes
    with pytest.raises(ValueError, match="not an allocated range"):
        ranges.free(3 * ALIGN, 2 * ALIGN)  # past the end
    assert ranges.free_ranges == [(2 * ALIGN, 2 * ALIGN)]


def _cache(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A cache's tensors: values [layers, 2, blocks, block_size, heads, dim] and, for an 8-bit
    cache, scales [layers, 2, blocks, block_size, heads]."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(2, 2, 12, 4, 2, 8, generator=generator).to(dtype)
    if dtype.itemsize != 1:
        return (values,)
    return values, torch.rand(2, 2, 12, 4, 2, generator=generator)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_copy_in_the_arena_equals_a_private_copy_and_goes_back(dtype: torch.dtype) -> None:
    tensors = _cache(dtype)
    block_ids = [7, 2, 3, 11]
    arena = ExportArena(64 * ALIGN)
    copy = arena.read_blocks(tensors, block_ids)
    assert copy.release is not None
    expected = read_blocks(tensors, block_ids)
    for block, reference in zip(copy.blocks, expected, strict=True):
        assert block.dtype == reference.dtype and block.shape == reference.shape
        assert block.is_contiguous() and block.untyped_storage().is_shared()
        assert torch.equal(block.view(torch.uint8), reference.view(torch.uint8))
    # Taken as it copied: the checksum of the stream the transfer sends (the copies in turn).
    stream = b"".join(reference.view(torch.uint8).numpy().tobytes() for reference in expected)
    assert copy.checksum == reference_checksum(stream)
    assert arena.free_bytes < arena.capacity
    # A second copy lies beside the first: both in one shared segment.
    more = arena.read_blocks(tensors, [0])
    assert more.release is not None
    assert (
        more.blocks[0].untyped_storage().data_ptr() == copy.blocks[0].untyped_storage().data_ptr()
    )
    copy.release()
    copy.release()  # once only: the second call gives nothing back twice
    more.release()
    assert arena.free_bytes == arena.capacity


def test_a_copy_that_does_not_fit_is_private() -> None:
    tensors = _cache(torch.bfloat16)
    arena = ExportArena(ALIGN)  # one page: 8 blocks of this cache fill it, 12 do not fit
    block_ids = list(range(12))
    copy = arena.read_blocks(tensors, block_ids)
    assert copy.release is None and copy.checksum is None
    assert not copy.blocks[0].untyped_storage().is_shared()
    assert torch.equal(copy.blocks[0], read_blocks(tensors, block_ids)[0])
    assert arena.free_bytes == arena.capacity


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_checksum_of_a_copy_over_many_chunks_is_the_streams(dtype: torch.dtype) -> None:
    """MiBs of blocks in scattered order (chunks of the checksum end mid-block and, for an
    8-bit cache, run from the codes into the scales): copied on the copy threads, the bytes and
    the checksum are those of the private copy's stream."""
    generator = torch.Generator().manual_seed(9)
    values = torch.randn(2, 2, 64, 16, 8, 48, generator=generator).to(dtype)
    tensors: tuple[torch.Tensor, ...] = (values,)
    if dtype.itemsize == 1:
        tensors = (values, torch.rand(2, 2, 64, 16, 8, generator=generator))
    block_ids = torch.randperm(64, generator=generator)[:50].tolist()
    arena = ExportArena(64 * 1024 * 1024)
    copy = arena.read_blocks(tensors, block_ids)
    expected = read_blocks(tensors, block_ids)
    stream = b"".join(reference.view(torch.uint8).numpy().tobytes() for reference in expected)
    assert len(stream) > 1024 * 1024  # several chunks
    assert b"".join(block.view(torch.uint8).numpy().tobytes() for block in copy.blocks) == stream
    assert copy.checksum == reference_checksum(stream)
    assert copy.release is not None
    copy.release()


def test_without_room_in_shared_memory_copies_are_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Past what /dev/shm can hold a write into the arena would be a SIGBUS: the copy is private
    instead (and said once)."""
    tensors = _cache(torch.bfloat16)
    full = tmp_path / "full"
    full.mkdir()
    monkeypatch.setattr(export_arena, "SHARED_MEMORY_FOLDER", str(full))
    monkeypatch.setattr(
        export_arena.os,
        "statvfs",
        lambda _: os.statvfs_result((4096, 4096, 0, 0, 0, 0, 0, 0, 0, 255)),
    )
    arena = ExportArena(64 * ALIGN)
    copy = arena.read_blocks(tensors, [1, 2])
    assert copy.release is None and copy.checksum is None
    assert torch.equal(copy.blocks[0], read_blocks(tensors, [1, 2])[0])
    assert arena.free_bytes == arena.capacity
