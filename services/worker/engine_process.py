"""The engine core in a process of its own (`--engine-core process`), as vLLM's V1 engine core.

Two pipes: to the engine `(call_id, function, args, kwargs)` (`call_id` None: nobody waits) or
`None` to stop; to the worker `(answers, outputs, load, probed)` once per engine loop turn. The KV
cache is in shared memory, so transfers land in it. The process dies with its worker
(PR_SET_PDEATHSIG); if it dies first, pending operations fail and the worker exits (`on_death`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch.multiprocessing

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import EngineLoad, StepOutput
from nori.parent_death import exit_with_parent
from nori.worker.engine_core import (
    EngineFacts,
    StepProbe,
    load_of,
    result_of_step,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

Answer = tuple[int, bool, object]


class EngineProcessDied(RuntimeError):
    """The engine process ended while the worker still needed it."""


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        setup: Callable[[LLMEngine], object] | None = None,
        probe: StepProbe | None = None,
        on_probe: Callable[[Any], None] | None = None,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self._loop = loop
        self._on_outputs = on_outputs
        self._setup = setup
        self._probe = probe
        self._on_probe = on_probe
        self._on_death = on_death
        self._call_ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._stopping = False
        self._dead_reason: str | None = None
        self.load = EngineLoad(taken_at=time.monotonic())
        context = torch.multiprocessing.get_context("spawn")
        self._operations_in, self._operations_out = context.Pipe(duplex=False)
        self._turns_in, self._turns_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=engine_main,
            args=(
                self._operations_in,
                self._turns_out,
                config,
                setup,
                probe,
                os.getpid(),
            ),
            name="nori-engine",
        )
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="nori-engine-writer", daemon=True)

    async def start(self) -> None:
        """Starts the process and waits until its engine is built (raising what building raised)."""
        self._process.start()
        self._operations_in.close()  # the engine's ends: theirs now
        self._turns_out.close()
        try:
            kind, payload = await asyncio.to_thread(self._turns_in.recv)
        except EOFError:
            code = await asyncio.to_thread(self._join, 5.0)
            raise EngineProcessDied(
                f"the engine process exited (code {code}) while loading"
            ) from None
        if kind != "ready":
            await asyncio.to_thread(self._join, 10.0)
            raise EngineProcessDied(f"the engine process could not load the model:\n{payload}")
        self.facts: EngineFacts
        self.facts, self.load = payload
        self._writer.start()
        self._loop.add_reader(self._turns_in.fileno(), self._read)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._dead_reason is None and not self._stopping and self._process.is_alive()

    async def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs `function(engine, *args, **kwargs)` in the engine process between steps; it must
        pickle by reference (a module-level function or an LLMEngine method)."""
        if self._dead_reason is not None:
            raise EngineProcessDied(self._dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = future
        try:
            self._outbox.put((call_id, function, args, kwargs))
            return await future
        finally:
            self._pending.pop(call_id, None)

    def submit(self, function: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Queues `function(engine, *args, **kwargs)` without waiting; a no-op once dead."""
        if self._dead_reason is None:
            self._outbox.put((None, function, args, kwargs))

    async def stop(self) -> None:
        self._stopping = True
        self._outbox.put(None)  # the engine stops after what is queued before it
        await asyncio.to_thread(self._join, 10.0)
        self._forget_reader()
        self._turns_in.close()

    def _write(self) -> None:
        """The writer thread: operations to the pipe, in order, until None."""
        while True:
            message = self._outbox.get()
            try:
                self._operations_out.send(message)
            except (OSError, ValueError):
                return  # the engine went: its reader tells the worker
            except Exception as error:  # an argument that does not pickle: that call fails
                call_id = message[0] if isinstance(message, tuple) else None
                self._loop.call_soon_threadsafe(self._fail_call, call_id, error)
                continue
            if message is None:
                self._operations_out.close()
                return

    def _fail_call(self, call_id: int | None, error: Exception) -> None:
        future = self._pending.get(call_id) if call_id is not None else None
        if future is not None and not future.done():
            future.set_exception(error)

    def _join(self, timeout_s: float) -> int | None:
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        return self._process.exitcode

    def _read(self) -> None:
        try:
            while self._turns_in.poll():
                answers, outputs, load, probed = self._turns_in.recv()
                self.load = load
                for call_id, ok, value in answers:
                    future = self._pending.get(call_id)
                    if future is None or future.done():
                        continue  # its caller gave up (cancelled)
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
                if outputs:
                    self._on_outputs(outputs)
                if probed is not None and self._on_probe is not None:
                    self._on_probe(probed)
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        self._forget_reader()
        if self._stopping or self._dead_reason is not None:
            return
        self._process.join(1.0)
        reason = f"the engine process ended (exit code {self._process.exitcode})"
        self._dead_reason = reason
        if self._on_death is not None:
            self._on_death(reason)  # a worker exits here
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineProcessDied(reason))

    def _forget_reader(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # closed already
            self._loop.remove_reader(self._turns_in.fileno())


def engine_main(
    operations: Connection,
    turns: Connection,
    config: EngineConfig,
    setup: Callable[[LLMEngine], object] | None,
    probe: StepProbe | None,
    worker_pid: int,
) -> None:
    """The engine process: builds the engine, then applies operations and steps until told to
    stop or its worker goes, then ends at once (`os._exit`, no interpreter teardown)."""
    exit_with_parent(worker_pid, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        engine = LLMEngine(config)
        if setup is not None:
            setup(engine)
        for tensor in engine.kv_cache.tensors:
            tensor.share_memory_()  # in place: the engine's own views see the same memory
        turns.send(("ready", (EngineFacts.of(engine), load_of(engine))))
        # What start-up made lives as long as the process: out of the collector's scans.
        gc.collect()
        gc.freeze()
    except BaseException:
        turns.send(("failed", traceback.format_exc()))
        return
    try:
        _serve(engine, operations, turns, probe)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the worker went
    finally:
        engine.close()
    logging.shutdown()
    os._exit(0)


def _serve(
    engine: LLMEngine, operations: Connection, turns: Connection, probe: StepProbe | None
) -> None:
    while True:
        answers, stop = _apply_operations(
            engine, operations, block=not engine.has_unfinished_requests()
        )
        outputs: list[StepOutput] = []
        probed = None
        if not stop and engine.has_unfinished_requests():
            outputs, probed = result_of_step(engine, probe)
        _send_turn(turns, answers, outputs, load_of(engine), probed)
        if stop:
            return


def _apply_operations(
    engine: LLMEngine, connection: Connection, block: bool
) -> tuple[list[Answer], bool]:
    answers: list[Answer] = []
    if not block and not connection.poll():
        return answers, False
    while True:
        message = connection.recv()  # blocks only for the first one when idle
        if message is None:
            return answers, True
        call_id, function, args, kwargs = message
        try:
            result = function(engine, *args, **kwargs)
        except Exception as error:
            if call_id is None:
                logger.warning("engine operation %s failed", function, exc_info=True)
            else:
                answers.append((call_id, False, error))
        else:
            if call_id is not None:
                answers.append((call_id, True, result))
        if not connection.poll():
            return answers, False


def _send_turn(
    connection: Connection,
    answers: list[Answer],
    outputs: list[StepOutput],
    load: EngineLoad,
    probed: object | None,
) -> None:
    # The worker never reads an output's prompt or whole text: keep them off the pipe.
    outputs = [replace(output, prompt_token_ids=[], text="") for output in outputs]
    try:
        connection.send((answers, outputs, load, probed))
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        # An answer that does not pickle fails its calls, not the engine.
        safe = [
            (call_id, False, RuntimeError(f"the engine's answer could not be sent: {error}"))
            for call_id, _, _ in answers
        ]
        connection.send((safe, outputs, load, probed))
