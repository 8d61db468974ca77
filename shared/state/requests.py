"""Each request's progress through the cluster, with the time it entered every state.

One hash per request: `state` (the latest), `t_<state>` for every state it has been in and the
writers' own fields, under a TTL. `StateRecorder` writes in the background: none waits on Redis."""

from __future__ import annotations

import asyncio
import enum
import logging
import time

from redis.typing import EncodableT

from nori.repeated_log import RepeatedFailureLog
from nori.state.codec import as_str_mapping
from nori.state.store import RedisStore

logger = logging.getLogger(__name__)


class RequestState(enum.StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED)


class RequestStateStore(RedisStore):
    default_ttl_s = 3600.0

    async def set_state(
        self, request_id: str, state: RequestState | str, /, **fields: str | int | float
    ) -> float:
        """Records that the request entered `state` now; returns the timestamp written. Extra
        fields are stored as strings; `state` and `t_*` are reserved for this method."""
        state = RequestState(state)  # refuses an unknown state name with ValueError
        reserved = [name for name in fields if name == "state" or name.startswith("t_")]
        if reserved:
            raise ValueError(f"fields {reserved} are reserved for the state and its timestamps")
        now = time.time()
        mapping: dict[EncodableT, EncodableT] = {name: str(v) for name, v in fields.items()}
        mapping["state"] = state.value
        mapping[f"t_{state.value}"] = repr(now)
        key = self._keys.request(request_id)
        # MULTI/EXEC: the hash never exists without its TTL, and every write refreshes it.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()
        return now

    async def get(self, request_id: str) -> dict[str, str] | None:
        raw = await self._redis.hgetall(self._keys.request(request_id))
        return as_str_mapping(raw) if raw else None


class StateRecorder:
    """At most `max_pending` writes in flight: beyond that a state is dropped and counted (the
    record is for observability; the request does not depend on it)."""

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
