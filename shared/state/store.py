"""What every Redis-backed store shares: the client, the key names, and a TTL on all it writes."""

from __future__ import annotations

from typing import ClassVar

from redis.asyncio import Redis

from nori.state.keys import Keys


class RedisStore:
    # Each store's own default: how long what it writes outlives its writer's silence.
    default_ttl_s: ClassVar[float]

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float | None = None) -> None:
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._redis = redis
        self._keys = keys
        self.ttl_s = ttl_s
        self._ttl_ms = max(1, round(ttl_s * 1000))
