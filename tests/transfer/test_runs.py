"""Runs of adjacent buffers (nori.transfer.buffers): what each side finds adjacent, the runs both
move as one message, the merged views, and the receiver's staged runs, checked against the bytes
they cover."""

from __future__ import annotations

import torch

from nori.transfer.buffers import (
    ScatteredRun,
    adjacent_runs,
    joint_runs,
    merge_runs,
    piece_views,
    receive_pieces,
    receive_runs,
    scatter_copy,
)


def test_adjacent_runs_follow_memory_not_order() -> None:
    cache = torch.arange(64, dtype=torch.uint8)
    blocks = list(cache.view(8, 8).unbind(0))
    # 0-1-2 adjacent, then 5 (a gap), 6, then 3 (behind), then another tensor's bytes.
    other = torch.zeros(8, dtype=torch.uint8)
    views = [blocks[0], blocks[1], blocks[2], blocks[5], blocks[6], blocks[3], other]
    assert adjacent_runs(views) == (3, 2, 1, 1)
    assert adjacent_runs([]) == ()


def test_joint_runs_end_where_either_side_does_and_cap_the_bytes() -> None:
    sizes = (100,) * 6
    assert joint_runs((6,), (6,), sizes) == (6,)
    assert joint_runs((2, 4), (3, 3), sizes) == (2, 1, 3)
    assert joint_runs((6,), (6,), sizes, max_run_bytes=250) == (2, 2, 2)
    # A buffer larger than the cap is a run of its own.
    assert joint_runs((3,), (3,), (100, 1000, 100), max_run_bytes=250) == (1, 1, 1)


def test_merged_views_cover_exactly_their_runs_bytes() -> None:
    cache = torch.arange(96, dtype=torch.uint8)
    blocks = list(cache.view(12, 8).unbind(0))
    views = [blocks[i] for i in (0, 1, 2, 7, 8, 4)]
    runs = joint_runs(adjacent_runs(views), (6,), tuple(v.numel() for v in views))
    assert runs == (3, 2, 1)
    merged = merge_runs(views, runs)
    assert [m.numel() for m in merged] == [24, 16, 8]
    assert torch.equal(torch.cat(merged), torch.cat(views))
    # In place: writing through a merged view writes the cache.
    merged[1].fill_(255)
    assert torch.equal(blocks[7], torch.full((8,), 255, dtype=torch.uint8))
    assert torch.equal(blocks[8], torch.full((8,), 255, dtype=torch.uint8))


def test_receive_runs_group_consecutive_small_runs_up_to_the_cap() -> None:
    cache = torch.zeros(64 * 8, dtype=torch.uint8)
    blocks = list(cache.view(64, 8).unbind(0))
    # Runs of 1, 1, 2 (16 bytes), 1, then a run of 6 (48 bytes, not small), then 1, 1.
    ids = [0, 2, 4, 5, 9, 20, 21, 22, 23, 24, 25, 30, 40]
    views = [blocks[i] for i in ids]
    assert adjacent_runs(views) == (1, 1, 2, 1, 6, 1, 1)
    # Small is under 48 bytes; a group holds at most 32 bytes: (1, 1, 2) is 32 bytes, the next
    # run of 1 starts a group, the large run stands alone, and the last two group again.
    assert receive_runs(views, stage_below=48, max_run_bytes=32) == (4, 1, 6, 2)
    # Nothing small: the adjacent runs themselves.
    assert receive_runs(views, stage_below=8, max_run_bytes=32) == adjacent_runs(views)
    assert receive_runs([], stage_below=48, max_run_bytes=32) == ()


def test_receive_pieces_merge_adjacent_runs_and_stage_the_others() -> None:
    cache = torch.zeros(16 * 8, dtype=torch.uint8)
    blocks = list(cache.view(16, 8).unbind(0))
    views = [blocks[i] for i in (0, 2, 4, 5, 9, 10, 11)]
    pieces = receive_pieces(views, (2, 2, 3))
    first, second, third = pieces
    assert isinstance(first, ScatteredRun)
    assert first.nbytes == 16
    assert [view.data_ptr() for view in first.views] == [blocks[0].data_ptr(), blocks[2].data_ptr()]
    # Adjacent runs are received in place, through one view over their bytes.
    assert isinstance(second, torch.Tensor) and isinstance(third, torch.Tensor)
    assert (second.data_ptr(), second.numel()) == (blocks[4].data_ptr(), 16)
    assert (third.data_ptr(), third.numel()) == (blocks[9].data_ptr(), 24)
    assert [view.data_ptr() for view in piece_views(pieces)] == [
        blocks[i].data_ptr() for i in (0, 2, 4, 9)
    ]


def test_scatter_copy_puts_each_views_bytes_in_place() -> None:
    cache = torch.zeros(10 * 8, dtype=torch.uint8)
    blocks = list(cache.view(10, 8).unbind(0))
    landed = torch.arange(24, dtype=torch.uint8)
    scatter_copy(landed.numpy(), (blocks[7], blocks[1], blocks[4]))
    expected = torch.zeros(10, 8, dtype=torch.uint8)
    expected[7], expected[1], expected[4] = landed[:8], landed[8:16], landed[16:]
    assert torch.equal(cache.view(10, 8), expected)
