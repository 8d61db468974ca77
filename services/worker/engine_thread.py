"""An LLMEngine on its own thread, driven from asyncio.

The engine is not thread-safe and a step can take tens of milliseconds, so it lives on one thread
that alternates between applying queued operations (add, abort, reserve, ...) and stepping. The
asyncio side never touches the engine: it sends operations with `call` and receives each step's
outputs on the event loop through `on_outputs`. gRPC handlers, KV transfers and Redis heartbeats
keep running while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TypeVar

from nori.engine.engine import LLMEngine
from nori.engine.outputs import EngineLoad, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        """`on_outputs` runs on the event loop; `on_step` on the engine thread after each step
        (e.g. to drain block events)."""
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_step = on_step
        self._operations: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], Future[object]]]
        self._operations = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nori-engine", daemon=True)
        self.load = self._snapshot()

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def responsive(self, stall_s: float) -> bool:
        """Alive, and idle or done with a step within `stall_s`: a step that takes longer is a
        wedged engine (a worker stops vouching for its requests then, e.g. lease renewals)."""
        load = self.load
        return self.alive and (not load.busy or time.monotonic() - load.taken_at < stall_s)

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    async def call(self, operation: Callable[[LLMEngine], T]) -> T:
        """Runs `operation(engine)` on the engine thread between steps and returns its result."""
        future: Future[object] = Future()
        self._operations.put((operation, future))
        result = await asyncio.wrap_future(future, loop=self._loop)
        return result  # type: ignore[return-value]

    def submit(self, operation: Callable[[LLMEngine], object]) -> None:
        """Queues `operation(engine)` without waiting (cleanup from a cancelled coroutine)."""
        self._operations.put((operation, Future()))

    async def stop(self) -> None:
        self._stopping.set()
        self._operations.put((lambda engine: None, Future()))  # wake the thread
        await asyncio.to_thread(self._thread.join, 10.0)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._apply_operations(block=not busy)
            if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
                if self._on_step is not None:
                    self._on_step(self.engine)
            except Exception:
                # A bug, not bad input (that is rejected when added): fail the batch, keep serving.
                logger.exception("engine step failed; aborting the running requests")
                outputs = self.engine.abort_all()
            self.load = self._snapshot()
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _apply_operations(self, block: bool) -> None:
        try:
            # Idle: sleep until an operation arrives (stop() sends one). Busy: only take what is
            # already queued.
            item = self._operations.get() if block else self._operations.get_nowait()
        except queue.Empty:
            return
        while True:
            operation, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(operation(self.engine))
                except BaseException as error:
                    future.set_exception(error)
            try:
                item = self._operations.get_nowait()
            except queue.Empty:
                break
        self.load = self._snapshot()

    def _snapshot(self) -> EngineLoad:
        return replace(self.engine.load(), taken_at=time.monotonic())
