"""What the prefill engine did in a step that the event loop must hear of: which prompts it has
begun computing, and which blocks it stored in or evicted from its prefix cache; with the
engine operations that record and list those blocks.

A prompt leaves the queue when the scheduler first puts it in the running batch. The engine has no
callback for that, and its internals are not ours to change, so this looks from outside:
`probe_step` runs in the engine loop after every step (the engine core's probe, in the engine's
thread or process) and takes the running batch and the block events; `StartWatch`, on the event
loop, compares the running batch with the previous step's and reports the newcomers. A prompt
admitted and finished within one step is never seen running; its caller learns it started from
its output instead.
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
    """In the engine loop, after a step (a module-level function: it goes to an engine process
    by name)."""
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
        """On the event loop, with each step's running batch."""
        started = set(running - self._previous)
        self._previous = running
        if started:
            self._on_started(started)
