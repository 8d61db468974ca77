"""The paged KV cache tensors and how many blocks fit in a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.models.config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
    return per_token * block_size * element


@dataclass(frozen=True)
class KVCache:
    # [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]: one tensor,
    # so a request's blocks for every layer are one index_select away (export, transfer).
    data: torch.Tensor

    @classmethod
    def allocate(
        cls,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (
            model.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            model.num_key_value_heads,
            model.head_dim,
        )
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[3])

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer_index, 0], self.data[layer_index, 1]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks for every layer: [layers, 2, len(block_ids), ...]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(2, index)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        if tuple(blocks.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(blocks.shape)}, expected {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.to(device=self.data.device, dtype=self.data.dtype))
