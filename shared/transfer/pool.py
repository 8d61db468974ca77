"""A sender's connections, pooled per receiver address.

Opening a connection costs round trips (and UCX's endpoint handshake), so connections are kept
and reused. Each carries one transfer at a time; up to `max_per_peer` transfers to the same
receiver run at once, each on its own connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from nori.transfer.base import TransferError, TransferRejected
from nori.transfer.conversation import HeaderPhaseError

logger = logging.getLogger(__name__)


class PooledConnection(Protocol):
    @property
    def alive(self) -> bool: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=PooledConnection)
T = TypeVar("T")


class _Peer(Generic[C]):
    def __init__(self, max_connections: int) -> None:
        self.slots = asyncio.Semaphore(max_connections)
        self.idle: list[C] = []


class ConnectionPool(Generic[C]):
    def __init__(self, connect: Callable[[str], Awaitable[C]], max_per_peer: int) -> None:
        self._connect = connect
        self._max_per_peer = max_per_peer
        self._peers: dict[str, _Peer[C]] = {}
        self._busy: set[C] = set()
        self._closed = False

    async def run(self, address: str, transfer: Callable[[C], Awaitable[T]]) -> T:
        """Runs `transfer` on a connection to `address`.

        The connection goes back to the pool after success or a rejection (the conversation is
        still in step) and is closed after any other failure. A pooled connection that broke
        before the receiver answered the header is replaced once, transparently.
        """
        if self._closed:
            raise TransferError("the sender is closed")
        peer = self._peers.setdefault(address, _Peer(self._max_per_peer))
        async with peer.slots:
            connection, reused = await self._checkout(peer, address)
            try:
                return await self._run_on(peer, connection, transfer)
            except HeaderPhaseError as error:
                if not reused:
                    raise
                logger.debug("pooled connection to %s was stale (%s); reconnecting", address, error)
            connection = await self._connect(address)
            return await self._run_on(peer, connection, transfer)

    async def _checkout(self, peer: _Peer[C], address: str) -> tuple[C, bool]:
        while peer.idle:
            connection = peer.idle.pop()
            if connection.alive:
                return connection, True
            await connection.close()
        return await self._connect(address), False

    async def _run_on(
        self, peer: _Peer[C], connection: C, transfer: Callable[[C], Awaitable[T]]
    ) -> T:
        if self._closed:
            # close() ran while this connection was being opened.
            await connection.close()
            raise TransferError("the sender is closed")
        self._busy.add(connection)
        try:
            result = await transfer(connection)
        except TransferRejected:
            await self._release(peer, connection)
            raise
        except BaseException:
            self._busy.discard(connection)
            await connection.close()
            raise
        await self._release(peer, connection)
        return result

    async def _release(self, peer: _Peer[C], connection: C) -> None:
        self._busy.discard(connection)
        if self._closed:
            await connection.close()
        else:
            peer.idle.append(connection)

    async def close(self) -> None:
        """Closes every connection, idle or busy (busy transfers then fail with TransferError)."""
        self._closed = True
        connections = [c for peer in self._peers.values() for c in peer.idle] + list(self._busy)
        self._peers.clear()
        self._busy.clear()
        for connection in connections:
            await connection.close()
