"""What every HTTP request passes through before its endpoint, as plain ASGI middleware: API keys
(else a 401; `/health` and `/metrics` stay open); a body bound per endpoint (else a 413, before
parsing); `x-request-id` and `x-trace-id` on every response; the drain (`Drain`: new requests
get 503 with `Retry-After` while the gateway stops); Prometheus figures (`GatewayMetrics`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from http import HTTPStatus

from fastapi import FastAPI
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nori.gateway.errors import APIError
from nori.telemetry.tracing import Tracing

logger = logging.getLogger("nori.gateway")

# ---------------------------------------------------------------------- API keys


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Collection[str], open_paths: Collection[str]) -> None:
        if not keys or any(not key for key in keys):
            raise ValueError("an API key must not be empty")
        self.app = app
        self._keys = [key.encode() for key in keys]
        self._open_paths = frozenset(open_paths)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Every key compared in constant time: no timing hint about which one is close.
        matches = [hmac.compare_digest(token.strip(), key) for key in self._keys]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self._open_paths:
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "OPTIONS" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            HTTPStatus.UNAUTHORIZED,
            "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)


# ---------------------------------------------------------------------- body size

# `--max-request-body-mib`'s default: a large prompt still gets the length check's clear 400.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# Per token of context: JSON text or a token id takes at most 12; the rest is room for fields.
PROMPT_BODY_BYTES_PER_TOKEN = 64
# ...and never under this, so short contexts still take a conversation with a long template.
MIN_PROMPT_BODY_BYTES = 1024 * 1024


def prompt_body_limit(max_model_len: int, max_bytes: int) -> int:
    """A prompt endpoint's body bound: what `max_model_len` tokens could need, <= `max_bytes`."""
    return min(max_bytes, max(MIN_PROMPT_BODY_BYTES, PROMPT_BODY_BYTES_PER_TOKEN * max_model_len))


class BodyLimitMiddleware:
    """`max_bytes` for every path, or `path_limits[path]` where it names one."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length", b"")
        if length.isdigit():
            if int(length) > limit:
                await self._refuse(scope, receive, send, limit, int(length))
                return
            await self.app(scope, receive, send)
            return
        # Chunked: read it all, up to the bound, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees it in the replay
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, receive, send, limit, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, limit: int, size: int | None
    ) -> None:
        path = scope.get("path", "")
        where = f"{path}'s" if path in self.path_limits else "this server's"
        stated = f" ({size} bytes)" if size is not None else ""
        error = APIError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body{stated} is larger than {where} limit of {limit} bytes",
        )
        await error.response()(scope, receive, send)


# ---------------------------------------------------------------------- request and trace ids

REQUEST_ID_HEADER = b"x-request-id"
# Longer ids are refused rather than carried into every log line, Redis key and trace.
MAX_REQUEST_ID_LEN = 256


def client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if not text or len(text) > MAX_REQUEST_ID_LEN or not text.isprintable():
                return None
            return text
    return None


def response_id(prefix: str, client_id: str | None) -> str:
    return f"{prefix}-{client_id if client_id is not None else uuid.uuid4().hex}"


def worker_request_id_base(response_id: str, client_id: str | None) -> str:
    """The prefix of the workers' request ids: a client's id gets a random suffix, since a
    client may send one id twice and workers need each call's id unique."""
    return response_id if client_id is None else f"{response_id}-{uuid.uuid4().hex[:8]}"


class EchoRequestIdMiddleware:
    """Adds the client's `x-request-id` to the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = client_request_id(scope) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, client_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


TRACE_ID_HEADER = "x-trace-id"


def instrument(app: FastAPI, tracing: Tracing, untraced_paths: Sequence[str]) -> None:
    """Server spans for `app` when tracing is on (nothing at all when it is off)."""
    if not tracing.enabled:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app.add_middleware(TraceIdHeaderMiddleware)
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=tracing.provider,
        # A span per SSE chunk sent would cost more than the chunk.
        exclude_spans=["receive", "send"],
        excluded_urls=",".join(untraced_paths),
    )


class TraceIdHeaderMiddleware:
    """Puts the current trace's id in the response headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = trace.get_current_span().get_span_context()

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start" and context.is_valid:
                headers = list(message.get("headers", []))
                headers.append(
                    (TRACE_ID_HEADER.encode(), trace.format_trace_id(context.trace_id).encode())
                )
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_trace_id)


# ---------------------------------------------------------------------- the drain

RETRY_AFTER_S = 5


class Drain:
    """Counts the API requests in flight and knows whether the gateway drains."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no request is left in flight, False when `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class DrainMiddleware:
    """Refuses new requests while draining (`open_paths` excepted) and counts the rest in flight
    until their last byte is sent."""

    def __init__(
        self, app: ASGIApp, drain: Drain, open_paths: Collection[str], health_path: str
    ) -> None:
        self.app = app
        self._drain = drain
        self._open_paths = frozenset(open_paths)
        self._health_path = health_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or (path in self._open_paths and path != self._health_path):
            await self.app(scope, receive, send)
            return
        if self._drain.draining:
            error = APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "The server is shutting down; retry the request.",
                "service_unavailable_error",
                code="server_shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            await error.response()(scope, receive, send)
            return
        if path in self._open_paths:
            await self.app(scope, receive, send)
            return
        self._drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self._drain.leave()


# ---------------------------------------------------------------------- metrics

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
