"""`/v1/completions` and `/v1/chat/completions`, from the parsed body to the answer.

An endpoint makes prompts and sampling parameters (`prompts.py`), one backend request per choice
and a format (`formats.py`); `respond`, one responder for both APIs, streaming or not, starts the
backend streams and collects them in a `Session`. A stream waits for its first chunk before the
200, so a backend refusal is still an HTTP 429/503, not an error inside the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import BaseModel
from starlette.types import Receive, Scope

from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, as_api_error
from nori.gateway.formats import (
    SSE_DONE,
    ChatFormat,
    Choice,
    CompletionFormat,
    EchoedPrompt,
    sse_event,
    usage,
)
from nori.gateway.middleware import client_request_id, response_id, worker_request_id_base
from nori.gateway.prompts import (
    ServingContext,
    chat_max_tokens_field,
    chat_prompt,
    chat_sampling_params,
    check_chat,
    check_completion,
    check_model,
    check_stop_token_ids,
    completion_max_tokens,
    completion_prompts,
    completion_sampling_params,
    echoed_prompts,
    resolve_max_tokens,
    sample_params,
)
from nori.gateway.protocol import ChatCompletionRequest, CompletionRequest, Usage
from nori.gateway.streams import ClientDisconnected, EventStreamResponse, GenerationRun
from nori.sampling.params import SamplingParams

# Larger bodies are tokenized on a thread, off the event loop that serves every stream.
LARGE_BODY_BYTES = 64 * 1024
# A non-streamed request's outputs come from the decode worker at most this often.
COALESCE_MS = 1000
# gen_ai.provider.name: this server (the conventions' list names the hosted APIs).
PROVIDER_NAME = "nori"
_Result = TypeVar("_Result")


async def off_loop_if_large(request: Request, work: Callable[..., _Result], *args: Any) -> _Result:
    """`work(*args)`, on a thread when the request body is large or of unstated size."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= LARGE_BODY_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_completion(body)
    check_stop_token_ids(body, ctx.vocab_size)
    distinct = await off_loop_if_large(request, completion_prompts, ctx, body.prompt)
    n = body.n
    # Choice k is sample k % n of prompt k // n: OpenAI's order of a batch's choices.
    prompts = [prompt for prompt in distinct for _ in range(n)]
    params = [
        sample
        for p in distinct
        for sample in sample_params(
            completion_sampling_params(
                body, completion_max_tokens(body, len(p), ctx.max_model_len)
            ),
            n,
        )
    ]
    echo = []
    if body.echo:
        texts = echoed_prompts(ctx, body.prompt)
        echo = [EchoedPrompt(t, p) for t, p in zip(texts, distinct, strict=True) for _ in range(n)]
    client_id = client_request_id(request.scope)
    completion_id = response_id("cmpl", client_id)
    base = worker_request_id_base(completion_id, client_id)
    request_ids = [f"{base}-{index}" for index in range(len(prompts))]
    span = describe_request("text_completion", ctx.model_name, params[0], completion_id)
    requests = generation_requests(
        ctx, request, request_ids, prompts, params, n, body.priority, bool(body.stream)
    )
    form = CompletionFormat(ctx.model_name, ctx.token_text, body, completion_id, echo)
    return await respond(ctx, requests, form, request, bool(body.stream), n, span)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_chat(body)
    check_stop_token_ids(body, ctx.vocab_size)
    # Always on a thread: a template (perhaps the request's own) runs up to its time limit.
    prompt = await asyncio.to_thread(chat_prompt, ctx, body)
    requested, param = chat_max_tokens_field(body)
    max_tokens = resolve_max_tokens(requested, param, len(prompt), ctx.max_model_len)
    client_id = client_request_id(request.scope)
    completion_id = response_id("chatcmpl", client_id)
    base = worker_request_id_base(completion_id, client_id)
    request_ids = [base] if body.n == 1 else [f"{base}-{index}" for index in range(body.n)]
    params = sample_params(chat_sampling_params(body, max_tokens), body.n)
    span = describe_request("chat", ctx.model_name, params[0], completion_id)
    requests = generation_requests(
        ctx,
        request,
        request_ids,
        [prompt] * body.n,
        params,
        body.n,
        body.priority,
        bool(body.stream),
    )
    form = ChatFormat(ctx.model_name, ctx.token_text, body, completion_id)
    return await respond(ctx, requests, form, request, bool(body.stream), body.n, span)


def generation_requests(
    ctx: ServingContext,
    http_request: Request,
    request_ids: Sequence[str],
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    samples_per_prompt: int,
    priority: int,
    streamed: bool,
) -> list[GenerationRequest]:
    """One backend request per choice (`prompts[i]`: choice i's; each prompt stands n times in a
    row), one admission group per HTTP request; not `streamed`, outputs come merged."""
    group = request_ids[0] if len(prompts) > 1 else None
    client = client_identity(http_request.scope)
    return [
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


def client_identity(scope: Scope) -> str:
    """Who sent a request, for fair shares: a digest of its API key (never the key), else its
    address (behind a proxy, one owner for every keyless client)."""
    header = dict(scope.get("headers", [])).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip()).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


def describe_request(
    operation: str, model: str, params: SamplingParams, response_id: str
) -> trace.Span:
    """Sets the GenAI request attributes on the current (server) span and returns it."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.response.id": response_id,
            }
        )
    return span


# ---------------------------------------------------------------------- the responder

# nginx's "client closed request": no client sees it, but the metrics tell it from errors.
CLIENT_CLOSED_REQUEST = 499


class ResponseFormat(Protocol):
    """What `formats.CompletionFormat` and `formats.ChatFormat` do for the responder."""

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        """The whole response, once every choice has finished."""
        ...

    def opening(self) -> list[str]:
        """SSE events before the first chunk's."""
        ...

    def render(self, index: int, chunk: GenerationChunk) -> list[str]:
        """SSE events for one chunk of choice `index` (none while text is held back)."""
        ...

    def closing(self, usage: Usage) -> list[str]:
        """SSE events after the last chunk (before [DONE])."""
        ...


async def respond(
    ctx: ServingContext,
    requests: Sequence[GenerationRequest],
    form: ResponseFormat,
    http_request: Request,
    stream: bool,
    samples_per_prompt: int = 1,
    span: trace.Span = trace.INVALID_SPAN,
) -> Response:
    """Serves `requests` (choice i is `requests[i]`) and answers in `form`; `span` gets the
    usage and finish reasons at the end."""
    session = Session(ctx, requests, samples_per_prompt, span)
    session.start()
    if not stream:
        try:
            await session.drain(http_request.receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            session.cancel()
        return JSONResponse(form.response(session.choices, session.usage()).model_dump())
    try:
        first = await session.first(http_request.receive)
    except ClientDisconnected:
        session.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException:
        session.cancel()
        raise
    return EventStreamResponse(_events(session, first, form), on_close=session.cancel)


async def _events(
    session: Session, first: tuple[int, GenerationChunk] | None, form: ResponseFormat
) -> AsyncIterator[str]:
    """The SSE body: opening events, events per chunk, closing events, then [DONE]. An error
    after the 200 is one `data: {"error": ...}` event, then [DONE], as vLLM does."""
    try:
        for event in form.opening():
            yield event
        item = first
        while item is not None:
            for event in form.render(*item):
                yield event
            item = await session.next()
        for event in form.closing(session.usage()):
            yield event
    except ClientDisconnected:
        # The client left just as its first chunk came: nobody to tell.
        return
    except Exception as error:
        yield sse_event(as_api_error(error).body().model_dump_json())
    finally:
        session.cancel()
    yield SSE_DONE


class Session:
    """One HTTP request's backend streams, its choices' output so far, its metrics and span."""

    def __init__(
        self,
        ctx: ServingContext,
        requests: Sequence[GenerationRequest],
        samples_per_prompt: int = 1,
        span: trace.Span = trace.INVALID_SPAN,
    ) -> None:
        self._metrics = ctx.metrics
        self._span = span
        self._samples_per_prompt = samples_per_prompt
        self._request_ids = [r.request_id for r in requests]
        self.choices = [Choice(len(r.prompt_token_ids)) for r in requests]
        self._seen = [False] * len(requests)
        self._first_token_seen = False
        self._run = GenerationRun(ctx.backend, requests, ctx.tasks)
        self.started = time.monotonic()

    def start(self) -> None:
        """Starts the backend streams."""
        self._run.start()

    async def next(self) -> tuple[int, GenerationChunk] | None:
        item = await self._run.next()
        metrics = self._metrics
        if item is None:
            metrics.e2e_latency.observe(time.monotonic() - self.started)
            self._describe_response()
            return None
        index, chunk = item
        if not self._seen[index]:
            # Counted once the backend took the prompt: refused requests do not count.
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
        self._run.watch_disconnect(receive)
        try:
            return await self.next()
        finally:
            self._run.stop_watching()

    async def drain(self, receive: Receive) -> None:
        self._run.watch_disconnect(receive)
        try:
            while await self.next() is not None:
                pass
        finally:
            self._run.stop_watching()

    def cancel(self) -> None:
        self._run.cancel()

    def usage(self) -> Usage:
        return usage(self.choices, self._samples_per_prompt)

    def _describe_response(self) -> None:
        if self._span.is_recording():
            totals = self.usage()
            self._span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": totals.prompt_tokens,
                    "gen_ai.usage.output_tokens": totals.completion_tokens,
                    "gen_ai.response.finish_reasons": [
                        choice.finish_reason or "" for choice in self.choices
                    ],
                }
            )
