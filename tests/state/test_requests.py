from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from nori.state.keys import Keys
from nori.state.requests import RequestState, RequestStateStore


@pytest.mark.asyncio
async def test_states_accumulate_timestamps_and_fields(redis_client: Redis, keys: Keys) -> None:
    store = RequestStateStore(redis_client, keys, ttl_s=60)
    before = time.time()
    await store.set_state("r1", RequestState.QUEUED, num_prompt_tokens=12)
    await store.set_state("r1", "prefilling", prefill_worker="p1")
    await store.set_state("r1", RequestState.TRANSFERRING)
    await store.set_state("r1", RequestState.DECODING, decode_worker="d1")
    done = await store.set_state("r1", RequestState.FINISHED, num_output_tokens=7)

    state = await store.get("r1")
    assert state is not None
    assert state["state"] == "finished"
    assert state["num_prompt_tokens"] == "12"
    assert state["num_output_tokens"] == "7"
    assert state["prefill_worker"] == "p1" and state["decode_worker"] == "d1"
    order = ["queued", "prefilling", "transferring", "decoding", "finished"]
    times = [float(state[f"t_{name}"]) for name in order]
    assert times == sorted(times)
    assert before <= times[0] and times[-1] == done
    assert "t_failed" not in state and "t_cancelled" not in state


@pytest.mark.asyncio
async def test_every_write_refreshes_the_ttl(redis_client: Redis, keys: Keys) -> None:
    store = RequestStateStore(redis_client, keys, ttl_s=60)
    key = keys.request("r1")
    await store.set_state("r1", RequestState.QUEUED)
    await redis_client.pexpire(key, 1000)  # as if most of the TTL had passed
    await store.set_state("r1", RequestState.FAILED, error="decode worker lost")
    assert 50_000 < await redis_client.pttl(key) <= 60_000
    assert (await store.get("r1") or {})["error"] == "decode worker lost"


@pytest.mark.asyncio
async def test_requests_expire(redis_client: Redis, keys: Keys) -> None:
    store = RequestStateStore(redis_client, keys, ttl_s=0.05)
    await store.set_state("r1", RequestState.CANCELLED)
    await asyncio.sleep(0.2)
    assert await store.get("r1") is None


@pytest.mark.asyncio
async def test_unknown_request_and_bad_arguments(redis_client: Redis, keys: Keys) -> None:
    store = RequestStateStore(redis_client, keys)
    assert await store.get("nope") is None
    with pytest.raises(ValueError):
        await store.set_state("r1", "sleeping")
    with pytest.raises(ValueError):
        await store.set_state("r1", RequestState.QUEUED, t_queued="0")
    with pytest.raises(ValueError):
        await store.set_state("r1", RequestState.QUEUED, state="finished")
    assert await store.get("r1") is None


def test_terminal_states() -> None:
    terminal = {s for s in RequestState if s.is_terminal}
    assert terminal == {RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED}
