"""Speculative decoding across real processes: Redis, the gateway, prefill and decode workers
(K/V over UCX or TCP), HTTP clients. Every worker runs the same --speculative-config; greedy
output must be token-identical to the offline engine WITHOUT speculation on the same checkpoint.

With a draft model, the prefill worker computes the draft's K/V of the prompt too and hands it
over with the target's (same block ids), so a decode worker drafts from its first step and never
computes a prompt position itself; a decode worker killed mid-stream hands its streams to the
other, which computes each one's tokens so far itself (migration) and goes on token-exact. Colocated, n-gram lookup. Whatever ends a request (its length, a stop string,
a client that leaves, an abort), every block comes back on every worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.models.truncate import truncate_layers
from nori.sampling.params import SamplingParams
from nori.state.keys import Keys
from nori.state.registry import WorkerRegistry
from tests.cluster.conftest import WORKER_ARGS, running_cluster, start_cluster
from tests.cluster.test_cluster_e2e import (
    idle_free_blocks,
    model_name,
    stats,
    wait_for_free_blocks,
)
from tests.cluster.test_faults import streams_survive
from tests.cluster.test_observability import _scrape, _value
from tests.telemetry.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the",
    "In a small village there lived an old man who",
    "1 2 3 4 5 6 7 8 9 10",
    "She looked at the sky and said",
]
# Recurring phrases: n-gram lookup finds drafts in the prompt from the first step.
REPETITIVE_PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
    "one two three one two three one two three one two",
    "Lily and Tom went to the park. Lily and Tom went to the",
]
NEW_TOKENS = 24
DECODES = ("decode-0", "decode-1")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    """The reference: the same checkpoint and engine flags as the workers, no speculation."""
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def draft_cluster(
    redis_url: str,
    checkpoint: Path,
    receiver: OTLPReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalCluster]:
    """1 prefill, 2 decode workers drafting with the target's first 2 of its 4 layers."""
    draft = truncate_layers(checkpoint, tmp_path_factory.mktemp("draft") / "demo-draft", 2)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # spans exported at once, not every 5 s
        running = start_cluster(
            redis_url,
            checkpoint,
            tmp_path_factory.mktemp("logs"),
            worker_args=(*WORKER_ARGS, "--speculative-config", json.dumps(spec)),
            otlp_traces_endpoint=receiver.endpoint,
        )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def ngram_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """One colocated worker (`nori up --colocated`) looking drafts up in each request's tokens.
    Function-scoped: one test uses it, and it stops before the next cluster's tests run."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    yield from running_cluster(
        redis_url,
        checkpoint,
        tmp_path_factory,
        colocated=True,
        worker_args=(*WORKER_ARGS, "--speculative-config", json.dumps(spec)),
    )


Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_workers(cluster: LocalCluster, only: str | None = None) -> dict[str, Scrape]:
    """Each worker's /metrics (or `only` that one's), by worker id, at the address it states in
    the registry (where a killed worker stays until its entry expires)."""

    async def addresses() -> dict[str, str]:
        redis = Redis.from_url(cluster.spec.redis_url)
        try:
            workers = await WorkerRegistry(redis, Keys(cluster.spec.namespace)).list_workers()
        finally:
            await redis.aclose()
        return {w.worker_id: w.metrics_address for w in workers}

    return {
        name: _scrape(f"http://{address}/metrics")
        for name, address in asyncio.run(addresses()).items()
        if only in (None, name)
    }


def total(scrape: Scrape, name: str) -> float:
    """A counter's value summed over its labels."""
    return sum(value for (sample, _), value in scrape.items() if sample == name)


def delta(
    after: dict[str, Scrape], before: dict[str, Scrape], worker: str, name: str, **labels: str
) -> float:
    """How much a counter grew on a worker: with `labels`, that sample; else summed over all."""
    if labels:
        return _value(after[worker], name, **labels) - _value(before[worker], name, **labels)
    return total(after[worker], name) - total(before[worker], name)


def complete(cluster: LocalCluster, prompt: str, **extra: object) -> dict[str, object]:
    """A greedy completion with its token ids (vLLM's return_tokens_as_token_ids), and the id
    of the trace it joined (where the cluster traces)."""
    trace_id = secrets.token_hex(16)
    response = httpx.post(
        f"{cluster.url}/v1/completions",
        json={
            "model": model_name(cluster),
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **extra,
        },
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return {**response.json(), "trace_id": trace_id}


def assert_token_identical(
    results: list[dict[str, object]], prompts: list[str], offline: LLM
) -> None:
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    expected = [o.outputs[0] for o in offline.generate(prompts, greedy, use_tqdm=False)]
    for index, (result, reference) in enumerate(zip(results, expected, strict=True)):
        choice = result["choices"][0]  # type: ignore[index]
        tokens = [f"token_id:{t}" for t in reference.token_ids]
        assert choice["logprobs"]["tokens"] == tokens, f"prompt {index} diverged"
        assert choice["text"] == reference.text
        assert choice["finish_reason"] == reference.finish_reason


def test_colocated_ngram_is_token_identical(ngram_cluster: LocalCluster, offline: LLM) -> None:
    cluster = ngram_cluster
    baseline = idle_free_blocks(cluster)
    before = scrape_workers(cluster)
    with concurrent.futures.ThreadPoolExecutor(len(REPETITIVE_PROMPTS)) as pool:
        results = list(pool.map(lambda prompt: complete(cluster, prompt), REPETITIVE_PROMPTS))
    assert_token_identical(results, REPETITIVE_PROMPTS, offline)
    after = scrape_workers(cluster)
    assert list(after) == ["colocated-0"]
    for counter in SPEC_COUNTERS:
        assert delta(after, before, "colocated-0", f"nori_spec_decode_{counter}_total") > 0
    assert _value(after["colocated-0"], "nori_kv_transfer_draft_bytes_total") == 0
    assert wait_for_free_blocks(cluster, baseline) == baseline


def test_disaggregated_draft_model_is_token_identical_and_hands_over_the_draft_kv(
    draft_cluster: LocalCluster, offline: LLM, receiver: OTLPReceiver
) -> None:
    cluster = draft_cluster
    before = scrape_workers(cluster)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda prompt: complete(cluster, prompt), PROMPTS))
    assert_token_identical(results, PROMPTS, offline)

    assert all(stats(cluster, name).num_requests > 0 for name in DECODES), "both decode"
    deadline = time.monotonic() + 10
    while True:  # a worker counts a request when it ends, a moment after the client has it
        after = scrape_workers(cluster)
        done = sum(delta(after, before, n, "nori_requests_total") for n in DECODES)
        if done >= len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for name in DECODES:
        for counter in SPEC_COUNTERS:
            assert delta(after, before, name, f"nori_spec_decode_{counter}_total") > 0, (
                name,
                counter,
            )
        # The draft's K/V came with the target's: neither prompt was computed here.
        assert delta(after, before, name, "nori_kv_transfer_draft_bytes_total") > 0, name
        assert _value(after[name], "nori_prompt_tokens_computed_total") == 0, name
    sent = delta(after, before, "prefill-0", "nori_kv_transfer_draft_bytes_total")
    received = sum(delta(after, before, n, "nori_kv_transfer_draft_bytes_total") for n in DECODES)
    assert sent == received > 0
    # The draft (2 layers) holds half the target's (4 layers) K/V of the same blocks: a third.
    assert 3 * sent == delta(after, before, "prefill-0", "nori_kv_transfer_bytes_total")
    assert delta(after, before, "prefill-0", "nori_prompt_tokens_computed_total") > 0

    # The hand-off's spans carry the draft's bytes on both ends.
    def has_transfer(spans: list[ReceivedSpan]) -> bool:
        return {"kv_send", "kv_receive"} <= {s.name for s in spans}

    spans = receiver.wait_for(str(results[0]["trace_id"]), has_transfer)
    kv_send = next(s for s in spans if s.name == "kv_send")
    kv_receive = next(s for s in spans if s.name == "kv_receive")
    assert kv_send.attributes["nori.kv.draft_bytes"] == kv_receive.attributes["nori.kv.draft_bytes"]
    assert 0 < 3 * kv_send.attributes["nori.kv.draft_bytes"] == kv_send.attributes["nori.kv.bytes"]


def test_no_block_leaks_after_finished_stopped_sampled_disconnected_and_aborted_requests(
    draft_cluster: LocalCluster, offline: LLM
) -> None:
    cluster = draft_cluster
    baseline = idle_free_blocks(cluster)
    name = model_name(cluster)
    # A stop string several tokens into the greedy answer: the request ends early, its
    # accepted drafts past the stop never shown.
    prompt, stop = PROMPTS[2], " are"
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    (reference,) = offline.generate([prompt], greedy, use_tqdm=False)
    text = reference.outputs[0].text
    assert text.index(stop) >= 20, f"the stop string should come late in {text!r}"

    def stopped() -> None:
        result = complete(cluster, prompt, stop=[stop])
        choice = result["choices"][0]  # type: ignore[index]
        assert choice["text"] == text[: text.index(stop)]
        assert choice["finish_reason"] == "stop"

    def seeded() -> None:
        # Sampled (seeded): speculation keeps the distribution, not a run's exact draws.
        response = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": name, "prompt": PROMPTS[0], "n": 2, "seed": 7, "temperature": 0.8,
                  "max_tokens": 16, "ignore_eos": True},
            timeout=120,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 32

    def disconnected(index: int) -> None:
        body = {"model": name, "prompt": f"{index} {PROMPTS[1]}", "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{cluster.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(4):
                next(events)
        # Leaving the block closed the connection mid-stream.

    def aborted(index: int) -> None:
        body = {"model": name, "prompt": f"{index} {PROMPTS[3]}", "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{cluster.url}/v1/completions", json=body, timeout=httpx.Timeout(120, read=2)
            )

    before = scrape_workers(cluster)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        greedy_futures = [pool.submit(complete, cluster, p) for p in PROMPTS[:2]]
        futures: list[concurrent.futures.Future[None]] = [
            pool.submit(stopped),
            pool.submit(seeded),
            *(pool.submit(disconnected, index) for index in range(2)),
            *(pool.submit(aborted, index) for index in range(2)),
        ]
        for future in futures:
            future.result()
        finished = [future.result() for future in greedy_futures]
    assert_token_identical(finished, PROMPTS[:2], offline)
    assert wait_for_free_blocks(cluster, baseline, timeout_s=30) == baseline
    # The four that the clients left were aborted on their decode workers, mid-decode.
    deadline = time.monotonic() + 10
    while True:
        after = scrape_workers(cluster)
        aborts = [delta(after, before, n, "nori_requests_total", outcome="abort") for n in DECODES]
        if sum(aborts) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(aborts) == 4, aborts
    assert all(stats(cluster, n).num_requests_holding_blocks == 0 for n in baseline)


def test_a_decode_worker_killed_mid_stream_hands_its_speculative_streams_over(
    draft_cluster: LocalCluster, checkpoint: Path
) -> None:
    """Last on this cluster: decode-0 does not come back. Its streams continue on decode-1,
    which computes each one's prompt and tokens so far itself (the gateway's migration path:
    the target's K/V and the draft's) and drafts on from there: token-exact against the
    offline engine without speculation, and no block is lost."""
    cluster = draft_cluster
    victim = cluster.worker("decode-0").process
    before = scrape_workers(cluster, "decode-1")["decode-1"]

    def strike() -> None:
        os.kill(victim.pid, signal.SIGKILL)

    streams_survive(cluster, checkpoint, strike)
    assert victim.wait(timeout=10) == -signal.SIGKILL
    after = scrape_workers(cluster, "decode-1")["decode-1"]
    accepted = "nori_spec_decode_num_accepted_tokens_total"
    assert _value(after, accepted) > _value(before, accepted)
    computed = "nori_prompt_tokens_computed_total"
    assert _value(after, computed) > _value(before, computed) == 0
