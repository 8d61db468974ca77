"""The Redis client of a long-running role: a bounded pool that waits instead of failing.

Extra commands wait for a connection (at most `timeout_s`) rather than raise, and every command
has a socket timeout. The URL is a secret (messages show it `redacted`); one without a password
takes NORI_REDIS_PASSWORD(_FILE). A starting worker waits for Redis (`wait_for_redis`)."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, TimeoutError

from nori.settings import Environment

logger = logging.getLogger(__name__)

# Connections per process: Redis serves each on one thread, so more buy only descriptors.
MAX_CONNECTIONS = 64
POOL_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 5.0
RETRY_S = 0.25


def connect(url: str, password: str | None = None) -> Redis:
    """A client for `url` (redis://, rediss:// for TLS); without a password in it, `password`,
    else NORI_REDIS_PASSWORD(_FILE). ValueError (password hidden) for an unusable URL."""
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
        # Build one connection now (no I/O), so a bad query argument fails at startup.
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
    """Returns once Redis answers PING, retrying every `retry_s` (one log line when away, one
    when back). Refused credentials, or any other answer, raise `unreachable`'s error at once."""
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
