"""One responder for every OpenAI endpoint, streaming or not.

An endpoint turns its body into the backend's requests (one per choice) and a format (how its API
spells a whole response and its stream events, `formats.py`); `respond` does the rest the same
way for all of them: it starts the backend streams (`streams.GenerationRun`) and collects what
they produce in a `Session`. The non-streaming path drains the session while watching for the
client's disconnect; the streaming path waits for the first chunk the same way (so that a backend
refusal is still an HTTP 429/503, not an error inside a 200 stream) and then hands the rest to an
SSE generator.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import BaseModel
from starlette.types import Receive

from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, as_api_error
from nori.gateway.formats import SSE_DONE, Choice, sse_event, usage
from nori.gateway.prompts import ServingContext
from nori.gateway.protocol import Usage
from nori.gateway.streams import ClientDisconnected, EventStreamResponse, GenerationRun

# Not an HTTP status a client will see (it has gone); nginx's code for "client closed request"
# keeps these apart from real errors in the request metrics.
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
    """Serves `requests` (choice i is `requests[i]`; with n > 1 each prompt stands n times in a
    row, `samples_per_prompt`) and answers in `form`. `span`: the request's server span, which
    gets the usage and finish reasons at the end."""
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
    """The SSE body: opening events, events per chunk, closing events, then [DONE].

    An error after the 200 has been sent can only be reported in the stream, as vLLM does: one
    `data: {"error": ...}` event, then [DONE].
    """
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
        # The client left just as its first chunk came (the watcher of `session.first` queued
        # the disconnect behind it): nobody to tell, and nothing went wrong.
        return
    except Exception as error:
        yield sse_event(as_api_error(error).body().model_dump_json())
    finally:
        # On disconnect (cancellation or aclose) this stops the backend streams still running.
        session.cancel()
    yield SSE_DONE


class Session:
    """One HTTP request's backend streams, the output of each of its choices so far, and its
    metrics (tokens, time to first token, latency) and span attributes."""

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
