"""Which prompts the engine has begun computing, told to the event loop.

A prompt leaves the queue when the scheduler first puts it in the running batch. The engine has no
callback for that, and its internals are not ours to change, so this looks from outside: after
every step (`EngineThread.on_step`, on the engine thread) it compares the running batch with the
previous step's and posts the newcomers to the event loop. A prompt admitted and finished within
one step is never seen running; its caller learns it started from its output instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nori.engine.engine import LLMEngine


class StartWatch:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_started: Callable[[set[str]], None]
    ) -> None:
        self._loop = loop
        self._on_started = on_started
        # Touched on the engine thread only.
        self._previous: set[str] = set()

    def on_step(self, engine: LLMEngine) -> None:
        running = engine.running_request_ids()
        started = running - self._previous
        self._previous = running
        if started:
            self._loop.call_soon_threadsafe(self._on_started, started)
