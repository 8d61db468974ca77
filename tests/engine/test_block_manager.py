"""Block manager: exact block ids, prefix caching, LRU reuse, invariants."""

from __future__ import annotations

import pytest

from nori.engine.block_manager import BlockEventKind, BlockManager, BlockUsage
from nori.prefix_cache import ROOT_HASH, hash_block
from tests.engine.helpers import make_request


def test_allocates_lowest_free_blocks_in_order() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert manager.allocate(request, 10)
    assert request.block_ids == [0, 1, 2]
    assert manager.usage() == BlockUsage(free=5, cached=0, in_use=3)
    manager.check_invariants([request])


def test_allocation_grows_only_when_a_block_fills() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(4)))
    assert manager.allocate(request, 4)
    request.num_computed_tokens = 4
    request.append_token(99)
    assert manager.allocate(request, 1)
    assert request.block_ids == [0, 1]
    request.num_computed_tokens = 5
    request.append_token(98)
    assert manager.allocate(request, 1)
    assert request.block_ids == [0, 1]


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(9)))
    assert not manager.allocate(request, 9)
    assert request.block_ids == []
    assert manager.num_free_blocks == 2
    manager.check_invariants([request])


def test_prefix_hit_reuses_blocks_and_always_computes_last_token() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(12)))
    assert manager.allocate(first, 12)
    first.num_computed_tokens = 12
    manager.cache_full_blocks(first)
    assert first.block_ids == [0, 1, 2]

    # Same 12 tokens: only two blocks may hit, the last token must be recomputed.
    same = make_request("b", list(range(12)))
    hits = manager.find_cached_prefix(same)
    assert hits == [0, 1]
    assert manager.allocate(same, 4, hits)
    assert same.block_ids == [0, 1, 3]
    assert same.num_computed_tokens == 8
    assert same.num_cached_tokens == 8
    assert manager.blocks[0].ref_count == 2
    manager.check_invariants([first, same])

    longer = make_request("c", [*range(8), 50, 51, 52, 53, 54])
    assert manager.find_cached_prefix(longer) == [0, 1]


def test_freed_blocks_keep_hash_and_are_reused_lru_first() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    assert manager.allocate(a, 4)
    a.num_computed_tokens = 4
    manager.cache_full_blocks(a)
    manager.free(a)
    assert manager.usage() == BlockUsage(free=4, cached=2, in_use=0)

    # A request with the same prefix gets block 0 back from the cache.
    b = make_request("b", [1, 2, 3, 4, 5])
    hits = manager.find_cached_prefix(b)
    assert hits == [0, 1]
    assert manager.allocate(b, 1, hits)
    assert b.block_ids == [0, 1, 2]
    manager.free(b)

    # Never-hashed blocks 3, 4, 5 come first (they waited longest), then the freed ones, tail
    # blocks before prefix blocks: 2, 1, 0.
    c = make_request("c", list(range(100, 112)))
    assert manager.allocate(c, 12)
    assert c.block_ids == [3, 4, 5, 2, 1, 0]
    assert manager.usage() == BlockUsage(free=0, cached=0, in_use=6)
    manager.check_invariants([c])


def test_eviction_forgets_hash_and_emits_events() -> None:
    manager = BlockManager(num_blocks=2, block_size=2, record_events=True)
    a = make_request("a", [1, 2, 3])
    assert manager.allocate(a, 3)
    a.num_computed_tokens = 3
    manager.cache_full_blocks(a)
    stored_hash = hash_block(ROOT_HASH, [1, 2])
    manager.free(a)
    b = make_request("b", [7, 8, 9, 10])
    assert manager.allocate(b, 4)
    assert b.block_ids == [1, 0]
    assert [(e.kind, e.block_hash) for e in manager.drain_events()] == [
        (BlockEventKind.STORED, stored_hash),
        (BlockEventKind.REMOVED, stored_hash),
    ]
    assert manager.drain_events() == []
    assert manager.find_cached_prefix(make_request("c", [1, 2, 3])) == []


def test_hash_collision_is_not_a_hit() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    assert manager.allocate(a, 3)
    a.num_computed_tokens = 3
    manager.cache_full_blocks(a)
    # Forge a collision: another prefix whose first hash equals a's.
    b = make_request("b", [5, 6, 7])
    b.block_hashes.append(hash_block(ROOT_HASH, [1, 2]))
    assert manager.find_cached_prefix(b) == []


def test_no_prefix_caching_means_no_hits() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3])
    assert manager.allocate(a, 3)
    a.num_computed_tokens = 3
    manager.cache_full_blocks(a)
    assert manager.find_cached_prefix(make_request("b", [1, 2, 3])) == []
    assert manager.usage().cached == 0


def test_invariant_check_catches_a_leak() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    assert manager.allocate(a, 3)
    with pytest.raises(AssertionError, match="ref_count"):
        manager.check_invariants([])
