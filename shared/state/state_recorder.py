"""Request states written to Redis in the background, off the request's own path.

A request must not wait on Redis to make progress, and a slow Redis must not pile up tasks: at
most `max_pending` writes are in flight; beyond that a state is dropped and counted (the record is
for observability, the request itself does not depend on it).
"""

from __future__ import annotations

import asyncio
import logging

from nori.repeated_log import RepeatedFailureLog
from nori.state.requests import RequestStateStore

logger = logging.getLogger(__name__)


class StateRecorder:
    def __init__(self, store: RequestStateStore, max_pending: int = 1024) -> None:
        self._store = store
        self._max_pending = max_pending
        self._pending: set[asyncio.Task[None]] = set()
        self.dropped = 0
        self._failures = RepeatedFailureLog(logger, "recording request states in Redis")

    def record(self, request_id: str, state: str, **fields: str | int | float) -> None:
        if len(self._pending) >= self._max_pending:
            self.dropped += 1
            return
        task = asyncio.get_running_loop().create_task(self._write(request_id, state, fields))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(
        self, request_id: str, state: str, fields: dict[str, str | int | float]
    ) -> None:
        try:
            await self._store.set_state(request_id, state, **fields)
        except Exception as error:
            self._failures.failed(error)

    async def flush(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
