"""A `Backend` that runs an in-process `LLMEngine` (single-process serving and HTTP-layer tests).

The engine runs on its own thread (`EngineThread`, the same one every worker uses); this file only
adds what the HTTP layer needs on top: a bound on unfinished requests, engine errors mapped to
backend errors, and shutdown ending the streams that are still open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import StepOutput
from nori.gateway.backend import BackendHealth, GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, InvalidRequestError, QueueFullError
from nori.sampling.tokenizer import Tokenizer
from nori.worker.engine_core import EngineThread
from nori.worker.servicer_base import OutputStreams

_SHUTDOWN = "the local engine is shutting down"


def chunk_from_output(output: StepOutput) -> GenerationChunk:
    logprobs = output.logprobs
    if logprobs is not None:
        # The engine reports every logprob so far; a chunk carries only the new tokens'.
        logprobs = logprobs[len(logprobs) - len(output.new_token_ids) :]
    return GenerationChunk(
        new_token_ids=list(output.new_token_ids),
        new_text=output.new_text,
        finished=output.finished,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        logprobs=logprobs,
        num_cached_tokens=output.num_cached_tokens,
        # With the first tokens only, as a worker sends them.
        prompt_logprobs=(
            output.prompt_logprobs if len(output.new_token_ids) == len(output.token_ids) else None
        ),
    )


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
        self._num_unfinished = 0
        self._streams = OutputStreams()
        # Started on first use: it delivers outputs to the event loop that serves the requests.
        self._thread: EngineThread | None = None
        self._closed = False
        self._shutdown = asyncio.Event()

    @classmethod
    def from_model(
        cls, model: str, max_queued_requests: int = 1024, **engine_options: Any
    ) -> LocalEngineBackend:
        """Loads `model` ("demo" or a checkpoint folder); options are EngineConfig fields."""
        return cls(LLMEngine(EngineConfig(model=model, **engine_options)), max_queued_requests)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.model.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.model.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model.config.vocab_size)

    def _engine_thread(self) -> EngineThread:
        if self._thread is None:
            loop = asyncio.get_running_loop()
            self._thread = EngineThread(self.engine, loop, self._streams.dispatch)
            self._thread.start()
        return self._thread

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._closed:
            raise BackendError("the local engine is shut down")
        if self._num_unfinished >= self._max_unfinished:
            raise QueueFullError(
                f"the engine already has {self._num_unfinished} unfinished requests "
                f"(limit {self._max_unfinished}); retry later"
            )
        thread = self._engine_thread()
        request_id = request.request_id
        prompt, params, priority = list(request.prompt_token_ids), request.params, request.priority
        try:
            queue = self._streams.open(request_id)
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        self._num_unfinished += 1
        finished = False
        try:
            try:
                await thread.call(
                    LLMEngine.add_request, request_id, prompt, params, priority=priority
                )
            except ValueError as error:
                finished = True
                raise InvalidRequestError(str(error)) from None
            while not finished:
                output = await self._next(queue)
                finished = output.finished
                yield chunk_from_output(output)
        finally:
            self._streams.close(request_id)
            self._num_unfinished -= 1
            if not finished and not self._closed:
                # Closed or cancelled early: the engine drops the request and frees its blocks.
                thread.submit(lambda engine: engine.abort_request(request_id))

    async def _next(self, queue: asyncio.Queue[StepOutput]) -> StepOutput:
        """The next output, or BackendError when the backend shuts down first."""
        if queue.empty() and self._shutdown.is_set():
            raise BackendError(_SHUTDOWN)
        getter = asyncio.ensure_future(queue.get())
        shutdown = asyncio.ensure_future(self._shutdown.wait())
        try:
            await asyncio.wait({getter, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            shutdown.cancel()
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        raise BackendError(_SHUTDOWN)

    async def health(self) -> BackendHealth:
        alive = not self._closed and (self._thread is None or self._thread.alive)
        detail = "" if alive else "the local engine is shut down"
        return BackendHealth(healthy=alive, workers={"local": int(alive)}, detail=detail)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shutdown.set()
        if self._thread is not None:
            await self._thread.stop()
