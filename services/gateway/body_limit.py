"""A bound on request bodies: a 413 in OpenAI's error shape before the body is parsed.

A body that states its length is refused from its header alone; one sent in chunks is buffered
up to the bound and refused as soon as it passes it, so no client can make the gateway hold
more than the bound per request.

The bound is per endpoint: the prompt endpoints (completions, chat, /tokenize, /detokenize) take
at most what a prompt that fits the context could need (`prompt_body_limit`), so a prompt of
10 M token ids or 20 MB of text is refused from its size, before JSON parsing turns it into
Python lists and strings several times its size and holds the event loop for seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nori.gateway.errors import APIError

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
