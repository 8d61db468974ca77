"""gRPC calls to workers as the request flow sees them, and what the flow does when one fails.

A failed call is a `BackendError` with the HTTP status it deserves (`error_from_rpc`), and a
worker's token delta is a GenerationChunk. After a failed attempt, `RetryPolicy` decides whether
the request tries again and how, or which error its client gets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from nori.gateway.backend import GenerationChunk
from nori.gateway.errors import (
    BackendError,
    DecodeFullError,
    InvalidRequestError,
    PrefillFailedError,
    QueueFullError,
    SaturatedError,
    TransferFailedError,
    UpstreamTimeoutError,
    WorkerFullError,
    WorkerLostError,
    WorkerUnreachableError,
)
from nori.rpc.convert import logprobs_from_proto, prompt_logprobs_from_delta, stop_reason_from_proto
from nori.state.registry import WorkerInfo
from nori.v1 import common_pb2, decode_pb2, prefill_pb2
from nori.v1.handoff_pb2 import KVDestination

T = TypeVar("T")

logger = logging.getLogger(__name__)


def chunk_from_delta(delta: common_pb2.TokenDelta) -> GenerationChunk:
    return GenerationChunk(
        new_token_ids=list(delta.token_ids),
        new_text=delta.text,
        finished=delta.finished,
        finish_reason=delta.finish_reason or None,
        stop_reason=stop_reason_from_proto(delta),
        logprobs=[logprobs_from_proto(entry) for entry in delta.logprobs] or None,
        num_cached_tokens=delta.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_from_delta(delta),
    )


def error_from_rpc(error: grpc.aio.AioRpcError, worker: str) -> BackendError:
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerFullError(f"{worker}: {details}", retry_after_s=1.0)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError(f"{worker}: {details}")
    if code is grpc.StatusCode.UNAVAILABLE:
        return WorkerUnreachableError(f"{worker} is unavailable: {details}", retry_after_s=1.0)
    if code is grpc.StatusCode.ABORTED:
        return TransferFailedError(f"{worker}: {details}")
    if code is grpc.StatusCode.CANCELLED:
        return WorkerLostError(
            f"{worker} dropped the call (CANCELLED): {details}", cancelled_by_server=True
        )
    return BackendError(f"{worker} failed ({code.name}): {details}")


async def rpc(call: Awaitable[T], worker: str) -> T:
    """Awaits a gRPC call; its failure becomes a BackendError.

    A call cancelled under us (its channel closed) is a failure too, not a cancellation of the
    request: only when this task itself is being cancelled (the client went away) does
    CancelledError pass through.
    """
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise error_from_rpc(error, worker) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise WorkerLostError(f"the call to {worker} was cancelled") from None


async def await_call(call: grpc.aio.UnaryUnaryCall, worker: str) -> prefill_pb2.PrefillResponse:
    response: prefill_pb2.PrefillResponse = await rpc(call, worker)
    return response


async def read(
    call: grpc.aio.UnaryStreamCall, worker: str, stall_timeout_s: float
) -> decode_pb2.GenerateResponse | None:
    """The stream's next message, None at its end.

    A worker that sends nothing for `stall_timeout_s` is taken as lost (WorkerLostError: the
    request moves to another worker). gRPC keepalive already ends the calls of a peer that
    stops answering pings; this bounds the wait when the peer answers pings but not the call.
    """
    try:
        async with asyncio.timeout(stall_timeout_s):
            message = await rpc(call.read(), worker)
    except TimeoutError:
        raise WorkerLostError(
            f"{worker} sent nothing for {stall_timeout_s:g} s (stalled)"
        ) from None
    if message is grpc.aio.EOF:
        return None
    return message


async def messages(
    call: grpc.aio.UnaryStreamCall, worker: str, stall_timeout_s: float
) -> AsyncIterator[decode_pb2.GenerateResponse]:
    while (message := await read(call, worker, stall_timeout_s)) is not None:
        yield message
        if message.delta.finished:
            return
    raise BackendError(f"{worker} ended the stream before the request finished")


async def reservation(
    decode_call: grpc.aio.UnaryStreamCall, decode: WorkerInfo, stall_timeout_s: float
) -> KVDestination:
    """The decode worker's reserved blocks, as the destination the prefill worker needs."""
    try:
        message = await read(decode_call, decode.worker_id, stall_timeout_s)
    except (WorkerFullError, WorkerUnreachableError) as error:
        # Full or unavailable before any work: another decode worker may take it.
        raise DecodeFullError(str(error), error.retry_after_s) from None
    except WorkerLostError as error:
        if not error.cancelled_by_server:
            raise
        # Dropped from its gRPC backlog before it was served: nothing ran there.
        raise DecodeFullError(str(error), retry_after_s=1.0) from None
    if message is None or not message.HasField("reservation"):
        raise BackendError(f"{decode.worker_id} did not answer with a reservation")
    destination = KVDestination()
    destination.CopyFrom(message.reservation)
    # The prefill worker renews the lease here while it holds the prompt.
    destination.grpc_address = decode.grpc_address
    return destination


# ---------------------------------------------------------------------- after a failure

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


class GroupWait:
    """The wait of a batch member or a batch line that found every worker full
    (`ClusterOptions.group_wait_s`): backoff, 50 ms doubling up to 1 s, until `limit_s` after
    the first turn.

    A single request that finds every worker full gets 429 at once (limit 0): its client is
    the one to retry. A batch was admitted as a whole, and its own running members free the
    room the rest need, so they wait for it instead of failing the batch.
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit_s = limit_s
        self._clock = clock
        self._deadline: float | None = None
        self._delay_s = FIRST_DELAY_S

    async def turn(self, woken: asyncio.Future[None] | None = None) -> bool:
        """Waits before the next try, or until `woken` is done (room freed), whichever comes
        first; False (without waiting) once the time is up. `woken` is cancelled either way."""
        try:
            if self._limit_s <= 0:
                return False
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


@dataclass(frozen=True)
class RetryLimits:
    # Decode workers to try when one answers that its pool is full.
    decode_attempts: int = 3
    # Tries of a prompt whose prefill worker failed (died, hung up, sent bad KV), or whose
    # prefill queue was full, each on a prefill worker that has not just failed.
    prefill_attempts: int = 3
    # Moves of a request whose decode worker died to another one (--migration-limit).
    migration_limit: int = 3
    # How long a member of a batch (or a batch line) waits for room when every worker is full,
    # instead of 429 (`GroupWait`); a single request does not wait.
    group_wait_s: float = 600.0


@dataclass
class RetryPolicy:
    """What happens after each failed attempt of one request: another try (and whether under a
    fresh id), or the error the client gets. Every counter of the request's tries is here.

    | failure                                  | next try, while the limit allows            |
    |------------------------------------------|---------------------------------------------|
    | DecodeFullError: refused before any work | another decode worker (decode_attempts)     |
    | WorkerFullError: the prefill queue full  | pick again (prefill_attempts)               |
    | PrefillFailedError, TransferFailedError  | start over (prefill_attempts, then 503)     |
    | WorkerUnreachableError, WorkerLostError  | migrate (migration_limit, then 503)         |

    A batch member (or batch line) whose tries are used up waits for room (`GroupWait`) and
    tries them all again, as long as the client has seen nothing.
    """

    limits: RetryLimits
    wait: GroupWait
    # The pool's `mark_failed`: route nothing to a worker whose calls just failed.
    mark_failed: Callable[[str], None]
    # Decode workers tried since the last wait (not to be picked again).
    tried: list[str] = field(default_factory=list)
    full_prefills: int = 0
    failed_prefills: int = 0
    migrations: int = 0

    async def no_decode_worker(self, request_id: str, streamed: bool) -> None:
        """Returns when the request may look for a decode worker again; raises otherwise."""
        if self.migrations:
            # Workers failed, not the request: a 503 the client may retry.
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
        """Returns when the request may try again: True when the next try needs a fresh id for
        the workers (the failed attempt may still be open on a worker a moment longer). Raises
        `error`, or the 503 it becomes, when the request must fail."""
        if isinstance(error, DecodeFullError):
            # Refused before any work (a full queue or pool): another worker may have room. A
            # migrating request may try them too: the new worker continues from what the
            # client has, so nothing is replayed.
            self.tried.append(decode_id)
            if len(self.tried) >= self.limits.decode_attempts + self.migrations:
                if num_streamed or not await self.wait.turn():
                    raise error
                self.tried.clear()
            return not num_streamed
        if isinstance(error, WorkerFullError):
            # The prefill worker's queue was full (its decode reservation is released): pick
            # again; routing by load favours another one.
            self.full_prefills += 1
            if self.full_prefills >= self.limits.prefill_attempts:
                if not await self.wait.turn():
                    raise error
                self.full_prefills = 0
            return True
        if isinstance(error, PrefillFailedError | TransferFailedError):
            # The prompt's prefill worker died, hung up or sent bad KV: its decode reservation
            # is already released (the decode call was cancelled); start over on another
            # prefill worker, while the client has seen nothing.
            if isinstance(error, PrefillFailedError) and error.unreachable:
                self.mark_failed(error.worker_id)
            self.failed_prefills += 1
            if num_streamed:
                raise error
            if self.failed_prefills >= self.limits.prefill_attempts:
                # Workers failed, not the request: a 503 the client may retry, not a 500.
                raise SaturatedError(
                    f"the prompt's prefill failed {self.failed_prefills} times ({error}); retry "
                    "after the time in Retry-After",
                    retry_after_s=1.0,
                ) from error
            logger.warning("request %s: %s; computing it again", request_id, error)
            return True
        if isinstance(error, WorkerUnreachableError | WorkerLostError):
            # The decode worker died or hung up: continue on another one from what the client
            # has (migration), or start over if it has nothing yet.
            self.mark_failed(decode_id)
            self.tried.append(decode_id)
            self.migrations += 1
            if self.migrations > self.limits.migration_limit:
                # Workers failed, not the request: a 503 the client (a batch runner) retries.
                raise SaturatedError(
                    f"request {request_id}: {error}; it moved to another decode worker "
                    f"{self.limits.migration_limit} times (--migration-limit); retry after the "
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
