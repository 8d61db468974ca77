"""The workers the gateway can route to, reread from the registry every `refresh_s`, with a gRPC
channel each; kept while Redis is away, and a little longer when it returns empty. The KV block
size is the workers' stated one, or `--block-size`. Left out, with one log line each: workers
that disagree with the cluster (`worker_agreement`) and registry entries whose signature check
failed (counted in `refused_entries`). `pick_decode` and `pick_prefill` choose from them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from nori.gateway.backend import BackendHealth
from nori.gateway.worker_agreement import RefusalLog, agree_on_kv_layout, agree_on_speculation
from nori.repeated_log import RepeatedFailureLog
from nori.rpc.channels import ChannelCache
from nori.state.registry import WorkerInfo, WorkerRegistry
from nori.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# Prompt slots per prompt worker shared out beside other owners (the rest wait in the gateway).
PROMPT_SLOTS_SHARED_PER_WORKER = 32
# How long a channel to a worker that left the registry stays open for calls still on it.
CHANNEL_LINGER_S = 120.0
# A worker whose call just failed gets no new request for this long (about the heartbeat TTL).
FAILED_WORKER_PAUSE_S = 3.0
# How long workers missing after an outage (Redis restarted empty) stay routable to re-register.
REGISTRY_LOSS_GRACE_S = 3.0


class WorkerPool:
    def __init__(
        self,
        registry: WorkerRegistry,
        block_size: int | None = None,
        refresh_s: float = 0.5,
        on_refresh: Callable[[WorkerPool], None] | None = None,
    ) -> None:
        """`on_refresh` is called after every read of the registry, with the pool."""
        self._registry = registry
        self._on_refresh = on_refresh
        self._expected_block_size = block_size
        self._refresh_s = refresh_s
        self.workers: list[WorkerInfo] = []
        self.block_size: int | None = block_size
        self._channels = ChannelCache()
        self._absent_since: dict[str, float] = {}
        self._failed_until: dict[str, float] = {}
        self._unread = False
        self._kept: list[WorkerInfo] = []
        self._kept_until = 0.0
        self._read_failures = RepeatedFailureLog(logger, "reading the worker registry")
        self.refusals = RefusalLog()
        self._refresher: asyncio.Task[None] | None = None

    @property
    def refused_entries(self) -> dict[str, int]:
        """Refused registry entries by reason (unsigned, forged, expired)."""
        return self.refusals.counts

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
        self.refusals.entries(listing.refused)
        agreement = agree_on_kv_layout(
            self._bridge_loss(listing.workers), self._expected_block_size
        )
        speculation = agree_on_speculation(agreement.members)
        self.workers = speculation.members
        self.block_size = agreement.block_size
        self.refusals.layouts(agreement)
        self.refusals.speculation(speculation)
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

    def capacities(
        self, prompts_on_decode: bool
    ) -> tuple[PoolCapacity | None, PoolCapacity | None]:
        """The decode pool's and the prompt pool's: the prefill workers, else (or when
        `prompts_on_decode`) the decode pool; each worker's figures as its registry entry states."""
        serving = [w for w in self.workers if not w.draining]
        figures = {
            w.worker_id: (w.max_num_seqs, w.max_open_calls) for w in serving if w.max_open_calls
        }
        decode_pool = [w.worker_id for w in serving if w.role in ("decode", "colocated")]
        prompt_pool = [w.worker_id for w in serving if w.role == "prefill"]
        if not prompt_pool or prompts_on_decode:
            prompt_pool = decode_pool
        decode = pool_capacity(figures, decode_pool, ASSUMED_FIGURES)
        prompt = pool_capacity(figures, prompt_pool, ASSUMED_FIGURES)
        if prompt is not None:
            shared = PROMPT_SLOTS_SHARED_PER_WORKER * len(prompt_pool)
            prompt = dataclasses.replace(prompt, shared_rows=shared)
        return decode, prompt


# ---------------------------------------------------------------------- routing and capacity
# Pure functions of the registry's figures and the ledger's counts, which change as it routes.


def pick_decode(
    workers: Iterable[WorkerInfo],
    in_flight: Mapping[str, int],
    turn: int,
    exclude: Iterable[str] = (),
) -> WorkerInfo | None:
    """The decode or colocated worker with the fewest calls in flight, then the most free KV
    blocks; equal workers take turns (`turn` rotates the start)."""
    excluded = set(exclude)
    candidates = [
        w
        for w in workers
        if w.role in ("decode", "colocated") and not w.draining and w.worker_id not in excluded
    ]
    return _least(
        candidates,
        turn,
        lambda w: (
            in_flight.get(w.worker_id, 0),
            -round(_free_share(w), 2),
            w.num_running + w.num_waiting,
        ),
    )


def pick_prefill(
    workers: Iterable[WorkerInfo],
    in_flight: Mapping[str, int],
    pending_prompt_tokens: Mapping[str, int],
    cached_tokens: Mapping[str, int],
    num_prompt_tokens: int,
    turn: int,
) -> WorkerInfo | None:
    """The prefill worker that would compute the fewest tokens before this prompt is done: the
    prompt minus its cached prefix there, plus what is queued on it."""

    def cost(w: WorkerInfo) -> tuple[int, int]:
        cached = min(cached_tokens.get(w.worker_id, 0), num_prompt_tokens)
        queued = pending_prompt_tokens.get(w.worker_id, 0)
        return (num_prompt_tokens - cached + queued, in_flight.get(w.worker_id, 0))

    return _least([w for w in workers if w.role == "prefill" and not w.draining], turn, cost)


def _least(
    candidates: list[WorkerInfo], turn: int, key: Callable[[WorkerInfo], tuple[float, ...]]
) -> WorkerInfo | None:
    if not candidates:
        return None
    candidates.sort(key=lambda w: w.worker_id)
    start = turn % len(candidates)
    return min(candidates[start:] + candidates[:start], key=key)


def _free_share(worker: WorkerInfo) -> float:
    if worker.num_total_blocks <= 0:
        return 0.0
    return worker.num_free_blocks / worker.num_total_blocks


# (rows, calls) of a worker whose entry states none (an older writer): the workers' defaults.
ASSUMED_FIGURES = (256, 320)


@dataclass(frozen=True)
class PoolCapacity:
    """A pool's summed running rows (`--max-num-seqs`) and calls served at once (rows + queue);
    `shared_rows`, when set, the rows owners share out beside others instead of `rows`."""

    rows: int
    calls: int
    shared_rows: int | None = None


def pool_capacity(
    figures: Mapping[str, tuple[int, int]],
    worker_ids: Sequence[str],
    assumed: tuple[int, int] | None = None,
) -> PoolCapacity | None:
    """The pool's capacity; a silent worker counts as the others' mean, else as `assumed`."""
    known = [figures[worker_id] for worker_id in worker_ids if worker_id in figures]
    if not known:
        if assumed is None or not worker_ids:
            return None
        known = [assumed]
    scale = len(worker_ids) / len(known)
    return PoolCapacity(
        rows=round(sum(rows for rows, _ in known) * scale),
        calls=round(sum(calls for _, calls in known) * scale),
    )


# ---------------------------------------------------------------------- admission and fair shares
# Pure functions of the `Ledger`'s counts.

MAX_RETRY_AFTER_S = 60.0


def prompt_bound(max_tokens_per_worker: int, num_workers: int) -> int | None:
    """The admission bound in prompt tokens; None: none (0, or no worker: routing says 503)."""
    if max_tokens_per_worker == 0 or num_workers <= 0:
        return None
    return max_tokens_per_worker * num_workers


def tokens_ahead(own: int, others: Iterable[int], share: int | None) -> int:
    """What a client's new prompt waits behind: its own client's tokens, others' up to `share`."""
    return own + sum(n if share is None else min(n, share) for n in others)


def retry_after_s(excess_tokens: int, drain_rate: float | None) -> float:
    """How long the pool needs to drain the excess at the recent rate, in [1, 60] s."""
    if drain_rate is None:
        return 1.0
    return min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(excess_tokens / drain_rate)))


def owner_limit(
    rows: int, max_share: float, others_active: bool, shared_rows: int | None = None
) -> int:
    """The most slots one owner may hold: every row alone, its share of `shared_rows` (else of
    the rows) beside others."""
    if not others_active:
        return max(1, rows)
    return max(1, math.floor(max_share * min(rows, shared_rows or rows)))


@dataclass(frozen=True)
class SlotCounts:
    """One pool's counts as one ticket sees them (its priority's calls, its owners' holds)."""

    held: int  # slots counted against `calls` (interactive: interactive ones only)
    calls: int
    group_held: int
    client_held: int
    group_alone: bool  # no other group holds or waits
    client_alone: bool


def may_hold(
    counts: SlotCounts, rows: int, max_share: float, shared_rows: int | None = None
) -> bool:
    return (
        counts.held < counts.calls
        and counts.group_held < owner_limit(rows, max_share, not counts.group_alone, shared_rows)
        and counts.client_held < owner_limit(rows, max_share, not counts.client_alone, shared_rows)
    )
