"""The Redis client of a long-running role: a bounded pool that waits instead of failing.

redis-py's default pool raises MaxConnectionsError once 100 commands are in flight, which a
gateway under a few dozen concurrent requests reaches (each records its states in the
background). A blocking pool makes the extra commands wait for a connection, at most
`timeout_s`, and every command has a socket timeout, so no caller waits on Redis forever.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

# Connections per process: Redis serves each on one thread anyway, so more buy nothing but
# file descriptors; the writes queue in the pool instead.
MAX_CONNECTIONS = 64
# How long a command may wait for a free connection, and for Redis to answer.
POOL_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 5.0


def connect(url: str) -> Redis:
    """A client for `url` (redis://, rediss:// for TLS, with a password in the URL if any)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
    )
    return Redis(connection_pool=pool)
