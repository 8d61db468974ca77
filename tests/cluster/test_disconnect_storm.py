"""800 short requests, streaming and not, 30% of them cut off by their clients at a random
point (before the request is out, before the first byte, mid-stream): every other request gets
all its tokens, every KV block on every worker comes back, and no role logs an error.

A disconnect lands anywhere in a request's path on the gateway (admission, the prefill call, the
reservation, the transfer, the decode stream), so a storm of them finds the paths that forget to
free a block, count a request twice, or log a cancellation as a failure.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from nori.launch.local_cluster import LocalCluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

NUM_REQUESTS = 800
CONCURRENCY = 32
CUT_FRACTION = 0.3
SEED = 2024
# A client that has not been answered by then: the request hung (none should come near it).
CLIENT_TIMEOUT_S = 120.0
# A level ERROR (or CRITICAL) line, ours or uvicorn's, or a traceback.
OUTCOMES = ("ok", "cut early", "cut mid-stream", "finished before its cut")
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |^(ERROR|CRITICAL):|^Traceback")


@dataclass(frozen=True)
class Plan:
    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    # None: read to the end. A float: cut after that many seconds, wherever the request is. An
    # int (streams only): cut after that many events.
    cut: float | int | None


def plans(seed: int) -> list[Plan]:
    rng = random.Random(seed)
    out = []
    for index in range(NUM_REQUESTS):
        prompt = [rng.randrange(10, 2000) for _ in range(rng.randint(8, 32))]
        max_tokens, stream = rng.randint(4, 16), rng.random() < 0.5
        cut: float | int | None = None
        if rng.random() < CUT_FRACTION:
            # Half by time (mostly before the first byte or early on), half mid-stream.
            cut = (
                rng.randint(1, max_tokens - 1)
                if stream and rng.random() < 0.5
                else rng.uniform(0, 0.3)
            )
        out.append(Plan(index, prompt, max_tokens, stream, cut))
    return out


async def send(client: httpx.AsyncClient, cluster: LocalCluster, plan: Plan) -> str:
    """ "ok", "cut early" (before any byte of the answer: a stream's headers wait for its first
    token), "cut mid-stream", "finished before its cut", or what went wrong."""
    body: dict[str, object] = {
        "model": model_name(cluster), "prompt": plan.prompt, "max_tokens": plan.max_tokens,
        "ignore_eos": True, "stream": plan.stream,
    }  # fmt: skip
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    where = "early"
    try:
        async with asyncio.timeout(plan.cut if isinstance(plan.cut, float) else None):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return f"{response.status_code} {(await response.aread())[:200]!r}"
                if not plan.stream:
                    usage = json.loads(await response.aread())["usage"]
                    return "ok" if usage["completion_tokens"] == plan.max_tokens else str(usage)
                where = "mid-stream"
                events, tokens, done = 0, 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    events += 1
                    if events == plan.cut:
                        # Leaving the block closes the connection (it is not reused half-read).
                        return "cut mid-stream"
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        return f"error event {event['error']}"
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                if not done or tokens != plan.max_tokens:
                    return f"stream of {tokens} tokens, [DONE]: {done}"
                return "ok" if plan.cut is None else "finished before its cut"
    except TimeoutError:  # only a planned cut sets an asyncio timeout
        return f"cut {where}"
    except httpx.HTTPError as error:  # the client timeout (a hang) included
        return repr(error)


async def storm(cluster: LocalCluster, todo: list[Plan]) -> list[str]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=cluster.url, limits=limits, timeout=CLIENT_TIMEOUT_S
    ) as client:
        queue = list(reversed(todo))
        results: list[str] = [""] * len(todo)

        async def worker() -> None:
            while queue:
                plan = queue.pop()
                results[plan.index] = await send(client, cluster, plan)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return results


def test_a_storm_of_requests_with_random_disconnects_leaks_nothing(cluster: LocalCluster) -> None:
    baseline = idle_free_blocks(cluster)
    todo = plans(SEED)
    started = time.monotonic()
    results = asyncio.run(storm(cluster, todo))
    elapsed = time.monotonic() - started

    counts = Counter(results)
    print(f"\n{len(todo)} requests in {elapsed:.1f} s: {dict(counts)}")
    # A planned cut that came after the answer (a short request) is just a whole request.
    wrong = [(p, r) for p, r in zip(todo, results, strict=True) if r not in OUTCOMES]
    assert not wrong, wrong[:5]
    assert all(r == "ok" for p, r in zip(todo, results, strict=True) if p.cut is None)
    # Both kinds of departure happened, many times.
    assert counts["cut early"] > NUM_REQUESTS * CUT_FRACTION / 10
    assert counts["cut mid-stream"] > NUM_REQUESTS * CUT_FRACTION / 10

    # The cluster idle: every block is back on every worker, exactly.
    idle_at = time.monotonic()
    assert idle_free_blocks(cluster) == baseline
    print(f"blocks back {time.monotonic() - idle_at:.1f} s after the storm: {baseline}")
    for process in cluster.processes:
        log = process.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in log if ERROR_LINE.search(line)]
        assert not errors, (process.name, errors[:5])
