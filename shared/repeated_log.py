"""A failure that repeats (Redis away, a peer down) logged once with a count, not per request:
the first with its traceback; later ones within `interval_s` are only counted, and the next log
line says how many there were and the last error."""

from __future__ import annotations

import logging
import time


class RepeatedFailureLog:
    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._what = what
        self._interval_s = interval_s
        self._last_logged = -float("inf")
        self._unlogged = 0
        self.total = 0

    def failed(self, error: BaseException) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last_logged < self._interval_s:
            self._unlogged += 1
            return
        if self._unlogged:
            self._logger.warning(
                "%s failed %d more times in the last %.0f s; now: %s",
                self._what,
                self._unlogged,
                now - self._last_logged,
                error,
            )
        else:
            self._logger.warning("%s failed: %s", self._what, error, exc_info=error)
        self._last_logged = now
        self._unlogged = 0
