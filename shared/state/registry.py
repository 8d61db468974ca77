"""The worker registry: who is in the cluster, what it serves, and how loaded it is.

Each worker owns one Redis hash that expires `ttl_s` after its last heartbeat. With a cluster
secret every entry is signed over all of its fields (`nori.state.entry_signing`) and the gateway
routes only to entries that verify; without one nothing is signed or checked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from redis.asyncio import Redis
from redis.typing import EncodableT

from nori.cluster_auth import ClusterAuth
from nori.settings import WORKER_ROLES, WorkerRole
from nori.state.codec import RawMapping, as_str, as_str_mapping
from nori.state.entry_signing import SIGNATURE_FIELD, RefusalReason, check_entry, sign_entry
from nori.state.keys import Keys
from nori.state.store import RedisStore

logger = logging.getLogger(__name__)

_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"0", "false", "no", ""})


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the registry stores it: identity, addresses, and its latest load figures."""

    worker_id: str
    role: WorkerRole
    grpc_address: str = ""  # "host:port"
    transfer_address: str = ""  # "" when the worker does not send or receive KV blocks
    metrics_address: str = ""  # "host:port" of its Prometheus /metrics; "" when it serves none
    model: str = ""  # the served model name
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_bytes_received: int = 0
    kv_bytes_sent: int = 0
    # One engine step's cost as the worker fits it (nori.engine.step_cost); 0.0 until fitted.
    step_fixed_s: float = 0.0
    step_per_row_s: float = 0.0
    step_per_token_s: float = 0.0
    draining: bool = False  # finishing its requests before leaving: route nothing new to it
    # KV block size in tokens (the gateway hashes prompts in blocks of it); 0: not stated.
    block_size: int = 0
    # The KV cache's element type; blocks move as stored, so all workers must agree. "": unknown.
    kv_cache_dtype: str = ""
    # SpeculativeConfig.as_json(); "" (or absent, an older writer) when off.
    speculative_config: str = ""
    # Capacity: rows run at once (--max-num-seqs), calls served at once (rows + queue); 0: unknown.
    max_num_seqs: int = 0
    max_open_calls: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0  # stamped by the registry on every write
    # Past it the entry is stale (signed: refused); updated_at + the TTL.
    expires_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.role not in WORKER_ROLES:
            raise ValueError(
                f"unknown worker role {self.role!r}; expected one of {sorted(WORKER_ROLES)}"
            )

    def to_mapping(self) -> dict[str, str]:
        """The Redis hash fields: every value a string, booleans as "1"/"0"."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                out[f.name] = "1" if value else "0"
            elif isinstance(value, float):
                out[f.name] = repr(value)  # repr round-trips a float exactly
            else:
                out[f.name] = str(value)
        return out

    @classmethod
    def from_mapping(cls, mapping: RawMapping) -> WorkerInfo:
        """Parses a hash written by `to_mapping` (perhaps by another Nori version): unknown fields
        ignored, missing ones defaulted; worker_id and role required; ValueError if malformed."""
        raw = as_str_mapping(mapping)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            text = raw[f.name]
            if f.type in ("int", int):
                kwargs[f.name] = int(text)
            elif f.type in ("float", float):
                kwargs[f.name] = float(text)
            elif f.type in ("bool", bool):
                kwargs[f.name] = _parse_bool(f.name, text)
            else:
                kwargs[f.name] = text
        for required in ("worker_id", "role"):
            if required not in kwargs:
                raise ValueError(f"worker hash lacks the {required!r} field")
        return cls(**kwargs)


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"field {name!r}: {text!r} is not a boolean")


@dataclass(frozen=True)
class RefusedEntry:
    """A registry entry that failed its check: which worker id it claimed, and why."""

    worker_id: str
    reason: RefusalReason
    # Tells one write of the entry from the next, so a refusal is counted once per write.
    version: str = ""


@dataclass(frozen=True)
class WorkerListing:
    """The registry as read: the workers that may be routed to and the entries refused."""

    workers: list[WorkerInfo]
    refused: list[RefusedEntry] = field(default_factory=list)


def _fields(mapping: dict[str, str]) -> dict[EncodableT, EncodableT]:
    return dict(mapping.items())


class WorkerRegistry(RedisStore):
    """The registry; with a secret in `auth`, writes are signed and reads list verified entries."""

    default_ttl_s = 5.0

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ttl_s: float | None = None,
        auth: ClusterAuth | None = None,
    ) -> None:
        super().__init__(redis, keys, ttl_s)
        self.auth = auth if auth is not None else ClusterAuth.open()

    async def register(self, info: WorkerInfo) -> WorkerInfo:
        """Writes a fresh record (dropping fields a previous run of this id left behind)."""
        return await self._write(info, fresh=True)

    async def heartbeat(self, info: WorkerInfo) -> WorkerInfo:
        """Refreshes the record and its expiry; recreates it if it had already expired."""
        return await self._write(info, fresh=False)

    async def _write(self, info: WorkerInfo, *, fresh: bool) -> WorkerInfo:
        now = time.time()
        stamped = replace(info, updated_at=now, expires_at=now + self.ttl_s)
        key = self._keys.worker(info.worker_id)
        mapping = sign_entry(self.auth, stamped.to_mapping())
        # MULTI/EXEC: the hash never exists without its expiry.
        async with self._redis.pipeline(transaction=True) as pipe:
            # A signed entry is rewritten whole: a leftover field would fail its check.
            if fresh or self.auth.enabled:
                pipe.delete(key)
            pipe.hset(key, mapping=_fields(mapping))
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()
        return stamped

    async def deregister(self, worker_id: str) -> None:
        await self._redis.delete(self._keys.worker(worker_id))

    async def get(self, worker_id: str) -> WorkerInfo | None:
        raw = await self._redis.hgetall(self._keys.worker(worker_id))
        if not raw:
            return None
        return WorkerInfo.from_mapping(raw)

    async def list_workers(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        """Live workers (optionally of one role) whose entries pass their check, by worker_id."""
        listing = await self.list_entries()
        return [w for w in listing.workers if role is None or w.role == role]

    async def list_entries(self) -> WorkerListing:
        """Live workers, sorted by worker_id, and the entries refused by their check. A record
        that does not parse is logged and skipped, so one bad worker cannot hide the others."""
        keys: set[str] = set()  # SCAN may return a key more than once
        async for key in self._redis.scan_iter(
            match=self._keys.worker_pattern(), count=500, _type="HASH"
        ):
            keys.add(as_str(key))
        if not keys:
            return WorkerListing([])
        ordered = sorted(keys)
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in ordered:
                pipe.hgetall(key)
            replies = await pipe.execute(raise_on_error=False)
        workers: list[WorkerInfo] = []
        refused: list[RefusedEntry] = []
        now = time.time()
        for key, raw in zip(ordered, replies, strict=True):
            if isinstance(raw, Exception):
                logger.warning("reading worker record %s failed: %s", key, raw)
                continue
            if not raw:
                continue  # expired (or deregistered) between SCAN and HGETALL
            worker_id = self._keys.worker_id_of(key)
            try:
                mapping = as_str_mapping(raw)
            except ValueError as error:  # not UTF-8
                if self.auth.enabled:  # no signature of ours covers it: refused, logged once
                    refused.append(RefusedEntry(worker_id, "forged"))
                else:
                    logger.warning("skipping unreadable worker record %s: %s", key, error)
                continue
            try:
                reason = check_entry(self.auth, worker_id, mapping, now)
                if reason is not None:
                    version = mapping.get(SIGNATURE_FIELD) or mapping.get("updated_at", "")
                    refused.append(RefusedEntry(worker_id, reason, version))
                    continue
                info = WorkerInfo.from_mapping(mapping)
            except (ValueError, TypeError) as error:
                logger.warning("skipping unreadable worker record %s: %s", key, error)
                continue
            workers.append(info)
        workers.sort(key=lambda w: w.worker_id)
        return WorkerListing(workers, refused)


FAILING_RETRY_S = 0.25


class Heartbeat:
    """Keeps one worker registered by re-writing its record (`info()`, called every beat) every
    `interval_s`. Failures are logged and retried, so a worker re-joins when Redis comes back."""

    def __init__(
        self,
        registry: WorkerRegistry,
        info: Callable[[], WorkerInfo],
        interval_s: float | None = None,
    ) -> None:
        self._registry = registry
        self._info = info
        self.interval_s = interval_s if interval_s is not None else registry.ttl_s / 3
        if self.interval_s <= 0:
            raise ValueError("interval_s must be positive")
        # While beats fail, retry often: a restarted Redis has the worker back at once.
        self.retry_s = min(self.interval_s, FAILING_RETRY_S)
        self._task: asyncio.Task[None] | None = None
        self._last_worker_id: str | None = None
        self.beats = 0  # successful writes, for tests and metrics
        self.failures = 0

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Starts beating (first beat at once) on the running event loop."""
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nori-heartbeat")

    async def stop(self, deregister: bool = True) -> None:
        """Stops beating and, by default, deletes the record; the task is awaited first so no
        late beat brings it back. A failed delete is only logged (the record expires anyway)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                # Swallow only the cancellation we asked for, not one aimed at our caller.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        if not deregister:
            return
        worker_id = self._last_worker_id
        try:
            if worker_id is None:
                worker_id = self._info().worker_id
            await self._registry.deregister(worker_id)
        except Exception:
            logger.warning("deregistering worker %s failed", worker_id, exc_info=True)

    async def _run(self) -> None:
        first = True
        failing = False
        while True:
            try:
                info = self._info()
                self._last_worker_id = info.worker_id
                # A write slower than the TTL is worthless: give up and retry.
                async with asyncio.timeout(self._registry.ttl_s):
                    if first:
                        await self._registry.register(info)
                    else:
                        await self._registry.heartbeat(info)
                first = False
                self.beats += 1
                if failing:
                    logger.info("heartbeat for worker %s recovered", info.worker_id)
                    failing = False
            except Exception:
                self.failures += 1
                if not failing:
                    logger.warning(
                        "heartbeat for worker %s failed; retrying every %.2fs",
                        self._last_worker_id,
                        self.retry_s,
                        exc_info=True,
                    )
                else:
                    logger.debug("heartbeat still failing", exc_info=True)
                failing = True
            await asyncio.sleep(self.retry_s if failing else self.interval_s)
