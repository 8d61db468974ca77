"""Drives this process's UCX worker from asyncio, and posts requests on its endpoints.

ucxx runs in "blocking" mode (no progress threads): while data moves, `wait_all` progresses the
worker on every loop turn; while a connection waits for a message it arms the worker and sleeps
on its event fd (through its own epoll, so many senders and receivers coexist). Bulk data is
posted straight on the endpoint through ucxx's private `Endpoint._ep` and `_tags` (present in
the pinned ucxx). Why: docs/benchmarks.md#ucx-progress-from-asyncio.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from nori.transfer.ucx_env import apply_ucx_env_defaults

apply_ucx_env_defaults()

import numpy as np  # noqa: E402
import ucxx  # noqa: E402 - UCX reads the environment set just above when ucxx initialises
from ucxx._lib.arr import Array  # noqa: E402
from ucxx.types import Tag, TagMaskFull  # noqa: E402

T = TypeVar("T")

# A transfer that saw no UCX progress for this long sleeps on the worker's fd between checks.
_QUIET_SLEEP_S = 0.2
# Sleeping waiters look again after this long even without an event, in case one was missed.
_BUSY_TIMEOUT_S = 0.001
_IDLE_TIMEOUT_S = 0.1
_ARM_ATTEMPTS = 16  # progress/arm rounds per event before yielding the loop
# One progress round this often whatever happens: ucxx's own handshakes wait on requests only
# progress moves, and after peers died mid-transfer no event may come to wake them.
_TICK_S = 0.05


class UcxRequest(Protocol):
    """A posted UCX operation; an asyncio.Task (a ucxx coroutine, `UcxProgress.run`) fits too."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class _Posted:
    """A request posted directly on the endpoint, holding its buffer alive until it is done."""

    __slots__ = ("_buffer", "_request")

    def __init__(self, request: Any, buffer: object) -> None:
        self._request = request
        self._buffer = buffer

    def done(self) -> bool:
        return bool(self._request.completed)

    def result(self) -> None:
        self._request.check_error()


class Poster:
    """Posts tagged sends and receives on one endpoint, each written in place in its buffer
    (buffer protocol or __cuda_array_interface__)."""

    def __init__(self, endpoint: Any) -> None:
        self._raw: Any = endpoint._ep
        # The same tags ucxx's Endpoint.send/recv use, so both interoperate.
        self._send_tag: Any = Tag(endpoint._tags["msg_send"])
        self._recv_tag: Any = Tag(endpoint._tags["msg_recv"])

    def send(self, buffer: object) -> UcxRequest:
        return _Posted(self._raw.tag_send(Array(buffer), self._send_tag), buffer)

    def recv(self, buffer: object) -> UcxRequest:
        return _Posted(self._raw.tag_recv(Array(buffer), self._recv_tag, TagMaskFull), buffer)


class UcxProgress:
    """Drives this process's UCX worker from the running asyncio loop (see the module doc)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        context = ucxx.core._get_ctx()
        context.continuous_ucx_progress(event_loop=self.loop)
        self._worker = context.worker
        if context.progress_mode != "blocking":
            raise RuntimeError("UcxProgress drives the UCX worker: ucxx must run in blocking mode")
        self._waiters: set[asyncio.Future[None]] = set()
        # Requests nobody awaits (byes), kept with their buffers until UCX is done with them.
        self._kept: list[_Posted] = []
        self._rearm_scheduled = False
        self._tick_handle: asyncio.TimerHandle | None = None
        self._epoll: select.epoll | None = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self.loop.add_reader(self._epoll.fileno(), self._on_event)
        self._on_event()
        self._tick()

    def _tick(self) -> None:
        self._worker.progress()
        self.wake()
        self._tick_handle = self.loop.call_later(_TICK_S, self._tick)

    def _arm(self) -> bool:
        """Progresses the worker until it can be armed; False if events keep arriving."""
        for _ in range(_ARM_ATTEMPTS):
            self._worker.progress()
            if self._worker.arm():
                return True
        return False

    def _on_event(self) -> None:
        self._rearm_scheduled = False
        if self._epoll is None:
            return
        if not self._arm() and not self._rearm_scheduled:
            self._rearm_scheduled = True
            self.loop.call_soon(self._on_event)
        # Refresh the nested epoll's ready list, so it stops reporting the drained fd.
        self._epoll.poll(0)
        self.wake()

    def poll(self) -> None:
        self._worker.progress()

    def wake(self) -> None:
        """Lets every idle waiter look again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def _sleep(self, timeout_s: float, request: UcxRequest | None = None) -> None:
        """Sleeps until the worker has an event (or `request`, a future, is done), at most
        `timeout_s`; returns at once if events are pending. The caller's last progress round
        found nothing, so arming cannot miss an event."""
        if not self._worker.arm():
            # Events are pending: handle them and let the caller look again (progressing first
            # and then arming could swallow the very event the caller waits for).
            self._worker.progress()
            await asyncio.sleep(0)
            return
        waiter = self.loop.create_future()
        self._waiters.add(waiter)
        wait_for: list[asyncio.Future[Any]] = [waiter]
        if isinstance(request, asyncio.Future):
            wait_for.append(request)
        try:
            await asyncio.wait(wait_for, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(waiter)
            waiter.cancel()

    async def wait_message(
        self, endpoint: Any, peer_left: Callable[[], bool] | None = None
    ) -> int | None:
        """Waits, without spinning, for a message on `endpoint`; returns its length, or None
        once the endpoint is closed or `peer_left` says so."""
        while True:
            try:
                probe = endpoint.tag_probe()
            except AttributeError:  # the endpoint was aborted locally
                return None
            if probe.matched:
                return int(probe.length)
            if endpoint.closed or (peer_left is not None and peer_left()):
                return None
            await self._sleep(_IDLE_TIMEOUT_S)

    async def wait_all(
        self,
        requests: Sequence[UcxRequest],
        peer_left: Callable[[], bool] | None = None,
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        """Waits for every request in order; raises the first failure, ConnectionError once
        `peer_left` says so. `on_done(i)` runs as soon as request i is found done.

        A turn without progress yields the CPU (`sched_yield`); it sleeps on the worker's fd only
        after `_QUIET_SLEEP_S` without progress, since UCX does not signal every step.
        """
        quiet_since: float | None = None
        for index, request in enumerate(requests):
            while not request.done():
                if self._worker.progress_once():
                    quiet_since = None
                    continue
                if peer_left is not None and peer_left():
                    # Posted requests reference their buffers until the caller aborts the endpoint.
                    for pending in requests:
                        if isinstance(pending, _Posted) and not pending.done():
                            self._kept.append(pending)
                    raise ConnectionError("the peer closed the connection")
                if quiet_since is None:
                    quiet_since = time.monotonic()
                    await asyncio.sleep(0)
                elif time.monotonic() - quiet_since < _QUIET_SLEEP_S:
                    os.sched_yield()
                    await asyncio.sleep(0)
                else:
                    await self._sleep(_BUSY_TIMEOUT_S, request)
            request.result()
            if on_done is not None:
                on_done(index)

    def _take(self, tag: int) -> tuple[_Posted, np.ndarray] | None:
        """Receives a message that came on `tag` (from any endpoint) into a buffer of its size;
        None when none came."""
        probe = self._worker.tag_probe(Tag(tag), TagMaskFull, True)
        if not probe.matched:
            return None
        length = int(probe.length)
        buffer = np.empty(max(1, length), dtype=np.uint8)  # ucxx takes no empty buffer
        posted = _Posted(self._worker.tag_recv_with_handle(Array(buffer), probe), buffer)
        return posted, buffer[:length]

    def take_bye(self, tag: int) -> bool:
        """Whether a bye came on `tag`; reads it (a byte) if so."""
        taken = self._take(tag)
        if taken is not None:
            self._keep(taken[0])
        return taken is not None

    def say_bye(self, endpoint: Any, tag: int) -> None:
        """Posts a one-byte bye on `tag` (best effort: the endpoint may close right after)."""
        buffer = np.zeros(1, dtype=np.uint8)
        self._keep(_Posted(endpoint._ep.tag_send(Array(buffer), Tag(tag)), buffer))
        self.poll()

    def keep(self, requests: Sequence[UcxRequest]) -> None:
        """Holds the unfinished `requests` and their buffers until UCX is done with them (a caller
        giving up on them until it aborts the endpoint)."""
        for request in requests:
            if isinstance(request, _Posted):
                self._keep(request)

    def _keep(self, request: _Posted) -> None:
        self._kept = [kept for kept in self._kept if not kept.done()]
        if not request.done():
            self._kept.append(request)

    async def post_send(self, endpoint: Any, payload: bytes, tag: int) -> None:
        """Sends `payload` on a tag of the caller's choosing and waits until it is out."""
        buffer = np.frombuffer(payload, dtype=np.uint8)
        await self.wait_all([_Posted(endpoint._ep.tag_send(Array(buffer), Tag(tag)), buffer)])

    async def next_tagged(self, tag: int, max_bytes: int) -> bytes | None:
        """The next message on `tag` (from any endpoint), waiting without spinning; None for one
        longer than `max_bytes` (read and dropped)."""
        while True:
            taken = self._take(tag)
            if taken is not None:
                posted, buffer = taken
                await self.wait_all([posted])
                return buffer.tobytes() if len(buffer) <= max_bytes else None
            await self._sleep(_IDLE_TIMEOUT_S)

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Awaits a ucxx coroutine (handshake, control message) while progressing the worker."""
        task = asyncio.ensure_future(awaitable)
        try:
            await self.wait_all([task])
        finally:
            task.cancel()
        return task.result()

    def close(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self._epoll is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            self._epoll = None
        self.wake()


async def connect(progress: UcxProgress, host: str, port: int, timeout_s: float) -> Any:
    return await progress.run(
        ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=timeout_s)
    )


def abort(endpoint: Any) -> None:
    """Closes an endpoint at once; its outstanding requests are cancelled, not completed."""
    # Without a progress thread ucxx progresses until the close completes; period (ns) bounds it.
    endpoint.abort(period=500_000_000, max_attempts=1)


def create_listener(handler: Any, port: int, connect_timeout_s: float) -> Any:
    return ucxx.create_listener(
        handler, port, endpoint_error_handling=True, connect_timeout=connect_timeout_s
    )
