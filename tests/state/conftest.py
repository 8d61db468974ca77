"""Fixtures for the cluster-state tests: a real Redis, and a private namespace per test.

A real Redis, never a fake: expiry, SCAN and MULTI/EXEC are exactly what these modules rely on.
The `redis_url` fixture (tests/conftest.py) honours REDIS_URL, else starts a private
redis-server. Each test gets its own key namespace and deletes only its own keys afterwards (no FLUSHDB), so
a shared REDIS_URL can serve several test runs at once.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from nori.state.keys import Keys


@pytest.fixture
def keys() -> Keys:
    return Keys(f"test-{uuid.uuid4().hex[:16]}")


async def delete_namespace(client: Redis, keys: Keys) -> None:
    found = [key async for key in client.scan_iter(match=keys.pattern(), count=1000)]
    if found:
        await client.delete(*found)


@pytest_asyncio.fixture
async def redis_client(redis_url: str, keys: Keys) -> AsyncIterator[Redis]:
    """A client with default settings (bytes replies), bound to this test's event loop."""
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await delete_namespace(client, keys)
        await client.aclose()
