"""Completions and chat completions: prompts to `GenerationRequest`s, chunks to OpenAI bodies.

One HTTP request becomes one `_Session`: a backend stream per prompt (run concurrently), a
`_Choice` accumulating each prompt's output, and the metrics of the request. The non-streaming
path drains the session while watching for the client's disconnect; the streaming path waits
for the first chunk the same way (so that a backend refusal is still an HTTP 429/503, not an
error inside a 200 stream) and then hands the rest to an SSE generator.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from nori.gateway.backend import Backend, BackendError, GenerationChunk, GenerationRequest
from nori.gateway.errors import APIError, as_api_error, bad_request
from nori.gateway.metrics import GatewayMetrics
from nori.gateway.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    TextContentPart,
    TopLogprob,
    Usage,
)
from nori.gateway.sampling import (
    chat_max_tokens_field,
    chat_sampling_params,
    check_chat,
    check_completion,
    completion_sampling_params,
    resolve_max_tokens,
)
from nori.gateway.streams import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    GenerationRun,
    sse_event,
)
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports impossible tokens with this value instead.
_MIN_LOGPROB = -9999.0
# Not an HTTP status a client will see (it has gone); nginx's code for "client closed request"
# keeps these apart from real errors in the request metrics.
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class ServingContext:
    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: GatewayMetrics
    # Keeps the per-prompt producer tasks referenced until they end.
    tasks: set[asyncio.Task[None]]
    # token id -> its text, cached (see create_app).
    token_text: Callable[[int], str]


# ----------------------------------------------------------------------------- prompts


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            HTTPStatus.NOT_FOUND,
            f"The model `{model}` does not exist. This server serves `{ctx.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _check_token_ids(ctx: ServingContext, ids: Sequence[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(
            f"{param} has token ids out of the vocabulary range [0, {ctx.vocab_size}): {bad[:5]}",
            param,
        )
    return list(ids)


def completion_prompts(ctx: ServingContext, prompt: object) -> list[list[int]]:
    """The completions `prompt` field as token ids, one list per prompt of the batch."""
    items: list[Any]
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]  # a single tokenized prompt
    elif isinstance(prompt, list):
        items = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    result = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            # Completions prompts get the tokenizer's special tokens (BOS), as in vLLM.
            result.append(_check_token_ids(ctx, ctx.tokenizer.encode(item), "prompt"))
        else:
            result.append(_check_token_ids(ctx, item, "prompt"))
    return result


def _message_for_template(message: ChatMessage) -> dict[str, Any]:
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if content is None:
        # Templates concatenate content as a string; an assistant turn may have none.
        rendered["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, TextContentPart):
                kind = part.get("type", "unknown")
                if kind == "text":
                    raise bad_request("a text content part needs a string `text`", "messages")
                raise bad_request(
                    f"message content of type {kind!r} is not supported; only text parts are",
                    "messages",
                )
            texts.append(part.text)
        # vLLM joins text parts with newlines.
        rendered["content"] = "\n".join(texts)
    return rendered


def chat_prompt(ctx: ServingContext, request: ChatCompletionRequest) -> list[int]:
    messages = [_message_for_template(m) for m in request.messages]
    extra = {
        key: value
        for key, value in (request.chat_template_kwargs or {}).items()
        if key not in ("messages", "add_generation_prompt")
    }
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, **extra
        )
    except (ValueError, TypeError) as error:
        # ChatTemplateError (no template, raise_exception, render failure) is a ValueError;
        # a TypeError comes from template code meeting content of an unexpected shape.
        raise bad_request(str(error), "messages") from error
    # The template writes BOS itself; adding special tokens again would double it.
    return _check_token_ids(ctx, ctx.tokenizer.encode(text, add_special_tokens=False), "messages")


# ----------------------------------------------------------------------------- logprobs


def _clamp(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN and -inf


@dataclass
class _Choice:
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

    def add(self, chunk: GenerationChunk) -> None:
        self.text.append(chunk.new_text)
        self.num_tokens += len(chunk.new_token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason


class _TokenNames:
    def __init__(self, ctx: ServingContext, as_token_ids: bool) -> None:
        self._text = ctx.token_text
        self._as_ids = as_token_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._text(token_id)


def completion_logprobs(
    entries: Sequence[TokenLogprobs], names: _TokenNames, choice: _Choice
) -> CompletionLogprobs:
    """vLLM's layout: the sampled token is always among top_logprobs, as vLLM reports it."""
    result = CompletionLogprobs()
    for entry in entries:
        token = names(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(entry.logprob))
        top = {names(token_id): _clamp(logprob) for token_id, logprob in entry.top}
        # Distinct ids can share a string (each partial UTF-8 byte decodes to U+FFFD); the
        # sampled token's own value wins so that top_logprobs[i][tokens[i]] is always right.
        top[token] = _clamp(entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(choice.text_offset)
        choice.text_offset += len(token)
    return result


def chat_logprobs(entries: Sequence[TokenLogprobs], names: _TokenNames) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = names(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            name = names(token_id)
            top.append(TopLogprob(token=name, logprob=_clamp(logprob), bytes=_utf8(name)))
        content.append(
            ChatTokenLogprob(
                token=token, logprob=_clamp(entry.logprob), bytes=_utf8(token), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


# ----------------------------------------------------------------------------- sessions


class _Session:
    """The backend streams of one HTTP request, their accumulated output, and its metrics."""

    def __init__(
        self,
        ctx: ServingContext,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
    ) -> None:
        self.ctx = ctx
        self.started = time.monotonic()
        self.choices = [_Choice(len(p)) for p in prompts]
        self._request_ids = list(request_ids)
        self._seen = [False] * len(prompts)
        self._first_token_seen = False
        requests = [
            GenerationRequest(request_id, prompt, p)
            for request_id, prompt, p in zip(request_ids, prompts, params, strict=True)
        ]
        self.run = GenerationRun(ctx.backend, requests, ctx.tasks)

    async def next(self) -> tuple[int, GenerationChunk] | None:
        item = await self.run.next()
        metrics = self.ctx.metrics
        if item is None:
            metrics.e2e_latency.observe(time.monotonic() - self.started)
            return None
        index, chunk = item
        if not self._seen[index]:
            # Counted once the backend has taken the prompt, so refused requests do not count.
            self._seen[index] = True
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

    def usage(self) -> Usage:
        prompt = sum(c.num_prompt_tokens for c in self.choices)
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in self.choices)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


async def _stream_events(
    session: _Session,
    first: tuple[int, GenerationChunk] | None,
    opening: Sequence[str],
    render: Callable[[int, GenerationChunk], list[str]],
    closing: Callable[[], list[str]],
) -> AsyncIterator[str]:
    """The SSE body: opening events, events per chunk, closing events, then [DONE].

    An error after the 200 has been sent can only be reported in the stream, as vLLM does: one
    `data: {"error": ...}` event, then [DONE].
    """
    try:
        for event in opening:
            yield event
        item = first
        while item is not None:
            for event in render(*item):
                yield event
            item = await session.next()
        for event in closing():
            yield event
    except Exception as error:
        yield sse_event(as_api_error(error).body().model_dump_json())
    finally:
        # On disconnect (cancellation or aclose) this stops the backend streams still running.
        session.cancel()
    yield SSE_DONE


async def _start(session: _Session, request: Request) -> tuple[int, GenerationChunk] | None:
    try:
        return await session.first(request.receive)
    except BaseException:
        session.cancel()
        raise


def _dump(model: CompletionChunk | ChatCompletionChunk, include_usage: bool) -> str:
    # With include_usage OpenAI sends `"usage": null` on every chunk but the last; without it,
    # no usage key at all.
    return sse_event(model.model_dump_json(exclude=None if include_usage else {"usage"}))


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- endpoints


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_completion(body)
    prompts = completion_prompts(ctx, body.prompt)
    params = [
        completion_sampling_params(
            body, resolve_max_tokens(body.max_tokens, "max_tokens", len(p), ctx.max_model_len)
        )
        for p in prompts
    ]
    completion_id = _new_id("cmpl")
    created = int(time.time())
    request_ids = [f"{completion_id}-{index}" for index in range(len(prompts))]
    session = _Session(ctx, request_ids, prompts, params)
    want_logprobs = body.logprobs is not None
    names = _TokenNames(ctx, body.return_tokens_as_token_ids)

    def choice_logprobs(index: int, entries: Sequence[TokenLogprobs] | None) -> Any:
        if not want_logprobs:
            return None
        return completion_logprobs(entries or (), names, session.choices[index])

    if not body.stream:
        try:
            await session.drain(request.receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            session.cancel()
        choices = [
            CompletionChoice(
                index=index,
                text="".join(choice.text),
                logprobs=choice_logprobs(index, choice.logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for index, choice in enumerate(session.choices)
        ]
        response = CompletionResponse(
            id=completion_id,
            created=created,
            model=ctx.model_name,
            choices=choices,
            usage=session.usage(),
        )
        return JSONResponse(response.model_dump())

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    try:
        first = await _start(session, request)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        model = CompletionChunk(
            id=completion_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return _dump(model, include_usage)

    def render(index: int, item: GenerationChunk) -> list[str]:
        logprobs = choice_logprobs(index, item.logprobs)
        if not item.new_text and logprobs is None and not item.finished:
            return []  # text held back (a possible stop string or a split character)
        choice = CompletionChoice(
            index=index,
            text=item.new_text,
            logprobs=logprobs,
            finish_reason=item.finish_reason if item.finished else None,
            stop_reason=item.stop_reason if item.finished else None,
        )
        return [chunk([choice])]

    def closing() -> list[str]:
        return [chunk([], session.usage())] if include_usage else []

    events = _stream_events(session, first, (), render, closing)
    return EventStreamResponse(events, on_close=session.cancel)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_chat(body)
    prompt = chat_prompt(ctx, body)
    requested, param = chat_max_tokens_field(body)
    max_tokens = resolve_max_tokens(requested, param, len(prompt), ctx.max_model_len)
    params = chat_sampling_params(body, max_tokens)
    completion_id = _new_id("chatcmpl")
    created = int(time.time())
    session = _Session(ctx, [completion_id], [prompt], [params])
    names = _TokenNames(ctx, body.return_tokens_as_token_ids)

    def logprobs_of(entries: Sequence[TokenLogprobs] | None) -> ChatLogprobs | None:
        return chat_logprobs(entries or (), names) if body.logprobs else None

    if not body.stream:
        try:
            await session.drain(request.receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            session.cancel()
        choice = session.choices[0]
        response = ChatCompletionResponse(
            id=completion_id,
            created=created,
            model=ctx.model_name,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatResponseMessage(content="".join(choice.text)),
                    logprobs=logprobs_of(choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            ],
            usage=session.usage(),
        )
        return JSONResponse(response.model_dump())

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    try:
        first = await _start(session, request)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
        model = ChatCompletionChunk(
            id=completion_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return _dump(model, include_usage)

    def render(_: int, item: GenerationChunk) -> list[str]:
        events = []
        logprobs = logprobs_of(item.logprobs) if item.new_token_ids else None
        if item.new_text or logprobs is not None:
            delta = ChatDelta(content=item.new_text)
            events.append(chunk([ChatStreamChoice(index=0, delta=delta, logprobs=logprobs)]))
        if item.finished:
            # As OpenAI does: the finish reason comes on a chunk of its own with an empty delta.
            final = ChatStreamChoice(
                index=0,
                delta=ChatDelta(),
                finish_reason=item.finish_reason,
                stop_reason=item.stop_reason,
            )
            events.append(chunk([final]))
        return events

    def closing() -> list[str]:
        return [chunk([], session.usage())] if include_usage else []

    opening = [chunk([ChatStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))])]
    events = _stream_events(session, first, opening, render, closing)
    return EventStreamResponse(events, on_close=session.cancel)
