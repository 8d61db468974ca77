"""The Redis client of a long-running role: a bounded pool that waits instead of failing.

redis-py's default pool raises MaxConnectionsError once 100 commands are in flight, which a
gateway under a few dozen concurrent requests reaches (each records its states in the
background). A blocking pool makes the extra commands wait for a connection, at most
`timeout_s`, and every command has a socket timeout, so no caller waits on Redis forever.

The URL carries everything about the connection (password, `rediss://` with its `ssl_*` query
arguments), so it is a secret: messages show it through `redacted`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import AuthenticationError

# Connections per process: Redis serves each on one thread anyway, so more buy nothing but
# file descriptors; the writes queue in the pool instead.
MAX_CONNECTIONS = 64
# How long a command may wait for a free connection, and for Redis to answer.
POOL_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 5.0


def connect(url: str) -> Redis:
    """A client for `url` (redis://, rediss:// for TLS, with a password in the URL if any).

    A ValueError for a URL redis-py cannot use; it names the URL with its password hidden.
    """
    try:
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
        )
        # redis-py passes unknown query arguments on to the connection, which would raise a
        # TypeError at the first command (`ssl_ca_certs` on redis:// for one): make one now,
        # which does no I/O, so a bad URL is a one-line error at startup.
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, ValueError) as error:
        hint = "; TLS arguments (ssl_*) need rediss://" if "'ssl_" in str(error) else ""
        raise ValueError(f"cannot use the Redis URL {redacted(url)} ({error}){hint}") from None
    return Redis(connection_pool=pool)


def redacted(url: str) -> str:
    """`url` with its password (in the user part or a `password=` argument) shown as ***."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.netloc.rpartition("@")[0].partition(":")[0]
        netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    query = parts.query
    arguments = parse_qsl(query, keep_blank_values=True)
    if any(key == "password" for key, _ in arguments):
        hidden = [(key, "***" if key == "password" else value) for key, value in arguments]
        query = urlencode(hidden, safe="*/")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def unreachable(url: str, error: Exception) -> ValueError:
    """The one-line error of a role whose Redis did not answer its first PING."""
    if isinstance(error, AuthenticationError):
        return ValueError(
            f"Redis at {redacted(url)} refused the credentials ({error}); check the password "
            "in --redis-url / REDIS_URL (redis://[USER]:PASSWORD@HOST:PORT/DB)"
        )
    return ValueError(
        f"cannot reach Redis at {redacted(url)} ({error}); start one, or pass --redis-url / "
        "set REDIS_URL"
    )
