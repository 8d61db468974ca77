"""Prometheus figures of one gateway app, in a registry of its own (so that one process, as in
the tests, may hold several apps).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("nori.gateway")

# Latencies of an LLM request span milliseconds (a cached one-token answer) to minutes.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

ExtraMetrics = Callable[[], Awaitable[str]]


class GatewayMetrics:
    def __init__(self, endpoints: frozenset[str]) -> None:
        # Only known paths become labels: a scanner must not grow the label set without bound.
        self.endpoints = endpoints
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "nori_gateway_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "nori_gateway_requests_in_flight",
            "HTTP requests being served now, by endpoint.",
            ["endpoint"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "nori_gateway_prompt_tokens",
            "Prompt tokens of requests handed to the backend.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "nori_gateway_generation_tokens",
            "Tokens generated for clients.",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "nori_gateway_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "nori_gateway_e2e_request_latency_seconds",
            "From request arrival to the last generated token, for completed generations.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def endpoint_label(self, path: str) -> str:
        return path if path in self.endpoints else "other"

    async def render(self, extra: ExtraMetrics | None) -> str:
        text = generate_latest(self.registry).decode()
        if extra is not None:
            try:
                extra_text = await extra()
            except Exception:
                logger.exception("extra_metrics hook failed")
            else:
                if extra_text:
                    text += extra_text if extra_text.endswith("\n") else extra_text + "\n"
        return text


class RequestMetricsMiddleware:
    """Counts requests by endpoint and status, and those in flight until their last byte (plain
    ASGI: `receive` is not wrapped, so handlers still see the client's disconnect)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.metrics.endpoint_label(scope.get("path", ""))
        status = 500  # if the app fails before starting a response

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        gauge = self.metrics.in_flight.labels(endpoint)
        gauge.inc()
        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            gauge.dec()
            self.metrics.requests.labels(endpoint, str(status)).inc()


def refused_worker_entries_text(counts: dict[str, int]) -> str:
    """The refused worker registry entries by reason, in the Prometheus text format."""
    name = "nori_gateway_refused_worker_entries_total"
    lines = [
        f"# HELP {name} Worker registry entries refused by their signature check, by reason.",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{reason="{reason}"}} {count}' for reason, count in sorted(counts.items())]
    return "\n".join(lines) + "\n"
