"""The HTTP layer against a fake backend, in-process: request parsing, response shapes, routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nori.gateway.app import create_app
from nori.gateway.backend import (
    GenerationChunk,
    GenerationRequest,
)
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import MAX_MODEL_LEN, MODEL, assert_error, client, make_app, post
from tests.gateway.helpers import FakeBackend, chunk, sse_json

pytestmark = pytest.mark.asyncio


# ----------------------------------------------------------------------------- happy paths


async def test_completion_response_shape(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    response = await post(
        make_app(tokenizer, backend), "/v1/completions", {"model": MODEL, "prompt": "hello"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Hello!",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    prompt_ids = tokenizer.encode("hello")
    assert prompt_ids[0] == tokenizer.bos_token_id  # completions prompts get BOS
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (request,) = backend.requests
    assert request.prompt_token_ids == prompt_ids
    assert request.request_id == f"{body['id']}-0"
    assert request.params.max_tokens == 16  # the completions default


async def test_sampling_fields_reach_the_backend(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    body = {
        "prompt": [3, 4, 5],
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "stop": "xy",
        "stop_token_ids": [9],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
        "min_tokens": 2,
        "logprobs": 3,
        "user": "someone",
        "some_future_field": {"ignored": True},
    }
    response = await post(make_app(tokenizer, backend), "/v1/completions", body)
    assert response.status_code == 200, response.text
    params = backend.requests[0].params
    assert backend.requests[0].prompt_token_ids == [3, 4, 5]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.5, 0.9, 7)
    assert (params.min_p, params.seed, params.stop, params.stop_token_ids) == (
        0.1,
        42,
        ("xy",),
        (9,),
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.ignore_eos, params.min_tokens) == (1.2, True, 2)
    assert params.logprobs == 3


async def test_chat_prompt_uses_template_without_extra_bos(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
        },
    ]
    response = await post(
        make_app(tokenizer, backend), "/v1/chat/completions", {"model": MODEL, "messages": messages}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}]
    )
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    request = backend.requests[0]
    assert request.prompt_token_ids == expected
    assert expected.count(tokenizer.bos_token_id) == 1  # the template's BOS, not a second one
    # No max_tokens: whatever the context leaves.
    assert request.params.max_tokens == MAX_MODEL_LEN - len(expected)
    assert body["usage"]["prompt_tokens"] == len(expected)


async def test_chat_max_completion_tokens_wins(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "max_completion_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    response = await post(make_app(tokenizer, backend), "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].params.max_tokens == 4
    assert backend.requests[0].params.logprobs == 2


async def test_batch_of_prompts_runs_concurrently(tokenizer: Tokenizer) -> None:
    both_started = asyncio.Event()
    started: list[str] = []

    class Backend(FakeBackend):
        async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
            started.append(request.request_id)
            if len(started) == 2:
                both_started.set()
            # Each stream waits for the other: a sequential gateway would never finish.
            await asyncio.wait_for(both_started.wait(), timeout=5)
            text = f"<{request.prompt_token_ids[-1]}>"
            yield chunk([1], text, finished=True, finish_reason="stop")

    backend = Backend()
    response = await post(
        make_app(tokenizer, backend), "/v1/completions", {"prompt": [[3, 10], [3, 11]]}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["<10>", "<11>"]
    assert sorted(started) == [f"{body['id']}-0", f"{body['id']}-1"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 2


async def test_logprobs_formats(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the cat", add_special_tokens=False)[:2]
    names = [tokenizer.decode([i]) for i in ids]
    assert all(names) and "\ufffd" not in "".join(names)
    entries = [
        TokenLogprobs(ids[0], -0.5, 1, ((ids[0], -0.5), (ids[1], -1.5))),
        TokenLogprobs(ids[1], -0.25, 2, ((ids[0], -0.2), (ids[1], -0.25))),
    ]

    def script(request: GenerationRequest) -> list[GenerationChunk]:
        return [
            chunk([ids[0]], names[0], logprobs=entries[:1]),
            chunk([ids[1]], names[1], logprobs=entries[1:], finished=True, finish_reason="stop"),
        ]

    app = make_app(tokenizer, FakeBackend(script))
    response = await post(app, "/v1/completions", {"prompt": "x", "logprobs": 2})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": names,
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{names[0]: -0.5, names[1]: -1.5}, {names[0]: -0.2, names[1]: -0.25}],
        "text_offset": [0, len(names[0])],
    }

    response = await post(
        app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
    )
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content[1] == {
        "token": names[1],
        "logprob": -0.25,
        "bytes": list(names[1].encode()),
        "top_logprobs": [
            {"token": names[0], "logprob": -0.2, "bytes": list(names[0].encode())},
            {"token": names[1], "logprob": -0.25, "bytes": list(names[1].encode())},
        ],
    }

    # Streaming: offsets continue across chunks; token ids on request (vLLM extension). The
    # backend waits between chunks, else the two would go out as one event (see below).
    app = make_app(tokenizer, FakeBackend(script, delay_s=0.05))
    response = await post(
        app,
        "/v1/completions",
        {"prompt": "x", "logprobs": 0, "stream": True, "return_tokens_as_token_ids": True},
    )
    chunks = sse_json(response.text)
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert [s["text_offset"] for s in streamed] == [[0], [len(f"token_id:{ids[0]}")]]
    assert [s["tokens"] for s in streamed] == [[f"token_id:{ids[0]}"], [f"token_id:{ids[1]}"]]


async def test_chunks_ready_together_go_out_as_one_event(tokenizer: Tokenizer) -> None:
    """A writer that falls behind the backend sends what piled up as one SSE event: the same
    text, tokens and logprobs, in fewer events."""
    ids = tokenizer.encode(" the cat sat", add_special_tokens=False)[:3]
    names = [tokenizer.decode([i]) for i in ids]
    entries = [TokenLogprobs(i, -0.5, 1, ((i, -0.5),)) for i in ids]

    def script(request: GenerationRequest) -> list[GenerationChunk]:
        return [
            chunk([ids[0]], names[0], logprobs=entries[:1]),
            chunk([ids[1]], names[1], logprobs=entries[1:2]),
            chunk([ids[2]], names[2], logprobs=entries[2:], finished=True, finish_reason="stop"),
        ]

    app = make_app(tokenizer, FakeBackend(script))
    body = {"prompt": "x", "logprobs": 0, "stream": True}
    chunks = sse_json((await post(app, "/v1/completions", body)).text)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "".join(names)
    # The first chunk alone (it marks the first token), the other two together.
    assert [t for t in texts if t] == [names[0], names[1] + names[2]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == names and offsets == [0, len(names[0]), len(names[0]) + len(names[1])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_streaming_chat_framing(tokenizer: Tokenizer) -> None:
    # Spaced out, so that each chunk is its own event (ready together, they would be merged).
    app = make_app(tokenizer, FakeBackend(delay_s=0.02))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    response = await post(app, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_json(response.text)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["Hel", "lo", "!"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)

    body["stream_options"] = {"include_usage": True}
    chunks = sse_json((await post(app, "/v1/chat/completions", body)).text)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_streaming_completion_batch(tokenizer: Tokenizer) -> None:
    body = {"prompt": ["a", "b"], "stream": True, "stream_options": {"include_usage": True}}
    response = await post(make_app(tokenizer), "/v1/completions", body)
    chunks = sse_json(response.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for item in chunks[:-1]:
        (choice,) = item["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hello!", 1: "Hello!"} and finishes == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


# ----------------------------------------------------------------------------- other routes


async def test_models_route(tokenizer: Tokenizer) -> None:
    async with client(make_app(tokenizer)) as http:
        body = (await http.get("/v1/models")).json()
        assert body["object"] == "list"
        (card,) = body["data"]
        assert card["id"] == MODEL and card["object"] == "model"
        assert card["max_model_len"] == MAX_MODEL_LEN
        assert (await http.get(f"/v1/models/{MODEL}")).json() == card
        assert_error(await http.get("/v1/models/other"), 404)


async def test_health_route(tokenizer: Tokenizer) -> None:
    async with client(make_app(tokenizer, FakeBackend())) as http:
        response = await http.get("/health")
        assert response.status_code == 200
        assert response.json() == {
            "status": "ok",
            "workers": {"prefill": 1, "decode": 2},
            "detail": "",
        }
    async with client(make_app(tokenizer, FakeBackend(healthy=False))) as http:
        response = await http.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "unhealthy"
    async with client(make_app(tokenizer, FakeBackend(health_error=OSError("redis down")))) as http:
        response = await http.get("/health")
        assert response.status_code == 503 and "redis down" in response.json()["detail"]


async def test_metrics_route(tokenizer: Tokenizer) -> None:
    async def extra() -> str:
        return 'nori_worker_kv_bytes_received_total{worker="d0"} 1234'

    backend = FakeBackend(delay_s=0.01)
    app = make_app(tokenizer, backend, extra_metrics=extra)
    other_app = make_app(tokenizer)  # a second app in the same process must not clash
    async with client(app) as http, client(other_app) as other:
        await http.post("/v1/completions", json={"prompt": "hi"})
        await http.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
        response = await http.get("/metrics")
        untouched = (await other.get("/metrics")).text
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    prompt_tokens = len(tokenizer.encode("hi"))
    for line in [
        'nori_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        'nori_gateway_requests_total{endpoint="/v1/completions",status="404"} 1.0',
        'nori_gateway_requests_in_flight{endpoint="/metrics"} 1.0',
        'nori_gateway_requests_in_flight{endpoint="/v1/completions"} 0.0',
        f"nori_gateway_prompt_tokens_total {float(prompt_tokens)}",
        "nori_gateway_generation_tokens_total 3.0",
        "nori_gateway_time_to_first_token_seconds_count 1.0",
        "nori_gateway_e2e_request_latency_seconds_count 1.0",
        'nori_worker_kv_bytes_received_total{worker="d0"} 1234',
    ]:
        assert line in text.splitlines(), line
    assert "nori_gateway_generation_tokens_total 0.0" in untouched.splitlines()
    assert "nori_worker" not in untouched


async def test_metrics_survive_a_failing_hook(tokenizer: Tokenizer) -> None:
    async def broken() -> str:
        raise ConnectionError("redis down")

    async with client(make_app(tokenizer, extra_metrics=broken)) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200 and "nori_gateway_requests_total" in response.text


async def test_create_app_rejects_a_useless_context(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        create_app(FakeBackend(), tokenizer, MODEL, 1)


async def test_error_bodies_are_json(tokenizer: Tokenizer) -> None:
    # The SSE error event must be valid JSON on one line (no newline inside a `data:` field).
    from nori.gateway.errors import bad_request

    text = bad_request("line one\nline two").body().model_dump_json()
    assert "\n" not in text and json.loads(text)["error"]["message"] == "line one\nline two"
