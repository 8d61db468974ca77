"""`nori bench transfer`'s settings, and the block layout both of its sides share.

Contract: the sender's block i lands in the receiver's cache block
`destination_block_ids(num_blocks, destinations)[i]`; every block is `block_bytes` long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# One message = one block of one layer's K (or V) in Nori's cache layout
# [layers, 2, blocks, block_size, kv_heads, head_dim]: that is the largest piece a receiver can
# write in place when the destination blocks are not adjacent. 16 tokens x 8 KV heads x 128 dims
# x 2 bytes (a Llama-3-8B-class model in bfloat16, block_size 16) = 32 KiB.
DEFAULT_BLOCK_KIB = 32
TRANSPORTS = ("ucx", "tcp_transport", "socket", "memcpy")
DestinationLayout = Literal["scattered", "adjacent"]


@dataclass(frozen=True)
class TransferBenchConfig:
    total_mib: int = 64
    block_kib: int = DEFAULT_BLOCK_KIB
    repeats: int = 5
    transports: tuple[str, ...] = TRANSPORTS
    # Where the blocks land in the receiver's cache: "scattered" (no two consecutive blocks
    # adjacent, as in a fragmented cache: one message per block, landing in place) or "adjacent" (consecutive, as for a fresh
    # reservation: both ends move runs of up to 1 MiB as one message, in place,
    # `nori.transfer.integrity.joint_runs`).
    destinations: DestinationLayout = "scattered"
    # Our transports' TransferConfig.map_shared_memory (`--bulk mapped`; False: `messages`).
    map_shared_memory: bool = True
    # HOST:PORT of `nori bench transfer --listen` (the receivers on another host); None: the
    # receivers are child processes of this one.
    receiver: str | None = None

    def __post_init__(self) -> None:
        if self.total_mib < 1 or self.block_kib < 1 or self.repeats < 1:
            raise ValueError("--total-mib, --block-kib and --repeats must be >= 1")
        if self.block_kib * 1024 > self.total_bytes:
            raise ValueError("--block-kib must not exceed --total-mib")
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown or not self.transports:
            raise ValueError(f"transports must be among {', '.join(TRANSPORTS)}")
        if self.receiver is not None:
            host_port(self.receiver, "--receiver")

    @property
    def block_bytes(self) -> int:
        return self.block_kib * 1024

    @property
    def num_blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_mib * 1024 * 1024


def destination_block_ids(num_blocks: int, layout: DestinationLayout) -> list[int]:
    """The receiver's cache block of each block sent, in order: the identity, or for
    "scattered" the even slots then the odd ones (consecutive blocks two slots apart)."""
    if layout == "adjacent":
        return list(range(num_blocks))
    return [*range(0, num_blocks, 2), *range(1, num_blocks, 2)]


def split_blocks(data: torch.Tensor, block_bytes: int) -> list[torch.Tensor]:
    return list(data.view(-1, block_bytes).unbind(0))


def host_port(text: str, flag: str) -> tuple[str, int]:
    """HOST:PORT (an IPv4 address or a name; port 0 only where listening picks one)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} takes HOST:PORT, got {text!r}")
    return host, int(port)
