"""gRPC calls to workers as the request flow sees them: a failed call is a BackendError with the
HTTP status it deserves, and a worker's token delta is a GenerationChunk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc

from nori.gateway.backend import (
    BackendError,
    GenerationChunk,
    InvalidRequestError,
    QueueFullError,
    SaturatedError,
)
from nori.rpc.convert import logprobs_from_proto, prompt_logprobs_from_delta, stop_reason_from_proto
from nori.v1 import common_pb2, decode_pb2, prefill_pb2

T = TypeVar("T")


class WorkerFullError(QueueFullError):
    """A worker refused the request before any work: its queue or KV pool is full. Another
    worker may have room; when none has, the client gets 429 with Retry-After."""


class DecodeFullError(WorkerFullError):
    """A decode worker could not take the request (queue or KV pool full): another may."""


class UpstreamTimeoutError(BackendError):
    status_code = 504
    error_type = "timeout"


class PrefillFailedError(BackendError):
    """A prefill worker failed a prompt (died, hung up, could not send the KV): another one may
    compute it, since the client has seen nothing yet."""

    def __init__(self, message: str, worker_id: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        # The worker itself is gone (its calls fail at the connection), not just this prompt.
        self.unreachable = unreachable


class WorkerUnreachableError(SaturatedError):
    """A worker did not answer (gone, or its port closed): another one may."""


class WorkerLostError(BackendError):
    """A worker's call broke off mid-way (the worker died or hung up): a request it was decoding
    can continue on another worker (migration)."""


class CallDroppedError(WorkerLostError):
    """The worker's gRPC server ended the call with CANCELLED, which the gateway never asked
    for: gRPC core cancels calls that wait unserved in a server's backlog past
    `grpc.server.max_pending_requests` (1,000, random early drop up to 3,000), before any
    handler runs. Before the call's first message nothing ran there: another try may
    succeed (the flow makes it a DecodeFullError); later, the stream is lost."""


class TransferFailedError(BackendError):
    """A decode worker refused or lost a prompt's KV transfer (a sender that died mid-way, bytes
    that failed their checksum): its blocks are freed; the request may start over."""


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
        return CallDroppedError(f"{worker} dropped the call (CANCELLED): {details}")
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
