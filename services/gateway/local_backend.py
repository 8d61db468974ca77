"""A `Backend` that runs an in-process `LLMEngine` (single-process serving and HTTP-layer tests).

The engine is not thread-safe and its `step()` blocks for a whole forward pass, so it lives on a
thread of its own and nothing else touches it. The event loop talks to that thread through a
command deque guarded by a condition variable (add a request, abort one, close); the thread
sleeps on the condition when it has neither commands nor unfinished requests, so an idle backend
costs no CPU. Outputs go back to each request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import RequestOutput
from nori.gateway.backend import (
    BackendError,
    BackendHealth,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
)
from nori.sampling.tokenizer import Tokenizer

logger = logging.getLogger("nori.gateway")

_Item = GenerationChunk | BackendError


@dataclass(frozen=True)
class _Sink:
    """Where one request's chunks go: an asyncio queue on the loop that awaits them."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]

    def deliver(self, item: _Item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody will ever read this request
            return False
        return True


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    sink: _Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class LocalEngineBackend:
    """Serves requests with one in-process engine on a background thread.

    At most `max_num_seqs + max_queued_requests` requests may be unfinished at once; beyond that
    `generate` refuses with QueueFullError (HTTP 429) instead of queueing without bound.
    """

    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024) -> None:
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self._max_unfinished = engine.config.max_num_seqs + max_queued_requests
        self._wakeup = threading.Condition()
        # Guarded by _wakeup.
        self._commands: deque[_Add | _Abort] = deque()
        self._num_unfinished = 0
        self._closed = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="nori-local-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(
        cls, model: str, max_queued_requests: int = 1024, **engine_options: Any
    ) -> LocalEngineBackend:
        """Loads `model` ("demo" or a checkpoint folder); options are EngineConfig fields."""
        return cls(LLMEngine(EngineConfig(model=model, **engine_options)), max_queued_requests)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model_config.vocab_size)

    # ------------------------------------------------------------------ event-loop side

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        sink = _Sink(asyncio.get_running_loop(), queue)
        with self._wakeup:
            if self._closed or self._failure is not None:
                raise BackendError(self._failure or "the local engine is shut down")
            if self._num_unfinished >= self._max_unfinished:
                raise QueueFullError(
                    f"the engine already has {self._num_unfinished} unfinished requests "
                    f"(limit {self._max_unfinished}); retry later"
                )
            self._num_unfinished += 1
            self._commands.append(_Add(request, sink))
            self._wakeup.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BackendError):
                    finished = True  # the engine side has already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Reached on completion, on error, and when the consumer closes or cancels us
            # early; only the last needs the engine to drop the request and free its blocks.
            with self._wakeup:
                self._num_unfinished -= 1
                if not finished:
                    self._commands.append(_Abort(request.request_id))
                    self._wakeup.notify()

    async def health(self) -> BackendHealth:
        alive = self._thread.is_alive() and not self._closed
        detail = self._failure or ("" if alive else "the local engine is shut down")
        return BackendHealth(healthy=alive, workers={"local": int(alive)}, detail=detail)

    async def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        sinks: dict[str, _Sink] = {}
        try:
            self._loop(sinks)
        except BaseException as error:
            # A bug in the loop itself: fail loudly and refuse new requests rather than hang.
            logger.exception("the local engine loop died")
            failure = f"the local engine loop died: {error!r}"
            with self._wakeup:
                self._failure = failure
                commands = list(self._commands)
                self._commands.clear()
            self._fail_all(sinks, commands, BackendError(failure))

    def _loop(self, sinks: dict[str, _Sink]) -> None:
        engine = self.engine
        while True:
            with self._wakeup:
                while not (self._commands or self._closed or engine.has_unfinished_requests()):
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
                closed = self._closed
            if closed:
                self._fail_all(sinks, commands, BackendError("the local engine is shutting down"))
                return
            for command in commands:
                self._apply(command, sinks)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:
                # The step's requests are in an unknown state; end them all, keep serving.
                logger.exception("engine step failed")
                self._fail_all(sinks, [], BackendError(f"engine step failed: {error}"))
                continue
            for output in outputs:
                self._deliver(output, sinks)

    def _apply(self, command: _Add | _Abort, sinks: dict[str, _Sink]) -> None:
        if isinstance(command, _Abort):
            sinks.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            return
        request = command.request
        try:
            self.engine.add_request(
                request.request_id, list(request.prompt_token_ids), request.params
            )
        except ValueError as error:
            command.sink.deliver(InvalidRequestError(str(error)))
            return
        sinks[request.request_id] = command.sink

    def _deliver(self, output: RequestOutput, sinks: dict[str, _Sink]) -> None:
        sink = sinks.get(output.request_id)
        if sink is None:
            return  # aborted while its step ran
        logprobs = output.logprobs
        if logprobs is not None:
            # The engine reports every logprob so far; a chunk carries only the new tokens'.
            logprobs = logprobs[len(logprobs) - len(output.new_token_ids) :]
        chunk = GenerationChunk(
            new_token_ids=list(output.new_token_ids),
            new_text=output.new_text,
            finished=output.finished,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=output.num_cached_tokens,
        )
        delivered = sink.deliver(chunk)
        if output.finished or not delivered:
            del sinks[output.request_id]
            if not delivered:
                self.engine.abort_request(output.request_id)

    def _fail_all(
        self, sinks: dict[str, _Sink], unapplied: list[_Add | _Abort], error: BackendError
    ) -> None:
        """Ends every request the engine holds, and those not yet handed to it, with `error`."""
        for request_id, sink in list(sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting %s failed", request_id)
            sink.deliver(error)
        sinks.clear()
        for command in unapplied:
            if isinstance(command, _Add):
                command.sink.deliver(error)
