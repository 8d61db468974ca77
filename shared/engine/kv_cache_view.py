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
        """The KV cache's tensors (the model's, then a draft model's), [layers, 2, blocks, ...]:
        transfers land straight in them. Under tensor parallelism, rank 0's heads only (blocks
        go in through `finish_kv_transfer(blocks=...)`)."""
        return self._runner.kv_tensors

    @property
    def num_draft_tensors(self) -> int:
        """How many of `tensors` (the last ones) are a draft model's; they travel too."""
        return self._runner.num_draft_kv_tensors

    def block_layouts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each KV tensor's dtype and per-block shape with every kv head (a staging receiver's
        layout)."""
        return self._runner.block_layouts()

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """A copy of these blocks with every kv head, one tensor per KV tensor."""
        return self._runner.read_blocks(block_ids)

    def record_block_events(self) -> None:
        self._block_manager.record_events = True

    def drain_block_events(self) -> list[BlockEvent]:
        """The log since the last drain (empty unless `record_block_events` was called)."""
        return self._block_manager.drain_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self._block_manager.cached_block_hashes()

    def check_invariants(self) -> None:
        """Raises AssertionError when the block bookkeeping is inconsistent (tests)."""
        self._block_manager.check_invariants(self._requests_holding_blocks())
