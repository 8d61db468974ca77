"""One streamed request into a record: SSE parsing, usage, and every way a request fails."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from nori.bench.serve.client import RequestOptions, first_model, request_body, send_request
from nori.bench.serve.records import RequestRecord
from nori.bench.serve.specs import RequestSpec
from tests.bench.fake_server import Handler, serving, sse, stream_bytes

COMPLETIONS = RequestOptions("completions", "/v1/completions", "m", timeout_s=5.0)
CHAT = RequestOptions("chat", "/v1/chat/completions", "m", temperature=0.5, timeout_s=5.0)
TEXT = RequestSpec("hello there", prompt_len=3, max_tokens=4, request_class="random")


async def send(
    handler: Handler, spec: RequestSpec = TEXT, options: RequestOptions = COMPLETIONS
) -> RequestRecord:
    async with serving(handler) as url, aiohttp.ClientSession() as session:
        options = replace(options, url=url + options.url)
        return await send_request(session, spec, options, index=3, origin=0.0)


def answer(body: bytes, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        if status != 200:
            return web.Response(status=status, body=body)
        return await stream_bytes(request, [body])

    return handler


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
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        return await stream_bytes(request, [body])

    record = await send(handler, options=CHAT)
    assert record.success and record.finish_reason == "stop"
    assert (record.prompt_tokens, record.output_tokens) == (3, 2)
    assert not record.usage_from_server
    assert seen == ["/v1/chat/completions"]


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
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = replace(COMPLETIONS, url=f"http://127.0.0.1:{port}/v1/completions")
    async with aiohttp.ClientSession() as session:
        record = await send_request(session, TEXT, options, index=0, origin=0.0)
    assert not record.success and record.error is not None
    assert record.error.startswith("ClientConnectorError")


async def test_a_request_past_its_timeout_fails() -> None:
    async def slow_stream() -> AsyncIterator[bytes]:
        yield sse({"choices": [{"text": "a", "finish_reason": None}]})
        await asyncio.sleep(5)
        yield sse("[DONE]")

    async def slow(request: web.Request) -> web.StreamResponse:
        return await stream_bytes(request, slow_stream())

    options = RequestOptions("completions", "/v1/completions", "m", timeout_s=0.1)
    record = await send(slow, options=options)
    assert not record.success and record.error == "timed out after 0.1 s"
    assert len(record.chunk_times) == 1


async def test_first_model() -> None:
    async def models(request: web.Request) -> web.StreamResponse:
        assert request.path == "/v1/models"
        return web.json_response({"data": [{"id": "llama"}, {"id": "other"}]})

    async def none(request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": []})

    async def refused(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no"}}, status=401)

    for handler, expected in ((models, "llama"), (none, None), (refused, "401")):
        async with serving(handler) as url, aiohttp.ClientSession() as session:
            if expected == "llama":
                assert await first_model(session, url) == expected
            else:
                with pytest.raises(ValueError, match="pass --model" if expected is None else "401"):
                    await first_model(session, url)
