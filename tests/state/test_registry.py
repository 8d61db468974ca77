from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from nori.settings import WorkerRole
from nori.state.keys import Keys
from nori.state.registry import WorkerInfo, WorkerRegistry
from tests.state.helpers import eventually


def make_info(worker_id: str = "w1", role: WorkerRole = "prefill", **changes: Any) -> WorkerInfo:
    info = WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address="127.0.0.1:50051",
        transfer_address="127.0.0.1:13337",
        model="tiny",
        num_running=2,
        num_waiting=3,
        num_free_blocks=100,
        num_total_blocks=128,
        kv_bytes_received=1 << 40,
        kv_bytes_sent=7,
        draining=False,
        started_at=1700000000.125,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4}',
        max_num_seqs=32,
        max_open_calls=40,
    )
    return dataclasses.replace(info, **changes)


# ------------------------------------------------------------------------- serialisation


def test_mapping_round_trip_is_exact() -> None:
    info = make_info(draining=True, updated_at=1700000001.1 + 1e-9)
    mapping = info.to_mapping()
    assert all(isinstance(v, str) for v in mapping.values())
    assert mapping["draining"] == "1"
    assert WorkerInfo.from_mapping(mapping) == info
    as_bytes = {k.encode(): v.encode() for k, v in mapping.items()}
    assert WorkerInfo.from_mapping(as_bytes) == info  # a client without decode_responses


def test_from_mapping_tolerates_other_versions() -> None:
    newer = {**make_info().to_mapping(), "gpu_kind": "H200", "num_spec_tokens": "4"}
    assert WorkerInfo.from_mapping(newer) == make_info()
    older = WorkerInfo.from_mapping({"worker_id": "w9", "role": "decode", "draining": "true"})
    assert older == WorkerInfo(worker_id="w9", role="decode", draining=True)
    assert older.speculative_config == ""  # a version before speculative decoding: off


@pytest.mark.parametrize(
    "mapping",
    [
        {"role": "decode"},
        {"worker_id": "w"},
        {"worker_id": "w", "role": "router"},
        {"worker_id": "w", "role": "decode", "num_running": "many"},
        {"worker_id": "w", "role": "decode", "draining": "maybe"},
    ],
)
def test_from_mapping_refuses_what_it_cannot_trust(mapping: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        WorkerInfo.from_mapping(mapping)


# ---------------------------------------------------------------------------- registry


@pytest.mark.asyncio
async def test_register_get_list_and_deregister(redis_client: Redis, keys: Keys) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=30)
    before = time.time()
    stored = await registry.register(make_info("p1", "prefill"))
    await registry.register(make_info("d1", "decode"))
    await registry.register(make_info("d0", "decode", draining=True))

    assert stored.updated_at >= before
    assert await registry.get("p1") == stored
    assert await registry.get("nobody") is None
    assert [w.worker_id for w in await registry.list_workers()] == ["d0", "d1", "p1"]
    assert [w.worker_id for w in await registry.list_workers("decode")] == ["d0", "d1"]
    assert await registry.list_workers("colocated") == []
    pttl = await redis_client.pttl(keys.worker("p1"))
    assert 0 < pttl <= 30_000

    await registry.deregister("d1")
    assert [w.worker_id for w in await registry.list_workers()] == ["d0", "p1"]


@pytest.mark.asyncio
async def test_workers_expire_without_heartbeats(redis_client: Redis, keys: Keys) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=0.3)
    await registry.register(make_info("short"))
    await WorkerRegistry(redis_client, keys, ttl_s=30).register(make_info("long"))
    assert {w.worker_id for w in await registry.list_workers()} == {"short", "long"}

    async def short_gone() -> bool:
        return [w.worker_id for w in await registry.list_workers()] == ["long"]

    await asyncio.sleep(0.3)
    await eventually(short_gone, timeout_s=2.0)
    assert await registry.get("short") is None


@pytest.mark.asyncio
async def test_register_replaces_stale_fields_heartbeat_updates(
    redis_client: Redis, keys: Keys
) -> None:
    registry = WorkerRegistry(redis_client, keys)
    key = keys.worker("w1")
    await registry.register(make_info())
    await redis_client.hset(key, "left_by_old_run", "x")
    beat = await registry.heartbeat(make_info(num_running=9))
    assert await redis_client.hget(key, "left_by_old_run") == b"x"
    assert await registry.get("w1") == beat
    assert beat.num_running == 9
    await registry.register(make_info())
    assert await redis_client.hget(key, "left_by_old_run") is None


@pytest.mark.asyncio
async def test_list_skips_expired_foreign_and_unreadable_keys(
    redis_client: Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = WorkerRegistry(redis_client, keys)
    await registry.register(make_info("good"))
    await redis_client.set(keys.worker("not-a-hash"), "x", ex=30)
    await redis_client.hset(keys.worker("broken"), mapping={"worker_id": "broken"})
    await redis_client.expire(keys.worker("broken"), 30)
    # A namespace whose name starts with ours must not leak into our listing.
    await WorkerRegistry(redis_client, Keys(keys.namespace + "x")).register(make_info("alien"))

    # A key that expires between SCAN and HGETALL: SCAN reports it, the read finds nothing.
    real_scan = redis_client.scan_iter

    async def scan_with_ghost(*args: Any, **kwargs: Any) -> AsyncIterator[bytes]:
        async for key in real_scan(*args, **kwargs):
            yield key
        yield keys.worker("ghost").encode()

    monkeypatch.setattr(redis_client, "scan_iter", scan_with_ghost)
    try:
        ids = [w.worker_id for w in await registry.list_workers()]
    finally:
        monkeypatch.undo()
        await redis_client.delete(Keys(keys.namespace + "x").worker("alien"))
    assert ids == ["good"]
