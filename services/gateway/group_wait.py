"""The wait of a batch member that found every worker full (see ClusterOptions.group_wait_s)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


class GroupWait:
    """Backoff, 50 ms doubling up to 1 s, until `limit_s` after the first turn.

    A single request that finds every worker full gets 429 at once (limit 0): its client is
    the one to retry. A batch was admitted as a whole, and its own running members free the
    room the rest need, so they wait for it instead of failing the batch.
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit_s = limit_s
        self._clock = clock
        self._deadline: float | None = None
        self._delay_s = FIRST_DELAY_S

    async def turn(self, woken: asyncio.Future[None] | None = None) -> bool:
        """Waits before the next try, or until `woken` is done (room freed), whichever comes
        first; False (without waiting) once the time is up. `woken` is cancelled either way."""
        try:
            if self._limit_s <= 0:
                return False
            now = self._clock()
            if self._deadline is None:
                self._deadline = now + self._limit_s
            if now >= self._deadline:
                return False
            delay_s = min(self._delay_s, self._deadline - now)
            if woken is None:
                await asyncio.sleep(delay_s)
            else:
                await asyncio.wait([woken], timeout=delay_s)
            self._delay_s = min(self._delay_s * 2, MAX_DELAY_S)
            return True
        finally:
            if woken is not None:
                woken.cancel()
