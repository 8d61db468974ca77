"""A bound on request bodies: a 413 in OpenAI's error shape before the body is parsed.

A body that states its length is refused from its header alone; one sent in chunks is buffered
up to the bound and refused as soon as it passes it, so no client can make the gateway hold
more than the bound per request.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nori.gateway.errors import APIError

# What `--max-request-body-mib` defaults to: a 10 MB prompt still reaches the length check
# (and its clear 400) instead of a blunt 413.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length", b"")
        if length.isdigit():
            if int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
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
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
        )
        await error.response()(scope, receive, send)
