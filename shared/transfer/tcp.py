"""The plain TCP transport: asyncio over raw non-blocking sockets. Received bytes go straight
into the sink's tensors (`sock_recv_into`); CUDA tensors are staged through host memory."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import torch

from nori.transfer import conversation
from nori.transfer.base import (
    ConnectionClosed,
    KVSink,
    MessageTooLarge,
    TransferConfig,
    TransferError,
)
from nori.transfer.conversation import ConnectionPool
from nori.transfer.cross_memory_receiver import PullReader
from nori.transfer.cross_memory_sender import PullSource
from nori.transfer.handoff import TransferHeader, parse_address
from nori.transfer.integrity import TransferHasher, check_sources, hash_chunks

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
# One sendmsg/recvmsg_into covers up to this many blocks (Linux's IOV_MAX).
_IOV_MAX = 1024
_SYSCALLS_PER_YIELD = 64


def _advance(views: list[memoryview], index: int, count: int) -> int:
    while count:
        size = len(views[index])
        if count < size:
            views[index] = views[index][count:]
            return index
        count -= size
        index += 1
    return index


class _HostStaging:
    """Moves CUDA bytes through host memory for the socket, saying so once per owner."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._logged = False

    def note(self) -> None:
        if not self._logged:
            self._logged = True
            logger.info(
                "%s: CUDA tensors go through host memory over TCP (use UCX to avoid the copy)",
                self._owner,
            )

    def host_bytes(self, view: torch.Tensor) -> memoryview:
        if view.is_cuda:
            self.note()
            view = view.cpu()
        return _flat(view)


def _feed(hasher: TransferHasher, views: list[torch.Tensor]) -> None:
    if any(view.is_cuda for view in views):
        for view in views:
            hasher.update(view.cpu().numpy().data)
    else:
        for _, chunk in hash_chunks(views):
            hasher.update(chunk)


def _flat(view: torch.Tensor) -> memoryview:
    return view.numpy().data.cast("B")


def _configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TcpChannel:
    def __init__(self, sock: socket.socket, staging: _HostStaging) -> None:
        self._sock = sock
        self._staging = staging
        self._loop = asyncio.get_running_loop()
        self._closed = False

    @property
    def alive(self) -> bool:
        if self._closed:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing to read: open and idle
        except OSError:
            return False
        return False  # EOF, or bytes nobody asked for: the conversation is out of step

    async def _read_into(self, view: memoryview, message_start: bool = False) -> None:
        first = True
        while len(view):
            received = await self._loop.sock_recv_into(self._sock, view)
            if received == 0:
                if first and message_start:
                    raise ConnectionClosed("the peer closed the connection")
                raise TransferError("the peer closed the connection mid-message")
            first = False
            view = view[received:]

    async def _ready(self, writable: bool) -> None:
        future = self._loop.create_future()
        fd = self._sock.fileno()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        if writable:
            self._loop.add_writer(fd, wake)
        else:
            self._loop.add_reader(fd, wake)
        try:
            await future
        finally:
            if writable:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)

    async def _vectored(self, views: list[memoryview], send: bool) -> None:
        index = calls = 0
        while index < len(views):
            batch = views[index : index + _IOV_MAX]
            try:
                count = self._sock.sendmsg(batch) if send else self._sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                await self._ready(writable=send)
                continue
            if count == 0 and not send:
                raise TransferError("the peer closed the connection mid-transfer")
            index = _advance(views, index, count)
            calls += 1
            if calls % _SYSCALLS_PER_YIELD == 0:
                await asyncio.sleep(0)

    async def send_message(self, payload: bytes) -> None:
        await self._loop.sock_sendall(self._sock, _LENGTH.pack(len(payload)) + payload)

    async def recv_message(self, max_bytes: int) -> bytes:
        prefix = bytearray(_LENGTH.size)
        await self._read_into(memoryview(prefix), message_start=True)
        (length,) = _LENGTH.unpack(prefix)
        if length > max_bytes:
            raise MessageTooLarge(f"a message of {length} bytes exceeds the {max_bytes}-byte limit")
        payload = bytearray(length)
        await self._read_into(memoryview(payload))
        return bytes(payload)

    async def send_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        if hasher is not None:
            # Before the whole transfer: one pass.
            _feed(hasher, views)
        await self._vectored(
            [self._staging.host_bytes(view) for view in views if view.numel()], send=True
        )

    async def recv_buffers(
        self, views: list[torch.Tensor], hasher: TransferHasher | None = None
    ) -> None:
        targets = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for view in views:
            if not view.numel():
                continue
            if view.is_cuda:
                self._staging.note()
                host = torch.empty(view.shape, dtype=torch.uint8, pin_memory=True)
                staged.append((view, host))
                view = host
            targets.append(_flat(view))
        await self._vectored(targets, send=False)
        for device_view, host in staged:
            device_view.copy_(host)
        if hasher is not None:
            # After the whole transfer: one more pass.
            _feed(hasher, views)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()


class TcpReceiver(conversation.ReceiverStats):
    def __init__(self, sink: KVSink, config: TransferConfig | None = None) -> None:
        super().__init__()
        self._sink = sink
        self._config = config or TransferConfig()
        self._reader = PullReader() if self._config.map_shared_memory else None
        self._staging = _HostStaging("TcpReceiver")
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(
        self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1"
    ) -> str:
        if self._listener is not None:
            raise RuntimeError("the receiver is already started")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        bound_port = listener.getsockname()[1]
        self._address = f"tcp://{advertise_host}:{bound_port}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(listener))
        return self._address

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as error:
                logger.warning("TcpReceiver accept failed: %s", error)
                await asyncio.sleep(0.1)
                continue
            _configure(sock)
            task = loop.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        channel = _TcpChannel(sock, self._staging)
        await conversation.serve_connection(channel, self._sink, self, self._config, self._reader)

    async def close(self) -> None:
        """Stops accepting and drops every connection; transfers in flight fail on both ends."""
        tasks = [task for task in (self._accept_task, *self._connections) if task is not None]
        for task in tasks:
            task.cancel()
        # Cancelling unregisters the readers first; each connection then closes its own socket.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._reader is not None:
            self._reader.close()


class TcpSender:
    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig()
        self._pull_source = PullSource() if self._config.map_shared_memory else None
        self._bytes_sent = 0
        self._staging = _HostStaging("TcpSender")
        self._pool: ConnectionPool[_TcpChannel] = ConnectionPool(
            self._connect, self._config.max_connections_per_peer
        )

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    async def _connect(self, address: str) -> _TcpChannel:
        target = parse_address(address)
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
            _configure(sock)
            await asyncio.wait_for(
                loop.sock_connect(sock, sockaddr), self._config.connect_timeout_s
            )
        except (OSError, TimeoutError) as error:
            if sock is not None:
                sock.close()
            reason = "timed out" if isinstance(error, TimeoutError) else str(error)
            raise TransferError(f"cannot connect to {address}: {reason}") from error
        return _TcpChannel(sock, self._staging)

    async def send(self, address: str, header: TransferHeader, buffers: list[torch.Tensor]) -> None:
        if parse_address(address).scheme != "tcp":
            raise ValueError(f"TcpSender cannot send to {address!r}")
        views = check_sources(header, buffers)
        await self._pool.run(
            address,
            lambda channel: conversation.send_transfer(
                channel, header, views, self._config, self._pull_source
            ),
        )
        self._bytes_sent += header.total_nbytes

    async def close(self) -> None:
        await self._pool.close()
        if self._pull_source is not None:
            self._pull_source.close()
