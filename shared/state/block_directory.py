"""The prefix-block directory: for each cached KV block (by content hash), which workers hold it.

Workers publish the STORED/REMOVED events their BlockManager records; the gateway hashes a
prompt the same way and asks which worker already holds the longest prefix of it. Entries are
hints, not truth: a worker that dies leaves its entries until they expire (callers pass the live
workers to ignore them), and an entry whose TTL lapsed only costs a missed cache hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nori.prefix_cache import BlockEvent, BlockEventKind, extend_block_hashes
from nori.state.codec import as_str
from nori.state.store import RedisStore


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, exactly as a worker's BlockManager makes them.

    Note that a worker never reuses the block holding the prompt's last token (it must compute
    that token's logits), so when len(token_ids) is a multiple of block_size the last hash here
    can be held by a worker and still not save any work.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    return extend_block_hashes([], token_ids, block_size)


class BlockDirectory(RedisStore):
    default_ttl_s = 600.0

    async def publish(self, worker_id: str, events: Iterable[BlockEvent]) -> int:
        """Mirrors a worker's block events; returns how many were sent.

        Events are applied in order (a block can be stored, evicted and stored again within one
        batch). A STORED refreshes the block's TTL for every holder; a REMOVED that empties the
        set deletes the key (Redis drops empty sets), so nothing outlives its last holder.
        """
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
        """Re-announces blocks a worker still holds so that their entries do not expire.

        A BlockManager reports a block once, when it is stored; a block that stays cached (and
        keeps getting hits) for longer than the TTL needs this to stay visible.
        """
        return await self.publish(
            worker_id, (BlockEvent(BlockEventKind.STORED, h) for h in block_hashes)
        )

    async def forget_worker(self, worker_id: str, block_hashes: Iterable[bytes]) -> int:
        """Removes a worker from the given blocks (e.g. all it held, when it leaves cleanly)."""
        return await self.publish(
            worker_id, (BlockEvent(BlockEventKind.REMOVED, h) for h in block_hashes)
        )

    async def longest_prefixes(
        self, block_hashes: Sequence[bytes], worker_ids: Iterable[str] | None = None
    ) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it holds.

        A worker stops counting at its first missing block: blocks after a gap are useless to it,
        because a cached block is only valid behind its whole prefix. With `worker_ids` (the live
        workers) only those are counted and every one of them appears in the result, 0 when it
        holds nothing; without, every worker holding at least the first block appears.
        One round trip whatever the prompt length.
        """
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
