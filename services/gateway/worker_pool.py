"""The workers the gateway can route to, reread from the registry every `refresh_s`, with a gRPC
channel each. While Redis is away the pool keeps the workers it last read, and when Redis returns
empty it keeps them a little longer while they re-register. It settles the cluster's KV block
size (the workers' stated one, or `--block-size`) and leaves out, with one log line each, a
worker whose block size, KV dtype or speculative decoding differs (`worker_agreement`), and any
registry entry its signature check refused (counted in `refused_entries`).

`Router` picks a request's workers from them and this gateway's own counts: registry load is up
to a heartbeat old, so the in-flight counts, updated the moment it routes, spread a burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from nori.gateway.backend import BackendHealth
from nori.gateway.worker_agreement import (
    KVLayoutAgreement,
    SpeculationAgreement,
    agree_on_kv_layout,
    agree_on_speculation,
    describe_speculation,
)
from nori.repeated_log import RepeatedFailureLog
from nori.rpc.channels import ChannelCache
from nori.state.registry import RefusedEntry, WorkerInfo, WorkerRegistry
from nori.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# How long a channel to a worker that left the registry stays open for calls still on it.
CHANNEL_LINGER_S = 120.0
# A worker whose call just failed gets no new request for this long (about the heartbeat TTL).
FAILED_WORKER_PAUSE_S = 3.0
# How long workers missing from a registry read again after an outage (Redis restarted empty)
# stay routable, while they re-register.
REGISTRY_LOSS_GRACE_S = 3.0
# Refused worker ids logged once each; past this many (forged entries) they are only counted.
MAX_LOGGED_REFUSALS = 1024


class WorkerPool:
    def __init__(
        self,
        registry: WorkerRegistry,
        block_size: int | None = None,
        refresh_s: float = 0.5,
        on_refresh: Callable[[WorkerPool], None] | None = None,
    ) -> None:
        self._registry = registry
        self._expected_block_size = block_size
        self._refresh_s = refresh_s
        self._on_refresh = on_refresh
        self.workers: list[WorkerInfo] = []
        self.block_size: int | None = block_size
        self._refused: set[tuple[str, int, str]] = set()
        self._refused_speculation: set[tuple[str, str]] = set()
        self._channels = ChannelCache()
        self._absent_since: dict[str, float] = {}
        self._failed_until: dict[str, float] = {}
        self._unread = False
        self._kept: list[WorkerInfo] = []
        self._kept_until = 0.0
        self._read_failures = RepeatedFailureLog(logger, "reading the worker registry")
        self.refused_entries: dict[str, int] = {}
        self._refused_versions: set[tuple[str, str]] = set()
        self._logged_refusals: set[str] = set()
        self._unlogged_refusals = RepeatedFailureLog(logger, "refusing unverified worker entries")
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self._channels.close_all()

    def available(self, role: str) -> list[WorkerInfo]:
        """The non-draining workers of `role`, those whose calls just failed last (a failure
        mark is a hint, never a reason to refuse a request)."""
        taking = [w for w in self.workers if w.role == role and not w.draining]
        return self._healthy_first(taking)

    def routable(self) -> list[WorkerInfo]:
        """Every worker, without those whose calls just failed unless that leaves no decode or
        colocated worker."""
        healthy = self._healthy_first(self.workers)
        if any(w.role in ("decode", "colocated") for w in healthy):
            return healthy
        return list(self.workers)

    def _healthy_first(self, workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
        now = time.monotonic()
        healthy = [w for w in workers if self._failed_until.get(w.worker_id, 0) <= now]
        return healthy or list(workers)

    def mark_failed(self, worker_id: str, for_s: float = FAILED_WORKER_PAUSE_S) -> None:
        """A call to the worker just failed: route nothing to it for `for_s`."""
        self._failed_until[worker_id] = time.monotonic() + for_s
        now = time.monotonic()
        for known, until in list(self._failed_until.items()):
            if until < now:
                del self._failed_until[known]

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def refresh(self) -> None:
        """Reads the registry again."""
        try:
            listing = await self._registry.list_entries()
        except Exception:
            self._unread = True  # Redis may come back empty: see _bridge_loss
            raise
        self._note_refused(listing.refused)
        agreement = agree_on_kv_layout(
            self._bridge_loss(listing.workers), self._expected_block_size
        )
        speculation = agree_on_speculation(agreement.members)
        self.workers = speculation.members
        self.block_size = agreement.block_size
        self._log_refusals(agreement)
        self._log_speculation_refusals(speculation)
        if self._on_refresh is not None:
            self._on_refresh(self)
        await self._close_channels_of_departed()

    def _bridge_loss(self, listed: list[WorkerInfo]) -> list[WorkerInfo]:
        """`listed`, plus the workers known before the registry became unreadable that are not
        back in it yet (a Redis restarted empty learns of them at their next heartbeats)."""
        now = time.monotonic()
        present = {w.worker_id for w in listed}
        if self._unread and now >= self._kept_until:
            # Workers that leave on purpose drain first: only serving ones are kept.
            self._kept = [w for w in self.workers if not w.draining and w.worker_id not in present]
            if self._kept:
                self._kept_until = now + REGISTRY_LOSS_GRACE_S
                logger.warning(
                    "the worker registry is readable again without %s (Redis restarted empty?); "
                    "keeping them for %g s while they re-register",
                    ", ".join(w.worker_id for w in self._kept),
                    REGISTRY_LOSS_GRACE_S,
                )
        self._unread = False
        if now >= self._kept_until:
            return listed
        missing = [w for w in self._kept if w.worker_id not in present]
        if not missing:
            self._kept_until = 0.0  # all back
        return sorted([*listed, *missing], key=lambda w: w.worker_id)

    def _note_refused(self, refused: list[RefusedEntry]) -> None:
        """Counts each refused write once and logs each refused worker id once (a forged entry
        stays in Redis and is read on every refresh)."""
        versions = {(entry.worker_id, entry.version) for entry in refused}
        for entry in refused:
            if (entry.worker_id, entry.version) in self._refused_versions:
                continue
            self.refused_entries[entry.reason] = self.refused_entries.get(entry.reason, 0) + 1
            if entry.worker_id in self._logged_refusals:
                continue
            if len(self._logged_refusals) >= MAX_LOGGED_REFUSALS:
                self._unlogged_refusals.failed(ValueError(f"{entry.worker_id}: {entry.reason}"))
                continue
            self._logged_refusals.add(entry.worker_id)
            logger.error(
                "refusing worker entry %s: %s (not signed with this cluster's secret, or out "
                "of date); nothing is routed to it",
                entry.worker_id,
                {
                    "unsigned": "it carries no signature",
                    "forged": "its signature does not verify",
                    "expired": "it has expired",
                }[entry.reason],
            )
        self._refused_versions = versions

    def _log_refusals(self, agreement: KVLayoutAgreement) -> None:
        refused = {(w.worker_id, w.block_size, w.kv_cache_dtype) for w in agreement.refused}
        for worker_id, size, dtype in sorted(refused - self._refused):
            logger.error(
                "refusing worker %s: its KV blocks are %d tokens of %s, the cluster's are %s "
                "tokens of %s (every worker must run with the same --block-size, --dtype and "
                "--kv-cache-dtype)",
                worker_id,
                size,
                dtype or "an unstated dtype",
                agreement.block_size,
                agreement.kv_cache_dtype,
            )
        self._refused = refused

    def _log_speculation_refusals(self, agreement: SpeculationAgreement) -> None:
        """One line per refused worker and setting (again only if it leaves and comes back)."""
        refused = {(w.worker_id, w.speculative_config) for w in agreement.refused}
        for worker_id, speculative_config in sorted(refused - self._refused_speculation):
            logger.error(
                "refusing worker %s: its speculative decoding is %s, the cluster's is %s (every "
                "worker must run with the same --speculative-config)",
                worker_id,
                describe_speculation(speculative_config),
                describe_speculation(agreement.speculative_config),
            )
        self._refused_speculation = refused

    async def _close_channels_of_departed(self) -> None:
        live = {worker.grpc_address for worker in self.workers}
        now = time.monotonic()
        for address in self._channels.addresses():
            if address in live:
                self._absent_since.pop(address, None)
                continue
            # A worker that missed its heartbeats may still be finishing calls on this channel.
            since = self._absent_since.setdefault(address, now)
            if now - since > CHANNEL_LINGER_S:
                del self._absent_since[address]
                await self._channels.close(address)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception as error:
                self._read_failures.failed(error)

    def health(self) -> BackendHealth:
        counts: dict[str, int] = {}
        for worker in self.workers:
            if not worker.draining:
                counts[worker.role] = counts.get(worker.role, 0) + 1
        disaggregated = counts.get("prefill", 0) > 0 and counts.get("decode", 0) > 0
        healthy = disaggregated or counts.get("colocated", 0) > 0
        detail = "" if healthy else "waiting for prefill and decode workers to register"
        return BackendHealth(healthy=healthy, workers=counts, detail=detail)

    async def stats(
        self, timeout_s: float = 2.0, metadata: tuple[tuple[str, str], ...] = ()
    ) -> list[common_pb2.WorkerStats]:
        """Live figures from every worker in the pool (for /metrics)."""

        async def one(worker: WorkerInfo) -> common_pb2.WorkerStats | None:
            channel = self.channel(worker.grpc_address)
            stub: prefill_pb2_grpc.PrefillServiceStub | decode_pb2_grpc.DecodeServiceStub
            if worker.role == "prefill":
                stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            else:
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
            try:
                stats: common_pb2.WorkerStats = await stub.GetStats(
                    common_pb2.StatsRequest(), timeout=timeout_s, metadata=metadata
                )
                return stats
            except grpc.aio.AioRpcError:
                return None

        results = await asyncio.gather(*(one(worker) for worker in self.workers))
        return [stats for stats in results if stats is not None]


# ---------------------------------------------------------------------- routing


@dataclass
class Router:
    """Picks a request's workers, and counts what this gateway has sent each."""

    in_flight: Counter[str] = field(default_factory=Counter)
    # Prompt tokens sent to each worker to compute and not yet seen computed.
    pending_prompt_tokens: Counter[str] = field(default_factory=Counter)
    _decode_picks: int = 0
    _prefill_picks: int = 0

    def pick_decode(
        self, workers: Iterable[WorkerInfo], exclude: Iterable[str] = ()
    ) -> WorkerInfo | None:
        """The decode or colocated worker with the fewest in-flight requests, then the most free
        KV blocks."""
        excluded = set(exclude)
        candidates = [
            worker
            for worker in workers
            if worker.role in ("decode", "colocated")
            and not worker.draining
            and worker.worker_id not in excluded
        ]
        if not candidates:
            return None
        # Equal workers take turns (the start rotates), so one-at-a-time requests spread too.
        candidates.sort(key=lambda w: w.worker_id)
        start = self._decode_picks % len(candidates)
        self._decode_picks += 1
        return min(
            candidates[start:] + candidates[:start],
            key=lambda w: (
                self.in_flight[w.worker_id],
                -round(_free_share(w), 2),
                w.num_running + w.num_waiting,
            ),
        )

    def pick_prefill(
        self,
        workers: Iterable[WorkerInfo],
        cached_tokens: Mapping[str, int],
        num_prompt_tokens: int,
    ) -> WorkerInfo | None:
        """The prefill worker that would compute the fewest tokens before this prompt is done:
        the prompt minus its cached prefix there, plus what is queued on it."""
        candidates = [w for w in workers if w.role == "prefill" and not w.draining]
        if not candidates:
            return None

        def cost(worker: WorkerInfo) -> tuple[int, int]:
            cached = min(cached_tokens.get(worker.worker_id, 0), num_prompt_tokens)
            queued = self.pending_prompt_tokens[worker.worker_id]
            return (num_prompt_tokens - cached + queued, self.in_flight[worker.worker_id])

        candidates.sort(key=lambda w: w.worker_id)
        start = self._prefill_picks % len(candidates)
        self._prefill_picks += 1
        return min(candidates[start:] + candidates[:start], key=cost)

    def started(self, worker_id: str, prompt_tokens: int = 0) -> None:
        self.in_flight[worker_id] += 1
        self.prompt_started(worker_id, prompt_tokens)

    def ended(self, worker_id: str, prompt_tokens: int = 0) -> None:
        self.in_flight[worker_id] -= 1
        # Worker ids come and go: the counters must not grow with them.
        if self.in_flight[worker_id] <= 0:
            del self.in_flight[worker_id]
        self.prompt_done(worker_id, prompt_tokens)

    def prompt_started(self, worker_id: str, prompt_tokens: int) -> None:
        """A prompt sent to `worker_id` to be computed (its request counted elsewhere)."""
        self.pending_prompt_tokens[worker_id] += prompt_tokens

    def prompt_done(self, worker_id: str, prompt_tokens: int) -> None:
        self.pending_prompt_tokens[worker_id] -= prompt_tokens
        if self.pending_prompt_tokens[worker_id] <= 0:
            del self.pending_prompt_tokens[worker_id]


def _free_share(worker: WorkerInfo) -> float:
    if worker.num_total_blocks <= 0:
        return 0.0
    return worker.num_free_blocks / worker.num_total_blocks
