"""This process's UCX worker driven from asyncio, and connections to a UCX worker address.

ucxx runs in "blocking" mode; a waiting connection sleeps on the worker's event fd. Bulk data is
posted straight on the endpoint (ucxx's private `Endpoint._ep` and `_tags`). A loopback receiver
is reached by its worker address (a hello on its tag, answered by a welcome); UCX reports no close
or death there, so each end says bye on close and watches the other's process (`PeerWatch`).
Why: docs/benchmarks.md#ucx-progress-from-asyncio."""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nori.transfer.ucx_env import apply_ucx_env_defaults

apply_ucx_env_defaults()

import numpy as np  # noqa: E402
import ucxx  # noqa: E402 - UCX reads the environment set just above when ucxx initialises
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402
from ucxx._lib_async.endpoint import Endpoint  # noqa: E402
from ucxx.types import Tag, TagMaskFull  # noqa: E402

T = TypeVar("T")

# A transfer that saw no UCX progress for this long sleeps on the worker's fd between checks.
_QUIET_SLEEP_S = 0.2
_BUSY_TIMEOUT_S, _IDLE_TIMEOUT_S = 0.001, 0.1  # a sleeping waiter looks again after this
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
        self._request.check_error()  # raises the request's failure


class Poster:
    """Posts tagged sends and receives on one endpoint, each written in place in its buffer
    (buffer protocol or __cuda_array_interface__), on the tags ucxx's own send/recv use."""

    def __init__(self, endpoint: Any) -> None:
        self._raw: Any = endpoint._ep
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

    def _on_event(self) -> None:
        self._rearm_scheduled = False
        if self._epoll is None:
            return
        armed = False
        for _ in range(_ARM_ATTEMPTS):
            self._worker.progress()
            if armed := self._worker.arm():
                break
        if not armed and not self._rearm_scheduled:
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
        `timeout_s`; returns at once if events are pending."""
        if not self._worker.arm():
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
        self, requests: Sequence[UcxRequest], peer_left: Callable[[], bool] | None = None
    ) -> None:
        """Waits for every request in order; raises the first failure, ConnectionError once
        `peer_left` says so; sleeps on the worker's fd after `_QUIET_SLEEP_S` without progress."""
        quiet_since: float | None = None
        for request in requests:
            while not request.done():
                if self._worker.progress_once():
                    quiet_since = None
                    continue
                if peer_left is not None and peer_left():
                    # Posted requests reference their buffers until the caller aborts the endpoint.
                    self.keep(requests)
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

    def _take(self, tag: int) -> tuple[_Posted, np.ndarray] | None:
        """A message that came on `tag` (any endpoint), in a buffer of its size; None if none."""
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
            self.keep([taken[0]])
        return taken is not None

    def say_bye(self, endpoint: Any, tag: int) -> None:
        """Posts a one-byte bye on `tag` (best effort: the endpoint may close right after)."""
        buffer = np.zeros(1, dtype=np.uint8)
        self.keep([_Posted(endpoint._ep.tag_send(Array(buffer), Tag(tag)), buffer)])
        self.poll()

    def keep(self, requests: Sequence[UcxRequest]) -> None:
        """Holds the unfinished `requests` and their buffers until UCX is done with them (a caller
        giving up on them until it aborts the endpoint)."""
        self._kept = [kept for kept in self._kept if not kept.done()]
        self._kept.extend(r for r in requests if isinstance(r, _Posted) and not r.done())

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


def listen(handler: Any, port: int, connect_timeout_s: float) -> Any:
    return ucxx.create_listener(
        handler, port, endpoint_error_handling=True, connect_timeout=connect_timeout_s
    )


def abort(endpoint: Any) -> None:
    """Closes an endpoint at once; its outstanding requests are cancelled, not completed."""
    # Without a progress thread ucxx progresses until the close completes; period (ns) bounds it.
    endpoint.abort(period=500_000_000, max_attempts=1)


# A hello: this magic, the sender's connection tag base (8 bytes), its process (`_PROCESS`),
# then its worker address. The welcome: _WELCOME and the receiver's process.
_HELLO_MAGIC = b"NORIUCX1"
_WELCOME = b"nori-ucx-welcome"
_PEER_CHECK_S = 0.2
MAX_HELLO_BYTES = 8192  # larger ones are dropped: a worker address is a few hundred bytes


@dataclass(frozen=True)
class ConnectionTags:
    """A worker-address connection's tags: messages each way and each end's bye."""

    send: int
    recv: int
    send_bye: int
    recv_bye: int

    @classmethod
    def of(cls, base: int, sender: bool) -> ConnectionTags:
        ends = (0, 1, 2, 3) if sender else (1, 0, 3, 2)  # to receiver, to sender, byes
        return cls(*(base | end for end in ends))


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None if not seen, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


# A process as each end tells the other: pid and start time (a reused pid has another).
_PROCESS = struct.Struct("<IQ")


def _this_process() -> bytes:
    return _PROCESS.pack(os.getpid(), _start_ticks(os.getpid()) or 0)


class PeerWatch:
    """Says whether a connection's peer left: its bye, or its process gone (checked at most
    every `_PEER_CHECK_S`, where this host shows the process at all)."""

    def __init__(self, progress: UcxProgress, bye_tag: int, process: bytes) -> None:
        self._progress = progress
        self._bye_tag = bye_tag
        pid, ticks = _PROCESS.unpack(process[: _PROCESS.size])
        self._peer = (pid, ticks) if ticks and _start_ticks(pid) == ticks else None
        self._next_check = 0.0
        self.left = False

    def __call__(self) -> bool:
        if not self.left:
            self.left = self._progress.take_bye(self._bye_tag)
        if not self.left and self._peer is not None:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _PEER_CHECK_S
                self.left = _start_ticks(self._peer[0]) != self._peer[1]
        return self.left


def worker_address() -> bytes:
    """This process's UCX worker address: what a sender needs to reach it (no socket)."""
    return bytes(ucx_api.UCXAddress.create_from_worker(ucxx.core._get_ctx().worker))


def _endpoint_to(address: bytes, tags: ConnectionTags) -> Any:
    context = ucxx.core._get_ctx()
    buffer = np.frombuffer(address, dtype=np.uint8)
    raw = ucx_api.UCXEndpoint.create_from_worker_address(
        context.worker, ucx_api.UCXAddress.create_from_buffer(buffer), True
    )
    return Endpoint(raw, context, tags={"msg_send": tags.send, "msg_recv": tags.recv})


async def connect_to_worker(
    progress: UcxProgress, address: bytes, receiver_tag: int
) -> tuple[Any, ConnectionTags, PeerWatch]:
    """A connection to the receiver listening for hellos on `receiver_tag` at `address`: the
    hello, then its welcome. The caller bounds the wait."""
    tags = ConnectionTags.of(secrets.randbits(64) & ~3, sender=True)
    endpoint = _endpoint_to(address, tags)
    try:
        hello = struct.pack("<Q", tags.send) + _this_process() + worker_address()
        await progress.post_send(endpoint, _HELLO_MAGIC + hello, receiver_tag)
        length = await progress.wait_message(endpoint, lambda: progress.take_bye(tags.recv_bye))
        if length is None or length != len(_WELCOME) + _PROCESS.size:
            raise ConnectionError("the receiver did not welcome the connection")
        buffer = np.empty(length, dtype=np.uint8)
        await progress.run(endpoint.recv(buffer))
        answer = buffer.tobytes()
        if not answer.startswith(_WELCOME):
            raise ConnectionError("the receiver answered the hello with something else")
    except BaseException:
        abort(endpoint)
        raise
    return endpoint, tags, PeerWatch(progress, tags.recv_bye, answer[len(_WELCOME) :])


def accept_hello(progress: UcxProgress, hello: bytes) -> tuple[Any, ConnectionTags, PeerWatch]:
    """The endpoint back to a hello's sender (the caller sends `welcome()`); ValueError for
    anything that is not a hello."""
    head = len(_HELLO_MAGIC) + 8 + _PROCESS.size
    if len(hello) <= head or not hello.startswith(_HELLO_MAGIC):
        raise ValueError("not a hello")
    (base,) = struct.unpack("<Q", hello[8:16])
    tags = ConnectionTags.of(base & ~3, sender=False)
    try:
        endpoint = _endpoint_to(hello[head:], tags)
    except Exception as error:  # ucxx's own error types for an unusable worker address
        raise ValueError(f"a hello with an unusable worker address: {error}") from error
    return endpoint, tags, PeerWatch(progress, tags.recv_bye, hello[16:head])


def welcome() -> bytes:
    return _WELCOME + _this_process()
