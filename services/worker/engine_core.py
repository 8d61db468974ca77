"""The engine core a worker's gRPC side drives: an LLMEngine on its own thread (`EngineThread`)
or in its own process (`nori.worker.engine_process`), chosen by `--engine-core`.

The engine is not thread-safe: one loop owns it. `call(function, *args)` queues a picklable
function applied as `function(engine, *args)` between steps; outputs reach the event loop through
`on_outputs`, and a `probe` run after each step reports to `on_probe`."""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

import torch

from nori.engine.config import EngineConfig
from nori.engine.device import resolve_device
from nori.engine.engine import LLMEngine
from nori.engine.outputs import EngineLoad, StepOutput
from nori.worker.cpu_binding import usable_cpu_count

logger = logging.getLogger(__name__)

T = TypeVar("T")

EngineCoreMode = Literal["auto", "process", "thread"]
ENGINE_CORE_MODES: tuple[EngineCoreMode, ...] = ("auto", "process", "thread")


def resolve_engine_core(
    mode: EngineCoreMode, config: EngineConfig, num_cpus: int
) -> Literal["process", "thread"]:
    """`auto`: a process of its own on CPU with one rank and at least two CPUs (`num_cpus`: its
    affinity), else a thread. Why: docs/benchmarks.md#engine-core-thread-or-process."""
    if mode != "auto":
        return mode
    on_cpu = resolve_device(config.device).type == "cpu"
    alone = config.tensor_parallel_size == 1
    return "process" if on_cpu and alone and num_cpus >= 2 else "thread"


StepProbe = Callable[[LLMEngine], object]
Operation = tuple[Callable[..., object], tuple[Any, ...], dict[str, Any], Future[object]]


def _wake(engine: LLMEngine) -> None:
    """Does nothing: `stop` queues it to wake an idle engine thread."""


@dataclass(frozen=True)
class EngineFacts:
    """What the I/O side needs to know of the engine, fixed once it is built."""

    config: EngineConfig
    # Where a decode worker's transfers land (shared memory in a process; rank 0's heads).
    kv_cache_tensors: tuple[torch.Tensor, ...]
    # Each KV tensor's dtype and per-block shape with every head (a staging receiver's layout).
    kv_block_layouts: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    # The last this many KV tensors are a draft model's.
    num_draft_kv_tensors: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        return cls(
            config=engine.config,
            kv_cache_tensors=tuple(engine.kv_cache.tensors),
            kv_block_layouts=tuple(
                (dtype, tuple(shape)) for dtype, shape in engine.kv_cache.block_layouts()
            ),
            num_draft_kv_tensors=engine.kv_cache.num_draft_tensors,
        )

    @property
    def draft_kv_bytes_per_block(self) -> int:
        count = self.num_draft_kv_tensors
        layouts = self.kv_block_layouts[len(self.kv_block_layouts) - count :] if count else ()
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in layouts
        )

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size


class EngineCore(Protocol):
    facts: EngineFacts
    # After the last step or operation; `taken_at` (time.monotonic) is the loop's last sign of life.
    load: EngineLoad

    @property
    def alive(self) -> bool: ...

    async def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    def submit(self, function: Callable[..., object], *args: Any, **kwargs: Any) -> None: ...

    async def stop(self) -> None: ...


def responsive(core: EngineCore, stall_s: float) -> bool:
    """Alive, and idle or stepped within `stall_s` (else its worker stops vouching for requests)."""
    load = core.load
    return core.alive and (not load.busy or time.monotonic() - load.taken_at < stall_s)


async def start_engine_core(
    mode: EngineCoreMode,
    config: EngineConfig,
    on_outputs: Callable[[list[StepOutput]], None],
    *,
    setup: Callable[[LLMEngine], object] | None = None,
    probe: StepProbe | None = None,
    on_probe: Callable[[Any], None] | None = None,
    on_death: Callable[[str], None] | None = None,
) -> EngineCore:
    """Builds the engine (`setup` runs on it once, where it lives) and starts its loop;
    `on_death` hears why an engine process ended while serving."""
    loop = asyncio.get_running_loop()
    num_cpus = usable_cpu_count()
    resolved = resolve_engine_core(mode, config, num_cpus)
    logger.info(
        "engine core: %s%s", resolved, f" (auto, {num_cpus} CPU(s))" if mode == "auto" else ""
    )
    if resolved == "process":
        from nori.worker.engine_process import EngineProcess

        process = EngineProcess(config, loop, on_outputs, setup, probe, on_probe, on_death)
        await process.start()
        return process
    engine = await asyncio.to_thread(LLMEngine, config)
    if setup is not None:
        setup(engine)
    thread = EngineThread(engine, loop, on_outputs, probe, on_probe)
    thread.start()
    return thread


def result_of_step(
    engine: LLMEngine, probe: StepProbe | None
) -> tuple[list[StepOutput], object | None]:
    """One step's outputs and probe; a step that raises fails its batch, the engine serves on."""
    try:
        outputs = engine.step()
    except Exception:
        logger.exception("engine step failed; aborting the running requests")
        outputs = engine.abort_all()
    return outputs, probe(engine) if probe is not None else None


def load_of(engine: LLMEngine) -> EngineLoad:
    return replace(engine.load(), taken_at=time.monotonic())


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        probe: StepProbe | None = None,
        on_probe: Callable[[Any], None] | None = None,
    ) -> None:
        """`on_outputs` and `on_probe` run on the event loop; `probe` on the engine thread."""
        self.engine = engine
        self.facts = EngineFacts.of(engine)
        self._loop = loop
        self._on_outputs = on_outputs
        self._probe = probe
        self._on_probe = on_probe
        self._operations: queue.SimpleQueue[Operation] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nori-engine", daemon=True)
        self.load = load_of(engine)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    async def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        future: Future[object] = Future()
        self._operations.put((function, args, kwargs, future))
        result = await asyncio.wrap_future(future, loop=self._loop)
        return result  # type: ignore[return-value]

    def submit(self, function: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Queues `function(engine, *args, **kwargs)` without waiting."""
        self._operations.put((function, args, kwargs, Future()))

    async def stop(self) -> None:
        self._stopping.set()
        self._operations.put((_wake, (), {}, Future()))  # wake the thread
        await asyncio.to_thread(self._thread.join, 10.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._apply_operations(block=not busy)
            if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                continue
            outputs, probed = result_of_step(self.engine, self._probe)
            self.load = load_of(self.engine)
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)
            if probed is not None and self._on_probe is not None:
                self._loop.call_soon_threadsafe(self._on_probe, probed)

    def _apply_operations(self, block: bool) -> None:
        try:
            # Idle: sleep until an operation arrives (stop() sends one).
            item = self._operations.get() if block else self._operations.get_nowait()
        except queue.Empty:
            return
        while True:
            function, args, kwargs, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(self.engine, *args, **kwargs))
                except BaseException as error:
                    future.set_exception(error)
            try:
                item = self._operations.get_nowait()
            except queue.Empty:
                break
        self.load = load_of(self.engine)
