"""SIGTERM drains the gateway: streams in flight finish, new requests get 503 with Retry-After
(answered, not reset), and the process exits 0 once idle, or at the drain timeout. A real
uvicorn server in its own process, a real signal, real HTTP clients."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from nori.launch.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]

SERVER = """
import asyncio, logging, sys
import uvicorn
from nori.gateway.app import create_app
from nori.gateway.middleware import Drain
from nori.gateway.server import DrainingServer
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.helpers import FakeBackend, chunk

checkpoint, port, timeout_s, endless = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

def script(request):
    return [chunk([7], "x") for _ in range(29)] + [chunk([8], "y", finished=True, finish_reason="length")]

logging.basicConfig(level=logging.INFO)
backend = FakeBackend(script=script, delay_s=0.05, endless=endless == "1")
drain = Drain()
app = create_app(backend, Tokenizer.from_dir(checkpoint), "m", 64, drain=drain)
config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info", timeout_graceful_shutdown=1)
asyncio.run(DrainingServer(config, drain, timeout_s).serve())
print("exited cleanly", flush=True)
"""


def start_server(
    checkpoint: Path, timeout_s: float, endless: bool
) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVER,
            str(checkpoint),
            str(port),
            str(timeout_s),
            str(int(endless)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


def stream(url: str, started: threading.Event, texts: list[str]) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 30, "stream": True}
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            started.set()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if line == "data: [DONE]":
                texts.append("".join(pieces))


@pytest.mark.slow
def test_sigterm_finishes_streams_and_refuses_new_requests_with_503(tiny_checkpoint: Path) -> None:
    process, url = start_server(tiny_checkpoint, timeout_s=30, endless=False)
    try:
        texts: list[str] = []
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=stream, args=(url, e, texts)) for e in events]
        for thread in threads:
            thread.start()
        for event in events:
            assert event.wait(30)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert httpx.get(url + "/metrics").status_code == 200
        for thread in threads:
            thread.join(30)
        # Every stream ran to its last token: none was cut by the stop.
        assert texts == ["x" * 29 + "y"] * 3
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "draining: 3 request(s) in flight" in output
    assert "drained: no request in flight" in output
    assert "exited cleanly" in output


@pytest.mark.slow
def test_the_drain_ends_at_its_timeout_and_a_second_signal_ends_it_at_once(
    tiny_checkpoint: Path,
) -> None:
    for second_signal in (False, True):
        process, url = start_server(
            tiny_checkpoint, timeout_s=1.0 if not second_signal else 60, endless=True
        )
        try:
            started = threading.Event()
            texts: list[str] = []
            client = threading.Thread(target=stream_ignoring_errors, args=(url, started, texts))
            client.start()
            assert started.wait(30)
            began = time.monotonic()
            process.send_signal(signal.SIGTERM)
            if second_signal:
                time.sleep(0.3)
                process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
            took = time.monotonic() - began
            client.join(30)
        finally:
            if process.poll() is None:
                process.kill()
        assert texts == []  # the endless stream never finished
        assert took < 10, output
        if not second_signal:
            assert "drain timed out after 1 s with 1 request(s) in flight" in output


def stream_ignoring_errors(url: str, started: threading.Event, texts: list[str]) -> None:
    """`stream`, for a stream the server cuts."""
    with contextlib.suppress(httpx.HTTPError, AssertionError):
        stream(url, started, texts)
