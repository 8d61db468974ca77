"""A uvicorn server on a free port in a thread, and a scriptable fake backend."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from nori.gateway.backend import BackendHealth, GenerationChunk, GenerationRequest


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Runs `app` with uvicorn on 127.0.0.1 and yields its base URL; stops it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def chunk(token_ids: list[int], text: str, **kwargs: object) -> GenerationChunk:
    return GenerationChunk(new_token_ids=token_ids, new_text=text, **kwargs)


Script = Callable[[GenerationRequest], list[GenerationChunk]]


def default_script(request: GenerationRequest) -> list[GenerationChunk]:
    return [
        chunk([7], "Hel"),
        chunk([8], "lo"),
        chunk([9], "!", finished=True, finish_reason="length"),
    ]


@dataclass
class FakeBackend:
    """Plays `script` for each request; `endless` keeps yielding until closed.

    Records every request it saw and which generators were closed before finishing (what a
    client disconnect must cause), with thread-safe events since servers run in threads.
    """

    script: Script = default_script
    error: BaseException | None = None
    # Raised by generate() itself rather than by the first step of its iterator.
    call_error: BaseException | None = None
    endless: bool = False
    delay_s: float = 0.0
    healthy: bool = True
    health_error: BaseException | None = None
    requests: list[GenerationRequest] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    closed_event: threading.Event = field(default_factory=threading.Event)
    running: int = 0
    max_running: int = 0
    backend_closed: bool = False

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        if self.call_error is not None:
            raise self.call_error
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        finished = False
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.error is not None:
                raise self.error
            if self.endless:
                while True:
                    await asyncio.sleep(0.02)
                    yield chunk([7], "x")
            for item in self.script(request):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                finished = item.finished
                yield item
        finally:
            self.running -= 1
            if not finished:
                self.closed_early.append(request.request_id)
                self.closed_event.set()

    async def health(self) -> BackendHealth:
        if self.health_error is not None:
            raise self.health_error
        return BackendHealth(self.healthy, {"prefill": 1, "decode": 2}, "" if self.healthy else "x")

    async def close(self) -> None:
        self.backend_closed = True


def parse_sse(raw: str) -> list[str]:
    """The payloads of an SSE body, checking the framing: `data: ...` events split by a blank
    line, and nothing else."""
    assert raw.endswith("\n\n"), repr(raw[-50:])
    events = raw[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), repr(event)
        assert "\n" not in event, repr(event)
        payloads.append(event[len("data: ") :])
    return payloads


def sse_json(raw: str) -> list[dict[str, Any]]:
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]
