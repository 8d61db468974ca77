"""API keys at the gateway (`--api-key`, or NORI_API_KEY), as vLLM and OpenAI take them:
`Authorization: Bearer KEY`; anything else is a 401 in OpenAI's error shape. `/health` and
`/metrics` stay open for load balancers, orchestrators and Prometheus."""

from __future__ import annotations

import hmac
from collections.abc import Collection
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from nori.gateway.errors import APIError


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
