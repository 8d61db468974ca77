"""On one host the receiver takes a transfer's bytes straight out of the sender's memory, one
copy in all, instead of receiving them as messages: copied out of its own read-only mapping of
the sender's shared memory (the workers' KV caches and the prefill worker's export arena are
shared memory), or, for private memory, read with `process_vm_readv` (cross-memory attach).

Between two processes on one host UCX's eager shared-memory protocol copies every byte twice
(into its FIFO, then out of it), as a socket does (into the kernel, then out); UCX's own
single-copy lane (cma) is left out of endpoints that use peer-failure error handling, which ours
need (docs/benchmarks.md, issue 28). A copy by the receiver happens once, lands only where the
receiver's own lease says, and is hashed as it lands, while the bytes are in the core's cache.

The conversation (`nori.transfer.conversation`) uses it when both ends agree, over either
transport, whose connection still carries every message:

    sender    header with a CrossMemoryOffer: its pid, 16 random probe bytes, its regions, and
              where they lie in shared memory, its segments and the abstract Unix socket that
              hands out read-only descriptors of them
    receiver  maps the segments (once per sender: it asks the socket, which answers with the
              probe bytes and the descriptors), or else reads the probe back with
              process_vm_readv; if either works, accepts with `pull`, copies (or reads) the
              regions into its destinations 1 MiB at a time, hashing each chunk as it lands,
              then replies `pulled`
    sender    (hashes its own bytes meanwhile) answers with its 8-byte trailer, the checksum
    receiver  compares, tells the sink, replies done

The sender keeps its buffers until its trailer is sent, and sends it only after `pulled`: a
sender that gave up meanwhile (timed out, closed) sends none, and the receiver fails the
transfer rather than trust bytes read from memory the sender may have reused.

Mapping needs no permission to read another process: descriptors passed over a Unix socket
are what shared memory is for, so it works under Yama's ptrace_scope >= 1 (Ubuntu's default,
which lets a process read only its descendants, and the workers are siblings). It needs the
same network namespace (the abstract socket) and shared memory; process_vm_readv needs the same
pid namespace and that permission. Where neither works (another host; containers with their
own namespaces; seccomp), the receiver logs why once and takes the bytes as messages.

A large copy runs on two threads beside the event loop (`COPY_THREADS`), each taking 1 MiB
chunks in turn through a C++ kernel that copies a chunk's pieces and hashes them as it goes
(`nori.kernels.copy_pieces`), the GIL released: the transfer checksum is over chunk digests
(`integrity.TransferHasher`), so the chunks hash independently.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import ctypes
import logging
import mmap
import os
import secrets
import select
import selectors
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
from nori.transfer.buffers import ReceivePiece, ScatteredRun, adjacent_runs
from nori.transfer.handoff import CrossMemoryOffer, KVBulk
from nori.transfer.integrity import (
    CHECKSUM_CHUNK_BYTES,
    TransferHasher,
    hash_chunks,
    memory_at,
)

logger = logging.getLogger(__name__)

# Bytes copied or read per step, then hashed: small enough to still be in the core's L2/L3
# cache when hashed, large enough that a step's fixed cost does not count; the transfer
# checksum's chunk, so that each is hashed on its own (`integrity.TransferHasher`).
PULL_CHUNK_BYTES = CHECKSUM_CHUNK_BYTES
# The kernel's IOV_MAX: segments per side per call.
MAX_SEGMENTS = 1024
# The receiver lets its event loop run other work after about this many bytes.
_YIELD_EVERY_BYTES = 8 * 1024 * 1024
PROBE_BYTES = 16
# Descriptors handed over per message (the kernel's SCM_MAX_FD is 253).
MAX_FDS_PER_MESSAGE = 250
# Shared-memory segments a sender keeps descriptors of (its KV cache tensors: a few dozen); the
# least recently offered is closed beyond this.
MAX_SEGMENTS_OFFERED = 512
# Receivers a sender's segment socket serves at once (each keeps one connection per sender).
MAX_SEGMENT_CLIENTS = 64
# Senders whose segments a receiver keeps mapped; the least recently used is unmapped.
MAX_MAPPED_SENDERS = 8
_SEGMENT_CONNECT_TIMEOUT_S = 2.0
# A transfer of at least this many bytes out of mapped segments is copied by threads beside
# the event loop, which goes on serving meanwhile: they take the chunks in turn, each hashing
# the chunk it copied while it is in its core's cache. One core copies 32 KiB pieces at about
# 6 GB/s here (docs/benchmarks.md, issue 28); a socket moves bytes with two (a kernel copy on
# each side).
COPY_THREAD_MIN_BYTES = 4 * 1024 * 1024
COPY_THREADS = min(2, os.cpu_count() or 1)

# (address, byte count) of a stretch of memory.
Region = tuple[int, int]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)


def _libc_readv() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    function = _LIBC.process_vm_readv
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
    """The flat byte views' memory, in order, adjacent views merged into one region.
    Vectorized: a transfer of 32 KiB blocks has thousands of views."""
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


# A copy's pieces, in stream order: rows of (destination address, source address, byte count),
# each within one region of either side; int64 [n, 3] (what `kernels.copy_pieces` takes).
Pieces = np.ndarray


def copy_plan(
    sources: Sequence[Region], destinations: Sequence[Region], chunk_bytes: int = PULL_CHUNK_BYTES
) -> list[Pieces]:
    """The same byte stream laid out two ways, cut into chunks of `chunk_bytes` of the stream
    (the last one shorter), each a list of pieces that lie within one region of either side.
    ValueError when the two do not add up to the same total. Vectorized: a transfer of 32 KiB
    blocks has thousands of regions."""
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


# ---------------------------------------------------------------------- shared-memory segments
#
# The workers' KV caches are shared memory (the engine process shares them with its worker,
# `nori.worker.engine_process`). A sender hands a read-only descriptor of each segment its
# offered regions lie in to a receiver that asks on the sender's abstract Unix socket; the
# receiver maps it once and from then on copies with memmove out of its own mapping: no
# permission to read another process (Yama's ptrace_scope) needed, and none of
# process_vm_readv's per-page pinning. The socket stays connected while the receiver keeps the
# mapping: its end says the sender is gone, and the receiver unmaps.


@dataclass(frozen=True)
class Segment:
    """A stretch of shared memory holding offered regions: its start in the sender, its length,
    and the key its memory goes by (its shared-memory file's inode)."""

    address: int
    nbytes: int
    key: int


def shared_segments(views: Sequence[torch.Tensor]) -> list[tuple[Segment, int]]:
    """The shared-memory segments (torch storages shared by file descriptor) the views (a run's
    first view stands for the run) lie in,
    each with a descriptor of it that the storage owns; empty when any view is not in one."""
    storages: dict[int, torch.UntypedStorage] = {}
    for view in views:
        storage = view.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    segments: list[tuple[Segment, int]] = []
    for address, storage in storages.items():
        # Only storages shared already: sharing one now would move its memory under its views.
        if not storage.is_shared() or storage.nbytes() == 0:
            return []
        try:
            fd, nbytes = storage._share_fd_cpu_()
        except RuntimeError:  # shared another way (the file_system strategy)
            return []
        segments.append((Segment(address, int(nbytes), os.fstat(fd).st_ino), fd))
    return segments


def peer_uid(connection: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    credentials = connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    return int(struct.unpack("3i", credentials)[1])


class SegmentServer:
    """A sender's abstract Unix socket: answers a receiver's request for segments (by key) with
    the probe bytes, each segment's length (0 if unknown) and read-only descriptors of the
    known ones. One thread; receivers stay connected while they keep the mappings. Only a
    process of this one's user is answered (the kernel's word, SO_PEERCRED): the same
    boundary as reading this process's memory, which any other local user is refused; an
    abstract socket's name can be listed by anyone (/proc/net/unix)."""

    def __init__(self, probe: bytes) -> None:
        self._probe = probe
        self.name = f"nori-kv-{os.getpid()}-{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        # key -> (read-only descriptor, byte count), least recently offered first.
        self._segments: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind("\0" + self.name)
        self._listener.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nori-kv-segments", daemon=True)
        self._thread.start()

    def register(self, segments: Sequence[tuple[Segment, int]]) -> None:
        """Keeps a read-only descriptor of each segment (the storage's own may close with it)."""
        with self._lock:
            for segment, fd in segments:
                if segment.key in self._segments:
                    self._segments.move_to_end(segment.key)
                    continue
                read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                self._segments[segment.key] = (read_only, segment.nbytes)
                while len(self._segments) > MAX_SEGMENTS_OFFERED:
                    os.close(self._segments.popitem(last=False)[1][0])

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._closed.is_set():
                for key, _ in selector.select(timeout=0.5):
                    connection = key.fileobj
                    assert isinstance(connection, socket.socket)
                    if connection is self._listener:
                        client, _ = self._listener.accept()
                        if (
                            len(selector.get_map()) > MAX_SEGMENT_CLIENTS
                            or peer_uid(client) != os.getuid()
                        ):
                            client.close()
                        else:
                            selector.register(client, selectors.EVENT_READ)
                    elif not self._answer(connection):
                        selector.unregister(connection)
                        connection.close()
        except OSError as error:  # the listener closed under the selector
            if not self._closed.is_set():
                logger.warning("KV segment socket stopped: %s", error)
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            selector.close()

    def _answer(self, connection: socket.socket) -> bool:
        try:
            request = connection.recv(8 * MAX_FDS_PER_MESSAGE)
        except OSError:
            return False
        if not request or len(request) % 8:
            return False
        keys = struct.unpack(f"<{len(request) // 8}Q", request)
        with self._lock:
            known = [self._segments.get(key) for key in keys]
            sizes = [entry[1] if entry else 0 for entry in known]
            fds = [entry[0] for entry in known if entry]
            try:
                socket.send_fds(
                    connection, [self._probe + struct.pack(f"<{len(keys)}Q", *sizes)], fds
                )
            except OSError:
                return False
        return True

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._thread.join(timeout=2.0)
        with self._lock:
            for read_only, _ in self._segments.values():
                os.close(read_only)
            self._segments.clear()


@dataclass
class _MappedSender:
    """A receiver's mappings of one sender's segments, and the connection whose end says the
    sender is gone. Unmapped once evicted (or gone) and no copy uses them."""

    connection: socket.socket
    probe: bytes
    # key -> (local address of the mapping, byte count)
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
    """The sender's regions as addresses in the receiver's mappings, split where a region runs
    from one segment into the next; ValueError for a byte outside every mapped segment."""
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
            _extend(local, local_address + address - start, step)
            address += step
            nbytes -= step
    return local


class PullSource:
    """A sender's side: offers its buffers to receivers on its host. Keeps the probe bytes a
    receiver reads to prove it can read this process, and (from the first offer of shared
    memory on) the socket that hands out its segments."""

    def __init__(self) -> None:
        self._probe = ctypes.create_string_buffer(secrets.token_bytes(PROBE_BYTES), PROBE_BYTES)
        self._pid = os.getpid()
        self._segment_server: SegmentServer | None = None

    def offer(
        self,
        views: Sequence[torch.Tensor],
        runs: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> CrossMemoryOffer | None:
        """The offer for these flat byte views, given (or else finding) their `adjacent_runs`
        and byte sizes; None for CUDA memory (another process cannot read it this way) or no
        bytes at all. Per run, not per view: a transfer of 32 KiB blocks has thousands."""
        if runs is None:
            runs = adjacent_runs(list(views))
        if sizes is None:
            sizes = [view.numel() * view.element_size() for view in views]
        heads: list[torch.Tensor] = []  # each run's first view
        regions: list[Region] = []
        start = 0
        for run in runs:
            nbytes = sum(sizes[start : start + run])
            if nbytes:
                heads.append(views[start])
                _extend(regions, views[start].data_ptr(), nbytes)
            start += run
        if not regions or any(head.is_cuda for head in heads):
            return None
        offer = CrossMemoryOffer(
            pid=self._pid,
            probe_address=ctypes.addressof(self._probe),
            probe=self._probe.raw,
            region_addresses=[address for address, _ in regions],
            region_nbytes=[nbytes for _, nbytes in regions],
        )
        segments = shared_segments(heads)
        if segments:
            if self._segment_server is None:
                self._segment_server = SegmentServer(self._probe.raw)
            self._segment_server.register(segments)
            offer.segment_socket = self._segment_server.name
            offer.segment_addresses.extend(segment.address for segment, _ in segments)
            offer.segment_nbytes.extend(segment.nbytes for segment, _ in segments)
            offer.segment_keys.extend(segment.key for segment, _ in segments)
        return offer

    def close(self) -> None:
        if self._segment_server is not None:
            self._segment_server.close()
            self._segment_server = None


async def hash_while_pulled(views: Sequence[torch.Tensor], hasher: TransferHasher) -> None:
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
    """A receiver's side: checks an offer, then copies the bytes into its own destinations out
    of its mappings of the sender's shared memory, or reads them with process_vm_readv."""

    def __init__(self, chunk_bytes: int = PULL_CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        # The threads that copy large transfers out of mapped segments (COPY_THREADS).
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Why offers are refused, once each in the log (pids of peers on other hosts differ
        # without end; the reasons do not).
        self._refusals_logged: set[str] = set()
        self._ways_logged: set[str] = set()
        # Segment socket name -> that sender's mappings, least recently used first.
        self._senders: OrderedDict[str, _MappedSender] = OrderedDict()
        self.bytes_pulled = 0
        # Of those, copied out of mappings of the sender's shared memory.
        self.bytes_mapped = 0

    def can_pull(self, offer: CrossMemoryOffer, pieces: Sequence[ReceivePiece]) -> bool:
        """Whether this transfer's bytes can be taken from the sender's memory: host
        destinations, and either the offer's segments mapped here (the sender's socket answers
        with the offer's probe) or its probe read back with process_vm_readv."""
        if any(piece.is_cuda for piece in pieces if isinstance(piece, torch.Tensor)):
            return False
        if len(offer.probe) != PROBE_BYTES:
            self._refuse("the offer's probe is not 16 bytes")
            return False
        self._forget_gone_senders()
        if offer.segment_socket and self._mapped(offer) is not None:
            self._say_once(
                "mapped",
                "KV from senders on this host is copied out of their shared memory, mapped here",
            )
            return True
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
        self._say_once(
            "read", "KV from senders on this host is read out of their memory (cross-memory attach)"
        )
        return True

    @property
    def mapped_senders(self) -> int:
        """Senders whose segments are mapped here now."""
        return len(self._senders)

    def _say_once(self, way: str, message: str) -> None:
        if way not in self._ways_logged:
            self._ways_logged.add(way)
            logger.info(message)

    def _refuse(self, why: str) -> None:
        if why not in self._refusals_logged:
            self._refusals_logged.add(why)
            logger.info(
                "KV from a sender on this host is received as messages, not read from its "
                "memory (cross-memory attach): %s",
                why,
            )

    # ------------------------------------------------------------------ mappings

    def _mapped(self, offer: CrossMemoryOffer) -> _MappedSender | None:
        """The sender's mappings with every offered segment in them (mapping those missing);
        None, logged once by reason, where that cannot be done."""
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
            self._refuse_mapping(os.strerror(errno) if errno else str(error))
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

    def _refuse_mapping(self, why: str) -> None:
        if why not in self._refusals_logged:
            self._refusals_logged.add(why)
            logger.info(
                "KV from a sender on this host is not copied out of its shared memory: %s", why
            )

    def _evict(self, name: str) -> None:
        sender = self._senders.pop(name)
        sender.evicted = True
        sender.release()

    def _forget_gone_senders(self) -> None:
        for name in [name for name, sender in self._senders.items() if sender.gone()]:
            self._evict(name)

    def close(self) -> None:
        """Unmaps every sender's segments (a copy still under way unmaps its own when done)
        and stops the copy threads."""
        for name in list(self._senders):
            self._evict(name)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ the copy

    async def pull(
        self,
        offer: CrossMemoryOffer,
        pieces: Sequence[ReceivePiece],
        hasher: TransferHasher | None,
    ) -> KVBulk:
        """Takes the offered regions into the pieces' views, in order, out of the mapped
        segments where the offer has them (else with process_vm_readv), and says which; given a
        `hasher`, feeds it each chunk right after it landed. TransferError when that fails (the sender died,
        or unmapped a region, or the offer does not fit)."""
        sources = list(zip(offer.region_addresses, offer.region_nbytes, strict=True))
        sender = self._mapped(offer) if offer.segment_socket else None
        if sender is None:
            try:
                batches = pull_batches(sources, piece_regions(pieces), self._chunk_bytes)
            except ValueError as error:
                raise TransferError(
                    f"the sender's offer does not fit the destinations: {error}"
                ) from None
            await self._read(offer.pid, batches, hasher)
            return "read"
        sender.users += 1
        try:
            segments = [
                Segment(address, nbytes, key)
                for address, nbytes, key in zip(
                    offer.segment_addresses, offer.segment_nbytes, offer.segment_keys, strict=True
                )
            ]
            try:
                plan = copy_plan(_translate(sources, segments, sender), piece_regions(pieces))
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
                    if since_yield >= _YIELD_EVERY_BYTES:
                        since_yield = 0
                        await asyncio.sleep(0)
            if hasher is not None and plan:
                hasher.add_chunk_digests(digests, int(plan[-1][:, 2].sum()))
            self.bytes_pulled += nbytes
            self.bytes_mapped += nbytes
        finally:
            sender.users -= 1
            sender.release()
        return "mapped"

    async def _copy_on_threads(self, plan: list[Pieces], digests: list[int] | None) -> None:
        """The copy threads take the chunks in turn; given `digests`, each puts there the
        digest of the chunk it copied, hashed as it copies (in its core's cache). Returns, or
        raises, only once no thread touches the destinations any more: the caller may hand
        them back right after."""
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

    async def _read(
        self,
        pid: int,
        batches: list[tuple[list[Region], list[Region]]],
        hasher: TransferHasher | None,
    ) -> None:
        since_yield = 0
        for local, remote in batches:
            try:
                read_from(pid, local, remote)
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
