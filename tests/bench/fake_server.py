"""An OpenAI-style streaming server on a local socket (aiohttp.web): fast, and it counts what the
load generator did to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sse(*events: object) -> bytes:
    """`data: ...` events; a str is sent as is (e.g. "[DONE]"), anything else as JSON."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """Serves every path with `handler` on 127.0.0.1 (a free port); yields the base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def stream_bytes(
    request: web.Request, chunks: AsyncIterator[bytes] | list[bytes]
) -> web.StreamResponse:
    """A 200 text/event-stream response that writes each chunk as it comes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if isinstance(chunks, list):
        for chunk in chunks:
            await response.write(chunk)
    else:
        async for chunk in chunks:
            await response.write(chunk)
    await response.write_eof()
    return response


class FakeOpenAI:
    """Answers each completion with max_tokens one-token chunks, `token_delay_s` apart, then a
    usage chunk and [DONE]; a prompt given as token ids longer than `max_model_len` gets a 400,
    as Nori and vLLM answer it."""

    def __init__(self, token_delay_s: float = 0.001, max_model_len: int = 1 << 30) -> None:
        self.token_delay_s = token_delay_s
        self.max_model_len = max_model_len
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def serving(self) -> Any:
        return serving(self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})
        body = await request.json()
        self.bodies.append(body)
        prompt = body.get("prompt")
        num_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if num_prompt + body["max_tokens"] > self.max_model_len:
            error = {"message": "too long for this model", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        return await stream_bytes(request, self._stream(num_prompt, body["max_tokens"]))

    async def _stream(self, num_prompt: int, max_tokens: int) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for index in range(max_tokens):
            await asyncio.sleep(self.token_delay_s)
            finish = "length" if index == max_tokens - 1 else None
            yield sse({"choices": [{"index": 0, "text": f" t{index}", "finish_reason": finish}]})
        # Before the last chunk: a client that has read [DONE] may close the connection.
        self.in_flight -= 1
        usage = {"prompt_tokens": num_prompt, "completion_tokens": max_tokens}
        yield sse({"choices": [], "usage": usage}, "[DONE]")
