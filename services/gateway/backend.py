"""What the HTTP layer needs from whatever runs the model: one streaming call per request.

The OpenAI side (`endpoints.py`) knows nothing about gRPC, Redis or routing; it hands a
tokenised `GenerationRequest` to a `Backend` and turns the chunks that come back into OpenAI JSON
or SSE. The cluster backend (`cluster.py`) routes to prefill and decode workers; tests of pure
protocol logic may use a fake. What a backend raises when it cannot serve a request is an
`errors.BackendError`.
"""

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
    # The prompts (and choices) of one HTTP request share it: admission takes them as one, so a
    # batch larger than the queue bound is served whole rather than refused forever.
    admission_group: str | None = None
    # Who sent it (a digest of its API key, else its address): the owner whose share of the
    # pools it counts against (nori.gateway.ledger).
    client: str = ""
    # The HTTP request's members (prompts x n) and its n: what the gateway's caps check.
    group_size: int = 1
    num_choices: int = 1
    # vLLM's `priority`: lower values are served first (0 = interactive); batch lines carry
    # BATCH_PRIORITY. Admission, the workers' queues and preemption all order by it.
    priority: int = 0
    # Outputs the caller only needs at the end (not streamed to anyone): the decode worker sends
    # them merged, one message per this many milliseconds after the first token; 0: as they come.
    coalesce_ms: int = 0
    # A streamed request's outputs after the first: one message per this many new tokens (and
    # the last at the end); 1: every step's as they come (--stream-interval).
    stream_interval: int = 1


@dataclass(frozen=True)
class GenerationChunk:
    """What one request gained since the previous chunk (a delta), as the engine reports it."""

    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    # "stop", "length" or "abort" once finished.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if one did.
    stop_reason: str | int | None = None
    # One entry per new token when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # Prompt tokens served from a prefix cache (for usage.prompt_tokens_details).
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs, on the request's first chunk: one entry per prompt token,
    # the first None (it has no context to be scored in).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def followed_by(self, later: GenerationChunk) -> GenerationChunk:
        """One chunk for two consecutive ones of the same request (deltas joined, the end
        state of the later one): chunks that are ready together go out as one SSE event."""
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
    # Per role, how many workers are live: {"prefill": 1, "decode": 2}.
    workers: dict[str, int] = field(default_factory=dict)
    detail: str = ""


class Backend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks; the last one has finished=True.

        Closing the iterator early (client disconnect) must cancel the request everywhere and free
        its KV blocks. Raises an `errors.BackendError` for requests it cannot serve.
        """
        ...

    async def health(self) -> BackendHealth: ...

    async def close(self) -> None: ...
