"""One client's wide request (prompts x n members) beside other clients' single requests, on a
real cluster: 1 prefill and 2 decode workers of the test shape (32 running slots each), the
admission bound at 1,024 prompt tokens for the pool.

The members of a request count against their client's fair share, like that client's separate
requests: here 96 members of 40 prompt tokens (3,840 tokens, several times the bound) hold at most
the prompt pool's rows while the others come, and the others are admitted and served beside the
wide request. Before, its members took every decode row with their prompts counted as queued, and
every other client's request was refused (429, "the prefill queue is full") while it ran.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nori.launch.local_cluster import LocalCluster
from tests.cluster.conftest import running_cluster
from tests.cluster.test_fair_share import first_token_s, model_name

pytestmark = pytest.mark.slow

USERS = 6


@pytest.fixture(scope="module")
def small_bound_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    # Sent at once after the start: the workers' registry entries state their rows and calls,
    # so the gateway never overfills the 32-row prefill worker (its 429, "prefill-0 is full").
    yield from running_cluster(
        redis_url, checkpoint, tmp_path_factory, max_queued_prompt_tokens=1024
    )


def test_other_clients_are_served_beside_a_wide_request(
    small_bound_cluster: LocalCluster,
) -> None:
    model = model_name(small_bound_cluster.url)
    rng = random.Random(7)
    # Distinct prompts (no shared prefix for the caches to shortcut), 2 choices each.
    prompts = [[rng.randrange(10, 2000) for _ in range(40)] for _ in range(48)]

    async def users(client: httpx.AsyncClient) -> list[tuple[int, float]]:
        calls = (first_token_s(client, model, f"user-{i}") for i in range(USERS))
        return list(await asyncio.gather(*calls))

    async def scenario() -> tuple[
        list[tuple[int, float]], list[tuple[int, float]], httpx.Response, float
    ]:
        async with httpx.AsyncClient(base_url=small_bound_cluster.url, timeout=300) as client:
            await users(client)  # the cold burst
            alone = await users(client)
            body = {"model": model, "prompt": prompts, "n": 2, "max_tokens": 2, "ignore_eos": True}
            headers = {"Authorization": "Bearer wide"}
            wide = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=headers))
            await asyncio.sleep(0.3)
            beside = await users(client)
            served_by = time.monotonic()
            response = await wide
            return alone, beside, response, time.monotonic() - served_by

    alone, beside, wide, wide_after_s = asyncio.run(scenario())
    print(f"alone: {alone}\nbeside the wide request: {beside}; it ended {wide_after_s:.2f} s later")
    assert all(status == 200 for status, _ in alone), alone
    assert [status for status, _ in beside] == [200] * USERS, beside
    assert wide.status_code == 200, wide.text[:300]
    assert len(wide.json()["choices"]) == 96
    metrics = httpx.get(f"{small_bound_cluster.url}/metrics", timeout=30).text
    assert "\nnori_gateway_queued_prompt_tokens 0\n" in metrics  # every ticket closed
    assert "nori_gateway_decode_shares_held 0" in metrics
