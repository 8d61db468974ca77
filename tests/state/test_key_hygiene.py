"""Nothing grows without bound: every key the state modules create is namespaced and expires."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from nori.prefix_cache import BlockEvent, BlockEventKind
from nori.state.block_directory import BlockDirectory, prompt_block_hashes
from nori.state.keys import Keys
from nori.state.registry import Heartbeat, WorkerInfo, WorkerRegistry
from nori.state.requests import RequestState, RequestStateStore
from tests.state.conftest import delete_namespace
from tests.state.helpers import eventually


@pytest_asyncio.fixture
async def text_client(redis_url: str, keys: Keys) -> AsyncIterator[Redis]:
    # decode_responses=True this time: the modules must read both kinds of reply.
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await delete_namespace(client, keys)
        await client.aclose()


@pytest.mark.asyncio
async def test_every_key_in_the_namespace_has_a_ttl(text_client: Redis, keys: Keys) -> None:
    registry = WorkerRegistry(text_client, keys, ttl_s=30)
    await registry.register(WorkerInfo("p1", "prefill", grpc_address="h:1"))
    heartbeat = Heartbeat(registry, lambda: WorkerInfo("d1", "decode", draining=True))
    heartbeat.start()

    async def decode_worker_listed() -> bool:
        return [w.worker_id for w in await registry.list_workers("decode")] == ["d1"]

    await eventually(decode_worker_listed)
    await heartbeat.stop(deregister=False)
    assert (await registry.get("d1") or WorkerInfo("x", "decode")).draining

    requests = RequestStateStore(text_client, keys)
    await requests.set_state("r1", RequestState.QUEUED)
    await requests.set_state("r1", RequestState.DECODING, decode_worker="d1")
    await requests.set_state("r2", RequestState.FAILED, error="boom")
    assert (await requests.get("r1") or {})["decode_worker"] == "d1"

    directory = BlockDirectory(text_client, keys)
    hashes = prompt_block_hashes(list(range(64)), block_size=16)
    await directory.publish("p1", [BlockEvent(BlockEventKind.STORED, h) for h in hashes])
    await directory.publish("d1", [BlockEvent(BlockEventKind.STORED, h) for h in hashes[:2]])
    await directory.touch("d1", hashes[:1])
    await directory.publish("p1", [BlockEvent(BlockEventKind.REMOVED, h) for h in hashes[3:]])
    assert await directory.longest_prefixes(hashes) == {"p1": 3, "d1": 2}

    found = sorted([key async for key in text_client.scan_iter(match=keys.pattern())])
    expected = {
        keys.worker("p1"),
        keys.worker("d1"),
        keys.request("r1"),
        keys.request("r2"),
        *(keys.block(h) for h in hashes[:3]),
    }
    assert set(found) == expected
    ttls = {key: await text_client.pttl(key) for key in found}
    assert all(ttl > 0 for ttl in ttls.values()), ttls  # -1 would mean "never expires"
