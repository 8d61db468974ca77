from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from redis.asyncio import Redis

from nori.engine.block_manager import BlockManager
from nori.engine.request import Request
from nori.prefix_cache import ROOT_HASH, BlockEvent, BlockEventKind, hash_block
from nori.state.block_directory import BlockDirectory, prompt_block_hashes
from nori.state.keys import Keys

STORED, REMOVED = BlockEventKind.STORED, BlockEventKind.REMOVED


def stored(hashes: list[bytes]) -> list[BlockEvent]:
    return [BlockEvent(STORED, h) for h in hashes]


def removed(hashes: list[bytes]) -> list[BlockEvent]:
    return [BlockEvent(REMOVED, h) for h in hashes]


def run_prefill(manager: BlockManager, request_id: str, token_ids: list[int]) -> Request:
    """What an engine does for a prompt: reuse cached blocks, allocate, compute, publish."""
    request = Request(request_id, list(token_ids), sampling_params=cast(Any, None))
    hits = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - len(hits) * manager.block_size, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return request


# ------------------------------------------------------------------------- prompt hashes


def test_prompt_hashes_are_chained_over_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = prompt_block_hashes(tokens, block_size=4)
    assert len(hashes) == 2  # the last two tokens do not fill a block
    assert hashes[0] == hash_block(ROOT_HASH, tokens[0:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # Same block contents behind a different prefix: a different hash.
    assert prompt_block_hashes([9, 9, 9, 9, *tokens[4:8]], 4)[1] != hashes[1]
    assert prompt_block_hashes([], 4) == []
    with pytest.raises(ValueError):
        prompt_block_hashes(tokens, 0)


def test_prompt_hashes_equal_what_a_block_manager_publishes() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, record_events=True)
    tokens = [(7 * i + 3) % 50 for i in range(23)]
    run_prefill(manager, "r1", tokens)
    events = manager.drain_events()
    assert all(e.kind is STORED for e in events)
    assert [e.block_hash for e in events] == prompt_block_hashes(tokens, 4)


# ----------------------------------------------------------------------------- directory


@pytest.mark.asyncio
async def test_longest_prefixes_count_leading_blocks_only(redis_client: Redis, keys: Keys) -> None:
    directory = BlockDirectory(redis_client, keys)
    h = prompt_block_hashes(list(range(40)), block_size=4)  # 10 blocks
    await directory.publish("a", stored(h[:6]))
    await directory.publish("b", stored(h[:2] + h[3:10]))  # a gap at block 2
    await directory.publish("c", stored(h[1:10]))  # lacks the first block
    await directory.publish("d", stored(h[:10]))

    assert await directory.longest_prefixes(h) == {"a": 6, "b": 2, "d": 10}
    assert await directory.longest_prefixes(h[:4]) == {"a": 4, "b": 2, "d": 4}
    # Only the live workers count, and every one of them is in the answer.
    assert await directory.longest_prefixes(h, ["a", "c", "z"]) == {"a": 6, "c": 0, "z": 0}
    assert await directory.longest_prefixes(h, []) == {}
    assert await directory.longest_prefixes([], ["a"]) == {"a": 0}
    other = prompt_block_hashes(list(range(100, 140)), block_size=4)
    assert await directory.longest_prefixes(other) == {}


@pytest.mark.asyncio
async def test_eviction_removes_holders_and_empty_keys(redis_client: Redis, keys: Keys) -> None:
    directory = BlockDirectory(redis_client, keys, ttl_s=60)
    h = prompt_block_hashes(list(range(16)), block_size=4)
    assert await directory.publish("a", []) == 0  # nothing sent, nothing created
    assert await redis_client.exists(keys.block(h[0])) == 0

    await directory.publish("a", stored(h))
    await directory.publish("b", stored(h[:2]))
    await directory.publish("a", removed([h[1]]))
    assert await directory.longest_prefixes(h) == {"a": 1, "b": 2}
    # In-order application: evicted and stored again in one batch leaves it stored.
    await directory.publish("a", [*removed([h[2]]), *stored([h[1], h[2]])])
    assert await directory.longest_prefixes(h) == {"a": 4, "b": 2}

    await directory.publish("b", removed(h))
    await directory.publish("a", removed(h[2:]))
    assert await directory.longest_prefixes(h) == {"a": 2}
    assert await redis_client.exists(*(keys.block(x) for x in h[2:])) == 0
    for block_hash in h[:2]:
        assert 0 < await redis_client.pttl(keys.block(block_hash)) <= 60_000


@pytest.mark.asyncio
async def test_entries_expire_unless_touched(redis_client: Redis, keys: Keys) -> None:
    directory = BlockDirectory(redis_client, keys, ttl_s=0.4)
    h = prompt_block_hashes(list(range(8)), block_size=4)
    await directory.publish("a", stored(h))
    await directory.publish("b", stored(h))
    for _ in range(3):
        await asyncio.sleep(0.2)
        await directory.touch("a", h)
    assert await directory.longest_prefixes(h) == {"a": 2, "b": 2}  # b's entry rides along
    await asyncio.sleep(0.6)
    assert await directory.longest_prefixes(h) == {}


@pytest.mark.asyncio
async def test_directory_mirrors_a_block_manager_through_eviction(
    redis_client: Redis, keys: Keys
) -> None:
    """End to end: a worker's real events in, the gateway's prompt hashes out."""
    directory = BlockDirectory(redis_client, keys)
    manager = BlockManager(num_blocks=4, block_size=4, record_events=True)
    shared_prompt = list(range(100, 113))  # 3 full blocks + 1 token
    first = run_prefill(manager, "r1", shared_prompt)
    await directory.publish("w1", manager.drain_events())
    gateway_hashes = prompt_block_hashes(shared_prompt, 4)
    assert await directory.longest_prefixes(gateway_hashes, ["w1", "w2"]) == {"w1": 3, "w2": 0}

    # A different prompt needs all 4 blocks: the cached ones are evicted.
    manager.free(first)
    run_prefill(manager, "r2", list(range(500, 516)))
    events = manager.drain_events()
    assert {e.block_hash for e in events if e.kind is REMOVED} == set(gateway_hashes)
    await directory.publish("w1", events)
    assert await directory.longest_prefixes(gateway_hashes, ["w1"]) == {"w1": 0}
    new_hashes = prompt_block_hashes(list(range(500, 516)), 4)
    assert await directory.longest_prefixes(new_hashes) == {"w1": 4}
