"""`/v1/completions` and `/v1/chat/completions`: a body becomes prompts, sampling parameters and a
`Session`; the format classes say how each API spells its response, and `respond` sends it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

from fastapi import Request
from fastapi.responses import Response

from nori.gateway.backend import GenerationChunk
from nori.gateway.context import ServingContext
from nori.gateway.openai_logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_entries,
)
from nori.gateway.prompts import chat_prompt, check_model, completion_prompts, echoed_prompts
from nori.gateway.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    StreamOptions,
    Usage,
)
from nori.gateway.request_id import client_request_id, response_id, worker_request_id_base
from nori.gateway.request_params import (
    chat_max_tokens_field,
    chat_sampling_params,
    check_chat,
    check_completion,
    check_token_ids,
    completion_max_tokens,
    completion_sampling_params,
    resolve_max_tokens,
    sample_params,
)
from nori.gateway.responder import chunk_event, respond
from nori.gateway.session import Session, client_identity
from nori.gateway.tracing import describe_request
from nori.sampling.logprobs import TokenLogprobs

# Bodies above this many bytes are tokenized on a worker thread: a 10 MB prompt takes the
# tokenizer seconds, which on the event loop would stall every stream and /health.
LARGE_BODY_BYTES = 64 * 1024
_Result = TypeVar("_Result")


async def off_loop_if_large(request: Request, work: Callable[..., _Result], *args: Any) -> _Result:
    """`work(*args)`, on a thread when the request body is large or of unstated size (small
    ones stay inline: a thread hop costs more than tokenizing a short prompt)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= LARGE_BODY_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_completion(body)
    check_token_ids(body, ctx.vocab_size)
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
    session = Session(
        ctx,
        request_ids,
        prompts,
        params,
        samples_per_prompt=n,
        span=span,
        client=client_identity(request.scope),
        priority=body.priority,
        streamed=bool(body.stream),
    )
    form = CompletionFormat(ctx, body, completion_id, session, echo)
    return await respond(session, request, form, body.stream)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_chat(body)
    check_token_ids(body, ctx.vocab_size)
    # Always on a thread: the template (perhaps the request's own) runs up to its time limit.
    prompt = await asyncio.to_thread(chat_prompt, ctx, body)
    requested, param = chat_max_tokens_field(body)
    max_tokens = resolve_max_tokens(requested, param, len(prompt), ctx.max_model_len)
    client_id = client_request_id(request.scope)
    completion_id = response_id("chatcmpl", client_id)
    base = worker_request_id_base(completion_id, client_id)
    request_ids = [base] if body.n == 1 else [f"{base}-{index}" for index in range(body.n)]
    params = sample_params(chat_sampling_params(body, max_tokens), body.n)
    span = describe_request("chat", ctx.model_name, params[0], completion_id)
    session = Session(
        ctx,
        request_ids,
        [prompt] * body.n,
        params,
        samples_per_prompt=body.n,
        span=span,
        client=client_identity(request.scope),
        priority=body.priority,
        streamed=bool(body.stream),
    )
    form = ChatFormat(ctx, body, completion_id)
    return await respond(session, request, form, body.stream)


class _Format:
    """What both APIs' formats share: the response's id, time and model, and the usage chunk."""

    # The chunk model of the API, which the streamed choices are wrapped in.
    _chunk_type: ClassVar[type[CompletionChunk] | type[ChatCompletionChunk]]

    def __init__(
        self,
        ctx: ServingContext,
        completion_id: str,
        return_tokens_as_token_ids: bool | None,
        stream_options: StreamOptions | None,
    ) -> None:
        self._envelope = {"id": completion_id, "created": int(time.time()), "model": ctx.model_name}
        self._names = TokenNames(ctx, bool(return_tokens_as_token_ids))
        self._include_usage = stream_options is not None and stream_options.include_usage

    def _chunk(self, choices: Sequence[object], usage: Usage | None = None) -> str:
        model = self._chunk_type(**self._envelope, choices=choices, usage=usage)  # type: ignore[arg-type]
        return chunk_event(model, self._include_usage)

    def closing(self, session: Session) -> list[str]:
        return [self._chunk([], session.usage())] if self._include_usage else []


class EchoedPrompt(NamedTuple):
    """A choice's prompt as `echo` reports it before the completion."""

    text: str
    token_ids: list[int]


class CompletionFormat(_Format):
    _chunk_type = CompletionChunk

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        completion_id: str,
        session: Session,
        echo: Sequence[EchoedPrompt] = (),
    ) -> None:
        """`echo`: each choice's prompt when the request echoes, else empty."""
        super().__init__(ctx, completion_id, body.return_tokens_as_token_ids, body.stream_options)
        self._want_logprobs = body.logprobs is not None
        # Logprobs' text offsets run on across a choice's chunks.
        self._session = session
        self._echo = list(echo)
        # max_tokens 0: the prompt alone (the token the engine computed to score it is left out).
        self._prompt_only = body.echo and body.max_tokens == 0
        self._echoed: set[int] = set()

    def _content(
        self,
        index: int,
        text: str,
        entries: Sequence[TokenLogprobs] | None,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None,
    ) -> tuple[str, list[TokenLogprobs | int]]:
        """A choice's text and logprob entries: when echoing, its prompt's come first (once per
        choice), as vLLM reports them."""
        generated: list[TokenLogprobs | int] = [] if self._prompt_only else list(entries or ())
        text = "" if self._prompt_only else text
        if not self._echo or index in self._echoed:
            return text, generated
        self._echoed.add(index)
        prompt = self._echo[index]
        return prompt.text + text, prompt_entries(prompt.token_ids, prompt_logprobs) + generated

    def _logprobs(
        self, index: int, entries: Sequence[TokenLogprobs | int]
    ) -> CompletionLogprobs | None:
        if not self._want_logprobs:
            return None
        return completion_logprobs(entries, self._names, self._session.choices[index])

    def response(self, session: Session) -> CompletionResponse:
        choices = []
        for index, choice in enumerate(session.choices):
            text, entries = self._content(
                index, "".join(choice.text), choice.logprobs, choice.prompt_logprobs
            )
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=self._logprobs(index, entries),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(**self._envelope, choices=choices, usage=session.usage())  # type: ignore[arg-type]

    def opening(self) -> list[str]:
        return []

    def render(self, index: int, chunk: GenerationChunk) -> list[str]:
        text, entries = self._content(index, chunk.new_text, chunk.logprobs, chunk.prompt_logprobs)
        logprobs = self._logprobs(index, entries)
        if not text and logprobs is None and not chunk.finished:
            return []  # text held back (a possible stop string or a split character)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=chunk.finish_reason if chunk.finished else None,
            stop_reason=chunk.stop_reason if chunk.finished else None,
        )
        return [self._chunk([choice])]


class ChatFormat(_Format):
    _chunk_type = ChatCompletionChunk

    def __init__(
        self, ctx: ServingContext, body: ChatCompletionRequest, completion_id: str
    ) -> None:
        super().__init__(ctx, completion_id, body.return_tokens_as_token_ids, body.stream_options)
        self._want_logprobs = bool(body.logprobs)
        self._n = body.n

    def _logprobs(self, entries: Sequence[TokenLogprobs] | None) -> ChatLogprobs | None:
        return chat_logprobs(entries or (), self._names) if self._want_logprobs else None

    def response(self, session: Session) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            **self._envelope,  # type: ignore[arg-type]
            choices=[
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content="".join(choice.text)),
                    logprobs=self._logprobs(choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for index, choice in enumerate(session.choices)
            ],
            usage=session.usage(),
        )

    def opening(self) -> list[str]:
        # Each choice's stream starts with the role, as OpenAI's does.
        role = ChatDelta(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(index=i, delta=role)]) for i in range(self._n)]

    def render(self, index: int, chunk: GenerationChunk) -> list[str]:
        events = []
        logprobs = self._logprobs(chunk.logprobs) if chunk.new_token_ids else None
        if chunk.new_text or logprobs is not None:
            delta = ChatDelta(content=chunk.new_text)
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs)
            events.append(self._chunk([choice]))
        if chunk.finished:
            # As OpenAI does: the finish reason comes on a chunk of its own with an empty delta.
            final = ChatStreamChoice(
                index=index,
                delta=ChatDelta(),
                finish_reason=chunk.finish_reason,
                stop_reason=chunk.stop_reason,
            )
            events.append(self._chunk([final]))
        return events
