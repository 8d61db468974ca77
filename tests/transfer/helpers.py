"""What the transfer tests share: the transports to test, KV blocks to send, a free port."""

from __future__ import annotations

import socket
import struct

import pytest
import torch
import xxhash

from nori.transfer.factory import ucx_available
from nori.transfer.handoff import TransferHeader
from nori.v1.handoff_pb2 import KVDestination
from tests.transfer.receiver_process import CACHE_SHAPE

KINDS = [
    "tcp",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx is not importable")
    ),
]
# The same transports with the receiver copying the bytes out of the sender's shared memory.
PULL_KINDS = [
    "tcp+pull",
    pytest.param(
        "ucx+pull",
        marks=pytest.mark.skipif(not ucx_available(), reason="ucxx is not importable"),
    ),
]


def kv_blocks(
    request_id: str,
    block_ids: list[int],
    dtype: torch.dtype,
    seed: int,
    output_token_ids: tuple[int, ...] = (),
) -> tuple[TransferHeader, list[torch.Tensor], torch.Tensor]:
    """A header, its buffers (one contiguous slice per layer, K/V, block) and their source.

    The source is [layers, 2, len(block_ids), block_size, heads, dim], like a prefill worker's
    exported blocks, in shared memory like theirs; the buffers are views of it, so nothing is
    copied before sending.
    """
    layers, kv, _, *block_shape = CACHE_SHAPE
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(layers, kv, len(block_ids), *block_shape, generator=generator).to(dtype)
    # In shared memory, as a worker's KV cache is: a receiver on this host copies it out of
    # its own mapping.
    source.share_memory_()
    buffers = [
        source[layer, k, i]
        for layer in range(layers)
        for k in range(kv)
        for i in range(len(block_ids))
    ]
    header = TransferHeader.of(
        request_id=request_id,
        block_ids=block_ids,
        buffer_nbytes=[buffer.nbytes for buffer in buffers],
        output_token_ids=output_token_ids,
        # The test receiver keeps one cache per dtype; the destination's worker names it.
        destination=KVDestination(worker_id=str(dtype).removeprefix("torch.")),
    )
    return header, buffers, source


def reference_checksum(data: bytes) -> int:
    """A `checksums_follow` transfer's checksum of these bytes, from its definition: xxh3-64
    over the xxh3-64 digests (8 bytes little-endian) of each 1 MiB of the stream in turn."""
    chunk = 1024 * 1024
    digests = b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(data[start : start + chunk]))
        for start in range(0, len(data), chunk)
    )
    return int(xxhash.xxh3_64_intdigest(digests))


def free_port() -> int:
    """A TCP port nothing listens on (just released by the kernel)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
