"""The cluster backend: admits each request, picks its decode worker and hands it to the flow.

Admission (`admission.py`) refuses a request with 429 when the prompt tokens already queued for
the pool would make its first token too late, or when the gateway has `max_in_flight` requests.
Each admitted member then holds a share of the decode pool (`DecodeShares`): no more calls go
out than the workers serve at once, and one request or client keeps to its share while others
wait.
A decode worker is picked by free blocks and load (`router.py`); one that answers that its KV pool
is full is replaced by another, up to `decode_attempts`, as long as the client has seen nothing.
What happens on the workers is `request_flow.py`; who the workers are, `worker_pool.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry import trace
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nori.cluster_auth import ClusterAuth
from nori.gateway.admission import (
    DecodeShare,
    DecodeShares,
    PoolCapacity,
    PromptQueue,
    QueuedPrompt,
)
from nori.gateway.backend import (
    BackendError,
    BackendHealth,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    SaturatedError,
)
from nori.gateway.group_wait import GroupWait
from nori.gateway.request_flow import RequestFlow, Resumed
from nori.gateway.router import Router
from nori.gateway.worker_calls import (
    DecodeFullError,
    PrefillFailedError,
    TransferFailedError,
    WorkerFullError,
    WorkerLostError,
    WorkerUnreachableError,
)
from nori.gateway.worker_pool import WorkerPool
from nori.settings import RoleSettings
from nori.state.block_directory import BlockDirectory
from nori.state.connection import connect, unreachable
from nori.state.keys import Keys
from nori.state.registry import WorkerRegistry
from nori.state.requests import RequestStateStore
from nori.state.state_recorder import StateRecorder
from nori.v1 import common_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often the gateway reads the decode pool's capacity (GetStats) for its fair shares.
CAPACITY_REFRESH_S = 2.0


@dataclass(frozen=True)
class ClusterOptions(RoleSettings):
    # The workers' KV block size (the gateway hashes prompts in blocks of it to look them up);
    # None: the size the workers state in the registry.
    block_size: int | None = None
    refresh_s: float = 0.5
    max_in_flight: int = 4096
    # Decode workers to try when one answers that its pool is full.
    decode_attempts: int = 3
    # Tries of a prompt whose prefill worker failed (died, hung up, sent bad KV), each on a
    # prefill worker that has not just failed.
    prefill_attempts: int = 3
    # Moves of a request whose decode worker died to another one (--migration-limit).
    migration_limit: int = 3
    # How long a member of a batch (several prompts, or n > 1) waits for room when every worker
    # is full, instead of 429: the batch was admitted as one, and its running members free the
    # room the rest need, so a batch larger than the cluster's queues is served in waves.
    # 0: no waiting (429 at once, like a single request).
    group_wait_s: float = 600.0
    # The share of the decode pool's running slots one request (its members) or one client
    # (API key, else address) may hold while another waits or runs (admission.DecodeShares);
    # alone, either may fill every running slot.
    max_decode_share: float = 0.5
    # Choices per prompt (n), and choices of one request (prompts x n), past which a request is
    # refused with 400; the API itself takes n up to 64 (request_params.MAX_N).
    max_n: int = 64
    max_request_members: int = 4096
    # A worker stream silent this long counts as lost, and its request moves on. Longer than
    # any legitimate silence: a prompt's wait in a bounded queue, a long prompt's compute.
    stream_stall_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.stream_stall_timeout_s <= 0:
            raise ValueError(
                f"--stream-stall-timeout-s must be positive, got {self.stream_stall_timeout_s}"
            )
        if not 1 <= self.max_n <= 64:
            raise ValueError(f"--max-n must be in [1, 64], got {self.max_n}")
        if self.max_request_members < 1:
            raise ValueError(f"--max-request-members must be >= 1, got {self.max_request_members}")
        if not 0 < self.max_decode_share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {self.max_decode_share}")

    # Admission: prompt tokens that may wait for their first token, per worker computing prompts
    # (prefill or colocated); 0 = no bound. See admission.py for the default.
    max_queued_prompt_tokens: int = 8192


def pool_capacity(
    figures: Mapping[str, tuple[int, int]], worker_ids: Sequence[str]
) -> PoolCapacity | None:
    """The decode pool's capacity from its workers' (rows, calls). A worker that joined since
    the last GetStats round has not said yet: it counts as the mean of the others (workers of
    one pool run one configuration), not as nothing, which would hold a lone client to the
    first worker's share for up to a round. None while no worker has said."""
    known = [figures[worker_id] for worker_id in worker_ids if worker_id in figures]
    if not known:
        return None
    scale = len(worker_ids) / len(known)
    return PoolCapacity(
        rows=round(sum(rows for rows, _ in known) * scale),
        calls=round(sum(calls for _, calls in known) * scale),
    )


class ClusterBackend:
    def __init__(self, options: ClusterOptions, tracer: trace.Tracer | None = None) -> None:
        self.options = options
        self._tracer = tracer
        self.router = Router()
        self._redis: Redis | None = None
        self._pool: WorkerPool | None = None
        self._directory: BlockDirectory | None = None
        self._states: StateRecorder | None = None
        self._flow: RequestFlow | None = None
        self._num_in_flight = 0
        self.prompt_queue = PromptQueue(options.max_queued_prompt_tokens)
        self.decode_shares = DecodeShares(options.max_decode_share)
        # Each decode worker's last (rows, calls) from GetStats: one whose GetStats timed out
        # (busy) keeps them rather than dropping out of the pool's capacity.
        self._capacity_figures: dict[str, tuple[int, int]] = {}
        self._capacity_watch: asyncio.Task[None] | None = None
        # Registry entries are checked against it (nori.state.registry), and every call to a
        # worker carries its token (nori.rpc.auth).
        self._auth = ClusterAuth.from_text(options.cluster_secret)
        self.rpc_metadata = self._auth.rpc_metadata()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        keys = Keys(self.options.namespace)
        self._redis = connect(self.options.redis_url)
        self._pool = WorkerPool(
            WorkerRegistry(self._redis, keys, auth=self._auth),
            self.options.block_size,
            self.options.refresh_s,
        )
        self._directory = BlockDirectory(self._redis, keys)
        self._states = StateRecorder(RequestStateStore(self._redis, keys))
        self._flow = RequestFlow(
            self._pool,
            self.router,
            self._directory,
            self._states,
            self._tracer,
            self.options.stream_stall_timeout_s,
            rpc_metadata=self.rpc_metadata,
        )
        try:
            await self._redis.ping()
        except (RedisError, OSError) as error:
            raise unreachable(self.options.redis_url, error) from None
        await self._pool.start()
        self._capacity_watch = asyncio.create_task(self._watch_capacity())

    @property
    def pool(self) -> WorkerPool:
        assert self._pool is not None, "the backend is not started"
        return self._pool

    @property
    def flow(self) -> RequestFlow:
        assert self._flow is not None, "the backend is not started"
        return self._flow

    async def close(self) -> None:
        if self._capacity_watch is not None:
            self._capacity_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._capacity_watch
        if self._pool is not None:
            await self._pool.close()
        if self._states is not None:
            await self._states.flush()
        if self._redis is not None:
            await self._redis.aclose()

    async def health(self) -> BackendHealth:
        return self.pool.health()

    async def worker_stats(self, timeout_s: float = 2.0) -> list[common_pb2.WorkerStats]:
        """Live figures from every registered worker (for /metrics)."""
        return await self.pool.stats(timeout_s, metadata=self.rpc_metadata)

    # ------------------------------------------------------------------ requests

    def _check_fan_out(self, request: GenerationRequest) -> None:
        """A 400 for a request wider than the caps: a batch of more members than the gateway
        takes in flight could never be served whole, only 429 for ever."""
        if request.num_choices > self.options.max_n:
            raise InvalidRequestError(
                f"n is {request.num_choices}, more than this server allows ({self.options.max_n}, "
                "--max-n)"
            )
        limit = min(self.options.max_request_members, self.options.max_in_flight)
        if request.group_size > limit:
            raise InvalidRequestError(
                f"the request has {request.group_size} choices (prompts x n), more than this "
                f"server allows in one request ({limit}, --max-request-members)"
            )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self._check_fan_out(request)
        if self._num_in_flight >= self.options.max_in_flight:
            raise QueueFullError(
                f"the gateway has {self._num_in_flight} requests in flight (the limit)"
            )
        num_prompt_workers = sum(
            1 for w in self.pool.workers if w.role in ("prefill", "colocated") and not w.draining
        )
        queued = await self._admit(request, num_prompt_workers)
        request_id = request.request_id
        self._record(request_id, "queued", num_prompt_tokens=len(request.prompt_token_ids))
        self._num_in_flight += 1
        outcome = "cancelled"
        num_output_tokens = 0
        share: DecodeShare | None = None
        try:
            share = await self._decode_share(request, queued)
            async for chunk in self._route(request, queued):
                num_output_tokens += len(chunk.new_token_ids)
                if chunk.finished:
                    # Before the yield: a consumer may close us right after the last chunk.
                    outcome = "finished"
                yield chunk
        except BackendError as error:
            outcome = "failed"
            self._record(request_id, "failed", error=str(error))
            raise
        finally:
            queued.abandon()  # a no-op once its first token came
            if share is not None:
                share.release()
            self._num_in_flight -= 1
            if outcome != "failed":
                self._record(request_id, outcome, num_output_tokens=num_output_tokens)

    async def _admit(self, request: GenerationRequest, num_prompt_workers: int) -> QueuedPrompt:
        """The prompt into the admission count. A background request (a batch line, priority
        above interactive) is never refused for a full queue: it waits for room, up to
        `group_wait_s`, while interactive requests are measured against interactive work."""
        background = request.priority > 0
        wait = GroupWait(self.options.group_wait_s if background else 0.0)
        while True:
            try:
                return self.prompt_queue.admit(
                    len(request.prompt_token_ids),
                    num_prompt_workers,
                    time.monotonic(),
                    request.admission_group,
                    background,
                )
            except QueueFullError:
                woken = self.prompt_queue.room_freed(len(request.prompt_token_ids))
                if not await wait.turn(woken):
                    raise

    async def _decode_share(self, request: GenerationRequest, queued: QueuedPrompt) -> DecodeShare:
        """The request's hold on the decode pool (`DecodeShares`). A batch member beyond its
        share waits for one here (up to `group_wait_s`, its tokens out of the prompt queue
        meanwhile); a single request without one gets 429 at once, as from a full worker."""
        group = request.admission_group or request.request_id
        # Batch lines are an owner of their own, apart from the same key's interactive work.
        client = f"{request.client}#background" if request.priority > 0 else request.client
        self._refresh_capacity()
        share = self.decode_shares.try_take(group, client, request.priority)
        if share is not None:
            return share
        waits = request.admission_group is not None or request.priority > 0
        wait_s = self.options.group_wait_s if waits else 0.0
        queued.pause()
        try:
            return await self.decode_shares.take(group, client, wait_s, request.priority)
        finally:
            queued.resume()

    def _refresh_capacity(self) -> None:
        """The fair shares' capacity for the decode pool as the registry has it now: a worker
        that joined or left since the last GetStats round counts at once (see `pool_capacity`)."""
        decode_pool = [
            w.worker_id
            for w in self.pool.workers
            if w.role in ("decode", "colocated") and not w.draining
        ]
        capacity = pool_capacity(self._capacity_figures, decode_pool)
        if capacity != self.decode_shares.capacity:
            self.decode_shares.set_capacity(capacity)

    async def _watch_capacity(self) -> None:
        """Keeps `decode_shares` told what the decode pool holds, from the workers' GetStats:
        a worker that joins, leaves or drains changes it."""
        figures = self._capacity_figures
        while True:
            try:
                for stats in await self.worker_stats():
                    if stats.max_open_calls > 0:
                        figures[stats.worker_id] = (stats.max_num_seqs, stats.max_open_calls)
                self._refresh_capacity()
                live = {w.worker_id for w in self.pool.workers}
                for gone in set(figures) - live:
                    del figures[gone]
            except Exception as error:  # the next round tries again
                logger.debug("reading the decode pool's capacity failed: %s", error)
            await asyncio.sleep(CAPACITY_REFRESH_S)

    async def _route(
        self, request: GenerationRequest, queued: QueuedPrompt
    ) -> AsyncIterator[GenerationChunk]:
        """The request on a decode worker; elsewhere when that one is full, when its prompt's
        prefill worker fails before token one, or (migration) when the decode worker dies."""
        tried: list[str] = []
        restarts = migrations = full_prefills = 0
        # Each new attempt of a request that was refused or failed before its first token
        # gets a fresh id for the workers ("~1", "~2", ...): the earlier attempt may still be
        # open on a worker a moment longer (a decode reservation being released, an engine
        # process applying the abort), which would refuse the same id as in use.
        renamed = 0

        def fresh_id(request: GenerationRequest) -> GenerationRequest:
            nonlocal renamed
            renamed += 1
            base_id = request.request_id.rsplit("~", 1)[0]
            return dataclasses.replace(request, request_id=f"{base_id}~{renamed}")

        streamed = Resumed([])
        waits = request.admission_group is not None or request.priority > 0
        wait = GroupWait(self.options.group_wait_s if waits else 0.0)
        while True:
            routable = self.pool.routable()
            decode = self.router.pick_decode(routable, exclude=tried)
            if decode is None:
                if migrations:
                    # Workers failed, not the request: a 503 the client may retry.
                    raise SaturatedError(
                        f"the decode worker streaming request {request.request_id} failed and "
                        "no other decode worker is left to continue it; retry after the time in "
                        "Retry-After"
                    )
                if tried and not streamed.token_ids and await wait.turn():
                    tried.clear()  # a batch member: try them all again
                    continue
                if tried:
                    raise QueueFullError(
                        "no decode worker could take the request (queues or KV pools full); "
                        "retry after the time in Retry-After"
                    )
                raise SaturatedError("no decode worker is available")
            self.router.started(decode.worker_id)
            try:
                if streamed.token_ids:
                    chunks = self.flow.colocated(request, decode, queued, resumed=streamed)
                elif decode.role == "colocated":
                    chunks = self.flow.colocated(request, decode, queued)
                else:
                    chunks = self.flow.disaggregated(request, decode, queued)
                async for chunk in chunks:
                    streamed.add(chunk)
                    yield chunk
                return
            except DecodeFullError:
                # Refused before any work (a full queue or pool): another worker may have room.
                # A migrating request may try them too: the new worker continues from what the
                # client has, so nothing is replayed.
                tried.append(decode.worker_id)
                if len(tried) >= self.options.decode_attempts + migrations:
                    if streamed.token_ids or not await wait.turn():
                        raise
                    tried.clear()
                if not streamed.token_ids:
                    request = fresh_id(request)
            except WorkerFullError:
                # The prefill worker's queue was full (its decode reservation is released):
                # pick again; routing by load favours another one.
                full_prefills += 1
                if full_prefills >= self.options.prefill_attempts:
                    if not await wait.turn():
                        raise
                    full_prefills = 0
                request = fresh_id(request)
            except (PrefillFailedError, TransferFailedError) as error:
                # The prompt's prefill worker died, hung up or sent bad KV: its decode
                # reservation is already released (the decode call was cancelled); start over
                # on another prefill worker, while the client has seen nothing.
                if isinstance(error, PrefillFailedError) and error.unreachable:
                    self.pool.mark_failed(error.worker_id)
                restarts += 1
                if streamed.token_ids:
                    raise
                if restarts >= self.options.prefill_attempts:
                    # Workers failed, not the request: a 503 the client may retry, not a 500.
                    raise SaturatedError(
                        f"the prompt's prefill failed {restarts} times ({error}); retry after "
                        "the time in Retry-After",
                        retry_after_s=1.0,
                    ) from error
                logger.warning("request %s: %s; computing it again", request.request_id, error)
                request = fresh_id(request)
            except (WorkerUnreachableError, WorkerLostError) as error:
                # The decode worker died or hung up: continue on another one from what the
                # client has (migration), or start over if it has nothing yet.
                self.pool.mark_failed(decode.worker_id)
                tried.append(decode.worker_id)
                migrations += 1
                if migrations > self.options.migration_limit:
                    # Workers failed, not the request: a 503 the client (a batch runner) retries.
                    raise SaturatedError(
                        f"request {request.request_id}: {error}; it moved to another decode "
                        f"worker {self.options.migration_limit} times (--migration-limit); retry "
                        "after the time in Retry-After"
                    ) from error
                logger.warning(
                    "request %s: %s; continuing on another decode worker after %d tokens",
                    request.request_id,
                    error,
                    len(streamed.token_ids),
                )
            finally:
                self.router.ended(decode.worker_id)

    def _record(self, request_id: str, state: str, **fields: str | int | float) -> None:
        if self._states is not None:
            self._states.record(request_id, state, **fields)
