"""One request's life in the engine: its tokens and explicit progress counters.

The engine never keeps a separate "prefill" or "decode" phase. A request has `num_tokens` (prompt
plus everything sampled so far) and `num_computed_tokens` (how many of those have K/V in the
cache); each step the scheduler gives it some of the difference. It samples a new token exactly
when a step brings `num_computed_tokens` up to `num_tokens`. This one rule covers chunked prefill,
decode, recompute after preemption, and a decode worker taking over a request that a prefill worker
computed.
With overlapped steps a sampled token may still be on the device: `num_pending_tokens` counts
those, in `num_tokens` but not yet in `token_ids`; the engine resolves them a step later.
The hand-off types: `add_request`'s `remote_kv`, and what moves between two engines.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nori.sampling.detokenizer import IncrementalDetokenizer
    from nori.sampling.logprobs import TokenLogprobs
    from nori.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Its K/V is computed elsewhere and arrives into blocks reserved for it (added with
    # KVFromRemote); the scheduler skips it until `finish_kv_transfer` says the K/V is in.
    WAITING_FOR_KV = "waiting_for_kv"
    # K/V in place, waiting for a row in the running batch (which is full); blocks kept.
    READY = "ready"
    # Its K/V goes elsewhere (added with KVToRemote): it sampled its first token, and its
    # blocks stay held until `finish_kv_transfer` says they were sent.
    PREFILLED = "prefilled"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # An attribute, not a property: read for every request in every step.
        self.is_finished = value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Monotonic arrival number: FCFS order and preemption victim choice (newest first).
    arrival_index: int = 0
    # vLLM's `priority`: lower values are served first; FIFO among equal values (0: interactive,
    # nori.settings.BATCH_PRIORITY: batch lines). Preemption takes the largest value first.
    priority: int = 0
    # Stop after the first sampled token and keep the blocks for export to a decode engine
    # (the engine's KVToRemote).
    prefill_only: bool = False
    # The most tokens it may generate (max_tokens, capped by the model's length); 0: not known.
    max_new_tokens: int = 0

    token_ids: list[int] = field(init=False)
    # Sampled tokens not in `token_ids` yet (a step still in flight); `num_tokens` counts them.
    num_pending_tokens: int = 0
    # Its row in the sampled tokens of the step in flight, while a token is pending.
    pending_row: int = 0
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was (last) admitted.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained content hashes of this request's full blocks, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of block_ids already offered to the prefix cache (skipped next time).
    num_published_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # time.time() of the first step that computed any of it: when it left the queue.
    first_scheduled_at: float | None = None
    # Speculative decoding: the draft tokens this step verifies after the last token (set once
    # the scheduler granted them, cleared after the step), and the draft model's distribution at
    # each (a [k, vocab] tensor; None for one-hot proposals such as n-gram lookups).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = field(default=None, repr=False)

    # The engine's side (`outputs.py`; the scheduler never reads these): the text so far,
    # what has been reported, why it stopped, and the seeded sampler's torch.Generator.
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    generator: Any = field(default=None, repr=False)
    text: str = ""
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None
    # SamplingParams.prompt_logprobs, on the engine that computes the prompt: entry i for prompt
    # token i (the first is None), filled in chunk by chunk as the prompt is computed. Such a
    # request reads nothing from the prefix cache (`skips_prefix_cache`).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Cached blocks would leave their positions' prompt logprobs uncomputed."""
        return self.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def reached_length_limit(self) -> bool:
        """Its tokens, pending ones included, already make its longest output: nothing more to
        compute (its last token only waits to be resolved)."""
        return 0 < self.max_new_tokens <= self.num_output_tokens

    @property
    def awaits_last_token(self) -> bool:
        """Its last token by length is pending: nothing to schedule, it ends once resolved."""
        return self.num_pending_tokens > 0 and self.reached_length_limit

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError, saying why, for a prompt the engine can never serve."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; this model accepts at most "
            f"{max_model_len - 1} (max_model_len {max_model_len} includes the output)"
        )


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
