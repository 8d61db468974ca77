"""The cluster backend: one `RequestTicket` per request, from admission to its one `close()`
(in `generate`'s `finally`, whatever path the request takes).

`generate` checks the fan-out caps (400), admits into the `Ledger` (429), takes a slot under fair
shares (429 for a single request without one, a wait for a batch member), then runs attempts on
decode workers (`request_flow.RequestFlow`), each failed one followed by `RetryPolicy.after`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nori.cluster_auth import ClusterAuth
from nori.gateway.backend import BackendHealth, GenerationChunk, GenerationRequest
from nori.gateway.disaggregation import DisaggregationPolicy
from nori.gateway.errors import (
    BackendError,
    DecodeFullError,
    InvalidRequestError,
    PrefillFailedError,
    QueueFullError,
    SaturatedError,
    TransferFailedError,
    WorkerFullError,
    WorkerLostError,
    WorkerUnreachableError,
)
from nori.gateway.ledger import Ledger, RequestTicket
from nori.gateway.request_flow import RequestFlow, Resumed
from nori.gateway.worker_pool import WorkerPool, pick_decode
from nori.settings import (
    DEFAULT_DISAGGREGATION,
    DEFAULT_MAX_LOCAL_COMPUTE_S,
    DisaggregationMode,
    RoleSettings,
)
from nori.state.block_directory import BlockDirectory
from nori.state.connection import connect, unreachable
from nori.state.keys import Keys
from nori.state.registry import WorkerRegistry
from nori.state.requests import RequestStateStore, StateRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterOptions(RoleSettings):
    """The gateway's cluster settings; `nori serve gateway --help` describes their flags."""

    block_size: int | None = None  # None: the KV block size the workers state
    max_in_flight: int = 4096
    # Prompt tokens that may wait for token one, per worker computing prompts (0: no bound).
    max_queued_prompt_tokens: int = 8192
    migration_limit: int = 3  # moves to another decode worker (RetryPolicy)
    # How long a batch member waits for room when every worker is full (0: a 429 at once).
    group_wait_s: float = 600.0
    max_decode_share: float = 0.5  # of a pool's rows, per owner beside others (ledger.py)
    # Choices per prompt (n), and of one request (prompts x n), past which it is a 400.
    max_n: int = 64
    max_request_members: int = 4096
    stream_stall_timeout_s: float = 300.0  # a worker stream silent this long is lost
    disaggregation: DisaggregationMode = DEFAULT_DISAGGREGATION  # where prompts are computed
    max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S  # auto: the most on a decode worker

    def __post_init__(self) -> None:
        if self.stream_stall_timeout_s <= 0:
            stall = self.stream_stall_timeout_s
            raise ValueError(f"--stream-stall-timeout-s must be positive, got {stall}")
        if not 1 <= self.max_n <= 64:
            raise ValueError(f"--max-n must be in [1, 64], got {self.max_n}")
        if self.max_request_members < 1:
            raise ValueError(f"--max-request-members must be >= 1, got {self.max_request_members}")
        if not 0 < self.max_decode_share <= 1:
            raise ValueError(f"--max-decode-share must be in (0, 1], got {self.max_decode_share}")


class ClusterBackend:
    def __init__(self, options: ClusterOptions, tracer: trace.Tracer | None = None) -> None:
        self.options = options
        self._tracer = tracer
        self._redis: Redis | None = None
        self._pool: WorkerPool | None = None
        self._states: StateRecorder | None = None
        self._flow: RequestFlow | None = None
        self.ledger = Ledger(
            options.max_in_flight, options.max_queued_prompt_tokens, options.max_decode_share
        )
        self.disaggregation = DisaggregationPolicy(
            options.disaggregation, options.max_local_compute_s
        )
        self._auth = ClusterAuth.from_text(options.cluster_secret)
        self.rpc_metadata = self._auth.rpc_metadata()

    async def start(self) -> None:
        keys = Keys(self.options.namespace)
        self._redis = connect(self.options.redis_url)
        registry = WorkerRegistry(self._redis, keys, auth=self._auth)
        self._pool = WorkerPool(registry, self.options.block_size, on_refresh=self._set_capacity)
        self._states = StateRecorder(RequestStateStore(self._redis, keys))
        self._flow = RequestFlow(
            self._pool,
            self.ledger,
            BlockDirectory(self._redis, keys),
            self._states,
            self._tracer,
            self.options.stream_stall_timeout_s,
            self.rpc_metadata,
            self.disaggregation,
        )
        try:
            await self._redis.ping()
        except (RedisError, OSError) as error:
            raise unreachable(self.options.redis_url, error) from None
        await self._pool.start()

    @property
    def pool(self) -> WorkerPool:
        assert self._pool is not None, "the backend is not started"
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._states is not None:
            await self._states.flush()
        if self._redis is not None:
            await self._redis.aclose()

    async def health(self) -> BackendHealth:
        return self.pool.health()

    def _check_fan_out(self, request: GenerationRequest) -> None:
        """A 400 for a request wider than the caps (past `max_in_flight`: 429s for ever)."""
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
        ticket = await self._admit(request)
        request_id, outcome, num_output_tokens = request.request_id, "cancelled", 0
        self._record(request_id, "queued", num_prompt_tokens=len(request.prompt_token_ids))
        try:
            await ticket.take(self.options.group_wait_s if ticket.waits else 0.0)
            async for chunk in self._attempts(request, ticket):
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
            ticket.close()
            if outcome != "failed":
                self._record(request_id, outcome, num_output_tokens=num_output_tokens)

    async def _attempts(
        self, request: GenerationRequest, ticket: RequestTicket
    ) -> AsyncIterator[GenerationChunk]:
        """The request on a decode worker; on another when that one is full, when the prefill
        worker fails before token one, or (migration) when the decode worker dies."""
        assert self._flow is not None, "the backend is not started"
        flow, wait = self._flow, GroupWait(self.options.group_wait_s if ticket.waits else 0.0)
        policy = RetryPolicy(self.options.migration_limit, wait, self.pool.mark_failed)
        streamed = Resumed([])
        renamed = 0
        while True:
            routable = self.pool.routable()
            decode = pick_decode(
                routable, self.ledger.in_flight, self.ledger.turn("decode"), policy.tried
            )
            if decode is None:
                await policy.no_decode_worker(request.request_id, bool(streamed.token_ids))
                continue
            ticket.decoding_on(decode.worker_id)
            try:
                if streamed.token_ids:
                    chunks = flow.compute_and_decode(request, decode, ticket, streamed)
                elif decode.role == "colocated":
                    chunks = flow.compute_and_decode(request, decode, ticket)
                else:
                    chunks = flow.serve_disaggregated(request, decode, ticket)
                async for chunk in chunks:
                    streamed.add(chunk)
                    yield chunk
                return
            except BackendError as error:
                fresh_id = await policy.after(
                    error, request.request_id, decode.worker_id, len(streamed.token_ids)
                )
                if fresh_id:
                    # A fresh id per attempt ("~1", "~2", ...): the earlier one may still be
                    # open on a worker a moment longer, which would refuse the id as in use.
                    renamed += 1
                    base_id = request.request_id.rsplit("~", 1)[0]
                    request = dataclasses.replace(request, request_id=f"{base_id}~{renamed}")
            finally:
                ticket.decoding_off()

    async def _admit(self, request: GenerationRequest) -> RequestTicket:
        """The request's ticket (`Ledger.admit`). A background request (priority above 0) waits
        for room, up to `group_wait_s`, rather than being refused for a full queue."""
        wait = GroupWait(self.options.group_wait_s if request.priority > 0 else 0.0)
        while True:
            num_prompt_workers = sum(
                1
                for w in self.pool.workers
                if w.role in ("prefill", "colocated") and not w.draining
            )
            try:
                return self.ledger.admit(request, num_prompt_workers, time.monotonic())
            except QueueFullError:
                if self.ledger.num_open >= self.ledger.max_in_flight:
                    raise
                woken = self.ledger.room_freed(len(request.prompt_token_ids))
                if not await wait.turn(woken):
                    raise

    def _set_capacity(self, pool: WorkerPool) -> None:
        """Tells the ledger the pools' capacities, after every read of the registry (a worker
        that joined or left counts from then)."""
        capacities = pool.capacities(self.options.disaggregation == "never")
        if capacities != (self.ledger.capacity, self.ledger.prompt_capacity):
            self.ledger.set_capacity(*capacities)

    def _record(self, request_id: str, state: str, **fields: str | int | float) -> None:
        if self._states is not None:
            self._states.record(request_id, state, **fields)


FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0
# Decode workers tried for a request refused before any work, and prefills (full, or failed).
DECODE_ATTEMPTS = PREFILL_ATTEMPTS = 3


class GroupWait:
    """A batch member's (or batch line's) wait when every worker is full: doubling backoff
    until `limit_s` after the first turn (a single request's limit is 0: a 429 at once)."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit_s = limit_s
        self._clock = clock
        self._deadline: float | None = None
        self._delay_s = FIRST_DELAY_S

    async def turn(self, woken: asyncio.Future[None] | None = None) -> bool:
        """Waits for the backoff or `woken` (room freed), then cancels `woken`; False, at once,
        when the time is up."""
        try:
            now = self._clock()
            if self._deadline is None:
                self._deadline = now + self._limit_s
            if now >= self._deadline:
                return False
            delay_s = min(self._delay_s, self._deadline - now)
            if woken is None:
                await asyncio.sleep(delay_s)
            else:
                await asyncio.wait([woken], timeout=delay_s)
            self._delay_s = min(self._delay_s * 2, MAX_DELAY_S)
            return True
        finally:
            if woken is not None:
                woken.cancel()


@dataclass
class RetryPolicy:
    """After each failed attempt of one request: another try (under a fresh id or not), or the
    client's error; a batch member out of tries waits (`GroupWait`), then tries them all again.

    | failure                                  | next try, while the limit allows            |
    |------------------------------------------|---------------------------------------------|
    | DecodeFullError: refused before any work | another decode worker (DECODE_ATTEMPTS)     |
    | WorkerFullError: the prefill queue full  | pick again (PREFILL_ATTEMPTS)               |
    | PrefillFailedError, TransferFailedError  | start over (PREFILL_ATTEMPTS, then 503)     |
    | WorkerUnreachableError, WorkerLostError  | migrate (migration_limit, then 503)         |
    """

    migration_limit: int
    wait: GroupWait
    mark_failed: Callable[[str], None]
    tried: list[str] = field(default_factory=list)
    full_prefills: int = 0
    failed_prefills: int = 0
    migrations: int = 0

    async def no_decode_worker(self, request_id: str, streamed: bool) -> None:
        """Returns when the request may look for a decode worker again; raises otherwise."""
        if self.migrations:
            raise SaturatedError(
                f"the decode worker streaming request {request_id} failed and no other decode "
                "worker is left to continue it; retry after the time in Retry-After"
            )
        if self.tried and not streamed and await self.wait.turn():
            self.tried.clear()  # a batch member: try them all again
            return
        if self.tried:
            raise QueueFullError(
                "no decode worker could take the request (queues or KV pools full); "
                "retry after the time in Retry-After"
            )
        raise SaturatedError("no decode worker is available")

    async def after(
        self, error: BackendError, request_id: str, decode_id: str, num_streamed: int
    ) -> bool:
        """Returns when the request may try again (True: under a fresh id); raises `error`, or
        the 503 it becomes, when it must fail."""
        if isinstance(error, DecodeFullError):
            # A migrating request may try others too: nothing is replayed.
            self.tried.append(decode_id)
            if len(self.tried) >= DECODE_ATTEMPTS + self.migrations:
                if num_streamed or not await self.wait.turn():
                    raise error
                self.tried.clear()
            return not num_streamed
        if isinstance(error, WorkerFullError):
            self.full_prefills += 1
            if self.full_prefills >= PREFILL_ATTEMPTS:
                if not await self.wait.turn():
                    raise error
                self.full_prefills = 0
            return True
        if isinstance(error, PrefillFailedError | TransferFailedError):
            # Its decode reservation is released: start over while the client has seen nothing.
            if isinstance(error, PrefillFailedError) and error.unreachable:
                self.mark_failed(error.worker_id)
            self.failed_prefills += 1
            if num_streamed:
                raise error
            if self.failed_prefills >= PREFILL_ATTEMPTS:
                # Workers failed, not the request: a 503, not a 500.
                raise SaturatedError(
                    f"the prompt's prefill failed {self.failed_prefills} times ({error}); retry "
                    "after the time in Retry-After"
                ) from error
            logger.warning("request %s: %s; computing it again", request_id, error)
            return True
        if isinstance(error, WorkerUnreachableError | WorkerLostError):
            self.mark_failed(decode_id)
            self.tried.append(decode_id)
            self.migrations += 1
            if self.migrations > self.migration_limit:
                raise SaturatedError(
                    f"request {request_id}: {error}; it moved to another decode worker "
                    f"{self.migration_limit} times (--migration-limit); retry after the "
                    "time in Retry-After"
                ) from error
            logger.warning(
                "request %s: %s; continuing on another decode worker after %d tokens",
                request_id,
                error,
                num_streamed,
            )
            return False
        raise error
