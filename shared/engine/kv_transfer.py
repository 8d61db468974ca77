"""What moves between a prefill engine and a decode engine, and how `add_request` is told that a
request's K/V is computed elsewhere (`remote_kv`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.sampling.params import SamplingParams


@dataclass(frozen=True)
class KVFromRemote:
    """Decode side: the prompt's K/V lands in blocks `add_request` reserves (and returns) now;
    the request waits (WAITING_FOR_KV) until `finish_kv_transfer` starts it decoding."""


@dataclass(frozen=True)
class KVToRemote:
    """Prefill side: compute the prompt, sample the first token, then hold the blocks (PREFILLED)
    until `finish_kv_transfer` frees them."""


RemoteKV = KVFromRemote | KVToRemote


class NoFreeBlocks(RuntimeError):
    """A KVFromRemote request found no room, even after preempting less important requests."""


@dataclass(frozen=True)
class TransferState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens whose K/V the blocks hold (the prompt); the last output token is not computed yet.
    num_computed_tokens: int
    block_size: int
    # A seeded sampler's RNG state: it samples the same tokens after moving.
    generator_state: bytes | None = None
    priority: int = 0

    @property
    def num_blocks(self) -> int:
        return -(-self.num_computed_tokens // self.block_size)


@dataclass(frozen=True)
class KVExport:
    state: TransferState
    # One copy per KVCache.tensors, in the request's block order ([layers, 2, n, ...]).
    blocks: tuple[torch.Tensor, ...]


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A seeded request's RNG state as bytes, for the hand-off (None for an unseeded one)."""
    return None if generator is None else bytes(generator.get_state().tolist())


def set_generator_state(generator: torch.Generator | None, state: bytes | None) -> None:
    """Restores what `generator_state` took (nothing when either is None)."""
    if generator is not None and state is not None:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
