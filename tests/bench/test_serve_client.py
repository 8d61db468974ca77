"""One streamed request into a record: SSE parsing, usage, and every way a request fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from nori.bench.serve.client import RequestOptions, first_model, request_body, send_request
from nori.bench.serve.records import RequestRecord
from nori.bench.serve.specs import RequestSpec
from tests.bench.fake_server import sse

COMPLETIONS = RequestOptions("completions", "/v1/completions", "m", timeout_s=5.0)
CHAT = RequestOptions("chat", "/v1/chat/completions", "m", temperature=0.5, timeout_s=5.0)
TEXT = RequestSpec("hello there", prompt_len=3, max_tokens=4, request_class="random")

Handler = Callable[[httpx.Request], Any]


async def send(
    handler: Handler, spec: RequestSpec = TEXT, options: RequestOptions = COMPLETIONS
) -> RequestRecord:
    transport = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await send_request(client, spec, options, index=3, origin=0.0)


def answer(body: bytes, status: int = 200) -> Handler:
    return lambda request: httpx.Response(status, content=body)


async def test_completion_stream_with_usage() -> None:
    body = b": keep-alive comment\n\n" + sse(
        {"choices": [{"text": "Hello", "finish_reason": None}], "usage": None},
        {"choices": [{"text": " big world", "finish_reason": None}], "usage": None},
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}},
        "[DONE]",
    )
    record = await send(answer(body))
    assert record.success and record.error is None
    assert record.index == 3 and record.request_class == "random"
    assert len(record.chunk_times) == 2  # the empty closing chunk carries no text
    assert (record.prompt_tokens, record.output_tokens) == (7, 4)  # the server's counts
    assert record.usage_from_server and record.finish_reason == "length"
    assert record.max_tokens == 4 and not record.truncated
    ttft, e2el = record.ttft, record.e2el
    assert ttft is not None and e2el is not None and 0 <= ttft <= e2el


async def test_chat_stream_without_usage_is_counted_locally() -> None:
    body = sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {"content": " you"}}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
        "[DONE]",
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=body)

    record = await send(handler, options=CHAT)
    assert record.success and record.finish_reason == "stop"
    assert (record.prompt_tokens, record.output_tokens) == (3, 2)
    assert not record.usage_from_server
    assert seen[0].url.path == "/v1/chat/completions"


def test_request_bodies() -> None:
    ids = RequestSpec((0, 5, 6), prompt_len=3, max_tokens=9, request_class="random")
    body = request_body(ids, COMPLETIONS)
    assert body == {
        "model": "m",
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [0, 5, 6],
        "max_tokens": 9,
    }
    eos = request_body(TEXT, RequestOptions("completions", "/v1/completions", "m", ignore_eos=True))
    assert eos["ignore_eos"] is True and eos["prompt"] == "hello there"
    chat = request_body(TEXT, CHAT)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert chat["max_completion_tokens"] == 4 and chat["temperature"] == 0.5
    assert "prompt" not in chat and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="text prompts"):
        request_body(ids, CHAT)


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (
            400,
            b'{"error": {"message": "prompt is too long", "type": "invalid_request_error"}}',
            "HTTP 400: prompt is too long",
        ),
        (500, b"Internal Server Error", "HTTP 500: Internal Server Error"),
        (404, b'{"object": "error", "message": "no such model"}', "HTTP 404: no such model"),
        (429, b'{"detail": "slow down"}', "HTTP 429: slow down"),
    ],
)
async def test_a_refused_request_fails_with_the_server_message(
    status: int, body: bytes, error: str
) -> None:
    record = await send(answer(body, status))
    assert not record.success
    assert record.error == error
    assert record.ttft is None and record.e2el is None


async def test_an_error_event_inside_the_stream_fails_the_request() -> None:
    body = sse(
        {"choices": [{"text": "a", "finish_reason": None}]},
        {"error": {"message": "worker lost", "type": "internal_error"}},
        "[DONE]",
    )
    record = await send(answer(body))
    assert not record.success and record.error == "stream error: worker lost"
    assert len(record.chunk_times) == 1


async def test_a_stream_cut_before_done_fails() -> None:
    record = await send(answer(sse({"choices": [{"text": "a", "finish_reason": None}]})))
    assert not record.success and record.error == "the stream ended without data: [DONE]"


async def test_a_malformed_event_fails() -> None:
    record = await send(answer(b"data: {not json\n\n"))
    assert not record.success and record.error is not None
    assert record.error.startswith("malformed stream event")


async def test_a_connection_failure_fails() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    record = await send(refuse)
    assert not record.success and record.error == "ConnectError: connection refused"


async def test_a_request_past_its_timeout_fails() -> None:
    async def slow_stream() -> AsyncIterator[bytes]:
        yield sse({"choices": [{"text": "a", "finish_reason": None}]})
        await asyncio.sleep(5)
        yield sse("[DONE]")

    options = RequestOptions("completions", "/v1/completions", "m", timeout_s=0.1)
    record = await send(lambda request: httpx.Response(200, content=slow_stream()), options=options)
    assert not record.success and record.error == "timed out after 0.1 s"
    assert len(record.chunk_times) == 1


async def test_first_model() -> None:
    def models(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "llama"}, {"id": "other"}]})

    def none(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": []})

    for handler, expected in ((models, "llama"), (none, None)):
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if expected is None:
                with pytest.raises(ValueError, match="pass --model"):
                    await first_model(client)
            else:
                assert await first_model(client) == expected
