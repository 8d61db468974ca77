"""Polling for conditions that become true on Redis' clock (expiry) or a background task's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    condition: Callable[[], Awaitable[bool]], timeout_s: float = 3.0, every_s: float = 0.02
) -> None:
    """Waits until `condition()` is true; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(every_s)
