"""Content hashes of full KV blocks, chained so a hash names the whole prefix up to its block.

blake2b rather than Python's hash(): the value must be the same in every process, because the
block directory in Redis maps these hashes to the workers that hold them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"nori-prefix-root"


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
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
