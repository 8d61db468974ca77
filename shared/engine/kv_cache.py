"""The paged KV cache tensors, how many blocks fit in a memory budget, and what the services see
of an engine's cache (`KVCacheView`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nori.engine.config import EngineConfig
from nori.engine.memory_profile import MemoryProfile, kv_pool_bytes
from nori.kernels.kv_quant import KV_CACHE_DTYPES, KV_SCALE_DTYPE
from nori.models.config import ModelConfig

if TYPE_CHECKING:
    from nori.engine.block_manager import BlockEvent, BlockManager
    from nori.engine.model_runner import ModelRunner
    from nori.engine.request import Request


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: "auto" keeps the model's dtype; "int8"/"fp8" store 8-bit codes."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, int8 or fp8, got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in KV_CACHE_DTYPES.values()


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block for every layer, K and V; an 8-bit cache adds its scales."""
    element = torch.empty((), dtype=dtype).element_size()
    per_head = model.head_dim * element
    if is_quantized(dtype):
        per_head += torch.empty((), dtype=KV_SCALE_DTYPE).element_size()
    return 2 * model.num_hidden_layers * model.num_key_value_heads * per_head * block_size


def num_blocks_in_budget(
    config: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    draft_bytes_per_block: int = 0,
    profile: MemoryProfile | None = None,
) -> int:
    """Blocks that fit (a draft model's share included): `num_kv_blocks` when set, else on CUDA the
    profiled pool at `gpu_memory_utilization` (`kv_pool_bytes`, required), or `cpu_kv_cache_gib`."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model, config.block_size, dtype) + draft_bytes_per_block
    if device.type == "cuda":
        if profile is None:
            raise ValueError("a KV pool on CUDA is sized from a memory profile")
        budget = float(kv_pool_bytes(profile, config.gpu_memory_utilization))
    else:
        budget = config.cpu_kv_cache_gib * 2**30
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(
            "no memory left for the KV cache; lower the model size or raise "
            "gpu_memory_utilization / cpu_kv_cache_gib"
        )
    if device.type != "cuda":
        # Host memory is every process's: a small model takes no more than max_num_seqs
        # full-length sequences can fill, rather than the whole --cpu-kv-cache-gib.
        context = config.max_model_len or model.max_position_embeddings
        blocks_per_seq = -(-context // config.block_size)
        num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq + 1)
    return num_blocks


@dataclass(frozen=True)
class KVCache:
    """The paged cache; every layer's K/V views are made once, here, so a step takes them
    without an aten call."""

    # [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]: one tensor.
    data: torch.Tensor
    # An 8-bit cache's float16 scales [num_layers, 2, num_blocks, block_size, num_kv_heads].
    scales: torch.Tensor | None = None
    _layers: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(init=False, repr=False)
    _layer_scales: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...] = field(
        init=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_layers", tuple((k, v) for k, v in self.data.unbind(0)))
        scales = (
            [(None, None)] * self.data.shape[0]
            if self.scales is None
            else [(k, v) for k, v in self.scales.unbind(0)]
        )
        object.__setattr__(self, "_layer_scales", tuple(scales))

    @classmethod
    def allocate(
        cls,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """dtype: the model's float dtype, or int8 / float8_e4m3fn for an 8-bit cache."""
        shape = (
            model.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            model.num_key_value_heads,
            model.head_dim,
        )
        if not is_quantized(dtype):
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        # Zero bytes are 0 in both 8-bit formats; unit scales keep unwritten slots finite.
        codes = torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
        scales = torch.ones(shape[:-1], dtype=KV_SCALE_DTYPE, device=device)
        return cls(codes, scales)

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[3])

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a request's blocks live in, [layers, 2, num_blocks, ...], in the order
        transfers move them."""
        return (self.data,) if self.scales is None else (self.data, self.scales)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[layer_index]

    def layer_scales(self, layer_index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._layer_scales[layer_index]

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """A copy of the given blocks for every layer, one per `tensors`: [layers, 2, n, ...]."""
        return read_blocks(self.tensors, block_ids)

    def write_blocks(self, block_ids: list[int], blocks: tuple[torch.Tensor, ...]) -> None:
        """Writes `read_blocks`' result (of another cache of the same layout) into block_ids."""
        if len(blocks) != len(self.tensors):
            raise ValueError(
                f"{len(blocks)} KV tensors for a cache of {len(self.tensors)} "
                "(float and 8-bit caches do not mix)"
            )
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        for tensor, part in zip(self.tensors, blocks, strict=True):
            expected = (*tensor.shape[:2], len(block_ids), *tensor.shape[3:])
            if tuple(part.shape) != expected:
                raise ValueError(f"KV blocks of shape {tuple(part.shape)}, expected {expected}")
            if is_quantized(tensor.dtype) and part.dtype != tensor.dtype:
                raise ValueError(f"KV blocks in {part.dtype}, the cache holds {tensor.dtype}")
            part = part.to(device=tensor.device, dtype=tensor.dtype)
            _bytes(tensor).index_copy_(2, index, _bytes(part))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if is_quantized(tensor.dtype) else tensor


def read_blocks(
    tensors: tuple[torch.Tensor, ...], block_ids: list[int]
) -> tuple[torch.Tensor, ...]:
    """A copy of the given blocks of a cache's `tensors`, each [layers, 2, n, ...]."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    # Through bytes: index_select has no float8 implementation on CPU.
    return tuple(_bytes(tensor).index_select(2, index).view(tensor.dtype) for tensor in tensors)


class KVCacheView:
    """An engine's cache as the services see it (`LLMEngine.kv_cache`): its tensors and block
    layouts for transfers, block reads, the prefix cache's events, and the bookkeeping check."""

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
        return len(self.tensors) - len(self._runner.kv_cache.tensors)

    def block_layouts(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each KV tensor's dtype and per-block shape with every kv head (a staging receiver's
        layout)."""
        world_size = 1 if self._runner.parallel is None else self._runner.parallel.world_size
        layouts = []
        for tensor in self.tensors:
            shape = [*tensor.shape[:2], *tensor.shape[3:]]
            shape[3] *= world_size
            layouts.append((tensor.dtype, tuple(shape)))
        return layouts

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
