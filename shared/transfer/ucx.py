"""The UCX transport (ucxx): shared memory between workers on one host, the network across.

UCX receives each run of buffers straight into the sink's tensor (CPU, or CUDA with a
CUDA-enabled UCX), and the sender posts every run at once. Consecutive small runs scattered over
a host cache come as one message into a staging buffer of the connection, copied to their places
as soon as it lands (`buffers.ScatteredRun`, `_UcxChannel._receive_all`). Across hosts UCX uses
what it was built with: the ucxx-cu12 wheel's UCX has TCP but no InfiniBand/RoCE (`ucx_info
-v`: --without-verbs), so RDMA needs a system UCX. Importing this module applies the UCX
settings in `nori.transfer.ucx_env` (before ucxx initialises) and raises ImportError without
ucxx.

Between workers on one host the bytes go through UCX's sysv shared-memory FIFO, eager (see
ucx_env); `nori bench transfer` measures it (figures in the README and docs/benchmarks.md).
A transfer's checksum is hashed here, piece by piece, as buffers are posted and land
(`_send_all`, `_receive_all`).
"""

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

from nori.transfer.address import Address, parse_address, worker_peer
from nori.transfer.base import KVSink, TransferConfig, TransferError
from nori.transfer.buffers import (
    MAX_RUN_BYTES,
    ReceivePiece,
    ScatteredRun,
    check_sources,
    scatter_copy,
)
from nori.transfer.conversation import (
    ConnectionClosed,
    MessageTooLarge,
    ReceiverStats,
    TransferCounters,
    send_transfer,
    serve_connection,
)
from nori.transfer.cross_memory_receiver import PullReader
from nori.transfer.cross_memory_sender import PullSource
from nori.transfer.handoff import TransferHeader
from nori.transfer.integrity import TransferHasher, hash_chunks
from nori.transfer.pool import ConnectionPool
from nori.transfer.ucx_env import is_loopback
from nori.transfer.ucx_progress import (
    Poster,
    UcxProgress,
    UcxRequest,
    abort,
    connect,
    create_listener,
    worker_addresses_supported,
)
from nori.transfer.ucx_worker_address import (
    MAX_HELLO_BYTES,
    ConnectionTags,
    PeerWatch,
    accept_hello,
    connect_to_worker,
    welcome,
    worker_address,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests posted between two rounds of progress: data starts moving while the rest of a
# transfer's thousands of blocks are still being posted.
_POST_BATCH = 64
# Staging buffers of MAX_RUN_BYTES a receiving connection fills at once: UCX's shared-memory
# FIFO holds far less, so a few keep the sender streaming while landed ones are copied out.
_STAGING_SLOTS = 4
# How long close() waits for ucxx to retire its listener's connection handlers.
_CLOSE_WAIT_S = 5.0


def _ucx_buffer(view: torch.Tensor) -> object:
    """What ucxx takes for a flat uint8 view: a NumPy array sharing the CPU memory, or the CUDA
    tensor itself (it exposes __cuda_array_interface__). Neither copies."""
    return view if view.is_cuda else view.numpy()


class _UcxChannel:
    """One connection: a listener's endpoint pair, or (with `tags`) two one-way endpoints
    between worker addresses, whose ends say bye when they close."""

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
        # Staging buffers for scattered runs, kept between transfers (`_receive_all`).
        self._free_slots: list[np.ndarray] = []

    @property
    def alive(self) -> bool:
        return not self._closed and not self._endpoint.closed and not self._peer_said_bye()

    async def _transport(self, operation: Awaitable[T], what: str) -> T:
        """Runs a ucxx operation; its failures (ucxx's own exception types) become TransferError."""
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

    def _peer_said_bye(self) -> bool:
        return self._peer is not None and self._peer()

    async def _send_all(self, views: list[torch.Tensor], hasher: TransferHasher | None) -> None:
        """Posts a send of every view; given a `hasher`, feeds it every byte in order. On the
        host each run of adjacent views (`integrity.hash_chunks`, at most 512 KiB) is hashed
        right before it is posted, so UCX's copy finds it in cache."""
        on_host = not any(view.is_cuda for view in views)
        # Per view: the end of the hash chunk it closes, if any.
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

    def _staging_slot(self) -> np.ndarray:
        """A free staging buffer of MAX_RUN_BYTES (the channel keeps them for later
        transfers; at most `_STAGING_SLOTS` are ever in flight)."""
        if self._free_slots:
            return self._free_slots.pop()
        return np.empty(MAX_RUN_BYTES, dtype=np.uint8)

    async def _receive_all(self, pieces: list[ReceivePiece], hasher: TransferHasher | None) -> None:
        """Posts a receive per piece, in order: in place into a flat view, or for a
        `ScatteredRun` into one of a few staging buffers, whose bytes are copied to their
        places as soon as they land (the buffer is then reused for a later piece). Given a
        `hasher`, each piece is hashed the moment it lands (in order), while UCX's copy just
        left it in cache; a staged one before it is copied out, in the staging buffer still
        in L2."""
        on_host = not any(piece.is_cuda for piece in pieces if not isinstance(piece, ScatteredRun))
        # Posted receives, oldest first: (request, piece, its staging buffer or None).
        inflight: collections.deque[tuple[UcxRequest, ReceivePiece, np.ndarray | None]] = (
            collections.deque()
        )
        staged_inflight = 0

        def land() -> None:
            nonlocal staged_inflight
            request, piece, slot = inflight.popleft()
            request.result()
            if slot is None:
                if hasher is not None and on_host:
                    hasher.update(_ucx_buffer(piece))  # type: ignore[arg-type]
                return
            assert isinstance(piece, ScatteredRun)
            landed = slot[: piece.nbytes]
            if hasher is not None:
                hasher.update(landed.data)
            scatter_copy(landed, piece.views)
            self._free_slots.append(slot)
            staged_inflight -= 1

        try:
            posted = 0
            for piece in pieces:
                if isinstance(piece, ScatteredRun):
                    if not piece.nbytes:
                        continue
                    while staged_inflight >= _STAGING_SLOTS:
                        await self._progress.wait_all([inflight[0][0]], self._peer)
                        land()
                    # `receive_runs` caps a staged run at MAX_RUN_BYTES: it fits a slot.
                    slot = self._staging_slot()
                    staged_inflight += 1
                    inflight.append((self._poster.recv(slot[: piece.nbytes]), piece, slot))
                elif piece.numel():
                    inflight.append((self._poster.recv(_ucx_buffer(piece)), piece, None))
                else:
                    continue
                posted += 1
                if posted % _POST_BATCH == 0:
                    self._progress.poll()
                    while inflight and inflight[0][0].done():
                        land()
            while inflight:
                await self._progress.wait_all([inflight[0][0]], self._peer)
                land()
        except BaseException:
            # Receives still posted write into their buffers until the endpoint is aborted.
            self._progress.keep([request for request, _, _ in inflight])
            raise
        if hasher is not None and not on_host:
            for piece in pieces:  # CUDA: from host copies, after the transfer
                assert not isinstance(piece, ScatteredRun)
                hasher.update(piece.cpu().numpy().data)

    async def send_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._send_all(views, hasher), "send")

    async def recv_buffers(
        self, pieces: list[ReceivePiece], hasher: TransferHasher | None = None
    ) -> None:
        await self._transport(self._receive_all(pieces, hasher), "receive")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self._tags is not None and not self._peer_said_bye():
                    self._progress.say_bye(self._endpoint, self._tags.send_bye)
                abort(self._endpoint)
            except Exception as error:
                logger.debug("UCX endpoint abort failed: %s", error)
            self._progress.wake()


class UcxReceiver(ReceiverStats):
    """Receives UCX senders' transfers into the sink's tensors.

    Bound to a loopback `host` (as `nori up` starts every worker), it opens no socket of its
    own: its address carries its UCX worker address, senders say hello to it by that, and UCX's
    own TCP sockets stay on the loopback device (`ucx_env.confine_ucx_to`). Otherwise (or on a
    ucxx without the internals that takes, `worker_addresses_supported`) it listens
    with ucxx's listener, which binds every interface: its Python API (ucxx 0.52) takes a port
    but no address. Either way a transfer is accepted only with its reservation's token
    (`DecodeKVSink`). `advertise_host` is what the address carries.
    """

    def __init__(self, sink: KVSink, config: TransferConfig | None = None) -> None:
        super().__init__()
        self._sink = sink
        self._config = config or TransferConfig()
        self._reader = PullReader() if self._config.map_shared_memory else None
        self._progress: UcxProgress | None = None
        self._listener: Any = None
        # Worker-address mode: the task reading hellos and one task per connection it serves.
        self._accepting: asyncio.Future[None] | None = None
        self._serving: set[asyncio.Future[None]] = set()
        self._channels: set[_UcxChannel] = set()
        self._closing = False

    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        if self._progress is not None or self._closing:
            raise RuntimeError("a UcxReceiver starts once")
        self._progress = UcxProgress()
        if is_loopback(host) and worker_addresses_supported():
            hello_tag = secrets.randbits(64)
            peer = worker_peer(hello_tag, worker_address())
            self._accepting = asyncio.ensure_future(self._accept_hellos(hello_tag))
            self._address = str(Address("ucx", advertise_host, 0, peer))
            return self._address
        try:
            self._listener = create_listener(self._handle, port, self._config.connect_timeout_s)
        except Exception as error:
            self._progress.close()
            # As a socket would say it (a port in use, say), whichever transport is behind.
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
            channel = _UcxChannel(endpoint, self._progress, tags, peer)
            task = asyncio.ensure_future(self._welcome(channel))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _welcome(self, channel: _UcxChannel) -> None:
        try:
            await asyncio.wait_for(channel.send_message(welcome()), self._config.connect_timeout_s)
        except (TransferError, TimeoutError) as error:
            logger.debug("UcxReceiver could not welcome a sender: %s", error)
            await channel.close()
            return
        await self._serve(channel)

    async def _handle(self, endpoint: Any) -> None:
        # ucxx runs this coroutine per accepted connection and counts it as a live handler
        # until it returns: it serves the connection for as long as it lasts.
        assert self._progress is not None
        await self._serve(_UcxChannel(endpoint, self._progress))

    async def _serve(self, channel: _UcxChannel) -> None:
        if self._closing:
            await channel.close()
            return
        self._channels.add(channel)
        try:
            await serve_connection(channel, self._sink, self._counters, self._config, self._reader)
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
        # Dropping the listener while ucxx still runs a handler makes ucxx warn ("client
        # handler(s) still alive") and leaves that handler's endpoint behind: wait them out.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_WAIT_S
        while (listener is not None and listener.active_clients) and loop.time() < deadline:
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
        self._counters = TransferCounters()
        self._progress: UcxProgress | None = None
        self._pool: ConnectionPool[_UcxChannel] = ConnectionPool(
            self._connect, self._config.max_connections_per_peer
        )
        # Transfers whose caller went away, still running to their end (see `send`).
        self._orphans: set[asyncio.Future[None]] = set()

    @property
    def bytes_sent(self) -> int:
        return self._counters.nbytes

    def _progress_here(self) -> UcxProgress:
        if self._progress is None:
            self._progress = UcxProgress()
        elif self._progress.loop is not asyncio.get_running_loop():
            raise RuntimeError("a UcxSender serves the event loop it first sent from")
        return self._progress

    async def _connect(self, address: str) -> _UcxChannel:
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
                # ucxx bounds its handshake by connect_timeout; wait_for also bounds the rest.
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
        return _UcxChannel(endpoint, progress, tags, peer)

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
            # UCX reads the KV views, and writes the receiver's replies into buffers of ours,
            # in place and after the call that posted them returned. A caller cancelled mid-way
            # (its client left) must not free those buffers under posted requests: seen as
            # corrupted Python memory and a segfault in the prefill worker. So the transfer
            # runs to its end, or its timeout, whatever happens to the caller.
            await asyncio.shield(transfer)
        except asyncio.CancelledError:
            if not transfer.done():
                self._orphans.add(transfer)
                transfer.add_done_callback(self._orphan_done)
            raise
        self._counters.add(header.total_nbytes)

    def _orphan_done(self, transfer: asyncio.Future[None]) -> None:
        self._orphans.discard(transfer)
        if not transfer.cancelled() and transfer.exception() is not None:
            logger.debug("a transfer whose caller left failed: %s", transfer.exception())

    async def close(self) -> None:
        await self._pool.close()
        # The pool's connections are aborted, so orphaned transfers end promptly; their
        # buffers must outlive them (see `send`).
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=self._config.timeout_s)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._pull_source is not None:
            self._pull_source.close()
