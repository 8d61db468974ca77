"""What the prefill engine did in a step that the event loop must hear of: prompts it began
computing and prefix-cache block events. `probe_step` runs in the engine loop after each step;
`StartWatch` reports prompts new to the running batch. A prompt admitted and finished in one step
is never seen running (its output says it started).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nori.engine.block_manager import BlockEvent
from nori.engine.engine import LLMEngine


@dataclass(frozen=True)
class StepProbed:
    running_request_ids: frozenset[str]
    block_events: tuple[BlockEvent, ...]


def probe_step(engine: LLMEngine) -> StepProbed:
    """In the engine loop, after a step (module-level: it goes to an engine process by name)."""
    running = engine.load().running_request_ids
    return StepProbed(running, tuple(engine.kv_cache.drain_block_events()))


def record_block_events(engine: LLMEngine) -> None:
    """The prefill engine's setup: keep a log of its prefix cache's blocks for `probe_step`."""
    engine.kv_cache.record_block_events()


def cached_block_hashes(engine: LLMEngine) -> list[bytes]:
    """Every block the engine's prefix cache can serve now (the directory's refresh)."""
    return engine.kv_cache.cached_block_hashes()


class StartWatch:
    def __init__(self, on_started: Callable[[set[str]], None]) -> None:
        self._on_started = on_started
        self._previous: frozenset[str] = frozenset()

    def on_running(self, running: frozenset[str]) -> None:
        started = set(running - self._previous)
        self._previous = running
        if started:
            self._on_started(started)
