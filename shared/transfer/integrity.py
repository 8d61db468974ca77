"""Checksums of KV transfer buffers: the receiver decodes only on the bytes the sender sent.

Now (issue 28, fifth session): a `checksums_follow` transfer carries one checksum of its whole
byte stream, xxh3-64 over the xxh3-64 digests of each CHECKSUM_CHUNK_BYTES of it
(`TransferHasher`). The prefill worker's export copy takes it as it copies the blocks
(`nori.prefill.export_arena`); a receiver copying out of the sender's shared memory takes each
chunk's digest as it copies the chunk (`nori.kernels.copy_pieces`); the other paths hash as the
bytes go out and land. What follows is how the earlier designs were measured.

One xxh3-64 per buffer, computed by the sender over its export buffers and carried in the
transfer header, and by the receiver over the cache blocks the bytes landed in; the decode
worker's sink compares the two before the request joins a batch (fail-closed: a header without
checksums is refused, and so is a transfer whose bytes differ).

What it costs is the memory traffic and the calls, not the hashing. Measured on an Intel Xeon
(AVX-512, 2 cores shared with other work), 64 MiB in 2048 buffers of 32 KiB: xxh3 over buffers
that are out of cache runs at ~12 GB/s (5.4 ms), over a 32 KiB buffer still in cache at ~50 GB/s
(0.66 us); the per-buffer wrapper of the first version (dtype view, `.numpy()`, checks) cost
~3 us a call, 6 ms per transfer, more than the hash. So:

- `buffer_checksum` takes the short path (one `.numpy()` and one hash call) for the CPU uint8
  views the transports hand it;
- the receiving transport hashes each buffer as soon as its receive completes, while UCX's copy
  just left it in the cache, instead of a second pass over the whole transfer afterwards
  (`nori.transfer.conversation`: the figures travel to the sink as
  `TransferHeader.received_checksums`).

`nori bench transfer` measures the end-to-end cost (`integrity_cost_vs_ucx`: sender hashing plus
receiver hashing and comparing, against the same transfer unchecked). On that Xeon: 0.35 at 32
KiB blocks and 0.66 at 256 KiB (UCX eager over sysv), of which the extra message is 0.06-0.10:
the hashes still run at the out-of-cache speed there, the target (0.2) is not met yet.

A prefill worker sends `checksums_follow` headers (one xxh3 over the whole transfer, after the
data); per-buffer checksums in the header are still accepted and checked by the sink.

Scattered small blocks land through the UCX receiver's staging buffer (`buffers.ScatteredRun`),
hashed there while the buffer is in L2, before it is copied out: on an AMD EPYC (Zen 3, AVX2,
2 cores), 64 MiB of scattered 32 KiB blocks, the check cost 0.05-0.08 of the transfer (0.63-0.77
before, each block its own message hashed in place; `results/transfer/issue28_s3/`). Runs that
land in place still pay the pass below (0.2-0.5 there).

Where the remaining cost is (same Xeon, 64 MiB of 32 KiB blocks in runs): the receiver's hash
alone, with the sender's checksum taken beforehand in the export copy and carried in the
header, cost 0.38 of the transfer, as much as both sides hashing (0.34): the floor is the
receiver's one read pass over bytes that UCX's copy-out did not leave in the cache (xxh3 over
that memory runs at 12-16 GB/s, 45 GB/s over a chunk still in L2), about 5 ms for 64 MiB against
a 14 ms transfer. Hashing the export copy piece by piece cost more than it saved (the pieces
lost index_select's two threads: +1.06 of the transfer), so it was not kept.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from nori.transfer.buffers import adjacent_runs, joint_runs

# xxh3-64 of no bytes: what an empty buffer checks as.
EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")


def array_checksum(data: np.ndarray) -> int:
    """xxh3-64 of a contiguous NumPy array's bytes (a transport's own view of a buffer)."""
    return int(xxhash.xxh3_64_intdigest(data))  # type: ignore[arg-type]  # ndarray is a buffer


def buffer_checksum(buffer: torch.Tensor) -> int:
    """xxh3-64 of a buffer's bytes (a contiguous tensor; a GPU one is hashed from a host copy)."""
    if buffer.dtype == torch.uint8 and buffer.device.type == "cpu" and buffer.is_contiguous():
        return array_checksum(buffer.detach().numpy())  # the transports' flat views
    host = buffer if buffer.device.type == "cpu" else buffer.cpu()
    if not host.is_contiguous():
        raise ValueError("KV transfer buffers must be contiguous")
    # As bytes: numpy has no bfloat16, and the hash is of the bytes anyway.
    return array_checksum(host.detach().view(torch.uint8).numpy())


def buffer_checksums(buffers: Sequence[torch.Tensor]) -> list[int]:
    return [buffer_checksum(buffer) for buffer in buffers]


def checksum_mismatch(actual: Sequence[int], expected: Sequence[int]) -> str | None:
    """Why checksums computed over received bytes are not the sender's (the first differing
    buffer), or None."""
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
    """Why the bytes that landed in `buffers` are not what the sender hashed, or None: from the
    checksums the receiving transport took as they landed (`received`), else from a pass over
    the buffers."""
    if received:
        return checksum_mismatch(received, expected)
    return first_mismatch(buffers, expected)


# The most bytes hashed in one call over adjacent buffers: small enough to stay in a core's L2
# cache between the hash and UCX's copy of the same bytes.
HASH_CHUNK_BYTES = 512 * 1024


# The transfer checksum's chunks: consecutive stretches of this many bytes of the stream.
CHECKSUM_CHUNK_BYTES = 1024 * 1024


class TransferHasher:
    """The checksum of a `checksums_follow` transfer: xxh3-64 over the xxh3-64 digests (8 bytes
    little-endian each) of the stream's consecutive CHECKSUM_CHUNK_BYTES stretches, the last
    one shorter (no stretch at all for no bytes).

    It does not depend on how the bytes are cut into calls, so each side hashes runs of
    adjacent buffers in one call (per-call overhead was most of the cost at 32 KiB buffers);
    and the chunks hash independently, so a receiver that copies a transfer on several threads
    hashes each chunk on the thread that just copied it, in that core's cache
    (`add_chunk_digests`)."""

    def __init__(self) -> None:
        self._digests = bytearray()
        self._chunk = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current chunk hashed so far
        self._ended = False  # a short last chunk came as a digest: nothing may follow

    def update(self, data: memoryview | bytes | bytearray | np.ndarray) -> None:
        """Feeds the next bytes of the stream (any contiguous buffer)."""
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
        """The digests of the next whole chunks, hashed elsewhere (each xxh3-64 of its bytes;
        `nori.kernels.copy_pieces.copy_and_hash_pieces` takes them as it copies), the last of
        them `last_nbytes` long (short only for the transfer's last chunk). Only at a chunk
        boundary."""
        if self._filled or self._ended:
            raise ValueError("chunk digests must start at a chunk boundary")
        for digest in digests:
            self._digests += struct.pack("<Q", digest)
        self._ended = last_nbytes < CHECKSUM_CHUNK_BYTES

    def intdigest(self) -> int:
        tail = struct.pack("<Q", self._chunk.intdigest()) if self._filled else b""
        return int(xxhash.xxh3_64_intdigest(bytes(self._digests) + tail))


def transfer_hasher() -> TransferHasher:
    """A new `TransferHasher`: the checksum both sides of a `checksums_follow` transfer take."""
    return TransferHasher()


def hash_chunks(views: Sequence[torch.Tensor]) -> list[tuple[int, memoryview]]:
    """Adjacent CPU views grouped into chunks of at most HASH_CHUNK_BYTES (a view larger than
    that is a chunk of its own): (index of the chunk's last non-empty view, its bytes), in
    order. Feeding the chunks to a `transfer_hasher` hashes exactly the views' bytes, in order.
    The chunks are the runs a transfer's messages are cut into (`buffers.joint_runs`), smaller."""
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
    """The message that follows the buffers of a `checksums_follow` transfer: the sender's
    `transfer_hasher` digest, 8 bytes little-endian."""
    return struct.pack("<Q", checksum)


def unpack_checksum(payload: bytes) -> int:
    if len(payload) != 8:
        raise ValueError(f"a checksum of {len(payload)} bytes, not 8")
    checksum: int = struct.unpack("<Q", payload)[0]
    return checksum
