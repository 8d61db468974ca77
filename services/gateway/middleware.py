"""What every HTTP request passes through before its endpoint (plain ASGI middleware, so a
streamed response passes through untouched and handlers still see the client's disconnect).

- **API keys** (`--api-key`, or NORI_API_KEY), as vLLM and OpenAI take them:
  `Authorization: Bearer KEY`; anything else is a 401 in OpenAI's error shape. `/health` and
  `/metrics` stay open for load balancers, orchestrators and Prometheus.
- **A bound on request bodies**: a 413 in OpenAI's error shape before the body is parsed. A body
  that states its length is refused from its header alone; one sent in chunks is buffered up to
  the bound and refused as soon as it passes it, so no client can make the gateway hold more than
  the bound per request. The bound is per endpoint: the prompt endpoints (completions, chat,
  /tokenize, /detokenize) take at most what a prompt that fits the context could need
  (`prompt_body_limit`), so a prompt of 10 M token ids or 20 MB of text is refused from its size,
  before JSON parsing turns it into Python lists and strings several times its size and holds the
  event loop for seconds.
- **`x-request-id`**, as vLLM honours it: the client's id names the request (its response `id`
  is `cmpl-<id>` or `chatcmpl-<id>`, and its workers' request ids start with that) and comes back
  on the response, errors included.
- **`x-trace-id`**: the server span comes from OpenTelemetry's FastAPI instrumentation (an
  incoming W3C `traceparent` becomes its parent); its trace id goes back to the client, the id to
  search for in Jaeger. The endpoints describe the request on that span
  (`endpoints.describe_request`); the request flow adds child spans for routing and the decode
  reservation and passes the context to the workers in gRPC metadata.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Collection, Mapping, Sequence
from http import HTTPStatus

from fastapi import FastAPI
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nori.gateway.errors import APIError
from nori.telemetry.tracing import Tracing

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
        # Constant time, and every key compared: no timing hint about which one is close.
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

# What `--max-request-body-mib` defaults to: a 10 MB prompt still reaches the length check
# (and its clear 400) instead of a blunt 413.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# A prompt endpoint's bound per token of context: a token of JSON text is a few bytes (up to
# 12 for escaped non-ASCII), a token id at most 11; the rest is room for batches and fields.
PROMPT_BODY_BYTES_PER_TOKEN = 64
# ...and never under this, so short contexts still take a conversation with a long template.
MIN_PROMPT_BODY_BYTES = 1024 * 1024


def prompt_body_limit(max_model_len: int, max_bytes: int) -> int:
    """The body bound of an endpoint that takes a prompt: what a context of `max_model_len`
    tokens could need, within the server's overall bound."""
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
        # No length stated (chunked): read it all, up to the bound, then replay it.
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
    """The prefix of the request ids workers see. A client may send one id twice (a retry, two
    clients alike); workers need each call's id unique, so a client's id gets a short suffix."""
    return response_id if client_id is None else f"{response_id}-{uuid.uuid4().hex[:8]}"


class EchoRequestIdMiddleware:
    """Adds the client's `x-request-id` to the response (a plain ASGI middleware, so streamed
    responses pass through untouched)."""

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
