"""The prefix-block directory: for each cached KV block (by content hash), which workers hold it.

Workers publish their BlockManager's STORED/REMOVED events. Entries are hints: a dead worker's
expire (callers pass the live workers), and a lapsed entry only costs a missed cache hit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nori.prefix_cache import BlockEvent, BlockEventKind, extend_block_hashes
from nori.state.codec import as_str
from nori.state.store import RedisStore


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, exactly as a worker's BlockManager makes them
    (a worker never reuses the block holding the prompt's last token)."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    return extend_block_hashes([], token_ids, block_size)


class BlockDirectory(RedisStore):
    default_ttl_s = 600.0

    async def publish(self, worker_id: str, events: Iterable[BlockEvent]) -> int:
        """Mirrors a worker's block events in order; returns how many were sent. A STORED
        refreshes the block's TTL; a REMOVED emptying the set deletes the key."""
        batch = list(events)
        if not batch:
            return 0
        # MULTI/EXEC so that a set never exists without its TTL, even if the connection drops.
        async with self._redis.pipeline(transaction=True) as pipe:
            for event in batch:
                key = self._keys.block(event.block_hash)
                if event.kind is BlockEventKind.STORED:
                    pipe.sadd(key, worker_id)
                    pipe.pexpire(key, self._ttl_ms)
                else:
                    pipe.srem(key, worker_id)
            await pipe.execute()
        return len(batch)

    async def touch(self, worker_id: str, block_hashes: Iterable[bytes]) -> int:
        """Re-announces blocks a worker still holds so that their entries do not expire (a
        block is reported once, when stored)."""
        return await self.publish(
            worker_id, (BlockEvent(BlockEventKind.STORED, h) for h in block_hashes)
        )

    async def longest_prefixes(
        self, block_hashes: Sequence[bytes], worker_ids: Iterable[str] | None = None
    ) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it holds (it stops counting at
        its first gap), in one round trip. With `worker_ids` only those count, each present (0
        when it holds nothing); without, every worker holding the first block appears."""
        counts: dict[str, int] = {w: 0 for w in worker_ids} if worker_ids is not None else {}
        if not block_hashes or (worker_ids is not None and not counts):
            return counts
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in block_hashes:
                pipe.smembers(self._keys.block(block_hash))
            replies = await pipe.execute()
        first = {as_str(member) for member in replies[0]}
        candidates = first & counts.keys() if worker_ids is not None else first
        for members in replies:
            holders = {as_str(member) for member in members}
            candidates &= holders
            if not candidates:
                break
            for worker in candidates:
                counts[worker] = counts.get(worker, 0) + 1
        return counts
