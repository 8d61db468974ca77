"""The sender's side of a transfer that the receiver copies out of the sender's shared memory.

`PullSource.offer` describes a transfer's bytes only when all lie in shared memory, else they go
as messages. The offer names an abstract Unix socket (`SegmentServer`) that hands read-only
segment descriptors to a process of this user. Invariant: the buffers stay unchanged until the
trailer, sent only after the receiver's `pulled`. The message sequence: docs/architecture.md."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nori.transfer.handoff import CrossMemoryOffer
from nori.transfer.integrity import TransferHasher, adjacent_runs, hash_chunks

logger = logging.getLogger(__name__)

# Random bytes that name one sender: its offers carry them, its segment socket answers with them.
PROBE_BYTES = 16
# Descriptors handed over per message (the kernel's SCM_MAX_FD is 253).
MAX_FDS_PER_MESSAGE = 250
# Segments a sender keeps descriptors of; the least recently offered is closed beyond this.
MAX_SEGMENTS_OFFERED = 512
MAX_SEGMENT_CLIENTS = 64
YIELD_EVERY_BYTES = 8 * 1024 * 1024

Region = tuple[int, int]


def extend_regions(regions: list[Region], address: int, nbytes: int) -> None:
    """Appends a region, merged into the last one where it continues it."""
    if regions and regions[-1][0] + regions[-1][1] == address:
        regions[-1] = (regions[-1][0], regions[-1][1] + nbytes)
    else:
        regions.append((address, nbytes))


@dataclass(frozen=True)
class Segment:
    """Shared memory: its start in the sender, length and key (the shared-memory file's inode)."""

    address: int
    nbytes: int
    key: int


def shared_segments(views: Sequence[torch.Tensor]) -> list[tuple[Segment, int]]:
    """The shared-memory segments the views lie in (a run's first view stands for the run), each
    with a descriptor the storage owns; empty when any view is not in one."""
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
    credentials = connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    return int(struct.unpack("3i", credentials)[1])


class SegmentServer:
    """A sender's abstract Unix socket, on one thread: answers a request for segments (8-byte
    keys) with the probe, each length (0 if unknown) and read-only descriptors. Only this user's
    processes are answered (SO_PEERCRED): anyone can list abstract socket names."""

    def __init__(self, probe: bytes) -> None:
        self._probe = probe
        self.name = f"nori-kv-{os.getpid()}-{secrets.token_hex(8)}"
        self._lock = threading.Lock()
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


class PullSource:
    """A sender's side: offers its buffers in shared memory to receivers on its host."""

    def __init__(self) -> None:
        self._probe = secrets.token_bytes(PROBE_BYTES)
        self._segment_server: SegmentServer | None = None

    def offer(
        self,
        views: Sequence[torch.Tensor],
        runs: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> CrossMemoryOffer | None:
        """The offer for these flat byte views (given or finding their `adjacent_runs`); None for
        memory that is not shared, or no bytes."""
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
                extend_regions(regions, views[start].data_ptr(), nbytes)
            start += run
        if not regions or any(head.is_cuda for head in heads):
            return None
        segments = shared_segments(heads)
        if not segments:
            return None
        if self._segment_server is None:
            self._segment_server = SegmentServer(self._probe)
        self._segment_server.register(segments)
        return CrossMemoryOffer(
            probe=self._probe,
            region_addresses=[address for address, _ in regions],
            region_nbytes=[nbytes for _, nbytes in regions],
            segment_socket=self._segment_server.name,
            segment_addresses=[segment.address for segment, _ in segments],
            segment_nbytes=[segment.nbytes for segment, _ in segments],
            segment_keys=[segment.key for segment, _ in segments],
        )

    def close(self) -> None:
        if self._segment_server is not None:
            self._segment_server.close()
            self._segment_server = None


async def hash_while_pulled(views: Sequence[torch.Tensor], hasher: TransferHasher) -> None:
    """The sender's checksum while the receiver copies, in the transports' chunks, letting the
    event loop run between them."""
    since_yield = 0
    for _, chunk in hash_chunks(views):
        hasher.update(chunk)
        since_yield += chunk.nbytes
        if since_yield >= YIELD_EVERY_BYTES:
            since_yield = 0
            await asyncio.sleep(0)
