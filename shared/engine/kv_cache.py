"""The paged KV cache tensors and how many blocks fit in a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.kernels.kv_quant import KV_CACHE_DTYPES, KV_SCALE_DTYPE
from nori.models.config import ModelConfig


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


@dataclass(frozen=True)
class KVCache:
    # [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]: one tensor.
    data: torch.Tensor
    # An 8-bit cache's float16 scales [num_layers, 2, num_blocks, block_size, num_kv_heads].
    scales: torch.Tensor | None = None

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
        return self.data[layer_index, 0], self.data[layer_index, 1]

    def layer_scales(self, layer_index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scales is None:
            return None, None
        return self.scales[layer_index, 0], self.scales[layer_index, 1]

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
