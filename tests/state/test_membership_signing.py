"""Signed registry entries: what a signature covers, and who is refused.

The pure part (`sign_entry`, `check_entry`) with every kind of tampering; then the registry and
the gateway's worker pool on a real Redis: entries written without the secret (or copied, or
stale) are never listed, each refused worker id is logged once and each write counted once, and
a cluster without a secret lists what it always did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from nori.cluster_auth import ClusterAuth, generate_secret
from nori.gateway.worker_pool import WorkerPool
from nori.state.entry_signing import CLOCK_SKEW_S, SIGNATURE_FIELD, check_entry, sign_entry
from nori.state.keys import Keys
from nori.state.registry import WorkerRegistry
from tests.state.test_registry import make_info

AUTH = ClusterAuth.from_text(generate_secret())
NOW = 1_800_000_000.0


def signed(worker_id: str = "w1", expires_at: float = NOW + 3.0) -> dict[str, str]:
    info = make_info(worker_id, updated_at=NOW, expires_at=expires_at)
    return sign_entry(AUTH, info.to_mapping())


# ------------------------------------------------------------------------- pure logic


def test_a_signed_entry_verifies_and_carries_its_signature() -> None:
    entry = signed()
    assert len(entry[SIGNATURE_FIELD]) == 64  # hex HMAC-SHA256
    assert check_entry(AUTH, "w1", entry, NOW) is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("grpc_address", "10.6.6.6:50051"),  # where requests would go
        ("transfer_address", "10.6.6.6:13337"),
        ("role", "decode"),
        ("model", "other"),
        ("block_size", "32"),
        ("kv_cache_dtype", "int8"),
        ("started_at", "1.0"),
        ("num_free_blocks", "999999"),  # load figures are covered too
        ("draining", "1"),
        ("expires_at", str(NOW + 3600)),  # a longer life
        ("extra_field", "x"),  # a field added after signing
    ],
)
def test_any_change_to_an_entry_is_forged(name: str, value: str) -> None:
    entry = {**signed(), name: value}
    assert check_entry(AUTH, "w1", entry, NOW) == "forged"


def test_a_dropped_field_a_wrong_key_or_another_id_is_forged() -> None:
    entry = signed()
    assert check_entry(AUTH, "w1", {k: v for k, v in entry.items() if k != "model"}, NOW) == (
        "forged"
    )
    other = ClusterAuth.from_text(generate_secret())
    assert check_entry(other, "w1", entry, NOW) == "forged"
    # A genuine entry copied under another worker's key.
    assert check_entry(AUTH, "w2", entry, NOW) == "forged"
    # Signatures that are not even hex.
    for signature in ("é" * 64, "not hex", "0" * 64):
        assert check_entry(AUTH, "w1", {**entry, SIGNATURE_FIELD: signature}, NOW) == "forged"


def test_an_unsigned_entry_is_refused_only_with_a_secret() -> None:
    entry = make_info().to_mapping()
    assert check_entry(AUTH, "w1", entry, NOW) == "unsigned"
    assert check_entry(ClusterAuth.open(), "w1", entry, NOW) is None
    # And a signed one is fine in an open cluster (a gateway without the secret ignores it).
    assert check_entry(ClusterAuth.open(), "w1", signed(), NOW) is None
    assert sign_entry(ClusterAuth.open(), entry) == entry


def test_an_entry_expires_after_its_stamp_plus_the_clock_allowance() -> None:
    entry = signed(expires_at=NOW)
    assert check_entry(AUTH, "w1", entry, NOW + CLOCK_SKEW_S - 0.01) is None
    # A replay of a genuine entry later than that is refused.
    assert check_entry(AUTH, "w1", entry, NOW + CLOCK_SKEW_S + 0.01) == "expired"


# ------------------------------------------------------------------------- on a real Redis


@pytest_asyncio.fixture
async def text_client(redis_client: Redis, redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def test_the_registry_signs_what_it_writes_and_lists_only_what_verifies(
    redis_client: Redis, text_client: Redis, keys: Keys
) -> None:
    registry = WorkerRegistry(redis_client, keys, ttl_s=3.0, auth=AUTH)
    written = await registry.register(make_info("real", role="decode"))
    assert 0 < written.expires_at - written.updated_at == pytest.approx(3.0)
    stored = await text_client.hgetall(keys.worker("real"))
    assert check_entry(AUTH, "real", stored, time.time()) is None
    # Written straight into Redis by someone without the secret.
    fake = make_info("fake", role="decode", grpc_address="127.0.0.1:1").to_mapping()
    await text_client.hset(keys.worker("fake"), mapping={**fake, SIGNATURE_FIELD: "0" * 64})
    await text_client.hset(keys.worker("bare"), mapping=make_info("bare").to_mapping())
    # A genuine entry copied under another id; bytes that are not even text.
    await text_client.hset(keys.worker("copy"), mapping=stored)
    await redis_client.hset(keys.worker("binary"), mapping={b"worker_id": b"\xff\xfe"})

    listing = await registry.list_entries()
    assert [w.worker_id for w in listing.workers] == ["real"]
    assert sorted((r.worker_id, r.reason) for r in listing.refused) == [
        ("bare", "unsigned"),
        ("binary", "forged"),
        ("copy", "forged"),
        ("fake", "forged"),
    ]
    assert [w.worker_id for w in await registry.list_workers("decode")] == ["real"]
    # Heartbeats stay signed (the entry is rewritten whole, signature and all).
    await registry.heartbeat(make_info("real", role="decode", num_running=5))
    assert [w.num_running for w in await registry.list_workers()] == [5]
    # Without a secret everything parseable is listed, as before (the copy names "real").
    open_registry = WorkerRegistry(redis_client, keys)
    await redis_client.delete(keys.worker("binary"))
    listed = sorted(w.worker_id for w in await open_registry.list_workers())
    assert listed == ["bare", "fake", "real", "real"]


async def test_the_pool_logs_a_refused_worker_once_and_counts_each_write_once(
    redis_client: Redis, text_client: Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    registry = WorkerRegistry(redis_client, keys, auth=AUTH)
    await registry.register(make_info("real", role="decode"))
    fake = make_info("fake", role="colocated").to_mapping()
    await text_client.hset(keys.worker("fake"), mapping=fake)
    pool = WorkerPool(registry)
    try:
        with caplog.at_level(logging.ERROR, logger="nori.gateway.worker_pool"):
            for _ in range(5):
                await pool.refresh()
            assert [w.worker_id for w in pool.workers] == ["real"]
            assert pool.refused_entries == {"unsigned": 1}
            # Written again: counted again, not logged again.
            await text_client.hset(keys.worker("fake"), "updated_at", repr(time.time() + 1))
            await pool.refresh()
            assert pool.refused_entries == {"unsigned": 2}
        refusals = [r for r in caplog.records if "refusing worker entry fake" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
        assert "no signature" in refusals[0].getMessage()
    finally:
        await pool.close()
