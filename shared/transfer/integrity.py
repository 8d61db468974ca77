"""A transfer's bytes: flat views of its tensors, the checks both ends make on them, their runs
of adjacent buffers, and checksums, so the receiver decodes only the bytes the sender sent.

A `checksums_follow` transfer ends with one checksum of its byte stream (`TransferHasher`); one
without it, or whose bytes differ, is refused. Costs: docs/benchmarks.md#kv-integrity-checksums."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from nori.transfer.base import TransferRejected
from nori.transfer.handoff import TransferHeader


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 tensor sharing its memory; not flattened (`numel()` is the
    byte count). The caller has checked contiguity."""
    if tensor.dtype is torch.uint8:
        return tensor
    return (tensor.view(1) if tensor.dim() == 0 else tensor).view(torch.uint8)


def check_sources(header: TransferHeader, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sender's buffers as byte views; ValueError when they do not match the header."""
    if len(buffers) != len(header.buffer_nbytes):
        raise ValueError(
            f"{len(buffers)} buffers for a header that lists {len(header.buffer_nbytes)}"
        )
    for index, (buffer, nbytes) in enumerate(zip(buffers, header.buffer_nbytes, strict=True)):
        if not buffer.is_contiguous():
            raise ValueError(f"buffer {index} is not contiguous")
        if buffer.nbytes != nbytes:
            raise ValueError(
                f"buffer {index} holds {buffer.nbytes} bytes, the header says {nbytes}"
            )
    return [byte_view(buffer) for buffer in buffers]


def check_destinations(
    header: TransferHeader, destinations: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The sink's destinations as byte views; TransferRejected when they do not fit the header."""
    if len(destinations) != len(header.buffer_nbytes):
        raise TransferRejected(
            f"size mismatch: the receiver has {len(destinations)} destination buffers, "
            f"the header lists {len(header.buffer_nbytes)}"
        )
    for index, (tensor, nbytes) in enumerate(zip(destinations, header.buffer_nbytes, strict=True)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise TransferRejected(f"destination {index} is not a contiguous tensor")
        if tensor.nbytes != nbytes:
            raise TransferRejected(
                f"size mismatch: destination {index} holds {tensor.nbytes} bytes, "
                f"the header says {nbytes}"
            )
    return [byte_view(tensor) for tensor in destinations]


# Runs of adjacent buffers: each side states its runs (sender in the header, receiver in its
# acceptance), and both move each run adjacent on both sides as one message.


def adjacent_runs(views: list[torch.Tensor]) -> tuple[int, ...]:
    """The lengths, in order, of the runs of views adjacent in memory (one storage, each
    starting where the one before ends)."""
    runs: list[int] = []
    end = -1
    storage = -1
    for view in views:
        start = view.data_ptr()
        here = view.untyped_storage().data_ptr()
        if runs and start == end and here == storage and view.numel():
            runs[-1] += 1
        else:
            runs.append(1)
        end = start + view.numel() * view.element_size()
        storage = here
    return tuple(runs)


# The most bytes one run's message carries: small enough to be in L2 when its checksum is taken.
MAX_RUN_BYTES = 1024 * 1024


def joint_runs(
    first: tuple[int, ...],
    second: tuple[int, ...],
    buffer_nbytes: tuple[int, ...],
    max_run_bytes: int = MAX_RUN_BYTES,
) -> tuple[int, ...]:
    """The runs adjacent on both sides, cut so no run of several buffers holds more than
    `max_run_bytes`. Both sides know every input, so both cut the same messages."""
    ends = set(_run_ends(first)) | set(_run_ends(second))
    runs: list[int] = []
    run_bytes = 0
    for index, nbytes in enumerate(buffer_nbytes):
        if runs and runs[-1] and run_bytes + nbytes <= max_run_bytes:
            runs[-1] += 1
            run_bytes += nbytes
        else:
            runs.append(1)
            run_bytes = nbytes
        if index + 1 in ends:
            runs.append(0)  # the next buffer starts a run
            run_bytes = 0
    return tuple(run for run in runs if run)


def _run_ends(runs: tuple[int, ...]) -> list[int]:
    ends, position = [], 0
    for run in runs:
        position += run
        ends.append(position)
    return ends


def merge_runs(views: list[torch.Tensor], runs: tuple[int, ...]) -> list[torch.Tensor]:
    """One flat byte view (no copy) per run; `runs` must be runs of adjacent views."""
    if sum(runs) != len(views):
        raise ValueError(f"runs over {sum(runs)} buffers for {len(views)}")
    merged: list[torch.Tensor] = []
    start = 0
    for run in runs:
        first = views[start]
        if run == 1:
            merged.append(first)
        else:
            nbytes = sum(view.numel() for view in views[start : start + run])
            merged.append(first.as_strided((nbytes,), (1,), first.storage_offset()))
        start += run
    return merged


def landed_mismatch(received: Sequence[int], expected: Sequence[int]) -> str | None:
    """Why the checksum the receiver took as the bytes landed is not the sender's, or None."""
    if not received or len(received) != len(expected):
        return f"{len(expected)} checksums from the sender, {len(received)} taken on receipt"
    for got, checksum in zip(received, expected, strict=True):
        if got != checksum:
            return f"the transfer checksum is {got:#018x}, the sender's is {checksum:#018x}"
    return None


# The most bytes hashed in one call: small enough to stay in L2 until UCX copies them.
HASH_CHUNK_BYTES = 512 * 1024


CHECKSUM_CHUNK_BYTES = 1024 * 1024


class TransferHasher:
    """xxh3-64 over the xxh3-64 digests (8 bytes little-endian each) of the stream's consecutive
    CHECKSUM_CHUNK_BYTES stretches. Independent of how bytes are cut into calls, and chunks can
    be hashed on other threads (`add_chunk_digests`)."""

    def __init__(self) -> None:
        self._digests = bytearray()
        self._chunk = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current chunk hashed so far
        self._ended = False  # a short last chunk came as a digest: nothing may follow

    def update(self, data: memoryview | bytes | bytearray | np.ndarray) -> None:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        if self._ended and len(view):
            raise ValueError("bytes after the transfer's last chunk")
        while len(view):
            take = min(len(view), CHECKSUM_CHUNK_BYTES - self._filled)
            self._chunk.update(view[:take] if take < len(view) else view)
            view = view[take:]
            self._filled += take
            if self._filled == CHECKSUM_CHUNK_BYTES:
                self._digests += struct.pack("<Q", self._chunk.intdigest())
                self._chunk.reset()
                self._filled = 0

    def add_chunk_digests(self, digests: Sequence[int], last_nbytes: int) -> None:
        """Adds the digests of the next whole chunks, hashed elsewhere, the last `last_nbytes`
        long; only at a chunk boundary."""
        if self._filled or self._ended:
            raise ValueError("chunk digests must start at a chunk boundary")
        for digest in digests:
            self._digests += struct.pack("<Q", digest)
        self._ended = last_nbytes < CHECKSUM_CHUNK_BYTES

    def intdigest(self) -> int:
        tail = struct.pack("<Q", self._chunk.intdigest()) if self._filled else b""
        return int(xxhash.xxh3_64_intdigest(bytes(self._digests) + tail))


def hash_chunks(views: Sequence[torch.Tensor]) -> list[tuple[int, memoryview]]:
    """Adjacent CPU views grouped into chunks of at most HASH_CHUNK_BYTES (a larger view alone):
    (index of the chunk's last non-empty view, its bytes), in order."""
    sizes = tuple(view.numel() * view.element_size() for view in views)
    runs = adjacent_runs(list(views))
    chunks: list[tuple[int, memoryview]] = []
    start = 0
    for run in joint_runs(runs, runs, sizes, HASH_CHUNK_BYTES):
        members = [index for index in range(start, start + run) if sizes[index]]
        if members:
            nbytes = sum(sizes[index] for index in members)
            chunks.append((members[-1], memory_at(views[members[0]].data_ptr(), nbytes)))
        start += run
    return chunks


def memory_at(pointer: int, nbytes: int) -> memoryview:
    """The bytes at `pointer` (inside views the caller keeps alive), without a copy."""
    return memoryview((ctypes.c_char * nbytes).from_address(pointer)).cast("B")


def pack_checksum(checksum: int) -> bytes:
    """The trailer of a `checksums_follow` transfer: the digest, 8 bytes little-endian."""
    return struct.pack("<Q", checksum)


def unpack_checksum(payload: bytes) -> int:
    if len(payload) != 8:
        raise ValueError(f"a checksum of {len(payload)} bytes, not 8")
    checksum: int = struct.unpack("<Q", payload)[0]
    return checksum
