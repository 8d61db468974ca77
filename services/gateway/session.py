"""One HTTP request's backend streams: the output of each of its prompts so far, and its metrics.

A completions request may carry several prompts (a batch); each is one backend stream, run
concurrently. The endpoints read the session chunk by chunk (streaming) or drain it (not).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from starlette.types import Receive, Scope

from nori.gateway.backend import BackendError, GenerationChunk, GenerationRequest
from nori.gateway.context import ServingContext
from nori.gateway.protocol import PromptTokensDetails, Usage
from nori.gateway.streams import GenerationRun
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams


def client_identity(scope: Scope) -> str:
    """Who sent a request, for fair shares: its API key (a digest: the key itself is never
    kept), else its address. Behind a proxy every keyless client is one address, and clients
    sharing one key are one owner; the request's own share bounds them still."""
    header = dict(scope.get("headers", [])).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip()).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


# A non-streamed request's outputs come from the decode worker at most this often after its
# first token: per-token messages would cost the worker and the gateway for nobody.
COALESCE_MS = 1000


@dataclass
class Choice:
    """What one prompt has produced so far."""

    num_prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    # Characters of token strings already reported (the next completions text_offset).
    text_offset: int = 0
    # The prompt's own logprobs (an echo with logprobs), from the first chunk; the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text.append(chunk.new_text)
        self.num_tokens += len(chunk.new_token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason


class Session:
    """The backend streams of one HTTP request, their accumulated output, and its metrics."""

    def __init__(
        self,
        ctx: ServingContext,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        samples_per_prompt: int = 1,
        span: trace.Span = trace.INVALID_SPAN,
        client: str = "",
        priority: int = 0,
        streamed: bool = True,
    ) -> None:
        """`prompts[i]` is choice i's prompt; with n > 1 each prompt stands n times in a row
        (`samples_per_prompt`), and its tokens count once in the usage. `client`: who sent it
        (`client_identity`), the owner its share of the decode pool counts against.
        `priority`: the body's (vLLM's; lower first), every choice's. Not `streamed`: the answer
        is one body at the end, so the workers send their outputs merged (`COALESCE_MS`)."""
        self.ctx = ctx
        # The request's server span: the usage and finish reasons go on it at the end.
        self._span = span
        self._samples_per_prompt = samples_per_prompt
        self.started = time.monotonic()
        self.choices = [Choice(len(p)) for p in prompts]
        self._request_ids = list(request_ids)
        self._seen = [False] * len(prompts)
        self._first_token_seen = False
        group = self._request_ids[0] if len(prompts) > 1 else None
        requests = [
            GenerationRequest(
                request_id,
                prompt,
                p,
                admission_group=group,
                client=client,
                group_size=len(prompts),
                num_choices=samples_per_prompt,
                priority=priority,
                coalesce_ms=0 if streamed else COALESCE_MS,
                stream_interval=ctx.stream_interval if streamed else 1,
            )
            for request_id, prompt, p in zip(request_ids, prompts, params, strict=True)
        ]
        self.run = GenerationRun(ctx.backend, requests, ctx.tasks)

    async def next(self) -> tuple[int, GenerationChunk] | None:
        item = await self.run.next()
        metrics = self.ctx.metrics
        if item is None:
            metrics.e2e_latency.observe(time.monotonic() - self.started)
            self._describe_response()
            return None
        index, chunk = item
        if not self._seen[index]:
            # Counted once the backend has taken the prompt, so refused requests do not count.
            self._seen[index] = True
            if index % self._samples_per_prompt == 0:
                metrics.prompt_tokens.inc(self.choices[index].num_prompt_tokens)
        if chunk.new_token_ids:
            metrics.generation_tokens.inc(len(chunk.new_token_ids))
            if not self._first_token_seen:
                self._first_token_seen = True
                metrics.time_to_first_token.observe(time.monotonic() - self.started)
        if chunk.finished and chunk.finish_reason == "abort":
            raise BackendError(f"request {self._request_ids[index]} was aborted before it finished")
        self.choices[index].add(chunk)
        return item

    async def first(self, receive: Receive) -> tuple[int, GenerationChunk] | None:
        """The first chunk, or ClientDisconnected if the client leaves before it arrives."""
        self.run.watch_disconnect(receive)
        try:
            return await self.next()
        finally:
            self.run.stop_watching()

    async def drain(self, receive: Receive) -> None:
        self.run.watch_disconnect(receive)
        try:
            while await self.next() is not None:
                pass
        finally:
            self.run.stop_watching()

    def cancel(self) -> None:
        self.run.cancel()

    def _describe_response(self) -> None:
        if self._span.is_recording():
            usage = self.usage()
            self._span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                    "gen_ai.response.finish_reasons": [
                        choice.finish_reason or "" for choice in self.choices
                    ],
                }
            )

    def usage(self) -> Usage:
        firsts = self.choices[:: self._samples_per_prompt]  # one choice per distinct prompt
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in firsts)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
