"""A client that goes away must cancel its backend streams promptly (real uvicorn server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nori.gateway.app import create_app
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.helpers import FakeBackend, serve

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def endless(tokenizer: Tokenizer) -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend(endless=True)
    with serve(create_app(backend, tokenizer, "m", 64)) as url:
        yield url, backend
    assert backend.backend_closed  # the app closes its backend at shutdown


def wait_closed(backend: FakeBackend, count: int = 1, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(backend.closed_early) < count:
        assert time.monotonic() < deadline, f"closed: {backend.closed_early}"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)],
)
def test_streaming_disconnect_closes_the_backend_stream(
    endless: tuple[str, FakeBackend], path: str, body: dict[str, Any]
) -> None:
    url, backend = endless
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert not backend.closed_early
    wait_closed(backend)
    assert backend.closed_early == [r.request_id for r in backend.requests]


def test_streaming_disconnect_closes_every_prompt(endless: tuple[str, FakeBackend]) -> None:
    url, backend = endless
    body = {"prompt": ["a", "b", "c"], "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        next(response.iter_lines())
    wait_closed(backend, 3)
    assert sorted(backend.closed_early) == sorted(r.request_id for r in backend.requests)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": ["a", "b"]}), ("/v1/chat/completions", CHAT)],
)
def test_non_streaming_disconnect_closes_the_backend_stream(
    endless: tuple[str, FakeBackend], path: str, body: dict[str, Any]
) -> None:
    url, backend = endless
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, timeout=0.3)
    wait_closed(backend, len(backend.requests))
    assert len(backend.requests) == (2 if path == "/v1/completions" else 1)


def test_disconnect_before_the_first_chunk(tokenizer: Tokenizer) -> None:
    # A streaming request waits for its first chunk before sending headers (so a refusal is
    # still a 429/503); leaving during that wait must cancel too.
    backend = FakeBackend(delay_s=30)
    with serve(create_app(backend, tokenizer, "m", 64)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "a", "stream": True}, timeout=0.3)
        wait_closed(backend)


async def test_a_disconnect_queued_behind_the_first_chunk_ends_the_stream_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The client leaves just as its first chunk comes: the watcher of `Session.first` queues the
    # disconnect behind that chunk, and the SSE body meets it on its next read. That is a
    # departure, not an error (the disconnect storm in tests/cluster logged it as one).
    from nori.gateway.endpoints import ClientDisconnected, _events

    class Departed:
        cancelled = False

        async def next(self) -> None:
            raise ClientDisconnected()

        def cancel(self) -> None:
            self.cancelled = True

    class Form:
        def opening(self) -> list[str]:
            return []

        def render(self, index: int, chunk: object) -> list[str]:
            return ["data: first\n\n"]

        def closing(self, usage: object) -> list[str]:
            return []

    session = Departed()
    events = [e async for e in _events(session, (0, None), Form())]  # type: ignore[arg-type]
    assert events == ["data: first\n\n"]  # no error event, no [DONE]: nobody is listening
    assert session.cancelled
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
