"""What the services see of an engine's KV cache (`LLMEngine.kv_cache`): its tensors and block
layouts for transfers, block reads, the prefix cache's events, and the bookkeeping check."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from nori.engine.block_manager import BlockEvent, BlockManager
from nori.engine.model_runner import ModelRunner
from nori.engine.request import Request


class KVCacheView:
    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        requests_holding_blocks: Callable[[], Iterable[Request]],
    ) -> None:
        self._runner = runner
        self._block_manager = block_manager
        self._requests_holding_blocks = requests_holding_blocks

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The paged KV cache's tensors (the model's KVCache.tensors, then a draft model's),
        each [layers, 2, blocks, ...]: a
        decode worker receives transferred blocks straight into them. Under tensor parallelism
        these are rank 0's heads only: blocks go in through `finish_kv_transfer(blocks=...)`
        instead (see `block_layouts`)."""
        return self._runner.kv_tensors

    @property
    def num_draft_tensors(self) -> int:
        """How many of `tensors` (the last ones) hold a draft model's K/V (speculative
        decoding): they travel with the model's in every hand-off."""
        return self._runner.num_draft_kv_tensors

    def block_layouts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each KV tensor's dtype and per-block shape [layers, 2, block_size, heads, ...] with
        every kv head: what a transfer carries (a staging receiver allocates these)."""
        return self._runner.block_layouts()

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """A copy of these blocks with every kv head (gathered from the ranks under tensor
        parallelism), one tensor per KV tensor."""
        return self._runner.read_blocks(block_ids)

    def record_block_events(self) -> None:
        """From now on, keep a log of blocks entering and leaving the prefix cache."""
        self._block_manager.record_events = True

    def drain_block_events(self) -> list[BlockEvent]:
        """The log since the last drain (empty unless `record_block_events` was called)."""
        return self._block_manager.drain_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Hashes of every block the prefix cache can serve now."""
        return self._block_manager.cached_block_hashes()

    def check_invariants(self) -> None:
        """Raises AssertionError when the block bookkeeping is inconsistent (tests)."""
        self._block_manager.check_invariants(self._requests_holding_blocks())
