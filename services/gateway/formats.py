"""How each OpenAI API spells its answer: a whole response, or the SSE events of a stream.
`CompletionFormat` and `ChatFormat` turn chunks and choices into the API's JSON (logprobs in
vLLM's layout) and the usage; `endpoints.respond` decides when each is sent."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from nori.gateway.backend import GenerationChunk
from nori.gateway.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    Usage,
)
from nori.sampling.logprobs import TokenLogprobs

# JSON has no -inf; vLLM reports impossible tokens with this value instead.
_MIN_LOGPROB = -9999.0


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse_event("[DONE]")


@dataclass
class Choice:
    """What one choice (one prompt's one sample) has produced so far."""

    num_prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    # An echo's prompt logprobs, from the first chunk; the first None.
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


def usage(choices: Sequence[Choice], samples_per_prompt: int) -> Usage:
    """The request's usage: each distinct prompt's tokens once, every choice's output."""
    firsts = choices[::samples_per_prompt]  # one choice per distinct prompt
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in firsts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


# ---------------------------------------------------------------------- log-probabilities


def _clamp(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN and -inf


def token_names(token_text: Callable[[int], str], as_token_ids: bool) -> Callable[[int], str]:
    """A token id as the logprobs name it: its text, or `token_id:N`."""
    return (lambda token_id: f"token_id:{token_id}") if as_token_ids else token_text


def prompt_entries(
    token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobs | None] | None
) -> list[TokenLogprobs | int]:
    """An echoed prompt's tokens: each one's logprobs, or its bare id where it has none."""
    scored = prompt_logprobs or ()
    entries: list[TokenLogprobs | int] = []
    for index, token_id in enumerate(token_ids):
        entry = scored[index] if index < len(scored) else None
        entries.append(token_id if entry is None else entry)
    return entries


def completion_logprobs(
    entries: Sequence[TokenLogprobs | int], names: Callable[[int], str], text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """vLLM's layout, text offsets from `text_offset` on, and the offset after the last token.
    The sampled token is always among top_logprobs; a bare token id has null logprobs."""
    result = CompletionLogprobs()
    for entry in entries:
        if isinstance(entry, int):
            token = names(entry)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            continue
        token = names(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(entry.logprob))
        top = {names(token_id): _clamp(logprob) for token_id, logprob in entry.top}
        # Distinct ids can share a string (U+FFFD): top_logprobs[i][tokens[i]] must be right.
        top[token] = _clamp(entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


def chat_logprobs(entries: Sequence[TokenLogprobs], names: Callable[[int], str]) -> ChatLogprobs:
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


# ---------------------------------------------------------------------- the two APIs


class _Format:
    """What both APIs' formats share: the response's id, time and model, and the usage chunk."""

    _chunk_type: ClassVar[type[CompletionChunk] | type[ChatCompletionChunk]]

    def __init__(
        self,
        model_name: str,
        token_text: Callable[[int], str],
        completion_id: str,
        return_tokens_as_token_ids: bool | None,
        stream_options: StreamOptions | None,
    ) -> None:
        self._envelope = {"id": completion_id, "created": int(time.time()), "model": model_name}
        self._names = token_names(token_text, bool(return_tokens_as_token_ids))
        self._include_usage = stream_options is not None and stream_options.include_usage

    def _chunk(self, choices: Sequence[object], usage: Usage | None = None) -> str:
        model: BaseModel = self._chunk_type(**self._envelope, choices=choices, usage=usage)  # type: ignore[arg-type]
        # As OpenAI: `"usage": null` on every chunk but the last with include_usage, else none.
        return sse_event(model.model_dump_json(exclude=None if self._include_usage else {"usage"}))

    def opening(self) -> list[str]:
        return []

    def closing(self, usage: Usage) -> list[str]:
        return [self._chunk([], usage)] if self._include_usage else []


class EchoedPrompt(NamedTuple):
    """A choice's prompt as `echo` reports it before the completion."""

    text: str
    token_ids: list[int]


class CompletionFormat(_Format):
    _chunk_type = CompletionChunk

    def __init__(
        self,
        model_name: str,
        token_text: Callable[[int], str],
        body: CompletionRequest,
        completion_id: str,
        echo: Sequence[EchoedPrompt] = (),
    ) -> None:
        """`echo`: each choice's prompt when the request echoes, else empty."""
        super().__init__(
            model_name,
            token_text,
            completion_id,
            body.return_tokens_as_token_ids,
            body.stream_options,
        )
        self._want_logprobs = body.logprobs is not None
        # Per choice: logprobs' text offsets run on across its chunks.
        self._text_offsets: dict[int, int] = {}
        self._echo = list(echo)
        # max_tokens 0: the prompt alone (the token computed to score it is left out).
        self._prompt_only = body.echo and body.max_tokens == 0
        self._echoed: set[int] = set()

    def _content(
        self,
        index: int,
        text: str,
        entries: Sequence[TokenLogprobs] | None,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None,
    ) -> tuple[str, list[TokenLogprobs | int]]:
        """A choice's text and logprob entries, an echoed prompt's first (once per choice)."""
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
        logprobs, self._text_offsets[index] = completion_logprobs(
            entries, self._names, self._text_offsets.get(index, 0)
        )
        return logprobs

    def response(self, choices: Sequence[Choice], usage: Usage) -> CompletionResponse:
        rendered = []
        for index, choice in enumerate(choices):
            text, entries = self._content(
                index, "".join(choice.text), choice.logprobs, choice.prompt_logprobs
            )
            rendered.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=self._logprobs(index, entries),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(**self._envelope, choices=rendered, usage=usage)  # type: ignore[arg-type]

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
        self,
        model_name: str,
        token_text: Callable[[int], str],
        body: ChatCompletionRequest,
        completion_id: str,
    ) -> None:
        super().__init__(
            model_name,
            token_text,
            completion_id,
            body.return_tokens_as_token_ids,
            body.stream_options,
        )
        self._want_logprobs = bool(body.logprobs)
        self._n = body.n

    def _logprobs(self, entries: Sequence[TokenLogprobs] | None) -> ChatLogprobs | None:
        return chat_logprobs(entries or (), self._names) if self._want_logprobs else None

    def response(self, choices: Sequence[Choice], usage: Usage) -> ChatCompletionResponse:
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
                for index, choice in enumerate(choices)
            ],
            usage=usage,
        )

    def opening(self) -> list[str]:
        # As OpenAI: each choice's stream starts with the role.
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
            # As OpenAI: the finish reason on a chunk of its own, with an empty delta.
            final = ChatStreamChoice(
                index=index,
                delta=ChatDelta(),
                finish_reason=chunk.finish_reason,
                stop_reason=chunk.stop_reason,
            )
            events.append(self._chunk([final]))
        return events


# ---------------------------------------------------------------------- the SSE response


async def close_iterator(iterator: object) -> None:
    """`aclose()` an async iterator if it has one (async generators do, plain iterators not)."""
    aclose: Callable[[], Awaitable[Any]] | None = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that always closes its body iterator, whatever ends the stream, so
    the backend request is cancelled as soon as the client goes away."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None
    ) -> None:
        """`on_close` runs once the response is over, even if the body never started."""
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    # A send to a closed connection raises OSError on newer ASGI servers.
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    while True:
                        message: Message = await receive()
                        if message["type"] == "http.disconnect":
                            break
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            with anyio.CancelScope(shield=True):
                await close_iterator(self.body_iterator)
            if self._on_close is not None:
                self._on_close()
