"""Checksums of KV transfer buffers: the receiver decodes only on the bytes the sender sent.

One xxh3-64 per buffer (tens of GB/s on a CPU core, so checking costs little beside the copy),
computed by the sender over its export buffers and carried in the transfer header, recomputed
by the receiver over the cache blocks the bytes landed in, before the request joins a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash


def buffer_checksum(buffer: torch.Tensor) -> int:
    """xxh3-64 of a buffer's bytes (a contiguous tensor; a GPU one is hashed from a host copy).
    Few calls per buffer: a transfer has thousands of small ones, and their overhead, not the
    hashing, is what costs."""
    host = buffer if buffer.device.type == "cpu" else buffer.cpu()
    if not host.is_contiguous():
        raise ValueError("KV transfer buffers must be contiguous")
    # As bytes: numpy has no bfloat16, and the hash is of the bytes anyway.
    data = host.detach().view(torch.uint8).numpy()
    return int(xxhash.xxh3_64_intdigest(data))  # type: ignore[arg-type]  # ndarray is a buffer


def buffer_checksums(buffers: Sequence[torch.Tensor]) -> list[int]:
    return [buffer_checksum(buffer) for buffer in buffers]


def first_mismatch(buffers: Sequence[torch.Tensor], expected: Sequence[int]) -> str | None:
    """Why `buffers` are not what the sender hashed (the first differing buffer), or None."""
    if len(buffers) != len(expected):
        return f"{len(expected)} checksums for {len(buffers)} buffers"
    for index, (buffer, checksum) in enumerate(zip(buffers, expected, strict=True)):
        actual = buffer_checksum(buffer)
        if actual != checksum:
            return f"buffer {index} has checksum {actual:#018x}, the sender's is {checksum:#018x}"
    return None
