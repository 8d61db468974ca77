"""Checksums of KV transfer buffers: the receiver decodes only the bytes the sender sent.

A `checksums_follow` transfer ends with one checksum of its byte stream (`TransferHasher`),
taken by the sender as it copies and by the receiver as the bytes land. A header with
per-buffer checksums is still accepted; with none, refused (fail-closed), as is a transfer whose
bytes differ. Costs: docs/benchmarks.md#kv-integrity-checksums.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from nori.transfer.buffers import adjacent_runs, joint_runs

EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")


def array_checksum(data: np.ndarray) -> int:
    return int(xxhash.xxh3_64_intdigest(data))  # type: ignore[arg-type]  # ndarray is a buffer


def buffer_checksum(buffer: torch.Tensor) -> int:
    """xxh3-64 of a buffer's bytes (a contiguous tensor; a GPU one is hashed from a host copy)."""
    if buffer.dtype == torch.uint8 and buffer.device.type == "cpu" and buffer.is_contiguous():
        return array_checksum(buffer.detach().numpy())  # the transports' flat views
    host = buffer if buffer.device.type == "cpu" else buffer.cpu()
    if not host.is_contiguous():
        raise ValueError("KV transfer buffers must be contiguous")
    return array_checksum(host.detach().view(torch.uint8).numpy())


def buffer_checksums(buffers: Sequence[torch.Tensor]) -> list[int]:
    return [buffer_checksum(buffer) for buffer in buffers]


def checksum_mismatch(actual: Sequence[int], expected: Sequence[int]) -> str | None:
    """Why checksums over received bytes are not the sender's (the first differing buffer), or
    None."""
    if len(actual) != len(expected):
        return f"{len(expected)} checksums for {len(actual)} buffers"
    for index, (got, checksum) in enumerate(zip(actual, expected, strict=True)):
        if got != checksum:
            return f"buffer {index} has checksum {got:#018x}, the sender's is {checksum:#018x}"
    return None


def first_mismatch(buffers: Sequence[torch.Tensor], expected: Sequence[int]) -> str | None:
    """Why `buffers` are not what the sender hashed (the first differing buffer), or None."""
    if len(buffers) != len(expected):
        return f"{len(expected)} checksums for {len(buffers)} buffers"
    return checksum_mismatch(buffer_checksums(buffers), expected)


def landed_mismatch(
    received: Sequence[int], expected: Sequence[int], buffers: Sequence[torch.Tensor]
) -> str | None:
    """Why the bytes in `buffers` are not what the sender hashed, or None: from `received` (the
    transport's checksums) if given, else from a pass over the buffers."""
    if received:
        return checksum_mismatch(received, expected)
    return first_mismatch(buffers, expected)


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


def transfer_hasher() -> TransferHasher:
    return TransferHasher()


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
