"""The Redis client of a long-running role: a bounded pool that waits instead of failing.

redis-py's default pool raises MaxConnectionsError at 100 commands in flight, which a busy
gateway reaches; this blocking pool makes extra commands wait for a connection, at most
`timeout_s`, and every command has a socket timeout, so no caller waits on Redis forever. The URL
carries everything about the connection, so it is a secret: messages show it `redacted`; one
without a password takes NORI_REDIS_PASSWORD(_FILE). A worker that starts while Redis is away
waits for it (`wait_for_redis`) instead of exiting into a supervisor's restart backoff.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, TimeoutError

from nori.settings import Environment

logger = logging.getLogger(__name__)

# Connections per process: Redis serves each on one thread anyway, so more buy nothing but
# file descriptors; the writes queue in the pool instead.
MAX_CONNECTIONS = 64
# How long a command may wait for a free connection, and for Redis to answer.
POOL_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 5.0
# How often a role waiting for Redis tries again: it rejoins well within a second of Redis' return.
RETRY_S = 0.25


def connect(url: str, password: str | None = None) -> Redis:
    """A client for `url` (redis://, rediss:// for TLS, with a password in the URL if any).

    Without a password in the URL, `password`, else NORI_REDIS_PASSWORD(_FILE), if set.
    A ValueError for a URL redis-py cannot use; it names the URL with its password hidden.
    """
    extra = {}
    if not _has_password(url):
        password = password or Environment.read().redis_password
        if password:
            extra["password"] = password
    try:
        pool = BlockingConnectionPool.from_url(
            url,
            **extra,
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


def _has_password(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.password) or any(
        key == "password" for key, _ in parse_qsl(parts.query, keep_blank_values=True)
    )


async def wait_for_redis(redis: Redis, url: str, retry_s: float = RETRY_S) -> None:
    """Returns once Redis answers PING; while it cannot be reached, retries every `retry_s`.

    One log line when it is away and one when it answers, not one per try. Refused
    credentials (or any answer other than a connection failure) raise `unreachable`'s one-line
    error at once: waiting would not fix a wrong password.
    """
    waiting_since: float | None = None
    loop = asyncio.get_running_loop()
    while True:
        try:
            await redis.ping()
        except AuthenticationError as error:
            raise unreachable(url, error) from None
        except (ConnectionError, TimeoutError, OSError) as error:
            if waiting_since is None:
                waiting_since = loop.time()
                logger.warning(
                    "cannot reach Redis at %s (%s); retrying every %.2f s",
                    redacted(url),
                    error,
                    retry_s,
                )
            await asyncio.sleep(retry_s)
            continue
        except RedisError as error:
            raise unreachable(url, error) from None
        if waiting_since is not None:
            logger.warning(
                "Redis at %s answers again after %.1f s", redacted(url), loop.time() - waiting_since
            )
        return


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
