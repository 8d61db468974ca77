"""The per-transfer conversation, the same over UCX and TCP; a transport only provides a
`Channel` (framed messages both ways, one transfer at a time).

A header, accepted or rejected; the bytes; a checksum or trailer; `done` only after the sink
took the bytes. The message sequence: docs/architecture.md."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import torch

from nori.transfer.base import (
    Channel,
    ConnectionClosed,
    HeaderPhaseError,
    KVSink,
    MessageTooLarge,
    TransferConfig,
    TransferError,
    TransferRejected,
)
from nori.transfer.cross_memory_receiver import PullReader
from nori.transfer.cross_memory_sender import PullSource, hash_while_pulled
from nori.transfer.handoff import KVTransferReply, TransferHeader, decode_reply, encode_reply
from nori.transfer.integrity import (
    TransferHasher,
    adjacent_runs,
    check_destinations,
    joint_runs,
    merge_runs,
    pack_checksum,
    unpack_checksum,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_REPLY_BYTES = 64 * 1024
MAX_ERROR_CHARS = 4000


class ReceiverStats:
    """What every receiver reports: the address it was started on, and what it completed."""

    def __init__(self) -> None:
        self._address = ""
        self._reader: PullReader | None = None
        self.bytes_received = 0
        self.transfers_completed = 0

    @property
    def address(self) -> str:
        if not self._address:
            raise RuntimeError("the receiver is not started")
        return self._address

    @property
    def bytes_mapped(self) -> int:
        return self._reader.bytes_mapped if self._reader is not None else 0


def _expect(payload: bytes, kind: str) -> KVTransferReply:
    """The receiver's reply, which must be `kind`; a rejection raises TransferRejected."""
    try:
        reply = decode_reply(payload)
    except ValueError as error:
        raise TransferError(f"the receiver sent a malformed reply: {error}") from None
    got = reply.WhichOneof("kind")
    if got == "rejected":
        raise TransferRejected(reply.rejected or "rejected")
    if got != kind:
        raise TransferError(f"the receiver replied {got!r}, expected {kind!r}")
    return reply


async def _within(operation: Awaitable[T], timeout_s: float, what: str) -> T:
    """Awaits `operation`, turning timeouts and socket errors into TransferError."""
    try:
        return await asyncio.wait_for(operation, timeout_s)
    except TimeoutError:
        raise TransferError(f"timed out after {timeout_s:g} s {what}") from None
    except OSError as error:
        raise TransferError(f"connection failed {what}: {error}") from error


async def send_transfer(
    channel: Channel,
    header: TransferHeader,
    views: list[torch.Tensor],
    config: TransferConfig,
    pull_source: PullSource | None = None,
) -> None:
    """The sender's side of one transfer; returns when the receiver acknowledged every byte.
    A `pull_source` offers the receiver the sender's shared memory."""
    source_runs = adjacent_runs(views)
    offer = (
        pull_source.offer(views, source_runs, header.buffer_nbytes)
        if pull_source is not None
        else None
    )
    header = dataclasses.replace(header, source_runs=source_runs, pull_offer=offer)
    try:
        await _within(channel.send_message(header.to_bytes()), config.timeout_s, "sending a header")
        reply = await _within(
            channel.recv_message(MAX_REPLY_BYTES), config.timeout_s, "waiting for the receiver"
        )
    except TransferError as error:
        raise HeaderPhaseError(str(error)) from error
    accepted = _expect(reply, "accepted")
    known = header.sender_checksum if header.checksums_follow else None
    hasher = TransferHasher() if header.checksums_follow and known is None else None
    if accepted.pull:
        if offer is None:
            raise TransferError("the receiver would read bytes it was not offered")
        await _within(_await_pull(channel, views, hasher, known), config.timeout_s, "being copied")
    else:
        destination_runs = tuple(accepted.destination_runs)
        if destination_runs:
            if sum(destination_runs) != len(views) or min(destination_runs) < 1:
                raise TransferError("the receiver's destination runs do not cover the buffers")
            views = merge_runs(
                views, joint_runs(source_runs, destination_runs, header.buffer_nbytes)
            )
        await _within(channel.send_buffers(views, hasher), config.timeout_s, "sending KV data")
        if header.checksums_follow:
            await _within(
                channel.send_message(
                    pack_checksum(hasher.intdigest() if hasher is not None else known or 0)
                ),
                config.timeout_s,
                "sending the checksum",
            )
    acknowledgement = channel.recv_message(MAX_REPLY_BYTES)
    payload = await _within(acknowledgement, config.timeout_s, "waiting for the acknowledgement")
    done = _expect(payload, "done_nbytes")
    if done.done_nbytes != header.total_nbytes:
        raise TransferError(
            f"the receiver acknowledged {done.done_nbytes} bytes of {header.total_nbytes}"
        )


async def _await_pull(
    channel: Channel,
    views: list[torch.Tensor],
    hasher: TransferHasher | None,
    known: int | None = None,
) -> None:
    """While the receiver copies the bytes: hashes them (unless `known`), waits for its `pulled`
    and answers with the trailer. After the trailer the buffers are never read again."""
    if hasher is not None:
        await hash_while_pulled(views, hasher)
    _expect(await channel.recv_message(MAX_REPLY_BYTES), "pulled")
    checksum = hasher.intdigest() if hasher is not None else known
    await channel.send_message(pack_checksum(checksum if checksum is not None else 0))


def _notify_failed(sink: KVSink, header: TransferHeader, error: str) -> None:
    try:
        sink.failed(header, error)
    except Exception:
        logger.exception("KV sink failed() raised for request %s", header.request_id)


async def _reply(channel: Channel, reply: KVTransferReply) -> bool:
    """Sends a reply; False when the connection is gone (the caller stops serving it)."""
    try:
        await channel.send_message(encode_reply(reply))
    except (TransferError, OSError) as error:
        logger.debug("could not reply %s: %s", reply.WhichOneof("kind"), error)
        return False
    return True


async def _reject(channel: Channel, error: str) -> bool:
    return await _reply(channel, KVTransferReply(rejected=error[:MAX_ERROR_CHARS]))


async def serve_connection(
    channel: Channel,
    sink: KVSink,
    stats: ReceiverStats,
    config: TransferConfig,
    reader: PullReader | None = None,
) -> None:
    """Serves transfers on one connection until the peer leaves; raises only cancellation.
    Every failure a peer can cause ends in a rejection or a dropped connection."""
    try:
        while await _serve_one(channel, sink, stats, config, reader):
            pass
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("KV receiver connection failed")
    finally:
        await channel.close()


async def _serve_one(
    channel: Channel,
    sink: KVSink,
    stats: ReceiverStats,
    config: TransferConfig,
    reader: PullReader | None,
) -> bool:
    """One transfer; returns whether the connection can carry another."""
    try:
        payload = await channel.recv_message(config.max_header_bytes)
    except ConnectionClosed:
        return False
    except MessageTooLarge as error:
        await _reject(channel, str(error))
        return False
    except (TransferError, OSError) as error:
        logger.debug("KV receiver connection lost: %s", error)
        return False

    try:
        header = TransferHeader.from_bytes(payload)
    except ValueError as error:
        return await _reject(channel, f"bad transfer header: {error}")
    try:
        destinations = sink.destinations(header)
    except TransferRejected as error:
        return await _reject(channel, str(error))
    except Exception as error:
        logger.exception("KV sink destinations() raised for request %s", header.request_id)
        return await _reject(channel, f"receiver error: {error!r}")
    try:
        views = check_destinations(header, destinations)
    except TransferRejected as error:
        _notify_failed(sink, header, str(error))
        return await _reject(channel, str(error))

    offer = header.pull_offer
    pull = reader is not None and offer is not None and reader.can_pull(offer, views)
    # Both sides move the joint runs as messages, each landing in place.
    destination_runs = adjacent_runs(views) if header.source_runs and not pull else ()
    accept = KVTransferReply(accepted=True, destination_runs=destination_runs, pull=pull)
    if not await _reply(channel, accept):
        _notify_failed(sink, header, "connection lost before the data")
        return False
    messages = views
    if destination_runs:
        messages = merge_runs(
            views, joint_runs(header.source_runs, destination_runs, header.buffer_nbytes)
        )
    # Checksums that follow the data are checked as it lands; header ones are the sink's.
    hasher = TransferHasher() if header.checksums_follow else None
    try:
        if pull:
            assert reader is not None and offer is not None
            await _within(reader.pull(offer, views, hasher), config.timeout_s, "copying KV")
            await _within(
                channel.send_message(encode_reply(KVTransferReply(pulled=True))),
                config.timeout_s,
                "saying the KV was copied",
            )
        else:
            await _within(
                channel.recv_buffers(messages, hasher), config.timeout_s, "receiving KV data"
            )
    except BaseException as error:
        # Close first: once close() returns, no late packet can land in blocks the sink reuses.
        await channel.close()
        _notify_failed(sink, header, str(error) or type(error).__name__)
        if isinstance(error, (TransferError, OSError)):
            logger.debug("KV transfer %s failed: %s", header.request_id, error)
            return False
        raise

    header = dataclasses.replace(header, bulk="mapped" if pull else "messages")
    if hasher is not None or pull:
        # The checksum; after a pull also the sender's word its buffers stayed unchanged.
        try:
            sent = unpack_checksum(
                await _within(channel.recv_message(8), config.timeout_s, "receiving the checksum")
            )
        except (TransferError, OSError, ValueError) as error:
            await channel.close()
            _notify_failed(sink, header, f"no checksum after the data: {error}")
            return False
        if hasher is not None:
            header = dataclasses.replace(
                header, buffer_checksums=(sent,), received_checksums=(hasher.intdigest(),)
            )
    nbytes = header.total_nbytes
    try:
        # Before the acknowledgement: once the sender returns, the decode side knows the blocks.
        sink.completed(header, nbytes)
    except TransferRejected as error:
        # The bytes failed the sink's check (it failed the request); the sender hears a refusal.
        return await _reject(channel, str(error))
    except Exception as error:
        logger.exception("KV sink completed() raised for request %s", header.request_id)
        return await _reject(channel, f"receiver error after the data: {error!r}")
    stats.bytes_received += nbytes
    stats.transfers_completed += 1
    return await _reply(channel, KVTransferReply(done_nbytes=nbytes))


class PooledConnection(Protocol):
    @property
    def alive(self) -> bool: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=PooledConnection)


class _Peer(Generic[C]):
    def __init__(self, max_connections: int) -> None:
        self.slots = asyncio.Semaphore(max_connections)
        self.idle: list[C] = []


class ConnectionPool(Generic[C]):
    """A sender's connections, kept per receiver address (opening one costs round trips); each
    carries one transfer at a time, up to `max_per_peer` at once to one receiver."""

    def __init__(self, connect: Callable[[str], Awaitable[C]], max_per_peer: int) -> None:
        self._connect = connect
        self._max_per_peer = max_per_peer
        self._peers: dict[str, _Peer[C]] = {}
        self._busy: set[C] = set()
        self._closed = False

    async def run(self, address: str, transfer: Callable[[C], Awaitable[T]]) -> T:
        """Runs `transfer` on a connection to `address`. The connection goes back to the pool
        after success or a rejection and is closed after any other failure; a pooled one that
        broke before the header's answer is replaced once."""
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
