"""The gateway's graceful stop: on SIGTERM (or the first Ctrl-C) it drains before it exits.

While draining, a new API request gets 503 with `Retry-After` (answered, never reset) and
`/health` answers 503 `draining`, so balancers send new work elsewhere; requests in flight,
streams included, run to their end. The server exits once none is left or after the drain
timeout; a second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Collection
from http import HTTPStatus
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from nori.gateway.errors import APIError

logger = logging.getLogger(__name__)

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


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining for at most `timeout_s` on its first SIGTERM or SIGINT."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        self._drain.draining = True
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info(
            "draining: %d request(s) in flight, new ones get 503 (at most %.0f s)",
            self._drain.in_flight,
            self._timeout_s,
        )
        if await self._drain.wait_idle(self._timeout_s):
            logger.info("drained: no request in flight")
        else:
            logger.warning(
                "drain timed out after %.0f s with %d request(s) in flight",
                self._timeout_s,
                self._drain.in_flight,
            )
        self.should_exit = True
