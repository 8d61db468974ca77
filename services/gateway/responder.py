"""One responder for every OpenAI endpoint, streaming or not.

An endpoint turns its body into a `Session` and a `ResponseFormat` (how its API spells a whole
response and its stream events); `respond` does the rest the same way for all of them. The
non-streaming path drains the session while watching for the client's disconnect; the streaming
path waits for the first chunk the same way (so that a backend refusal is still an HTTP 429/503,
not an error inside a 200 stream) and then hands the rest to an SSE generator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from nori.gateway.backend import GenerationChunk
from nori.gateway.errors import as_api_error
from nori.gateway.session import Session
from nori.gateway.streams import SSE_DONE, ClientDisconnected, EventStreamResponse, sse_event

# Not an HTTP status a client will see (it has gone); nginx's code for "client closed request"
# keeps these apart from real errors in the request metrics.
CLIENT_CLOSED_REQUEST = 499


class ResponseFormat(Protocol):
    def response(self, session: Session) -> BaseModel:
        """The whole response, once the session is drained."""
        ...

    def opening(self) -> list[str]:
        """SSE events before the first chunk's."""
        ...

    def render(self, index: int, chunk: GenerationChunk) -> list[str]:
        """SSE events for one chunk of prompt `index` (none while text is held back)."""
        ...

    def closing(self, session: Session) -> list[str]:
        """SSE events after the last chunk (before [DONE])."""
        ...


def chunk_event(model: BaseModel, include_usage: bool) -> str:
    # With include_usage OpenAI sends `"usage": null` on every chunk but the last; without it,
    # no usage key at all.
    return sse_event(model.model_dump_json(exclude=None if include_usage else {"usage"}))


async def respond(
    session: Session, request: Request, form: ResponseFormat, stream: bool
) -> Response:
    if not stream:
        try:
            await session.drain(request.receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            session.cancel()
        return JSONResponse(form.response(session).model_dump())
    try:
        first = await session.first(request.receive)
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
        for event in form.closing(session):
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
