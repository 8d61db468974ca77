"""Runs of adjacent buffers (nori.transfer.integrity): what each side finds adjacent, the runs both
move as one message, and the merged views, checked against the bytes they cover."""

from __future__ import annotations

import torch

from nori.transfer.integrity import adjacent_runs, joint_runs, merge_runs


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
