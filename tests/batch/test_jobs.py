"""A batch's work queue in a real Redis: claims, leases, takeover, rebuild from the directory."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from nori.batch.input_file import check_input
from nori.batch.jobs import BatchJobs
from nori.batch.store import BatchStore, LineResult
from nori.state.keys import Keys


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _batch(tmp_path: Path, num_lines: int) -> tuple[BatchStore, str]:
    store = BatchStore(tmp_path)
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "x"},
            }
        ).encode()
        + b"\n"
        for i in range(num_lines)
    ]
    meta = store.create_file("in.jsonl", "batch", iter([*lines, b"oops\n"]))
    batch_id = store.create_batch(
        {
            "input_file_id": meta["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "created_at": 0,
            "expires_at": 4102444800,
        }
    )
    checked = check_input(store.file_path(meta["id"]), "/v1/completions")
    store.write_validated(batch_id, checked.total, checked.lines, checked.line_errors)
    return store, batch_id


async def test_two_runners_share_the_lines_and_a_dead_ones_lines_are_taken_over(
    tmp_path: Path, redis: Redis
) -> None:
    store, batch_id = _batch(tmp_path, 6)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
    jobs = BatchJobs(redis, keys, lease_ms=300)
    assert await jobs.claim(batch_id, "a", 10) == []  # not seeded: nothing to claim
    assert await jobs.counts(batch_id, 7) is None
    assert await jobs.seed(batch_id, store)
    counts = await jobs.counts(batch_id, 7)
    assert counts is not None and (counts.completed, counts.failed) == (0, 1)  # the invalid line

    held_a = await jobs.claim(batch_id, "a", 3)
    held_b = await jobs.claim(batch_id, "b", 10)
    assert [c.index for c in held_a] == [0, 1, 2] and [c.index for c in held_b] == [3, 4, 5]
    assert not any(c.reclaimed for c in held_a + held_b)
    # b keeps renewing; a dies. After the lease, a's lines go to c, and only a's.
    for _ in range(4):
        await asyncio.sleep(0.1)
        await jobs.renew(batch_id, "b", [c.entry_id for c in held_b])
    taken = await jobs.claim(batch_id, "c", 10)
    assert sorted(c.index for c in taken) == [0, 1, 2] and all(c.reclaimed for c in taken)
    for claim in [*taken, *held_b]:
        await jobs.done(batch_id, claim.entry_id, claim.index + 1, ok=claim.index != 4)
    counts = await jobs.counts(batch_id, 7)
    assert counts is not None and (counts.completed, counts.failed) == (5, 2)
    assert await jobs.num_queued(batch_id) == 0
    await jobs.forget(batch_id)
    assert await redis.keys(keys.batch_pattern()) == []


async def test_a_redis_that_lost_the_batch_is_reseeded_from_the_durable_results(
    tmp_path: Path, redis: Redis
) -> None:
    store, batch_id = _batch(tmp_path, 5)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}")
    jobs = BatchJobs(redis, keys)
    await jobs.seed(batch_id, store)
    # Lines 1 and 3 are durable on disk; then Redis restarts empty.
    store.result_log(batch_id, "r").write_bytes(
        LineResult(1, True, {}).to_json() + b"\n" + LineResult(3, False, {}).to_json() + b"\n"
    )
    await redis.delete(*await redis.keys(keys.batch_pattern()))
    assert not await jobs.is_seeded(batch_id)
    await jobs.seed(batch_id, store)
    claims = await jobs.claim(batch_id, "a", 10)
    assert [c.index for c in claims] == [1, 3, 4]  # lines 2, 4, 5
    counts = await jobs.counts(batch_id, 6)
    assert counts is not None and (counts.completed, counts.failed) == (1, 2)
    # Every key expires.
    for key in await redis.keys(keys.batch_pattern()):
        assert await redis.ttl(key) > 0, key
    await jobs.forget(batch_id)


async def test_an_acknowledgement_survives_a_broken_connection(
    tmp_path: Path, redis_url: str
) -> None:
    """A runner's pooled connection that Redis closed (a Redis restarted mid-batch) must not
    leave a durable result unacknowledged: the line would run again on another runner."""
    from nori.state.connection import connect

    store, batch_id = _batch(tmp_path, 2)
    client = connect(redis_url)
    other = Redis.from_url(redis_url)
    try:
        jobs = BatchJobs(client, Keys(f"test-{uuid.uuid4().hex[:8]}"))
        await jobs.seed(batch_id, store)
        first, second = await jobs.claim(batch_id, "a", 10)
        await jobs.done(batch_id, first.entry_id, 1, ok=True)
        # Every connection of the runner's pool is closed by the server, as by a restart.
        killed = await other.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        await jobs.done(batch_id, second.entry_id, 2, ok=True)
        counts = await jobs.counts(batch_id, 3)
        assert counts is not None and (counts.completed, counts.failed) == (2, 1)
        assert await jobs.num_queued(batch_id) == 0
        await jobs.forget(batch_id)
    finally:
        await client.aclose()
        await other.aclose()
