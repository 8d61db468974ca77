"""The `x-request-id` header, as vLLM honours it: the client's id names the request (its response
`id` is `cmpl-<id>` or `chatcmpl-<id>`, and its workers' request ids start with that) and comes
back on the response, errors included."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
