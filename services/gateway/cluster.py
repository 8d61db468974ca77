"""The cluster backend: route each request to a prefill and a decode worker over gRPC.

Path of one request: pick a decode worker (free blocks, load) and a prefill worker (longest cached
prefix from the Redis block directory, then load); open the decode worker's Generate stream, which
answers with a reservation (block ids under a lease, and a transfer address); call Prefill with
that destination, and where to renew the reservation's lease while the prefill worker holds the
prompt. The prefill worker sends the KV blocks straight to the decode worker and returns the first
token; the decode stream carries the rest. Closing the iterator cancels both calls, and cancelling
a call frees the request's blocks on that worker.

Before any of that, admission (`admission.py`) refuses a request with 429 when the prompt tokens
already queued for the pool would make its first token too late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nori.gateway.admission import PromptQueue, QueuedPrompt
from nori.gateway.backend import (
    BackendError,
    BackendHealth,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    SaturatedError,
)
from nori.gateway.router import Router
from nori.gateway.worker_pool import WorkerPool
from nori.rpc.convert import logprobs_from_proto, params_to_proto, stop_reason_from_proto
from nori.serving.state_recorder import StateRecorder
from nori.settings import RoleSettings
from nori.state.block_directory import BlockDirectory, prompt_block_hashes
from nori.state.keys import Keys
from nori.state.registry import WorkerInfo, WorkerRegistry
from nori.state.requests import RequestStateStore
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DecodeFullError(SaturatedError):
    """A decode worker had no free KV blocks for the request: another one may have."""


class UpstreamTimeoutError(BackendError):
    status_code = 504
    error_type = "timeout"


@dataclass(frozen=True)
class ClusterOptions(RoleSettings):
    # The workers' KV block size (the gateway hashes prompts in blocks of it to look them up);
    # None: the size the workers state in the registry.
    block_size: int | None = None
    refresh_s: float = 0.5
    max_in_flight: int = 4096
    # Decode workers to try when one answers that its pool is full.
    decode_attempts: int = 3
    # Admission: prompt tokens that may wait for their first token, per worker computing prompts
    # (prefill or colocated); 0 = no bound. See admission.py for the default.
    max_queued_prompt_tokens: int = 8192


def chunk_from_delta(delta: common_pb2.TokenDelta) -> GenerationChunk:
    return GenerationChunk(
        new_token_ids=list(delta.token_ids),
        new_text=delta.text,
        finished=delta.finished,
        finish_reason=delta.finish_reason or None,
        stop_reason=stop_reason_from_proto(delta),
        logprobs=[logprobs_from_proto(entry) for entry in delta.logprobs] or None,
        num_cached_tokens=delta.num_cached_tokens,
    )


def error_from_rpc(error: grpc.aio.AioRpcError, worker: str) -> BackendError:
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return SaturatedError(f"{worker}: {details}", retry_after_s=1.0)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError(f"{worker}: {details}")
    if code is grpc.StatusCode.UNAVAILABLE:
        return SaturatedError(f"{worker} is unavailable: {details}", retry_after_s=1.0)
    return BackendError(f"{worker} failed ({code.name}): {details}")


class ClusterBackend:
    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.router = Router()
        self._redis: Redis | None = None
        self._pool: WorkerPool | None = None
        self._directory: BlockDirectory | None = None
        self._states: StateRecorder | None = None
        self._num_in_flight = 0
        self.prompt_queue = PromptQueue(options.max_queued_prompt_tokens)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        keys = Keys(self.options.namespace)
        self._redis = Redis.from_url(self.options.redis_url)
        self._pool = WorkerPool(
            WorkerRegistry(self._redis, keys), self.options.block_size, self.options.refresh_s
        )
        self._directory = BlockDirectory(self._redis, keys)
        self._states = StateRecorder(RequestStateStore(self._redis, keys))
        try:
            await self._redis.ping()
        except (RedisError, OSError) as error:
            raise ValueError(
                f"cannot reach Redis at {self.options.redis_url} ({error}); start one, or pass "
                "--redis-url / set REDIS_URL"
            ) from None
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

    async def worker_stats(self, timeout_s: float = 2.0) -> list[common_pb2.WorkerStats]:
        """Live figures from every registered worker (for /metrics)."""
        return await self.pool.stats(timeout_s)

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._num_in_flight >= self.options.max_in_flight:
            raise QueueFullError(
                f"the gateway has {self._num_in_flight} requests in flight (the limit)"
            )
        num_prompt_workers = sum(
            1 for w in self.pool.workers if w.role in ("prefill", "colocated") and not w.draining
        )
        queued = self.prompt_queue.admit(
            len(request.prompt_token_ids), num_prompt_workers, time.monotonic()
        )
        request_id = request.request_id
        self._record(request_id, "queued", num_prompt_tokens=len(request.prompt_token_ids))
        self._num_in_flight += 1
        outcome = "cancelled"
        num_output_tokens = 0
        try:
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
            self._num_in_flight -= 1
            if outcome != "failed":
                self._record(request_id, outcome, num_output_tokens=num_output_tokens)

    async def _route(
        self, request: GenerationRequest, queued: QueuedPrompt
    ) -> AsyncIterator[GenerationChunk]:
        tried: list[str] = []
        while True:
            num_yielded = 0
            decode = self.router.pick_decode(self.pool.workers, exclude=tried)
            if decode is None:
                if tried:
                    raise SaturatedError(
                        "no decode worker could take the request (KV pools full or draining); "
                        "retry shortly"
                    )
                raise SaturatedError("no decode worker is available")
            self.router.started(decode.worker_id)
            try:
                if decode.role == "colocated":
                    chunks = self._colocated(request, decode, queued)
                else:
                    chunks = self._disaggregated(request, decode, queued)
                async for chunk in chunks:
                    num_yielded += 1
                    yield chunk
                return
            except DecodeFullError:
                # Another worker may have room; but never replay a request the client has seen.
                tried.append(decode.worker_id)
                if num_yielded or len(tried) >= self.options.decode_attempts:
                    raise
            finally:
                self.router.ended(decode.worker_id)

    async def _colocated(
        self, request: GenerationRequest, worker: WorkerInfo, queued: QueuedPrompt
    ) -> AsyncIterator[GenerationChunk]:
        stub = decode_pb2_grpc.DecodeServiceStub(self.pool.channel(worker.grpc_address))
        call = stub.Generate(self._generate_request(request, compute_prompt=True))
        self._record(request.request_id, "decoding", decode_worker=worker.worker_id)
        try:
            async for message in _messages(call, worker.worker_id):
                queued.prefilled(time.monotonic())
                yield chunk_from_delta(message.delta)
        finally:
            call.cancel()

    async def _disaggregated(
        self, request: GenerationRequest, decode: WorkerInfo, queued: QueuedPrompt
    ) -> AsyncIterator[GenerationChunk]:
        # The prefill worker is chosen before the reservation is taken: the lease starts with
        # the reservation, so nothing slow (a Redis lookup) sits between it and the Prefill call.
        # Counted as started at once, so that a burst spreads over the prefill pool.
        num_prompt_tokens = len(request.prompt_token_ids)
        chosen = await self._pick_prefill(request)
        self.router.started(chosen.worker_id, num_prompt_tokens)
        # Still counted in the router's queued prompt tokens (until its first token).
        prefill: WorkerInfo | None = chosen
        prefill_call: grpc.aio.UnaryUnaryCall | None = None
        read_task: asyncio.Future[decode_pb2.GenerateResponse | None] | None = None
        stub = decode_pb2_grpc.DecodeServiceStub(self.pool.channel(decode.grpc_address))
        decode_call = stub.Generate(self._generate_request(request, compute_prompt=False))
        try:
            try:
                reservation = await _read(decode_call, decode.worker_id)
            except SaturatedError as error:
                raise DecodeFullError(str(error), error.retry_after_s) from None
            if reservation is None or not reservation.HasField("reservation"):
                raise BackendError(f"{decode.worker_id} did not answer with a reservation")
            self._record(
                request.request_id,
                "prefilling",
                prefill_worker=chosen.worker_id,
                decode_worker=decode.worker_id,
            )
            destination = KVDestination()
            destination.CopyFrom(reservation.reservation)
            # The prefill worker renews the lease here while it holds the prompt.
            destination.grpc_address = decode.grpc_address
            prefill_stub = prefill_pb2_grpc.PrefillServiceStub(
                self.pool.channel(chosen.grpc_address)
            )
            prefill_call = prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=params_to_proto(request.params),
                    destination=destination,
                )
            )
            # Either side may speak first: the decode stream ends early when the lease runs out
            # (the prefill worker hung or died, or the prompt never left its queue), and may
            # already carry token two before the prefill answer with token one reaches us.
            prefill_task = asyncio.ensure_future(_await_call(prefill_call, chosen.worker_id))
            read_task = asyncio.ensure_future(_read(decode_call, decode.worker_id))
            try:
                await asyncio.wait({prefill_task, read_task}, return_when=asyncio.FIRST_COMPLETED)
                if read_task.done() and not prefill_task.done():
                    read_task.result()  # raises the decode side's error (an expired lease)
                    # The KV arrived and decoding began, but token one (the prefill answer) has
                    # not: a prefill worker that hangs right after sending would otherwise hold
                    # this request until its channel closes.
                    lease_s = reservation.reservation.lease_seconds
                    await asyncio.wait({prefill_task}, timeout=lease_s)
                    if not prefill_task.done():
                        raise UpstreamTimeoutError(
                            f"{chosen.worker_id} sent the KV blocks but did not answer within "
                            f"{lease_s:g} s (hung or dead)"
                        )
                response = await prefill_task
            finally:
                prefill_task.cancel()
            self.router.ended(chosen.worker_id, num_prompt_tokens)
            prefill = None
            queued.prefilled(time.monotonic())
            first = chunk_from_delta(response.first)
            yield first
            if first.finished:
                return
            message = await read_task
            while message is not None:
                yield chunk_from_delta(message.delta)
                if message.delta.finished:
                    return
                message = await _read(decode_call, decode.worker_id)
            raise BackendError(f"{decode.worker_id} ended the stream before the request finished")
        finally:
            if read_task is not None:
                read_task.cancel()
            decode_call.cancel()
            if prefill_call is not None:
                prefill_call.cancel()
            if prefill is not None:
                self.router.ended(prefill.worker_id, num_prompt_tokens)

    async def _pick_prefill(self, request: GenerationRequest) -> WorkerInfo:
        assert self._directory is not None
        candidates = self.pool.available("prefill")
        block_size = self.pool.block_size
        if not candidates or block_size is None:
            raise SaturatedError("no prefill worker is available")
        hashes = prompt_block_hashes(request.prompt_token_ids, block_size)
        try:
            cached = await self._directory.longest_prefixes(
                hashes, [w.worker_id for w in candidates]
            )
        except Exception:
            logger.warning("block directory lookup failed; routing by load", exc_info=True)
            cached = {}
        cached_tokens = {worker_id: n * block_size for worker_id, n in cached.items()}
        chosen = self.router.pick_prefill(candidates, cached_tokens, len(request.prompt_token_ids))
        assert chosen is not None
        return chosen

    def _generate_request(
        self, request: GenerationRequest, compute_prompt: bool
    ) -> decode_pb2.GenerateRequest:
        return decode_pb2.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=params_to_proto(request.params),
            compute_prompt=compute_prompt,
        )

    def _record(self, request_id: str, state: str, **fields: str | int | float) -> None:
        if self._states is not None:
            self._states.record(request_id, state, **fields)


async def _rpc(call: Awaitable[T], worker: str) -> T:
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
        raise BackendError(f"the call to {worker} was cancelled") from None


async def _await_call(call: grpc.aio.UnaryUnaryCall, worker: str) -> prefill_pb2.PrefillResponse:
    response: prefill_pb2.PrefillResponse = await _rpc(call, worker)
    return response


async def _read(call: grpc.aio.UnaryStreamCall, worker: str) -> decode_pb2.GenerateResponse | None:
    """The stream's next message, None at its end."""
    message = await _rpc(call.read(), worker)
    if message is grpc.aio.EOF:
        return None
    return message


async def _messages(
    call: grpc.aio.UnaryStreamCall, worker: str
) -> AsyncIterator[decode_pb2.GenerateResponse]:
    while (message := await _read(call, worker)) is not None:
        yield message
        if message.delta.finished:
            return
    raise BackendError(f"{worker} ended the stream before the request finished")
