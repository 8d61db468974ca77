"""The receiver's side of a transfer it copies out of the sender's shared memory.

`PullReader.can_pull` takes up an offer only where it maps every offered segment here (else it
logs why once and the bytes go as messages). `pull` copies the regions into their destinations in
stream order, out of read-only mappings, hashing each chunk as it lands, touching no byte outside
the offered segments. Mappings are kept per sender (LRU) until it leaves and no copy uses them.
The message sequence: docs/architecture.md."""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import ctypes
import logging
import mmap
import os
import select
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nori.kernels.copy_pieces import copy_and_hash_pieces, copy_pieces, copy_share_of_chunks
from nori.transfer.base import TransferError
from nori.transfer.cross_memory_sender import (
    MAX_FDS_PER_MESSAGE,
    PROBE_BYTES,
    YIELD_EVERY_BYTES,
    Region,
    Segment,
    extend_regions,
)
from nori.transfer.handoff import CrossMemoryOffer
from nori.transfer.integrity import CHECKSUM_CHUNK_BYTES, TransferHasher

logger = logging.getLogger(__name__)

MAX_MAPPED_SENDERS = 8
_SEGMENT_CONNECT_TIMEOUT_S = 2.0
# A copy of at least this many bytes runs on threads beside the event loop, each hashing the
# 1 MiB chunk it copied while it is in its core's cache.
COPY_THREAD_MIN_BYTES = 4 * 1024 * 1024
COPY_THREADS = min(2, os.cpu_count() or 1)

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def regions_of(views: Sequence[torch.Tensor]) -> list[Region]:
    """The flat byte views' memory, in order, adjacent views merged into one region."""
    count = len(views)
    addresses = np.fromiter((view.data_ptr() for view in views), dtype=np.int64, count=count)
    sizes = np.fromiter((view.nbytes for view in views), dtype=np.int64, count=count)
    kept = sizes > 0
    addresses, sizes = addresses[kept], sizes[kept]
    if not len(sizes):
        return []
    starts = np.ones(len(sizes), dtype=bool)  # where a view does not continue the one before
    starts[1:] = addresses[1:] != addresses[:-1] + sizes[:-1]
    heads = np.flatnonzero(starts)
    return list(zip(addresses[heads].tolist(), np.add.reduceat(sizes, heads).tolist(), strict=True))


# A copy's pieces in stream order: int64 [n, 3] rows of (destination, source, byte count), each
# within one region of either side.
Pieces = np.ndarray


def copy_plan(
    sources: Sequence[Region],
    destinations: Sequence[Region],
    chunk_bytes: int = CHECKSUM_CHUNK_BYTES,
) -> list[Pieces]:
    """The same byte stream laid out two ways, cut into chunks of `chunk_bytes`, each a list of
    pieces within one region of either side; ValueError when the totals differ."""
    source = np.array(sources, dtype=np.int64).reshape(-1, 2)
    destination = np.array(destinations, dtype=np.int64).reshape(-1, 2)
    source_ends = np.cumsum(source[:, 1])
    destination_ends = np.cumsum(destination[:, 1])
    total = int(source_ends[-1]) if len(source_ends) else 0
    if total != (int(destination_ends[-1]) if len(destination_ends) else 0):
        raise ValueError("the source and destination regions hold different byte counts")
    if not total:
        return []
    chunk_starts = np.arange(0, total, chunk_bytes, dtype=np.int64)
    ends = np.unique(np.concatenate([source_ends, destination_ends, chunk_starts[1:]]))
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])
    keep = ends > starts  # empty regions make empty pieces
    starts, ends = starts[keep], ends[keep]
    at_source = np.searchsorted(source_ends, starts, side="right")
    at_destination = np.searchsorted(destination_ends, starts, side="right")
    source_addresses = source[at_source, 0] + starts - (source_ends - source[:, 1])[at_source]
    destination_addresses = (
        destination[at_destination, 0]
        + starts
        - (destination_ends - destination[:, 1])[at_destination]
    )
    pieces = np.stack([destination_addresses, source_addresses, ends - starts], axis=1)
    cuts = np.searchsorted(starts, chunk_starts)[1:]
    return [np.ascontiguousarray(chunk) for chunk in np.split(pieces, cuts)]


@dataclass
class _MappedSender:
    """A receiver's mappings of one sender's segments; unmapped once evicted (or the sender is
    gone) and no copy uses them."""

    connection: socket.socket
    probe: bytes
    mappings: dict[int, tuple[int, int]] = field(default_factory=dict)
    users: int = 0
    evicted: bool = False

    def gone(self) -> bool:
        try:
            # The sender writes nothing unasked: readable means its end closed.
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def release(self) -> None:
        if self.evicted and not self.users:
            for address, nbytes in self.mappings.values():
                _LIBC.munmap(address, nbytes)
            self.mappings.clear()
            self.connection.close()


def _map_read_only(fd: int, nbytes: int) -> int:
    if os.fstat(fd).st_size < nbytes:  # reading past the file's end would be SIGBUS
        raise OSError(0, "a shared-memory segment is shorter than offered")
    address = _LIBC.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address == _MAP_FAILED or address is None:
        error = ctypes.get_errno()
        raise OSError(error, f"mmap of a shared-memory segment: {os.strerror(error)}")
    return int(address)


def _translate(
    regions: Sequence[Region], segments: Sequence[Segment], mapped: _MappedSender
) -> list[Region]:
    """The sender's regions as addresses in the receiver's mappings, split at segment edges;
    ValueError for a byte outside every mapped segment."""
    starts = sorted((segment.address, segment.key) for segment in segments)
    addresses = [address for address, _ in starts]
    local: list[Region] = []
    for address, nbytes in regions:
        while nbytes:
            index = bisect.bisect_right(addresses, address) - 1
            start, key = starts[max(index, 0)]
            local_address, mapped_nbytes = mapped.mappings[key]
            room = start + mapped_nbytes - address
            if index < 0 or room <= 0:
                raise ValueError("an offered region lies outside the offered segments")
            step = min(nbytes, room)
            extend_regions(local, local_address + address - start, step)
            address += step
            nbytes -= step
    return local


class PullReader:
    """A receiver's side: checks an offer, then copies the bytes out of its mappings."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Why offers are refused, logged once per reason.
        self._refusals_logged: set[str] = set()
        self._said_mapped = False
        # Segment socket name -> that sender's mappings, least recently used first.
        self._senders: OrderedDict[str, _MappedSender] = OrderedDict()
        self.bytes_mapped = 0

    def can_pull(self, offer: CrossMemoryOffer, views: Sequence[torch.Tensor]) -> bool:
        """Whether the bytes can be copied out of the sender's shared memory: host destinations,
        and every offered segment mapped here."""
        if any(view.is_cuda for view in views):
            return False
        if len(offer.probe) != PROBE_BYTES:
            self._refuse("the offer's probe is not 16 bytes")
            return False
        self._forget_gone_senders()
        if self._mapped(offer) is None:
            return False
        if not self._said_mapped:
            self._said_mapped = True
            logger.info(
                "KV from senders on this host is copied out of their shared memory, mapped here"
            )
        return True

    @property
    def mapped_senders(self) -> int:
        return len(self._senders)

    def _refuse(self, why: str) -> None:
        if why not in self._refusals_logged:
            self._refusals_logged.add(why)
            logger.info(
                "KV from a sender is received as messages, not copied out of its shared memory: %s",
                why,
            )

    def _mapped(self, offer: CrossMemoryOffer) -> _MappedSender | None:
        """The sender's mappings with every offered segment in them; None (logged once by
        reason) where that cannot be done."""
        if not offer.segment_socket:
            self._refuse("the offer names no segment socket")
            return None
        sender = self._senders.get(offer.segment_socket)
        if sender is not None and sender.probe != offer.probe:
            self._evict(offer.segment_socket)  # another sender took the name's place
            sender = None
        try:
            if sender is None:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                connection.settimeout(_SEGMENT_CONNECT_TIMEOUT_S)
                try:
                    connection.connect("\0" + offer.segment_socket)
                except OSError:
                    connection.close()
                    raise
                sender = _MappedSender(connection, offer.probe)
                self._senders[offer.segment_socket] = sender
                while len(self._senders) > MAX_MAPPED_SENDERS:
                    self._evict(next(iter(self._senders)))
            self._senders.move_to_end(offer.segment_socket)
            missing = [
                key for key in dict.fromkeys(offer.segment_keys) if key not in sender.mappings
            ]
            for start in range(0, len(missing), MAX_FDS_PER_MESSAGE):
                self._map(sender, missing[start : start + MAX_FDS_PER_MESSAGE])
        except (OSError, ValueError) as error:
            if sender is not None:
                self._evict(offer.segment_socket)
            errno = getattr(error, "errno", None)
            self._refuse(os.strerror(errno) if errno else str(error))
            return None
        return sender

    def _map(self, sender: _MappedSender, keys: list[int]) -> None:
        sender.connection.sendall(struct.pack(f"<{len(keys)}Q", *keys))
        answer, fds, _, _ = socket.recv_fds(
            sender.connection, PROBE_BYTES + 8 * len(keys), len(keys)
        )
        try:
            if len(answer) != PROBE_BYTES + 8 * len(keys) or answer[:PROBE_BYTES] != sender.probe:
                raise ValueError("the segment socket answered for another sender")
            sizes = struct.unpack(f"<{len(keys)}Q", answer[PROBE_BYTES:])
            if any(size == 0 for size in sizes) or len(fds) != len(keys):
                raise ValueError("the sender no longer holds an offered segment")
            for key, size, fd in zip(keys, sizes, fds, strict=True):
                sender.mappings[key] = (_map_read_only(fd, size), size)
        finally:
            for fd in fds:
                os.close(fd)

    def _evict(self, name: str) -> None:
        sender = self._senders.pop(name)
        sender.evicted = True
        sender.release()

    def _forget_gone_senders(self) -> None:
        for name in [name for name, sender in self._senders.items() if sender.gone()]:
            self._evict(name)

    def close(self) -> None:
        """Unmaps all senders' segments (an ongoing copy's when done) and stops the copy threads."""
        for name in list(self._senders):
            self._evict(name)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def pull(
        self,
        offer: CrossMemoryOffer,
        views: Sequence[torch.Tensor],
        hasher: TransferHasher | None,
    ) -> None:
        """Copies the offered regions into the flat byte views, in order, feeding `hasher` each
        chunk's digest; TransferError when the segments are gone or the offer does not fit."""
        sender = self._mapped(offer)
        if sender is None:
            raise TransferError("the sender's shared memory is no longer mapped here")
        sender.users += 1
        try:
            sources = list(zip(offer.region_addresses, offer.region_nbytes, strict=True))
            segments = [
                Segment(address, nbytes, key)
                for address, nbytes, key in zip(
                    offer.segment_addresses, offer.segment_nbytes, offer.segment_keys, strict=True
                )
            ]
            try:
                plan = copy_plan(_translate(sources, segments, sender), regions_of(views))
            except ValueError as error:
                raise TransferError(
                    f"the sender's offer does not fit the destinations: {error}"
                ) from None
            nbytes = sum(offer.region_nbytes)
            digests = [0] * len(plan)
            if nbytes >= COPY_THREAD_MIN_BYTES and COPY_THREADS > 1:
                await self._copy_on_threads(plan, digests if hasher is not None else None)
            else:
                since_yield = 0
                for index, chunk in enumerate(plan):
                    if hasher is None:
                        copy_pieces(chunk)
                    else:
                        digests[index] = copy_and_hash_pieces(chunk)
                    since_yield += int(chunk[:, 2].sum())
                    if since_yield >= YIELD_EVERY_BYTES:
                        since_yield = 0
                        await asyncio.sleep(0)
            if hasher is not None and plan:
                hasher.add_chunk_digests(digests, int(plan[-1][:, 2].sum()))
            self.bytes_mapped += nbytes
        finally:
            sender.users -= 1
            sender.release()

    async def _copy_on_threads(self, plan: list[Pieces], digests: list[int] | None) -> None:
        """The copy threads take the chunks in turn, writing each chunk's digest to `digests`.
        Returns or raises only once no thread touches the destinations any more."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                COPY_THREADS, thread_name_prefix="nori-kv-copy"
            )
        stop = threading.Event()
        work = [
            self._executor.submit(copy_share_of_chunks, plan, first, COPY_THREADS, digests, stop)
            for first in range(COPY_THREADS)
        ]
        try:
            await asyncio.gather(*(asyncio.wrap_future(future) for future in work))
        except BaseException:
            stop.set()
            concurrent.futures.wait(work)  # each stops at its next chunk: well under a ms
            raise
