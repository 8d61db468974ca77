"""What the HTTP layer needs from whatever runs the model: one streaming call per request.

`endpoints.py` hands a tokenised `GenerationRequest` to a `Backend` (the cluster's is
`cluster.py`). A backend that cannot serve raises `BackendError`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Shared by one HTTP request's prompts and choices: admission takes them as one.
    admission_group: str | None = None
    # A digest of its API key, else its address: the fair-share owner (nori.gateway.ledger).
    client: str = ""
    # The HTTP request's members (prompts x n) and its n.
    group_size: int = 1
    num_choices: int = 1
    # vLLM's `priority`: lower is served first (0 = interactive; batch lines BATCH_PRIORITY).
    priority: int = 0
    # For outputs needed only at the end: one merged message per this many ms (0: as they come).
    coalesce_ms: int = 0
    # A streamed request's outputs after the first: one message per this many new tokens.
    stream_interval: int = 1


@dataclass(frozen=True)
class GenerationChunk:
    """What one request gained since the previous chunk (a delta), as the engine reports it."""

    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    # On the request's first chunk: one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def followed_by(self, later: GenerationChunk) -> GenerationChunk:
        """One chunk for two consecutive ones (deltas joined, the later one's end state)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return GenerationChunk(
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass(frozen=True)
class BackendHealth:
    healthy: bool
    # Live workers per role: {"prefill": 1, "decode": 2}.
    workers: dict[str, int] = field(default_factory=dict)
    detail: str = ""


class Backend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks, the last with finished=True; raises `BackendError`.
        Closing the iterator early must cancel the request everywhere and free its KV blocks."""
        ...

    async def health(self) -> BackendHealth: ...

    async def close(self) -> None: ...
