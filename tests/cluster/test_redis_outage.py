"""Redis killed (SIGKILL) under load and restarted on the same port, empty: the cluster rides it out.

Workers keep serving and the gateway keeps its last known worker list while Redis is away;
Redis persists nothing, so when it returns the workers re-register (their heartbeat recreates
their records) and the gateway relearns them. Every request in flight meanwhile finishes or fails
cleanly (an HTTP error JSON, or an error event in a stream; never a hang), new requests succeed
within 5 s of Redis returning, and afterwards every KV block is free again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from nori.launch.local_cluster import LocalCluster
from nori.launch.redis_server import RedisServer
from nori.state.keys import Keys
from tests.cluster.conftest import start_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

CLIENTS = 4
MAX_TOKENS = 8
OUTAGE_S = 3.0
# Far longer than any request takes here: a request that reaches it hung.
CLIENT_TIMEOUT_S = 60.0
# The bound: new requests succeed this soon after Redis returns.
RECOVERY_S = 5.0


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    # "ok"; "error" (a clean failure: an error JSON or an error event); "hung" (the client
    # timeout); "broken" (anything else: a dropped connection, a stream without [DONE]).
    kind: str
    detail: str = ""


@pytest.fixture(scope="module")
def cluster(
    redis_server: RedisServer, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    running = start_cluster(redis_server.url, checkpoint, tmp_path_factory.mktemp("logs"))
    try:
        yield running
    finally:
        running.stop()


def _error_outcome(started: float, response: httpx.Response) -> Outcome:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return Outcome(
            started, time.monotonic(), "broken", f"{response.status_code} {response.text}"
        )
    return Outcome(started, time.monotonic(), "error", f"{response.status_code} {error['message']}")


def one_request(cluster: LocalCluster, index: int, stream: bool) -> Outcome:
    body: dict[str, object] = {
        "model": model_name(cluster), "prompt": f"Request {index}: once upon a time",
        "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    url = f"{cluster.url}/v1/completions"
    try:
        with httpx.stream("POST", url, json=body, timeout=CLIENT_TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                return _error_outcome(started, response)
            if not stream:
                response.read()
                tokens = response.json()["usage"]["completion_tokens"]
                kind = "ok" if tokens == MAX_TOKENS else "broken"
                return Outcome(started, time.monotonic(), kind, f"{tokens} tokens")
            tokens, error, done = 0, "", False
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    error = event.get("error", {}).get("message", error)
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        if not done:
            return Outcome(started, time.monotonic(), "broken", "stream ended without [DONE]")
        if error:
            return Outcome(started, time.monotonic(), "error", f"stream: {error}")
        kind = "ok" if tokens == MAX_TOKENS else "broken"
        return Outcome(started, time.monotonic(), kind, f"{tokens} tokens")
    except httpx.TimeoutException as exc:
        return Outcome(started, time.monotonic(), "hung", repr(exc))
    except httpx.HTTPError as exc:
        return Outcome(started, time.monotonic(), "broken", repr(exc))


def run_clients(
    cluster: LocalCluster, stop: threading.Event, outcomes: list[Outcome]
) -> list[threading.Thread]:
    def client(number: int) -> None:
        index = number
        while not stop.is_set():
            # Odd clients stream, even ones do not: both error paths are exercised.
            outcomes.append(one_request(cluster, index, stream=number % 2 == 1))
            index += CLIENTS

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    return threads


def kill_redis(server: RedisServer) -> None:
    client = redis.Redis.from_url(server.url)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server.running:
        assert time.monotonic() < deadline, "redis-server outlived SIGKILL"
        time.sleep(0.01)


def test_redis_killed_and_restarted_empty_under_load(
    cluster: LocalCluster, redis_server: RedisServer
) -> None:
    baseline = idle_free_blocks(cluster)
    stop = threading.Event()
    outcomes: list[Outcome] = []
    threads = run_clients(cluster, stop, outcomes)
    try:
        time.sleep(3.0)  # a steady load before the outage
        killed_at = time.monotonic()
        kill_redis(redis_server)
        time.sleep(OUTAGE_S)
        # The same port, a new and empty Redis: every registry record is gone.
        redis_server.stop()
        redis_server.start()
        back_at = time.monotonic()
        time.sleep(RECOVERY_S + 3.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_S + 10)
    assert not any(thread.is_alive() for thread in threads)

    unclean = [o for o in outcomes if o.kind in ("hung", "broken")]
    assert not unclean, unclean
    before = [o for o in outcomes if o.started < killed_at]
    during = [o for o in outcomes if killed_at <= o.started < back_at]
    after = [o for o in outcomes if o.started >= back_at]
    # Requests were on their way when Redis died, and when it returned.
    in_flight = [o for o in outcomes if o.started < killed_at < o.ended]
    assert in_flight and any(o.started < back_at < o.ended for o in outcomes)
    assert before and all(o.kind == "ok" for o in before), before
    first_ok = min(o.ended for o in after if o.kind == "ok") - back_at
    # Once the workers are back in the registry, every request succeeds.
    late = [o for o in after if o.started >= back_at + RECOVERY_S]
    print(
        f"\nbefore: {len(before)} ok; in flight at the kill: "
        f"{sum(o.kind == 'ok' for o in in_flight)}/{len(in_flight)} ok; during the outage: "
        f"{sum(o.kind == 'ok' for o in during)}/{len(during)} ok, failures "
        f"{sorted({o.detail for o in during if o.kind != 'ok'})}; after: "
        f"{sum(o.kind == 'ok' for o in after)}/{len(after)} ok, failures "
        f"{sorted({o.detail for o in after if o.kind != 'ok'})}; first success "
        f"{first_ok:.2f} s after Redis returned"
    )
    assert first_ok < RECOVERY_S
    assert late and all(o.kind == "ok" for o in late), late
    # Stronger than the bound: nothing on a request's path waits on Redis (the gateway keeps
    # its last known workers while Redis is away, and while they re-register in an empty one).
    assert all(o.kind == "ok" for o in during + after), [
        o for o in during + after if o.kind != "ok"
    ]

    # The workers re-registered in the new Redis (the gateway would look healthy without them for
    # a while: it keeps what it knew), and every block came back.
    keys = Keys(cluster.spec.namespace)
    store = redis.Redis.from_url(redis_server.url)
    try:
        assert all(store.exists(keys.worker(name)) for name in baseline)
    finally:
        store.close()
    cluster.wait_healthy({"prefill": 1, "decode": 2}, timeout_s=10)
    assert idle_free_blocks(cluster) == baseline
