"""`nori health`, the containers' health check, as a subprocess."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from nori.launch.local_cluster import free_port


def _health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "health", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


class _Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_health_follows_the_status_code() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        assert _health(f"{base}/health").returncode == 0
        unhealthy = _health(f"{base}/other")
        assert unhealthy.returncode == 1 and "HTTP 503" in unhealthy.stderr
    finally:
        server.shutdown()


def test_nothing_listening_is_unhealthy_and_a_bad_target_is_a_usage_error() -> None:
    port = free_port()
    assert _health(f"http://127.0.0.1:{port}/health").returncode == 1
    assert _health(f"127.0.0.1:{port}", "--timeout-s", "1").returncode == 1
    bad = _health("nonsense")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
