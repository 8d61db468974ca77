"""Running backend streams for one HTTP request, and the SSE response that carries them.

Each prompt's backend iterator is driven by a task of its own, its chunks merged into one queue:
prompts of a batch run concurrently, and closing is always possible (an async generator cannot
be `aclose()`d while another task is inside its `__anext__`; cancelling the owning task ends the
step and runs the backend's cleanup, outside any cancelled anyio scope). A task watching ASGI
`receive()` puts the client's disconnect into the same queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from nori.gateway.backend import Backend, GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError

logger = logging.getLogger("nori.gateway")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


class _Disconnected:
    """Queue marker: the disconnect watcher saw `http.disconnect`."""


class _Done:
    """Queue marker: one prompt's stream ended after its finished chunk."""


_Event = tuple[int, GenerationChunk | _Done] | BaseException | _Disconnected


async def close_iterator(iterator: object) -> None:
    """`aclose()` an async iterator if it has one (async generators do, plain iterators not)."""
    aclose: Callable[[], Awaitable[Any]] | None = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class GenerationRun:
    """The backend streams of one HTTP request (one per prompt), merged in arrival order.
    `tasks`, the app's, keeps the producer tasks referenced until they end."""

    def __init__(
        self,
        backend: Backend,
        requests: Sequence[GenerationRequest],
        tasks: set[asyncio.Task[None]],
    ) -> None:
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._held: _Event | None = None
        # Prompts that handed out their first chunk, which is never merged.
        self._started: set[int] = set()
        self._remaining = len(requests)
        self._backend = backend
        self._requests = list(requests)
        self._tasks = tasks
        self._producers: list[asyncio.Task[None]] = []
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts one producer task per request."""
        assert not self._producers, "the run has started"
        self._producers = [
            self._spawn(self._produce(self._backend, i, r)) for i, r in enumerate(self._requests)
        ]

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _produce(self, backend: Backend, index: int, request: GenerationRequest) -> None:
        iterator: AsyncIterator[GenerationChunk] | None = None
        try:
            iterator = backend.generate(request)
            finished = False
            async for chunk in iterator:
                self._queue.put_nowait((index, chunk))
                if chunk.finished:
                    finished = True
                    break
            if not finished:
                raise BackendError(f"the backend ended request {request.request_id} early")
            self._queue.put_nowait((index, _Done()))
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

    def watch_disconnect(self, receive: Receive) -> None:
        """Until `stop_watching`, a client disconnect makes `next()` raise ClientDisconnected."""

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._queue.put_nowait(_Disconnected())
                    return

        self._watcher = self._spawn(watch())

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

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
            return index, self._merge_ready(index, item)
        self.stop_watching()
        return None

    def _merge_ready(self, index: int, chunk: GenerationChunk) -> GenerationChunk:
        """`chunk` joined with the same prompt's chunks queued behind it (a writer that fell
        behind sends one event); never a first chunk, never an abort."""
        if index not in self._started:
            self._started.add(index)
            return chunk
        while not chunk.finished and not self._queue.empty():
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

    def cancel(self) -> None:
        """Stops every stream still running. Synchronous: it runs in `finally` blocks that may
        be inside a cancelled anyio scope."""
        self.stop_watching()
        for task in self._producers:
            task.cancel()


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that always closes its body iterator, whatever ends the stream: a
    disconnect listener runs beside it on every ASGI spec version (Starlette's only below 2.4),
    so the backend request is cancelled as soon as the client goes away."""

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
