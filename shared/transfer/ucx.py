"""The UCX transport (ucxx): shared memory between workers on one host, the network across.

`UcxReceiver` lands transfers in the sink's tensors; `UcxSender` sends over pooled connections
(`UcxChannel`). Importing (ImportError without ucxx) applies `ucx_env` before ucxx initialises."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import torch

from nori.transfer.base import (
    ConnectionClosed,
    KVSink,
    MessageTooLarge,
    TransferConfig,
    TransferError,
)
from nori.transfer.conversation import (
    ConnectionPool,
    ReceiverStats,
    send_transfer,
    serve_connection,
)
from nori.transfer.cross_memory_receiver import PullReader
from nori.transfer.cross_memory_sender import PullSource
from nori.transfer.handoff import Address, TransferHeader, parse_address, worker_peer
from nori.transfer.integrity import TransferHasher, check_sources, hash_chunks
from nori.transfer.ucx_env import is_loopback
from nori.transfer.ucx_worker import (
    MAX_HELLO_BYTES,
    ConnectionTags,
    PeerWatch,
    Poster,
    UcxProgress,
    UcxRequest,
    abort,
    accept_hello,
    connect,
    connect_to_worker,
    listen,
    welcome,
    worker_address,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests posted between two rounds of progress, so data moves while the rest is posted.
_POST_BATCH = 64


def _ucx_buffer(view: torch.Tensor) -> object:
    return view if view.is_cuda else view.numpy()  # as ucxx takes it, without a copy


class UcxChannel:
    """One connection: a listener's endpoint pair, or (with `tags`) two one-way endpoints."""

    def __init__(
        self,
        endpoint: Any,
        progress: UcxProgress,
        tags: ConnectionTags | None = None,
        peer: PeerWatch | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._progress = progress
        self._poster = Poster(endpoint)
        self._tags = tags
        self._peer = peer
        self._closed = False

    @property
    def alive(self) -> bool:
        return not self._closed and not self._endpoint.closed and not self._peer_left()

    async def _transport(self, operation: Awaitable[T], what: str) -> T:
        """Runs a ucxx operation; its failures become TransferError."""
        if self._closed:
            raise TransferError("the connection is closed")
        try:
            return await operation
        except (TransferError, asyncio.CancelledError):
            raise
        except Exception as error:
            raise TransferError(f"UCX {what} failed: {error or type(error).__name__}") from error

    async def send_message(self, payload: bytes) -> None:
        message = np.frombuffer(payload, dtype=np.uint8)
        if self._tags is None:
            await self._transport(self._progress.run(self._endpoint.send(message)), "send")
        else:
            # A message the peer never takes (it left) must not wait for ever.
            sent = self._progress.wait_all([self._poster.send(message)], self._peer)
            await self._transport(sent, "send")

    async def recv_message(self, max_bytes: int) -> bytes:
        length = await self._transport(
            self._progress.wait_message(self._endpoint, self._peer), "receive"
        )
        if length is None:
            raise ConnectionClosed("the peer closed the connection")
        if length > max_bytes:
            raise MessageTooLarge(f"a message of {length} bytes exceeds the {max_bytes}-byte limit")
        message = np.empty(length, dtype=np.uint8)
        # The public recv: it still finds a message that arrived just before the peer left.
        await self._transport(self._progress.run(self._endpoint.recv(message)), "receive")
        return message.tobytes()

    def _peer_left(self) -> bool:
        return self._peer is not None and self._peer()

    async def _send_all(self, views: list[torch.Tensor], hasher: TransferHasher | None) -> None:
        """Posts a send of every view, feeding `hasher` every byte in order; on the host each
        hash chunk is hashed right before it is posted, so UCX's copy finds it in cache."""
        on_host = not any(view.is_cuda for view in views)
        chunk_ends: dict[int, memoryview] = (
            dict(hash_chunks(views)) if hasher is not None and on_host else {}
        )
        requests: list[UcxRequest] = []
        pending: list[int] = []
        for index, view in enumerate(views):
            if view.numel():
                pending.append(index)
            if index in chunk_ends or len(pending) >= _POST_BATCH or index == len(views) - 1:
                if index in chunk_ends:
                    hasher.update(chunk_ends[index])  # type: ignore[union-attr]
                requests.extend(self._poster.send(_ucx_buffer(views[i])) for i in pending)
                pending = []
                self._progress.poll()
        # Two one-way endpoints: a peer that leaves mid-transfer says so only with its bye.
        await self._progress.wait_all(requests, self._peer)
        if hasher is not None and not on_host:
            for view in views:  # CUDA: from host copies, after the transfer
                hasher.update(view.cpu().numpy().data)

    async def _receive_all(self, views: list[torch.Tensor], hasher: TransferHasher | None) -> None:
        """Posts a receive per view, in order, in place; on the host each view is hashed the
        moment it lands, in order, while it is still in cache."""
        on_host = not any(view.is_cuda for view in views)
        inflight: collections.deque[tuple[UcxRequest, torch.Tensor]] = collections.deque()

        def land() -> None:
            request, view = inflight.popleft()
            request.result()
            if hasher is not None and on_host:
                hasher.update(_ucx_buffer(view))  # type: ignore[arg-type]

        try:
            for posted, view in enumerate([view for view in views if view.numel()], 1):
                inflight.append((self._poster.recv(_ucx_buffer(view)), view))
                if posted % _POST_BATCH == 0:
                    self._progress.poll()
                    while inflight and inflight[0][0].done():
                        land()
            while inflight:
                await self._progress.wait_all([inflight[0][0]], self._peer)
                land()
        except BaseException:
            # Receives still posted write into their buffers until the endpoint is aborted.
            self._progress.keep([request for request, _ in inflight])
            raise
        if hasher is not None and not on_host:
            for view in views:  # CUDA: from host copies, after the transfer
                hasher.update(view.cpu().numpy().data)

    async def send_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._send_all(views, hasher), "send")

    async def recv_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._receive_all(views, hasher), "receive")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self._tags is not None and not self._peer_left():
                    self._progress.say_bye(self._endpoint, self._tags.send_bye)
                abort(self._endpoint)
            except Exception as error:
                logger.debug("UCX endpoint abort failed: %s", error)
            self._progress.wake()


_CLOSE_WAIT_S = 5.0


class UcxReceiver(ReceiverStats):
    """Receives UCX senders' transfers into the sink's tensors. Bound to a loopback `host` it
    opens no socket (its address carries its UCX worker address); otherwise ucxx's listener binds
    every interface. A transfer needs its reservation's token either way."""

    def __init__(self, sink: KVSink, config: TransferConfig | None = None) -> None:
        super().__init__()
        self._sink = sink
        self._config = config or TransferConfig()
        self._reader = PullReader() if self._config.map_shared_memory else None
        self._progress: UcxProgress | None = None
        self._listener: Any = None
        self._accepting: asyncio.Future[None] | None = None
        self._serving: set[asyncio.Future[None]] = set()
        self._channels: set[UcxChannel] = set()
        self._closing = False

    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        if self._progress is not None or self._closing:
            raise RuntimeError("a UcxReceiver starts once")
        self._progress = UcxProgress()
        if is_loopback(host):
            hello_tag = secrets.randbits(64)
            peer = worker_peer(hello_tag, worker_address())
            self._accepting = asyncio.ensure_future(self._accept_hellos(hello_tag))
            self._address = str(Address("ucx", advertise_host, 0, peer))
            return self._address
        try:
            self._listener = listen(self._handle, port, self._config.connect_timeout_s)
        except Exception as error:
            self._progress.close()
            raise OSError(f"UCX cannot listen on port {port}: {error}") from error
        self._address = f"ucx://{advertise_host}:{self._listener.port}"
        return self._address

    async def _accept_hellos(self, hello_tag: int) -> None:
        assert self._progress is not None
        while True:
            hello = await self._progress.next_tagged(hello_tag, MAX_HELLO_BYTES)
            if hello is None:
                continue
            try:
                endpoint, tags, peer = accept_hello(self._progress, hello)
            except ValueError as error:
                logger.debug("UcxReceiver dropped a hello: %s", error)
                continue
            channel = UcxChannel(endpoint, self._progress, tags, peer)
            task = asyncio.ensure_future(self._welcome(channel))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _welcome(self, channel: UcxChannel) -> None:
        try:
            await asyncio.wait_for(channel.send_message(welcome()), self._config.connect_timeout_s)
        except (TransferError, TimeoutError) as error:
            logger.debug("UcxReceiver could not welcome a sender: %s", error)
            await channel.close()
            return
        await self._serve(channel)

    async def _handle(self, endpoint: Any) -> None:
        # ucxx counts this coroutine as a live handler while it serves the connection.
        assert self._progress is not None
        await self._serve(UcxChannel(endpoint, self._progress))

    async def _serve(self, channel: UcxChannel) -> None:
        if self._closing:
            return await channel.close()
        self._channels.add(channel)
        try:
            await serve_connection(channel, self._sink, self, self._config, self._reader)
        finally:
            self._channels.discard(channel)

    async def close(self) -> None:
        """Stops taking connections and drops every one; transfers in flight fail on both ends."""
        if self._closing:
            return
        self._closing = True
        listener, progress = self._listener, self._progress
        if progress is None:
            return
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if listener is not None:
            listener.close()  # no new connections
        for channel in list(self._channels):
            await channel.close()
        # Dropping the listener while a handler runs leaves its endpoint behind: wait them out.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_WAIT_S
        while listener is not None and listener.active_clients and loop.time() < deadline:
            progress.wake()
            await asyncio.sleep(0.005)
        if listener is not None and listener.active_clients:
            logger.warning(
                "UcxReceiver closed with %d connection(s) still open", listener.active_clients
            )
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=_CLOSE_WAIT_S)
        self._listener = None
        progress.close()
        if self._reader is not None:
            self._reader.close()


class UcxSender:
    """Sends transfers to `ucx://` receivers over pooled UCX endpoints."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig()
        self._pull_source = PullSource() if self._config.map_shared_memory else None
        self._bytes_sent = 0
        self._progress: UcxProgress | None = None
        self._pool: ConnectionPool[UcxChannel] = ConnectionPool(
            self._connect, self._config.max_connections_per_peer
        )
        self._orphans: set[asyncio.Future[None]] = set()

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def _progress_here(self) -> UcxProgress:
        if self._progress is None:
            self._progress = UcxProgress()
        elif self._progress.loop is not asyncio.get_running_loop():
            raise RuntimeError("a UcxSender serves the event loop it first sent from")
        return self._progress

    async def _connect(self, address: str) -> UcxChannel:
        target = parse_address(address)
        progress = self._progress_here()
        timeout = self._config.connect_timeout_s
        tags: ConnectionTags | None = None
        peer: PeerWatch | None = None
        try:
            if target.peer:
                endpoint, tags, peer = await asyncio.wait_for(
                    connect_to_worker(progress, target.worker_address, target.hello_tag), timeout
                )
            else:
                endpoint = await asyncio.wait_for(
                    connect(progress, target.host, target.port, timeout), timeout + 1.0
                )
        except asyncio.CancelledError:
            raise
        except Exception as error:
            reason = "timed out" if isinstance(error, TimeoutError) else str(error)
            raise TransferError(
                f"cannot connect to {target.brief}: {reason or type(error).__name__}"
            ) from error
        return UcxChannel(endpoint, progress, tags, peer)

    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        if parse_address(address).scheme != "ucx":
            raise ValueError(f"UcxSender cannot send to {address!r}")
        views = check_sources(header, buffers)
        transfer = asyncio.ensure_future(
            self._pool.run(
                address,
                lambda channel: send_transfer(
                    channel, header, views, self._config, self._pull_source
                ),
            )
        )
        try:
            # UCX uses our buffers after the posting call returned: a cancelled caller must not
            # free them under posted requests, so the transfer runs to its end or timeout.
            await asyncio.shield(transfer)
        except asyncio.CancelledError:
            if not transfer.done():
                self._orphans.add(transfer)
                transfer.add_done_callback(self._orphan_done)
            raise
        self._bytes_sent += header.total_nbytes

    def _orphan_done(self, transfer: asyncio.Future[None]) -> None:
        self._orphans.discard(transfer)
        if not transfer.cancelled() and transfer.exception() is not None:
            logger.debug("a transfer whose caller left failed: %s", transfer.exception())

    async def close(self) -> None:
        await self._pool.close()
        # Pooled connections are aborted: orphans end promptly, their buffers outliving them.
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=self._config.timeout_s)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._pull_source is not None:
            self._pull_source.close()
