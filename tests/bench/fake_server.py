"""An OpenAI-style streaming server inside httpx (a MockTransport): fast, no sockets, and it
counts what the load generator did to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


def sse(*events: object) -> bytes:
    """`data: ...` events; a str is sent as is (e.g. "[DONE]"), anything else as JSON."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


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

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body.get("prompt")
        num_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if num_prompt + body["max_tokens"] > self.max_model_len:
            error = {"message": "too long for this model", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": error})
        return httpx.Response(200, content=self._stream(num_prompt, body["max_tokens"]))

    async def _stream(self, num_prompt: int, max_tokens: int) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for index in range(max_tokens):
            await asyncio.sleep(self.token_delay_s)
            finish = "length" if index == max_tokens - 1 else None
            yield sse({"choices": [{"index": 0, "text": f" t{index}", "finish_reason": finish}]})
        # Before the last yield: a client that has read [DONE] never resumes the generator.
        self.in_flight -= 1
        usage = {"prompt_tokens": num_prompt, "completion_tokens": max_tokens}
        yield sse({"choices": [], "usage": usage}, "[DONE]")
