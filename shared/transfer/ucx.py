"""The UCX transport (ucxx): shared memory between workers on one host, the network across.

`UcxReceiver` lands transfers in the sink's tensors; `UcxSender` sends over pooled connections
(`ucx_channel.UcxChannel`). On one host the bytes go through UCX's sysv shared-memory FIFO;
across hosts, what UCX was built with (the ucxx-cu12 wheel: TCP, no RDMA). Importing applies
`ucx_env`'s settings before ucxx initialises; ImportError without ucxx.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import torch

from nori.transfer.address import Address, parse_address, worker_peer
from nori.transfer.base import KVSink, TransferConfig, TransferError
from nori.transfer.buffers import check_sources
from nori.transfer.conversation import (
    ReceiverStats,
    TransferCounters,
    send_transfer,
    serve_connection,
)
from nori.transfer.cross_memory_receiver import PullReader
from nori.transfer.cross_memory_sender import PullSource
from nori.transfer.handoff import TransferHeader
from nori.transfer.pool import ConnectionPool
from nori.transfer.ucx_channel import UcxChannel
from nori.transfer.ucx_env import is_loopback
from nori.transfer.ucx_progress import (
    UcxProgress,
    connect,
    create_listener,
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

_CLOSE_WAIT_S = 5.0


class UcxReceiver(ReceiverStats):
    """Receives UCX senders' transfers into the sink's tensors.

    Bound to a loopback `host` it opens no socket of its own: its address carries its UCX worker
    address and UCX stays on loopback (`ucx_env.confine_ucx_to`). Otherwise ucxx's listener binds
    every interface (it takes no address). A transfer needs its reservation's token either way.
    """

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
            self._listener = create_listener(self._handle, port, self._config.connect_timeout_s)
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
        # Dropping the listener while a handler runs leaves its endpoint behind: wait them out.
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
        self._pool: ConnectionPool[UcxChannel] = ConnectionPool(
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
            # UCX reads and writes our buffers after the posting call returned: a cancelled
            # caller must not free them under posted requests (memory corruption), so the
            # transfer runs to its end or timeout whatever happens to the caller.
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
        # Pooled connections are aborted, so orphans end promptly; their buffers outlive them.
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=self._config.timeout_s)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._pull_source is not None:
            self._pull_source.close()
