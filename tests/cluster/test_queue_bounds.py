"""Bounded queues with real processes: workers that hold at most max-num-seqs + max-queued-requests
calls refuse the rest before doing any work, and the gateway answers the requests no worker can
take with 429 and Retry-After. Every admitted request completes, nothing answers 5xx, and every
KV block comes back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from nori.launch.local_cluster import LocalCluster
from tests.cluster.conftest import WORKER_ARGS, running_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

# Each worker runs 2 requests and queues 1 more: the prefill worker takes 3 prompts at a time,
# the 2 decode workers 6 streams.
BOUNDED = ("--max-num-seqs", "2", "--max-queued-requests", "1")


@pytest.fixture(scope="module")
def small_queues(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(
        redis_url, checkpoint, tmp_path_factory, worker_args=(*WORKER_ARGS, *BOUNDED)
    )


def test_requests_beyond_every_queue_get_429_and_the_rest_complete(
    small_queues: LocalCluster,
) -> None:
    cluster = small_queues
    baseline = idle_free_blocks(cluster)
    max_tokens = 64

    def complete(index: int) -> httpx.Response:
        return httpx.post(
            f"{cluster.url}/v1/completions",
            json={
                "model": model_name(cluster),
                "prompt": f"{index}: once upon a time there was a",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
            timeout=120,
        )

    with ThreadPoolExecutor(max_workers=24) as pool:
        responses = list(pool.map(complete, range(24)))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0 and statuses[200] >= 3, statuses
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_exceeded"
        else:
            assert response.json()["usage"]["completion_tokens"] == max_tokens
    # The refusals came from full workers, which the gateway tried in turn: not from its own
    # admission (which would name the prefill queue).
    assert any("full" in r.json()["error"]["message"] for r in responses if r.status_code == 429)
    assert idle_free_blocks(cluster) == baseline
    # Once the burst is over, the cluster serves as before.
    assert complete(99).status_code == 200
    for role in cluster.processes:
        assert "Traceback" not in role.log_path.read_text(), role.name


def test_a_batch_larger_than_every_queue_is_served_in_waves(small_queues: LocalCluster) -> None:
    """12 prompts in one request, n=2 each: 24 choices against room for 3 prompts and 6 streams
    at a time. A batch is admitted as one: its members wait for the room its running members
    free (ClusterOptions.group_wait_s) rather than fail the whole batch with 429."""
    cluster = small_queues
    baseline = idle_free_blocks(cluster)
    response = httpx.post(
        f"{cluster.url}/v1/completions",
        json={
            "model": model_name(cluster),
            "prompt": [f"{index}: the little cat" for index in range(12)],
            "n": 2,
            "max_tokens": 8,
            "ignore_eos": True,
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(choice["index"] for choice in choices) == list(range(24))
    assert response.json()["usage"]["completion_tokens"] == 24 * 8
    assert idle_free_blocks(cluster) == baseline
