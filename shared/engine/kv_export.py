"""What moves from a prefill engine to a decode engine: a request's state and its KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.sampling.params import SamplingParams


@dataclass(frozen=True)
class TransferState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens whose K/V the blocks hold (the prompt); the last output token is not computed yet.
    num_computed_tokens: int
    block_size: int
    # The seeded sampler's RNG state, so a seeded request samples the same tokens after moving.
    generator_state: bytes | None = None
    # Request.priority: the receiving engine serves and preempts by it as the sender did.
    priority: int = 0

    @property
    def num_blocks(self) -> int:
        return -(-self.num_computed_tokens // self.block_size)


@dataclass(frozen=True)
class KVExport:
    state: TransferState
    # One copy per KVCache.tensors, in the request's block order: the codes or values
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], then an 8-bit cache's
    # scales [num_layers, 2, num_blocks, block_size, num_kv_heads].
    blocks: tuple[torch.Tensor, ...]


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A seeded request's RNG state as bytes, for the hand-off (None for an unseeded one)."""
    return None if generator is None else bytes(generator.get_state().tolist())
