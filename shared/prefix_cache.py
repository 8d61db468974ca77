"""What identifies a cached prefix block across processes: its chained content hash (blake2b,
the same in every process), and the events that say a worker's cache gained or lost one.

The engine's BlockManager makes both; the block directory in Redis (nori.state.block_directory)
mirrors the events, and the gateway hashes prompts the same way to find the worker holding the
longest prefix. Pure Python (no torch, no Redis), so every role can import it."""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = b"nori-prefix-root"


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's hash: its tokens chained onto its parent's hash, naming the whole prefix."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], block_size: int
) -> list[bytes]:
    """Appends, in place, the hashes of full blocks of `token_ids` not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
    return block_hashes


class BlockEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class BlockEvent:
    """A change to the set of cached prefix blocks (what a block directory needs to mirror)."""

    kind: BlockEventKind
    block_hash: bytes
