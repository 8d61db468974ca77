"""Bookkeeping for the paged KV cache: which block holds what, and who uses it (pure Python).

Every block is in use (ref_count > 0, maybe shared by requests with a common prefix), cached
(ref_count 0, full, with a content hash, reusable until evicted) or free (ref_count 0, no hash).
Free and cached blocks wait in one LRU queue; allocation takes from its front, evicting the hash
of a cached block it takes. Hashes and directory events are nori.prefix_cache's."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from nori.engine.request import Request
from nori.prefix_cache import BlockEvent, BlockEventKind, extend_block_hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # Compared on every cache hit, so that a hash collision is never a hit.
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BlockUsage:
    free: int
    cached: int
    in_use: int

    @property
    def total(self) -> int:
        return self.free + self.cached + self.in_use


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    # Keep BlockEvents for a directory to drain; off by default so nothing grows unread.
    record_events: bool = False

    blocks: list[Block] = field(init=False)
    _free_queue: OrderedDict[int, None] = field(init=False)
    _cached: dict[bytes, int] = field(init=False)
    _events: list[BlockEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        self._cached = {}
        self._events = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache: in use or evictable."""
        return len(self._cached)

    def usage(self) -> BlockUsage:
        cached = sum(1 for b in self._free_queue if self.blocks[b].block_hash is not None)
        free = len(self._free_queue) - cached
        return BlockUsage(free=free, cached=cached, in_use=self.num_blocks - len(self._free_queue))

    def cached_block_hashes(self) -> list[bytes]:
        return list(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request, in order, stopping one token
        short of its end (its logits give the next token); none if it wants prompt logprobs."""
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return []
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index in range(min(max_blocks, len(hashes))):
            block_id = self._cached.get(hashes[index])
            if block_id is None:
                break
            start = index * self.block_size
            expected = tuple(request.token_ids[start : start + self.block_size])
            if self.blocks[block_id].token_ids != expected:
                break
            hits.append(block_id)
        return hits

    def num_missing_blocks(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[int] = ()
    ) -> int:
        """How many more blocks the pool must free for `allocate` with these arguments to succeed."""
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = needed - len(request.block_ids) - len(cached_prefix)
        # Hits that sit in the free queue stop being available once we take them.
        prefix_from_queue = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return max(num_new_blocks - (len(self._free_queue) - prefix_from_queue), 0)

    def blocks_freed_by(
        self, requests: Iterable[Request], keep: Collection[int] = ()
    ) -> Iterator[int]:
        """After each of `requests` in turn: blocks outside `keep` that would be freed if it and
        those before it gave theirs back (a shared block once all its holders are among them)."""
        holders: Counter[int] = Counter()
        freed = 0
        for request in requests:
            for block_id in request.block_ids:
                holders[block_id] += 1
                if holders[block_id] == self.blocks[block_id].ref_count and block_id not in keep:
                    freed += 1
            yield freed

    def allocate(
        self, request: Request, num_new_tokens: int, cached_prefix: Iterable[int] = ()
    ) -> bool:
        """Makes the request's block table cover `num_new_tokens` more tokens; False, changing
        nothing, when the pool cannot. `cached_prefix` (only for a request holding no blocks)
        starts its table, advancing num_computed_tokens."""
        if (
            not cached_prefix
            and request.num_computed_tokens + num_new_tokens
            <= len(request.block_ids) * self.block_size
        ):
            return True  # its table covers them already (a decode inside its last block)
        prefix = list(cached_prefix)
        if prefix and request.block_ids:
            raise ValueError("a cached prefix can only start an empty block table")
        if self.num_missing_blocks(request, num_new_tokens, prefix):
            return False
        num_computed = request.num_computed_tokens + len(prefix) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = needed - len(request.block_ids) - len(prefix)
        for block_id in prefix:
            self._touch(block_id)
        request.block_ids.extend(prefix)
        if prefix:
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._take_free_block())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publishes the request's computed full blocks in the prefix cache."""
        # Pending tokens (a step in flight) may be computed before they are known.
        num_known = min(request.num_computed_tokens, len(request.token_ids))
        num_full = num_known // self.block_size
        if not self.enable_prefix_caching or num_full <= request.num_published_blocks:
            return
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size)
        for index in range(request.num_published_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is not None:
                continue
            block_hash = hashes[index]
            if block_hash in self._cached:
                continue
            start = index * self.block_size
            block.block_hash = block_hash
            block.token_ids = tuple(request.token_ids[start : start + self.block_size])
            self._cached[block_hash] = block.block_id
            self._record(BlockEventKind.STORED, block_hash)
        request.num_published_blocks = max(request.num_published_blocks, num_full)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Gives back the tail blocks past the first `num_tokens` tokens' (rejected drafts); never
        a published block."""
        keep = self.blocks_needed(num_tokens)
        assert keep >= request.num_published_blocks, "trimming a block in the prefix cache"
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None
        request.block_ids = request.block_ids[:keep]  # a new list: tables only grow in place

    def free(self, request: Request) -> None:
        """Releases the request's blocks; ones reaching ref_count 0 join the queue's back, tail
        first, so shared prefix blocks are evicted last."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None
        request.block_ids = []
        request.num_published_blocks = 0

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent; `requests` must be every
        request that holds blocks."""
        expected_refs = [0] * self.num_blocks
        for request in requests:
            assert len(set(request.block_ids)) == len(request.block_ids), (
                f"request {request.request_id} holds a block twice: {request.block_ids}"
            )
            for block_id in request.block_ids:
                expected_refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == expected_refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {expected_refs[block.block_id]} requests"
            )
            in_queue = block.block_id in self._free_queue
            assert in_queue == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in free queue={in_queue}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has a hash the cache does not map to it"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"cache entry points at block {block_id} with another hash"
            )
        usage = self.usage()
        assert usage.total == self.num_blocks, f"{usage} does not add up to {self.num_blocks}"

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_queue[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._uncache(block)
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        self._record(BlockEventKind.REMOVED, block.block_hash)
        block.block_hash = None
        block.token_ids = None

    def _record(self, kind: BlockEventKind, block_hash: bytes) -> None:
        if self.record_events:
            self._events.append(BlockEvent(kind, block_hash))
