"""Cross-memory attach: on one host the receiver reads a transfer's bytes straight out of the
sender's memory (`process_vm_readv`), one copy in all, instead of receiving them as messages.

Between two processes on one host UCX's eager shared-memory protocol copies every byte twice
(into its FIFO, then out of it), as a socket does (into the kernel, then out); UCX's own
single-copy lane (cma) is left out of endpoints that use peer-failure error handling, which ours
need (docs/benchmarks.md, issue 28). A read by the receiver copies once, lands only where the
receiver's own lease says, and is hashed chunk by chunk while the chunk is still in its cache.

The conversation (`nori.transfer.conversation`) uses it when both ends agree, over either
transport, whose connection still carries every message:

    sender    header with a CrossMemoryOffer (its pid, 16 random probe bytes, its regions)
    receiver  reads the probe back; if it matches, accepts with `pull`, reads the regions into
              its destinations PULL_CHUNK_BYTES at a time (hashing each chunk as it lands),
              then replies `pulled`
    sender    (hashes its own bytes meanwhile) answers with its 8-byte trailer, the checksum
    receiver  compares, tells the sink, replies done

The sender keeps its buffers until its trailer is sent, and sends it only after `pulled`: a
sender that gave up meanwhile (timed out, closed) sends none, and the receiver fails the
transfer rather than trust bytes read from memory the sender may have reused.

Where the probe fails (another host; containers with their own pid namespaces; Yama's
ptrace_scope of 1 or more, which allows reading only descendants; seccomp), the receiver logs
why once and takes the bytes as messages, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import secrets
from collections.abc import Sequence

import torch
import xxhash

from nori.transfer.base import TransferError
from nori.transfer.buffers import ReceivePiece, ScatteredRun
from nori.transfer.handoff import CrossMemoryOffer
from nori.transfer.integrity import hash_chunks, memory_at

logger = logging.getLogger(__name__)

# Bytes read per process_vm_readv call, then hashed: small enough to still be in the core's
# L2/L3 cache when hashed, large enough that the call's fixed cost does not count.
PULL_CHUNK_BYTES = 1024 * 1024
# The kernel's IOV_MAX: segments per side per call.
MAX_SEGMENTS = 1024
# The receiver lets its event loop run other work after about this many bytes.
_YIELD_EVERY_BYTES = 8 * 1024 * 1024
PROBE_BYTES = 16

# (address, byte count) of a stretch of memory.
Region = tuple[int, int]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _libc_readv() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    function.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    function.restype = ctypes.c_ssize_t
    return function


_PROCESS_VM_READV = _libc_readv()


def read_from(pid: int, local: Sequence[Region], remote: Sequence[Region]) -> None:
    """Copies the bytes of `remote` (in process `pid`) into `local`, both in order and of the
    same total; raises OSError (errno and why) on any failure, a short read included."""
    want = sum(nbytes for _, nbytes in local)
    local_iov = (_IoVec * len(local))(*(_IoVec(*segment) for segment in local))
    remote_iov = (_IoVec * len(remote))(*(_IoVec(*segment) for segment in remote))
    got = _PROCESS_VM_READV(pid, local_iov, len(local), remote_iov, len(remote), 0)
    if got < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"process_vm_readv from pid {pid}: {os.strerror(error)}")
    if got != want:
        raise OSError(0, f"process_vm_readv from pid {pid} read {got} of {want} bytes")


def regions_of(views: Sequence[torch.Tensor]) -> list[Region]:
    """The flat byte views' memory, in order, adjacent views merged into one region."""
    regions: list[Region] = []
    for view in views:
        nbytes = view.numel() * view.element_size()
        if nbytes:
            _extend(regions, view.data_ptr(), nbytes)
    return regions


def piece_regions(pieces: Sequence[ReceivePiece]) -> list[Region]:
    """`regions_of` the views a receiver's pieces land in, in order."""
    views: list[torch.Tensor] = []
    for piece in pieces:
        views.extend(piece.views if isinstance(piece, ScatteredRun) else (piece,))
    return regions_of(views)


def pull_batches(
    sources: Sequence[Region],
    destinations: Sequence[Region],
    max_bytes: int = PULL_CHUNK_BYTES,
    max_segments: int = MAX_SEGMENTS,
) -> list[tuple[list[Region], list[Region]]]:
    """The same byte stream laid out two ways, cut into calls: each (local, remote) pair moves
    at most `max_bytes` in at most `max_segments` segments per side; regions are split where a
    call ends. ValueError when the two do not add up to the same total."""
    if sum(n for _, n in sources) != sum(n for _, n in destinations):
        raise ValueError("the source and destination regions hold different byte counts")
    batches: list[tuple[list[Region], list[Region]]] = []
    source_index = destination_index = 0
    source_done = destination_done = 0  # bytes of the current region already taken
    while destination_index < len(destinations):
        local: list[Region] = []
        remote: list[Region] = []
        room = max_bytes
        while room and destination_index < len(destinations):
            if len(local) == max_segments or len(remote) == max_segments:
                break
            source_address, source_nbytes = sources[source_index]
            destination_address, destination_nbytes = destinations[destination_index]
            step = min(room, source_nbytes - source_done, destination_nbytes - destination_done)
            _extend(local, destination_address + destination_done, step)
            _extend(remote, source_address + source_done, step)
            room -= step
            source_done += step
            destination_done += step
            if source_done == source_nbytes:
                source_index, source_done = source_index + 1, 0
            if destination_done == destination_nbytes:
                destination_index, destination_done = destination_index + 1, 0
        batches.append((local, remote))
    return batches


def _extend(segments: list[Region], address: int, nbytes: int) -> None:
    """Appends a segment, merged into the last one where it continues it."""
    if segments and segments[-1][0] + segments[-1][1] == address:
        segments[-1] = (segments[-1][0], segments[-1][1] + nbytes)
    else:
        segments.append((address, nbytes))


class PullSource:
    """A sender's side: offers its buffers to receivers on its host. Keeps the probe bytes a
    receiver reads to prove it can read this process."""

    def __init__(self) -> None:
        self._probe = ctypes.create_string_buffer(secrets.token_bytes(PROBE_BYTES), PROBE_BYTES)
        self._pid = os.getpid()

    def offer(self, views: Sequence[torch.Tensor]) -> CrossMemoryOffer | None:
        """The offer for these flat byte views; None for CUDA memory (another process cannot
        read it this way) or no bytes at all."""
        if any(view.is_cuda for view in views):
            return None
        regions = regions_of(views)
        if not regions:
            return None
        return CrossMemoryOffer(
            pid=self._pid,
            probe_address=ctypes.addressof(self._probe),
            probe=self._probe.raw,
            region_addresses=[address for address, _ in regions],
            region_nbytes=[nbytes for _, nbytes in regions],
        )


async def hash_while_pulled(views: Sequence[torch.Tensor], hasher: xxhash.xxh3_64) -> None:
    """The sender's checksum while the receiver reads: every byte in order, in the chunks the
    transports hash (`integrity.hash_chunks`), letting the event loop run between them."""
    since_yield = 0
    for _, chunk in hash_chunks(views):
        hasher.update(chunk)
        since_yield += chunk.nbytes
        if since_yield >= _YIELD_EVERY_BYTES:
            since_yield = 0
            await asyncio.sleep(0)


class PullReader:
    """A receiver's side: checks an offer, then reads the bytes into its own destinations."""

    def __init__(self, chunk_bytes: int = PULL_CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        # Why offers are refused, once each in the log (pids of peers on other hosts differ
        # without end; the reasons do not).
        self._refusals_logged: set[str] = set()
        self._pull_logged = False
        self.bytes_pulled = 0

    def can_pull(self, offer: CrossMemoryOffer, pieces: Sequence[ReceivePiece]) -> bool:
        """Whether this transfer's bytes can be read from the sender: host destinations, and
        the offer's probe reads back as offered."""
        if any(piece.is_cuda for piece in pieces if isinstance(piece, torch.Tensor)):
            return False
        if len(offer.probe) != PROBE_BYTES:
            self._refuse("the offer's probe is not 16 bytes")
            return False
        probe = ctypes.create_string_buffer(PROBE_BYTES)
        try:
            read_from(
                offer.pid,
                [(ctypes.addressof(probe), PROBE_BYTES)],
                [(offer.probe_address, PROBE_BYTES)],
            )
        except OSError as error:
            # By the reason, not the message: the pids differ from peer to peer.
            self._refuse(os.strerror(error.errno) if error.errno else str(error))
            return False
        if probe.raw != offer.probe:
            self._refuse("pid names another process (another host or pid namespace)")
            return False
        if not self._pull_logged:
            self._pull_logged = True
            logger.info(
                "KV from senders on this host is read out of their memory (cross-memory attach)"
            )
        return True

    def _refuse(self, why: str) -> None:
        if why not in self._refusals_logged:
            self._refusals_logged.add(why)
            logger.info(
                "KV from a sender on this host is received as messages, not read from its "
                "memory (cross-memory attach): %s",
                why,
            )

    async def pull(
        self,
        offer: CrossMemoryOffer,
        pieces: Sequence[ReceivePiece],
        hasher: xxhash.xxh3_64 | None,
    ) -> None:
        """Reads the offered regions into the pieces' views, in order; given a `hasher`, feeds
        it each chunk right after it landed. TransferError when a read fails (the sender died,
        or unmapped a region)."""
        sources = list(zip(offer.region_addresses, offer.region_nbytes, strict=True))
        try:
            batches = pull_batches(sources, piece_regions(pieces), self._chunk_bytes)
        except ValueError as error:
            raise TransferError(
                f"the sender's offer does not fit the destinations: {error}"
            ) from None
        since_yield = 0
        for local, remote in batches:
            try:
                read_from(offer.pid, local, remote)
            except OSError as error:
                raise TransferError(f"reading KV from the sender failed: {error}") from None
            nbytes = sum(n for _, n in local)
            if hasher is not None:
                for address, length in local:
                    hasher.update(memory_at(address, length))
            self.bytes_pulled += nbytes
            since_yield += nbytes
            if since_yield >= _YIELD_EVERY_BYTES:
                since_yield = 0
                await asyncio.sleep(0)
