"""The UCX transport (ucxx): shared memory between workers on one host, the network across.

UCX receives each buffer straight into the sink's tensor (CPU, or CUDA with a CUDA-enabled UCX),
and the sender posts every buffer at once. Across hosts UCX uses what it was built with: the
ucxx-cu12 wheel's UCX has TCP but no InfiniBand/RoCE (`ucx_info -v`: --without-verbs), so
RDMA needs a system UCX. Importing this module applies the UCX settings in
`nori.transfer.ucx_env` (before ucxx initialises) and raises ImportError without ucxx.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import torch

from nori.transfer.address import parse_address
from nori.transfer.base import KVSink, TransferConfig, TransferError
from nori.transfer.buffers import check_sources
from nori.transfer.conversation import (
    ConnectionClosed,
    MessageTooLarge,
    ReceiverStats,
    TransferCounters,
    send_transfer,
    serve_connection,
)
from nori.transfer.handoff import TransferHeader
from nori.transfer.pool import ConnectionPool
from nori.transfer.ucx_worker import (
    Poster,
    Request,
    UcxProgress,
    abort,
    connect,
    create_listener,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests posted between two rounds of progress: data starts moving while the rest of a
# transfer's thousands of blocks are still being posted.
_POST_BATCH = 64
# How long close() waits for ucxx to retire its listener's connection handlers.
_CLOSE_WAIT_S = 5.0


def _ucx_buffer(view: torch.Tensor) -> object:
    """What ucxx takes for a flat uint8 view: a NumPy array sharing the CPU memory, or the CUDA
    tensor itself (it exposes __cuda_array_interface__). Neither copies."""
    return view if view.is_cuda else view.numpy()


class _UcxChannel:
    def __init__(self, endpoint: Any, progress: UcxProgress) -> None:
        self._endpoint = endpoint
        self._progress = progress
        self._poster = Poster(endpoint)
        self._closed = False

    @property
    def alive(self) -> bool:
        return not self._closed and not self._endpoint.closed

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
        await self._transport(self._progress.run(self._endpoint.send(message)), "send")

    async def recv_message(self, max_bytes: int) -> bytes:
        length = await self._transport(self._progress.wait_message(self._endpoint), "receive")
        if length is None:
            raise ConnectionClosed("the peer closed the connection")
        if length > max_bytes:
            raise MessageTooLarge(f"a message of {length} bytes exceeds the {max_bytes}-byte limit")
        message = np.empty(length, dtype=np.uint8)
        # The public recv: it still finds a message that arrived just before the peer left.
        await self._transport(self._progress.run(self._endpoint.recv(message)), "receive")
        return message.tobytes()

    async def _post_all(self, views: list[torch.Tensor], send: bool) -> None:
        post = self._poster.send if send else self._poster.recv
        requests: list[Request] = []
        for start in range(0, len(views), _POST_BATCH):
            requests.extend(
                post(_ucx_buffer(view))
                for view in views[start : start + _POST_BATCH]
                if view.numel()
            )
            self._progress.poll()
        await self._progress.wait_all(requests)

    async def send_buffers(self, views: list[torch.Tensor]) -> None:
        await self._transport(self._post_all(views, send=True), "send")

    async def recv_buffers(self, views: list[torch.Tensor]) -> None:
        await self._transport(self._post_all(views, send=False), "receive")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                abort(self._endpoint)
            except Exception as error:
                logger.debug("UCX endpoint abort failed: %s", error)
            self._progress.wake()


class UcxReceiver(ReceiverStats):
    """Listens for UCX senders and receives their transfers into the sink's tensors.

    ucxx's listener binds every interface: its Python API (ucxx 0.52) takes no address, only a
    port (libucxx's ListenerBuilder has one, unexposed). So `host` is accepted for the
    interface's sake, and a transfer is accepted only with its reservation's token
    (`DecodeKVSink`); UCX's own TCP sockets stay on the loopback device for a loopback `host`
    (`ucx_env.confine_ucx_to`). `advertise_host` is what the address carries.
    """

    def __init__(self, sink: KVSink, config: TransferConfig | None = None) -> None:
        super().__init__()
        self._sink = sink
        self._config = config or TransferConfig()
        self._progress: UcxProgress | None = None
        self._listener: Any = None
        self._channels: set[_UcxChannel] = set()
        self._closing = False

    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        if self._listener is not None or self._closing:
            raise RuntimeError("a UcxReceiver starts once")
        self._progress = UcxProgress()
        try:
            self._listener = create_listener(self._handle, port, self._config.connect_timeout_s)
        except Exception as error:
            self._progress.close()
            # As a socket would say it (a port in use, say), whichever transport is behind.
            raise OSError(f"UCX cannot listen on port {port}: {error}") from error
        self._address = f"ucx://{advertise_host}:{self._listener.port}"
        return self._address

    async def _handle(self, endpoint: Any) -> None:
        # ucxx runs this coroutine per accepted connection and counts it as a live handler
        # until it returns: it serves the connection for as long as it lasts.
        assert self._progress is not None
        channel = _UcxChannel(endpoint, self._progress)
        if self._closing:
            await channel.close()
            return
        self._channels.add(channel)
        try:
            await serve_connection(channel, self._sink, self._counters, self._config)
        finally:
            self._channels.discard(channel)

    async def close(self) -> None:
        """Stops listening and drops every connection; transfers in flight fail on both ends."""
        if self._closing:
            return
        self._closing = True
        listener, progress = self._listener, self._progress
        if listener is None or progress is None:
            return
        listener.close()  # no new connections
        for channel in list(self._channels):
            await channel.close()
        # Dropping the listener while ucxx still runs a handler makes ucxx warn ("client
        # handler(s) still alive") and leaves that handler's endpoint behind: wait them out.
        deadline = asyncio.get_running_loop().time() + _CLOSE_WAIT_S
        while listener.active_clients and asyncio.get_running_loop().time() < deadline:
            progress.wake()
            await asyncio.sleep(0.005)
        if listener.active_clients:
            logger.warning(
                "UcxReceiver closed with %d connection(s) still open", listener.active_clients
            )
        self._listener = None
        progress.close()


class UcxSender:
    """Sends transfers to `ucx://` receivers over pooled UCX endpoints."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig()
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
        try:
            # ucxx bounds its handshake by connect_timeout; wait_for also bounds the rest.
            endpoint = await asyncio.wait_for(
                connect(progress, target.host, target.port, timeout), timeout + 1.0
            )
        except asyncio.CancelledError:
            raise
        except Exception as error:
            reason = "timed out" if isinstance(error, TimeoutError) else str(error)
            raise TransferError(
                f"cannot connect to {address}: {reason or type(error).__name__}"
            ) from error
        return _UcxChannel(endpoint, progress)

    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        if parse_address(address).scheme != "ucx":
            raise ValueError(f"UcxSender cannot send to {address!r}")
        views = check_sources(header, buffers)
        transfer = asyncio.ensure_future(
            self._pool.run(
                address, lambda channel: send_transfer(channel, header, views, self._config)
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
