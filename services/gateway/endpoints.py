"""`/v1/completions` and `/v1/chat/completions`, from the parsed body to the answer.

`respond` (both APIs, streaming or not) runs the backend streams in a `Session`. A stream waits
for its first chunk before the 200, so a backend refusal is still an HTTP 429/503."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import BaseModel
from starlette.types import Receive

from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, as_api_error
from nori.gateway.formats import (
    SSE_DONE,
    ChatFormat,
    Choice,
    CompletionFormat,
    EchoedPrompt,
    EventStreamResponse,
    close_iterator,
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
    generation_requests,
    resolve_max_tokens,
)
from nori.gateway.protocol import ChatCompletionRequest, CompletionRequest, Usage
from nori.sampling.params import SamplingParams, choice_params

logger = logging.getLogger("nori.gateway")

# Larger bodies are tokenized on a thread, off the event loop that serves every stream.
LARGE_BODY_BYTES = 64 * 1024
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
        for sample in choice_params(
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
    requests = generation_requests(ctx, request.scope, body, request_ids, prompts, params)
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
    params = choice_params(chat_sampling_params(body, max_tokens), body.n)
    span = describe_request("chat", ctx.model_name, params[0], completion_id)
    prompts = [prompt] * body.n
    requests = generation_requests(ctx, request.scope, body, request_ids, prompts, params)
    form = ChatFormat(ctx.model_name, ctx.token_text, body, completion_id)
    return await respond(ctx, requests, form, request, bool(body.stream), body.n, span)


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


# nginx's "client closed request": no client sees it, but the metrics tell it from errors.
CLIENT_CLOSED_REQUEST = 499


class ResponseFormat(Protocol):
    """What `formats.CompletionFormat` and `formats.ChatFormat` do for the responder: the whole
    `response` once every choice has finished; for a stream, the SSE events `opening` (before
    the first chunk's), `render` (for one chunk of choice `index`; none while text is held back)
    and `closing` (after the last chunk, before [DONE])."""

    def response(self, choices: Sequence[Choice], usage: Usage) -> BaseModel: ...
    def opening(self) -> list[str]: ...
    def render(self, index: int, chunk: GenerationChunk) -> list[str]: ...
    def closing(self, usage: Usage) -> list[str]: ...


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


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


class _Disconnected:
    """Queue marker: the disconnect watcher saw `http.disconnect`."""


class _Done:
    """Queue marker: one prompt's stream ended after its finished chunk."""


_Event = tuple[int, GenerationChunk | _Done] | BaseException | _Disconnected


class Session:
    """One HTTP request's backend streams, its choices' output so far, its metrics and span.
    A task per prompt drives its backend iterator into one queue (with the client's disconnect),
    so prompts run concurrently and closing is always possible."""

    def __init__(
        self,
        ctx: ServingContext,
        requests: Sequence[GenerationRequest],
        samples_per_prompt: int = 1,
        span: trace.Span = trace.INVALID_SPAN,
    ) -> None:
        self._ctx = ctx
        self._span = span
        self._samples_per_prompt = samples_per_prompt
        self._request_ids = [r.request_id for r in requests]
        self.choices = [Choice(len(r.prompt_token_ids)) for r in requests]
        self._seen = [False] * len(requests)  # handed out its first chunk (never merged)
        self._first_token_seen = False
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._held: _Event | None = None
        self._remaining = len(requests)
        self._watcher: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        self._producers = [self._spawn(self._produce(i, r)) for i, r in enumerate(requests)]

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        # The app's task set keeps it referenced until it ends.
        task = asyncio.ensure_future(coroutine)
        self._ctx.tasks.add(task)
        task.add_done_callback(self._ctx.tasks.discard)
        return task

    async def _produce(self, index: int, request: GenerationRequest) -> None:
        iterator: AsyncIterator[GenerationChunk] | None = None
        try:
            iterator = self._ctx.backend.generate(request)
            async for chunk in iterator:
                self._queue.put_nowait((index, chunk))
                if chunk.finished:
                    self._queue.put_nowait((index, _Done()))
                    return
            raise BackendError(f"the backend ended request {request.request_id} early")
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._queue.put_nowait(error)
        finally:
            if iterator is not None:
                # Suspended, not finished: run its cleanup now, not at garbage collection.
                try:
                    await close_iterator(iterator)
                except Exception:
                    logger.exception("closing the backend stream of %s failed", request.request_id)

    async def next(self) -> tuple[int, GenerationChunk] | None:
        """The next chunk of any prompt, None once all have finished; raises the first error of
        any prompt (cancelling the others), or ClientDisconnected."""
        while self._remaining > 0:
            event = self._held if self._held is not None else await self._queue.get()
            self._held = None
            if isinstance(event, _Disconnected):
                self.cancel()
                raise ClientDisconnected()
            if isinstance(event, BaseException):
                self.cancel()
                raise event
            index, item = event
            if isinstance(item, _Done):
                self._remaining -= 1
                continue
            return index, self._count(index, self._merge_ready(index, item))
        self._stop_watching()
        self._ctx.metrics.e2e_latency.observe(time.monotonic() - self.started)
        self._describe_response()
        return None

    def _merge_ready(self, index: int, chunk: GenerationChunk) -> GenerationChunk:
        """`chunk` joined with the same prompt's chunks queued behind it (a writer that fell
        behind sends one event); never a first chunk, never an abort."""
        while self._seen[index] and not chunk.finished and not self._queue.empty():
            event = self._queue.get_nowait()
            if (
                not isinstance(event, tuple)
                or event[0] != index
                or isinstance(event[1], _Done)
                or event[1].finish_reason == "abort"
            ):
                self._held = event
                break
            chunk = chunk.followed_by(event[1])
        return chunk

    def _count(self, index: int, chunk: GenerationChunk) -> GenerationChunk:
        metrics = self._ctx.metrics
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
        return chunk

    async def first(self, receive: Receive) -> tuple[int, GenerationChunk] | None:
        """The first chunk, or ClientDisconnected if the client leaves before it arrives."""
        self._watch_disconnect(receive)
        try:
            return await self.next()
        finally:
            self._stop_watching()

    async def drain(self, receive: Receive) -> None:
        self._watch_disconnect(receive)
        try:
            while await self.next() is not None:
                pass
        finally:
            self._stop_watching()

    def _watch_disconnect(self, receive: Receive) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._queue.put_nowait(_Disconnected())

        self._watcher = self._spawn(watch())

    def _stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def cancel(self) -> None:
        """Stops every stream still running. Synchronous: it runs in `finally` blocks that may
        be inside a cancelled anyio scope."""
        self._stop_watching()
        for task in self._producers:
            task.cancel()

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
