"""Observability of a running cluster: one trace per request across the gateway, prefill and
decode processes, sent over OTLP/gRPC to a receiver this test runs, with the spans in the right
parent/child order; and every role's Prometheus /metrics, whose figures add up to what was sent."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from nori.launch.local_cluster import LocalCluster
from nori.state.keys import Keys
from nori.state.registry import WorkerInfo, WorkerRegistry
from tests.cluster.conftest import start_cluster
from tests.telemetry.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

SERVER = 2  # OTLP's SPAN_KIND_SERVER
WORKER_SPANS = {
    ("nori-gateway", "route"),
    ("nori-gateway", "reserve"),
    ("nori-prefill", "prefill"),
    ("nori-prefill", "queue"),
    ("nori-prefill", "compute"),
    ("nori-prefill", "kv_send"),
    ("nori-decode", "decode"),
    ("nori-decode", "kv_receive"),
    ("nori-decode", "queue"),
    ("nori-decode", "generation"),
}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_cluster(
    redis_url: str,
    checkpoint: Path,
    receiver: OTLPReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as env:
        # Export each batch at once rather than every 5 s (the BatchSpanProcessor's default).
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        running = start_cluster(
            redis_url,
            checkpoint,
            tmp_path_factory.mktemp("logs"),
            num_decode=1,
            otlp_traces_endpoint=receiver.endpoint,
        )
    try:
        yield running
    finally:
        running.stop()


def _complete(spans: list[ReceivedSpan]) -> bool:
    return {(s.service, s.name) for s in spans} >= WORKER_SPANS and any(
        s.service == "nori-gateway" and s.kind == SERVER for s in spans
    )


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{len(found)} spans {service}/{name}"
    return found[0]


def test_a_request_is_one_trace_across_the_processes(
    traced_cluster: LocalCluster, receiver: OTLPReceiver
) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        f"{traced_cluster.url}/v1/completions",
        json={"model": "demo-llama", "prompt": "Once upon a time", "max_tokens": 12},
        headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trace-id"] == trace_id
    usage = response.json()["usage"]
    spans = receiver.wait_for(trace_id, _complete)

    server = next(s for s in spans if s.service == "nori-gateway" and s.kind == SERVER)
    assert server.name == "POST /v1/completions"
    assert server.parent_span_id == caller_span  # the incoming traceparent is the parent
    attributes = server.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "demo-llama"
    assert attributes["gen_ai.request.max_tokens"] == 12
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.id"] == response.json()["id"]
    assert attributes["gen_ai.response.finish_reasons"] == [
        response.json()["choices"][0]["finish_reason"]
    ]

    route = _one(spans, "nori-gateway", "route")
    reserve = _one(spans, "nori-gateway", "reserve")
    prefill = _one(spans, "nori-prefill", "prefill")
    decode = _one(spans, "nori-decode", "decode")
    for child in (route, reserve, prefill, decode):
        assert child.parent_span_id == server.span_id, child.name
    assert route.attributes["nori.prefill.worker"] == "prefill-0"
    assert route.attributes["nori.decode.worker"] == "decode-0"
    # Where the prompt was computed, and why (--disaggregation always here), on the request.
    assert attributes["nori.disaggregation.path"] == route.attributes["nori.disaggregation.path"]
    assert (attributes["nori.disaggregation.path"], attributes["nori.disaggregation.reason"]) == (
        "prefill",
        "mode",
    )
    assert attributes["nori.disaggregation.uncached_tokens"] == usage["prompt_tokens"]
    assert reserve.attributes["nori.kv.blocks"] >= 1

    for name in ("queue", "compute", "kv_send"):
        assert _one(spans, "nori-prefill", name).parent_span_id == prefill.span_id
    compute = _one(spans, "nori-prefill", "compute")
    assert compute.attributes["nori.prompt_tokens"] == usage["prompt_tokens"]
    kv_send = _one(spans, "nori-prefill", "kv_send")
    kv_receive = _one(spans, "nori-decode", "kv_receive")
    # The transfer's context crossed in its header: the receiver's span is the sender's child.
    assert kv_receive.parent_span_id == kv_send.span_id
    assert kv_send.attributes["nori.kv.bytes"] == kv_receive.attributes["nori.kv.bytes"] > 0
    assert kv_receive.attributes["nori.kv.blocks"] == reserve.attributes["nori.kv.blocks"]
    # Both workers run on this host: the decode worker copied the KV out of its mapping of the
    # prefill worker's KV cache (shared memory), which needs no permission to read another
    # process (Yama's ptrace_scope may be anything).
    assert kv_receive.attributes["nori.kv.bulk"] == "mapped"

    for name in ("queue", "generation"):
        assert _one(spans, "nori-decode", name).parent_span_id == decode.span_id
    generation = _one(spans, "nori-decode", "generation")
    # Token one came from the prefill worker; the decode worker generated the rest.
    assert generation.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] - 1
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    # Phases sit inside their call's span.
    for phase in (compute, kv_send, generation):
        parent = prefill if phase.service == "nori-prefill" else decode
        assert parent.start_ns <= phase.start_ns <= phase.end_ns <= parent.end_ns, phase.name


def test_a_streamed_chat_without_traceparent_starts_its_own_trace(
    traced_cluster: LocalCluster, receiver: OTLPReceiver
) -> None:
    client = openai.OpenAI(base_url=f"{traced_cluster.url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8,
        stream=True,
    )
    trace_id = raw.headers["x-trace-id"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert text
    spans = receiver.wait_for(trace_id, _complete)
    server = next(s for s in spans if s.service == "nori-gateway" and s.kind == SERVER)
    assert server.parent_span_id == ""  # the root
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert {s.trace_id for s in spans} == {trace_id}


# ---------------------------------------------------------------------- every role's /metrics


def _metric_urls(cluster: LocalCluster) -> dict[str, str]:
    """Each worker's /metrics, where it states it in the registry, and the gateway's."""

    async def workers() -> list[WorkerInfo]:
        redis = Redis.from_url(cluster.spec.redis_url)
        try:
            return await WorkerRegistry(redis, Keys(cluster.spec.namespace)).list_workers()
        finally:
            await redis.aclose()

    urls = {w.role: f"http://{w.metrics_address}/metrics" for w in asyncio.run(workers())}
    assert set(urls) == {"prefill", "decode"}, urls
    return {**urls, "gateway": f"{cluster.url}/metrics"}


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(
    scrape: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return scrape.get((name, frozenset(labels.items())), 0.0)


def test_every_role_serves_metrics_that_add_up(traced_cluster: LocalCluster) -> None:
    urls = _metric_urls(traced_cluster)
    before = {role: _scrape(url) for role, url in urls.items()}
    body = {"model": "demo-llama", "ignore_eos": True}
    prompts = ["Once upon a time", "The cat sat", "A little girl named Lily", "One day", "Tom"]

    # During load: a long stream, scraped after its first chunk.
    with httpx.stream(
        "POST",
        f"{traced_cluster.url}/v1/completions",
        json={**body, "prompt": "It was a sunny day. " * 8, "max_tokens": 300, "stream": True},
        timeout=120,
    ) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # The first token comes from the prefill worker; the decode worker runs the request
        # once its KV has landed, a moment later (its engine process reports its load after
        # each step): scraped until it shows, while the 300-token stream goes on.
        for _ in range(50):
            during = _scrape(urls["decode"])
            if _value(during, "nori_num_requests_running") >= 1:
                break
            time.sleep(0.05)
        assert _value(during, "nori_num_requests_running") >= 1
        assert _value(during, "nori_kv_blocks_used") > _value(
            before["decode"], "nori_kv_blocks_used"
        )
        assert (
            _value(
                _scrape(urls["gateway"]),
                "nori_gateway_requests_in_flight",
                endpoint="/v1/completions",
            )
            >= 1
        )
        assert [line for line in lines if line][-1] == "data: [DONE]"
    prompt_tokens = [
        httpx.post(
            f"{traced_cluster.url}/v1/completions",
            json={**body, "prompt": prompt, "max_tokens": 8},
            timeout=60,
        ).json()["usage"]["prompt_tokens"]
        for prompt in prompts
    ]
    sent = len(prompts) + 1
    generated = 300 + 8 * len(prompts)

    def delta(role: str, name: str, **labels: str) -> float:
        return _value(after[role], name, **labels) - _value(before[role], name, **labels)

    deadline = time.monotonic() + 10
    while True:  # a worker counts a call when it ends, just after the client has its answer
        after = {role: _scrape(url) for role, url in urls.items()}
        settled = delta("decode", "nori_requests_total", outcome="length") == sent and _value(
            after["decode"], "nori_kv_blocks_free"
        ) == _value(before["decode"], "nori_kv_blocks_free")
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    # Prefill: every prompt computed here and handed on; token one of each.
    assert delta("prefill", "nori_requests_total", outcome="transferred") == sent
    assert delta("prefill", "nori_requests_total", outcome="error") == 0
    assert delta("prefill", "nori_generation_tokens_total") == sent
    assert delta("prefill", "nori_prompt_tokens_total") >= sum(prompt_tokens)
    assert delta("prefill", "nori_prefix_cache_queries_total") == delta(
        "prefill", "nori_prompt_tokens_total"
    )
    for histogram in (
        "nori_time_to_first_token_seconds",
        "nori_request_queue_time_seconds",
        "nori_e2e_request_latency_seconds",
        "nori_kv_transfer_duration_seconds",
    ):
        assert delta("prefill", f"{histogram}_count") == sent, histogram
    sent_bytes = delta("prefill", "nori_kv_transfer_bytes_total")
    assert sent_bytes > 0

    # Decode: the same transfers in, the rest of the tokens out, each request to its length.
    assert delta("decode", "nori_requests_total", outcome="length") == sent
    assert delta("decode", "nori_requests_total", outcome="error") == 0
    assert delta("decode", "nori_kv_transfer_bytes_total") == sent_bytes
    assert delta("decode", "nori_kv_received_bytes_total", bulk="mapped") == sent_bytes
    # Every KV copy's range of the prefill worker's export arena went back after its transfer.
    assert ("nori_kv_export_arena_bytes_in_use", frozenset()) in after["prefill"]
    assert _value(after["prefill"], "nori_kv_export_arena_bytes_in_use") == 0
    assert delta("decode", "nori_generation_tokens_total") == generated - sent
    assert delta("decode", "nori_time_to_first_token_seconds_count") == sent
    assert delta("decode", "nori_request_queue_time_seconds_count") == sent
    assert delta("decode", "nori_e2e_request_latency_seconds_count") == sent
    itl = delta("decode", "nori_inter_token_latency_seconds_count")
    assert 0 < itl <= generated - 2 * sent
    assert delta("decode", "nori_kv_lease_expiries_total") == 0
    # Free blocks back where they started; nothing running.
    assert _value(after["decode"], "nori_kv_blocks_free") == _value(
        before["decode"], "nori_kv_blocks_free"
    )
    assert _value(after["decode"], "nori_num_requests_running") == 0
    # No speculation here: its counters are there from the start, at zero, on each worker and
    # in the gateway's per-worker copy (what `nori bench serve` reads); the ratios wait for a
    # first draft.
    for role in ("prefill", "decode"):
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_bonus_tokens"):
            assert after[role][(f"nori_spec_decode_{name}_total", frozenset())] == 0, name
        assert ("nori_prompt_tokens_computed_total", frozenset()) in after[role]
        assert ("nori_spec_decode_acceptance_rate", frozenset()) not in after[role]
    # Prompt positions computed: the prefill worker's, all but its prefix-cache hits; none on
    # the decode worker, which received every prompt's K/V.
    computed = delta("prefill", "nori_prompt_tokens_computed_total")
    assert computed == delta("prefill", "nori_prompt_tokens_total") - delta(
        "prefill", "nori_prefix_cache_hits_total"
    )
    assert delta("decode", "nori_prompt_tokens_computed_total") == 0
    per_worker = [key for key in after["gateway"] if key[0].startswith("nori_worker_spec_decode")]
    assert {dict(labels)["role"] for _, labels in per_worker} == {"prefill", "decode"}
    assert all(after["gateway"][key] == 0 for key in per_worker)
    # The long prompt's full blocks stay in the prefill worker's prefix cache.
    assert _value(after["prefill"], "nori_kv_blocks_cached") > 0

    # Gateway: what the clients saw.
    assert (
        delta("gateway", "nori_gateway_requests_total", endpoint="/v1/completions", status="200")
        == sent
    )
    assert delta("gateway", "nori_gateway_time_to_first_token_seconds_count") == sent
    assert delta("gateway", "nori_gateway_generation_tokens_total") == generated
