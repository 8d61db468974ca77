"""gRPC calls to workers as the request flow sees them: a failed call is a `BackendError` with
its HTTP status (`error_from_rpc`), a token delta a GenerationChunk; after a failed attempt,
`RetryPolicy` decides whether and how the request tries again, or which error its client gets.
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
    """Awaits a gRPC call; its failure becomes a BackendError. A call cancelled under us (its
    channel closed) is one too: CancelledError passes only when this task is being cancelled."""
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
    """The stream's next message, None at its end. A worker silent for `stall_timeout_s` is
    lost (WorkerLostError); keepalive only catches a peer that stops answering pings."""
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
        raise DecodeFullError(str(error), error.retry_after_s) from None
    except WorkerLostError as error:
        if not error.cancelled_by_server:
            raise
        # Dropped from its gRPC backlog unserved: nothing ran there.
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
    """A batch member's (or batch line's) wait when every worker is full: doubling backoff
    until `limit_s` after the first turn. A single request does not wait (limit 0: a 429 its
    client retries); a batch's own running members free the room the rest need."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit_s = limit_s
        self._clock = clock
        self._deadline: float | None = None
        self._delay_s = FIRST_DELAY_S

    async def turn(self, woken: asyncio.Future[None] | None = None) -> bool:
        """Waits for the backoff or `woken` (room freed), then cancels `woken`; False, at once,
        when the time is up."""
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
    decode_attempts: int = 3
    # Each of a failed or full prefill, or a move to another decode worker (--migration-limit).
    prefill_attempts: int = 3
    migration_limit: int = 3
    group_wait_s: float = 600.0


@dataclass
class RetryPolicy:
    """After each failed attempt of one request: another try (under a fresh id or not), or the
    error the client gets; a batch member whose tries are used up waits (`GroupWait`) and tries
    them all again while the client has seen nothing. Every counter of its tries is here.

    | failure                                  | next try, while the limit allows            |
    |------------------------------------------|---------------------------------------------|
    | DecodeFullError: refused before any work | another decode worker (decode_attempts)     |
    | WorkerFullError: the prefill queue full  | pick again (prefill_attempts)               |
    | PrefillFailedError, TransferFailedError  | start over (prefill_attempts, then 503)     |
    | WorkerUnreachableError, WorkerLostError  | migrate (migration_limit, then 503)         |
    """

    limits: RetryLimits
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
            if len(self.tried) >= self.limits.decode_attempts + self.migrations:
                if num_streamed or not await self.wait.turn():
                    raise error
                self.tried.clear()
            return not num_streamed
        if isinstance(error, WorkerFullError):
            self.full_prefills += 1
            if self.full_prefills >= self.limits.prefill_attempts:
                if not await self.wait.turn():
                    raise error
                self.full_prefills = 0
            return True
        if isinstance(error, PrefillFailedError | TransferFailedError):
            # Its decode reservation is already released: start over while the client has
            # seen nothing.
            if isinstance(error, PrefillFailedError) and error.unreachable:
                self.mark_failed(error.worker_id)
            self.failed_prefills += 1
            if num_streamed:
                raise error
            if self.failed_prefills >= self.limits.prefill_attempts:
                # Workers failed, not the request: a 503, not a 500.
                raise SaturatedError(
                    f"the prompt's prefill failed {self.failed_prefills} times ({error}); retry "
                    "after the time in Retry-After",
                    retry_after_s=1.0,
                ) from error
            logger.warning("request %s: %s; computing it again", request_id, error)
            return True
        if isinstance(error, WorkerUnreachableError | WorkerLostError):
            self.mark_failed(decode_id)
            self.tried.append(decode_id)
            self.migrations += 1
            if self.migrations > self.limits.migration_limit:
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
