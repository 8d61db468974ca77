from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nori.launch.redis_server import RedisServer
from nori.state.keys import Keys
from nori.state.registry import Heartbeat, WorkerInfo, WorkerRegistry
from tests.state.helpers import eventually

pytestmark = pytest.mark.asyncio


class LoadSource:
    """Stands in for a worker's engine: the figures a heartbeat reads on every beat."""

    def __init__(self, worker_id: str = "w1") -> None:
        self.info = WorkerInfo(worker_id=worker_id, role="decode", grpc_address="h:1")
        self.calls = 0
        self.fail_next = 0

    def __call__(self) -> WorkerInfo:
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("engine stats unavailable")
        return self.info


async def test_heartbeat_keeps_worker_alive_past_ttl_and_stop_removes_it(
    redis_client: Redis, keys: Keys
) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=0.3)
    source = LoadSource()
    heartbeat = Heartbeat(registry, source)
    assert heartbeat.interval_s == pytest.approx(0.1)
    heartbeat.start()
    try:
        await eventually(lambda: _present(registry, "w1"))
        first = await registry.get("w1")
        source.info = dataclasses.replace(source.info, num_running=5)
        await asyncio.sleep(0.9)  # three TTLs
        latest = await registry.get("w1")
        assert latest is not None and first is not None
        assert latest.num_running == 5  # every beat carries fresh load figures
        assert latest.updated_at > first.updated_at
        assert heartbeat.running and heartbeat.beats >= 5
    finally:
        await heartbeat.stop(deregister=True)
    assert not heartbeat.running
    assert await registry.get("w1") is None  # gone at once, not after the TTL


async def test_stop_without_deregister_leaves_record_to_expire(
    redis_client: Redis, keys: Keys
) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=0.3)
    heartbeat = Heartbeat(registry, LoadSource(), interval_s=0.05)
    heartbeat.start()
    await eventually(lambda: _present(registry, "w1"))
    await heartbeat.stop(deregister=False)
    assert await registry.get("w1") is not None
    await asyncio.sleep(0.3)
    await eventually(lambda: _absent(registry, "w1"), timeout_s=2.0)


async def test_failing_info_source_is_logged_and_retried(
    redis_client: Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=1.0)
    source = LoadSource()
    source.fail_next = 2
    heartbeat = Heartbeat(registry, source, interval_s=0.02)
    with caplog.at_level(logging.WARNING, logger="nori.state.registry"):
        heartbeat.start()
        await eventually(lambda: _present(registry, "w1"))
    await heartbeat.stop()
    assert heartbeat.failures == 2
    assert sum("failed; retrying" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
async def test_heartbeat_survives_redis_restart(caplog: pytest.LogCaptureFixture) -> None:
    """Redis goes away and comes back on the same port: the worker must re-join by itself."""
    keys = Keys("hiccup")
    server = RedisServer().start()
    port = server.port
    client = Redis.from_url(server.url)
    registry = WorkerRegistry(client, keys, ttl_s=1.0)
    heartbeat = Heartbeat(registry, LoadSource(), interval_s=0.05)
    restarted: RedisServer | None = None
    try:
        with caplog.at_level(logging.WARNING, logger="nori.state.registry"):
            heartbeat.start()
            await eventually(lambda: _present(registry, "w1"))
            server.stop()  # nothing persisted: the record is gone with it

            async def failing() -> bool:
                return heartbeat.failures >= 2

            await eventually(failing)
            assert heartbeat.running
            restarted = RedisServer(port=port).start()
            await eventually(lambda: _present(registry, "w1"), timeout_s=5.0)
        assert heartbeat.running
        assert any("failed; retrying" in r.getMessage() for r in caplog.records)
    finally:
        await heartbeat.stop()
        await client.aclose()
        server.stop()
        if restarted is not None:
            restarted.stop()


async def _present(registry: WorkerRegistry, worker_id: str) -> bool:
    try:
        return await registry.get(worker_id) is not None
    except (RedisError, OSError):  # the server is still restarting
        return False


async def _absent(registry: WorkerRegistry, worker_id: str) -> bool:
    return await registry.get(worker_id) is None
