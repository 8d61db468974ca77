"""Each request's progress through the cluster, with the time it entered every state.

One hash per request: `state` (the latest), `t_<state>` for every state it has been in, and
free-form fields the writers add (which workers served it, token counts, the error). The gateway
and the workers write it; the TTL bounds how long finished requests stay around for inspection.
"""

from __future__ import annotations

import enum
import time

from redis.typing import EncodableT

from nori.state.codec import as_str_mapping
from nori.state.store import RedisStore


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
        """Records that the request entered `state` now; returns the timestamp written.

        Extra fields are stored as strings. `state` and `t_*` are reserved for this method.
        """
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
