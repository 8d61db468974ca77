"""A batch's work in Redis: the lines still to run, which runner holds which, the counts.

Per batch, under `{namespace}:batch:{id}:`: `lines`, a stream (field `i`: index among valid
lines) read by the group `runners`; `completed` and `failed` sets; `seeded`; `lock:WHAT`. A claim
not renewed for `lease_ms` is taken over (XAUTOCLAIM). Not the truth: `seed` rebuilds it all."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from nori.batch.store import BatchStore, RequestCounts
from nori.state.keys import Keys

GROUP = "runners"
KEY_GRACE_S = 24 * 3600
# Tries of a line's acknowledgement, 0.1 s apart and doubling: well inside a lease, so a broken
# pooled connection does not get a durable line run again elsewhere.
ACK_ATTEMPTS = 6
ACK_FIRST_DELAY_S = 0.1


@dataclass(frozen=True)
class Claim:
    entry_id: str
    index: int  # into BatchStore.valid_lines
    # Taken over from a runner that stopped renewing it (it may have finished it meanwhile).
    reclaimed: bool = False


class BatchJobs:
    def __init__(self, redis: Redis, keys: Keys, lease_ms: int = 30_000) -> None:
        self.redis = redis
        self.keys = keys
        self.lease_ms = lease_ms

    def _key(self, batch_id: str, part: str) -> str:
        return self.keys.batch(batch_id, part)

    async def _expire_all(self, batch_id: str, expires_at: float) -> None:
        ttl = max(3600, int(expires_at - time.time()) + KEY_GRACE_S)
        pipe = self.redis.pipeline(transaction=False)
        for part in ("lines", "completed", "failed", "seeded"):
            pipe.expire(self._key(batch_id, part), ttl)
        await pipe.execute()

    async def lock(self, batch_id: str, what: str, ttl_ms: int) -> bool:
        return bool(
            await self.redis.set(self._key(batch_id, f"lock:{what}"), "1", nx=True, px=ttl_ms)
        )

    async def unlock(self, batch_id: str, what: str) -> None:
        await self.redis.delete(self._key(batch_id, f"lock:{what}"))

    async def is_seeded(self, batch_id: str) -> bool:
        return bool(await self.redis.exists(self._key(batch_id, "seeded")))

    async def seed(self, batch_id: str, store: BatchStore) -> bool:
        """Rebuilds the queue and counts from the directory (lines with a durable result not
        queued); False when another runner is doing it."""
        if not await self.lock(batch_id, "seed", 60_000):
            return False
        try:
            if await self.is_seeded(batch_id):
                return True
            validated = store.validated(batch_id) or {"errors": []}
            results = store.read_results(batch_id)
            lines = store.valid_lines(batch_id)
            stream = self._key(batch_id, "lines")
            pipe = self.redis.pipeline(transaction=True)
            for part in ("lines", "completed", "failed"):
                pipe.delete(self._key(batch_id, part))
            pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
            for index, line in enumerate(lines):
                if line.line not in results:
                    pipe.xadd(stream, {"i": index})
            completed = [n for n, r in results.items() if r.ok]
            failed = [n for n, r in results.items() if not r.ok]
            failed += [int(e["line"]) for e in validated["errors"]]
            if completed:
                pipe.sadd(self._key(batch_id, "completed"), *completed)
            if failed:
                pipe.sadd(self._key(batch_id, "failed"), *failed)
            pipe.set(self._key(batch_id, "seeded"), "1")
            await pipe.execute()
            await self._expire_all(batch_id, float(store.batch_request(batch_id)["expires_at"]))
            return True
        finally:
            await self.unlock(batch_id, "seed")

    async def claim(self, batch_id: str, consumer: str, count: int) -> list[Claim]:
        """Up to `count` lines for `consumer`, reclaimed ones first; [] when not seeded."""
        stream = self._key(batch_id, "lines")
        claims: list[Claim] = []
        try:
            reply = await self.redis.xautoclaim(
                stream, GROUP, consumer, self.lease_ms, start_id="0-0", count=count
            )
            claims += _claims(reply[1], reclaimed=True)
            if len(claims) < count:
                read: Any = await self.redis.xreadgroup(
                    GROUP, consumer, {stream: ">"}, count=count - len(claims)
                )
                for _, entries in read or []:
                    claims += _claims(entries)
        except ResponseError as error:
            if "NOGROUP" in str(error):
                return []
            raise
        return claims

    async def renew(self, batch_id: str, consumer: str, entry_ids: list[str]) -> None:
        if entry_ids:
            try:
                await self.redis.xclaim(
                    self._key(batch_id, "lines"),
                    GROUP,
                    consumer,
                    0,
                    list[Any](entry_ids),
                    justid=True,
                )
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise

    async def done(self, batch_id: str, entry_id: str, line: int, ok: bool) -> None:
        """The line's result is durable: off the queue, into the counts."""
        stream = self._key(batch_id, "lines")
        delay_s = ACK_FIRST_DELAY_S
        for attempt in range(ACK_ATTEMPTS):
            # Every command here may run twice (XACK, XDEL, SADD): a retry is safe.
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(stream, GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            pipe.sadd(self._key(batch_id, "completed" if ok else "failed"), line)
            try:
                await pipe.execute()
                return
            except (RedisConnectionError, RedisTimeoutError):
                if attempt == ACK_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(delay_s)
            delay_s *= 2

    async def counts(self, batch_id: str, total: int) -> RequestCounts | None:
        """The live counts; None when Redis does not have the batch (then read the disk)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self._key(batch_id, "seeded"))
        pipe.scard(self._key(batch_id, "completed"))
        pipe.scard(self._key(batch_id, "failed"))
        seeded, completed, failed = await pipe.execute()
        if not seeded:
            return None
        return RequestCounts(total, int(completed), int(failed))

    async def num_queued(self, batch_id: str) -> int:
        try:
            return int(await self.redis.xlen(self._key(batch_id, "lines")))
        except ResponseError:
            return 0

    async def forget(self, batch_id: str) -> None:
        await self.redis.delete(
            *(self._key(batch_id, part) for part in ("lines", "completed", "failed", "seeded"))
        )


def _claims(
    entries: list[tuple[bytes | str, dict[bytes | str, bytes | str]]], reclaimed: bool = False
) -> list[Claim]:
    claims = []
    for entry_id, fields in entries:
        if not fields:  # deleted meanwhile (XAUTOCLAIM of an acknowledged entry)
            continue
        raw = fields.get(b"i", fields.get("i"))
        if raw is None:
            continue
        claims.append(Claim(_text(entry_id), int(raw), reclaimed))
    return claims


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
