"""One attempt of an admitted request on the workers (`cluster.py` retries it): the prompt's path
(`disaggregation.py`), then `prefill_then_decode` (KV computed on a prefill worker, sent to the
decode worker) or `compute_and_decode` (one worker does both). The `RequestTicket` counts where
it is; closing the iterator cancels the calls, freeing the request's blocks on those workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.disaggregation import DisaggregationPolicy, PathQueues
from nori.gateway.errors import (
    BackendError,
    DecodeFullError,
    InvalidRequestError,
    PrefillFailedError,
    SaturatedError,
    UpstreamTimeoutError,
    WorkerFullError,
    WorkerLostError,
    WorkerUnreachableError,
    error_from_rpc,
)
from nori.gateway.ledger import Ledger, RequestTicket
from nori.gateway.worker_pool import WorkerPool, pick_prefill
from nori.repeated_log import RepeatedFailureLog
from nori.rpc.convert import (
    logprobs_from_proto,
    params_to_proto,
    prompt_logprobs_from_delta,
    stop_reason_from_proto,
)
from nori.state.block_directory import BlockDirectory, prompt_block_hashes
from nori.state.registry import WorkerInfo
from nori.state.requests import StateRecorder
from nori.telemetry.propagation import grpc_metadata
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Resumed:
    """What a request had streamed to the client: where a migrated request picks up."""

    token_ids: list[int]
    num_chars: int = 0

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.new_token_ids)
        self.num_chars += len(chunk.new_text)


class RequestFlow:
    """One attempt of an admitted request on the workers: the two ways a worker serves it."""

    def __init__(
        self,
        pool: WorkerPool,
        ledger: Ledger,
        directory: BlockDirectory,
        states: StateRecorder | None,
        tracer: trace.Tracer | None = None,
        stall_timeout_s: float = 300.0,
        rpc_metadata: tuple[tuple[str, str], ...] = (),
        policy: DisaggregationPolicy | None = None,
    ) -> None:
        self._pool = pool
        self._ledger = ledger
        self._directory = directory
        self._states = states
        self._tracer = tracer or trace.NoOpTracer()
        self._stall_timeout_s = stall_timeout_s
        self._rpc_metadata = rpc_metadata
        self.disaggregation = policy or DisaggregationPolicy("always")
        self._lookup_failures = RepeatedFailureLog(
            logger, "the block directory lookup (routing by load meanwhile)"
        )

    async def compute_and_decode(
        self,
        request: GenerationRequest,
        worker: WorkerInfo,
        ticket: RequestTicket,
        resumed: Resumed | None = None,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """One worker computes the prompt (and `resumed`, what a lost worker had streamed) and
        decodes: a colocated worker, a decode worker chosen for it, or a migration's."""
        trace.get_current_span().set_attribute("nori.decode.worker", worker.worker_id)
        call = self._generate(
            worker, request, compute_prompt=True, metadata=self._call_metadata(), resumed=resumed
        )
        self._record(request.request_id, "decoding", decode_worker=worker.worker_id)
        answered = False
        try:
            async for message in messages(call, worker.worker_id, self._stall_timeout_s):
                answered = True
                ticket.first_token(time.monotonic())
                yield chunk_from_delta(message.delta)
        except (WorkerFullError, WorkerLostError) as error:
            if answered and isinstance(error, WorkerLostError):
                raise
            raise took_nothing(error) from None
        finally:
            call.cancel()

    async def serve_disaggregated(
        self, request: GenerationRequest, decode: WorkerInfo, ticket: RequestTicket
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The request on a disaggregated decode worker, its prompt where the policy chooses.
        The choice (a Redis lookup) comes before the reservation, whose lease starts at once."""
        num_tokens = len(request.prompt_token_ids)
        request_span = trace.get_current_span()
        with self._tracer.start_as_current_span("route") as span:
            span.set_attribute("nori.decode.worker", decode.worker_id)
            prefill, cached = await self._pick_prefill(request, span)
            choice = self.disaggregation.choose(
                num_tokens,
                decode,
                prefill,
                cached,
                PathQueues.counted(
                    decode, prefill, self._ledger.in_flight, self._ledger.pending_prompt_tokens
                ),
            )
            attributes = choice.span_attributes()
            span.set_attributes(attributes)
            request_span.set_attributes(attributes)
        if choice.path == "decode":
            ticket.prompt_on(decode.worker_id, whole_request=False)
            chunks = self.compute_and_decode(request, decode, ticket)
        elif prefill is None:
            raise SaturatedError("no prefill worker is available")
        else:
            ticket.prompt_on(prefill.worker_id)
            chunks = self.prefill_then_decode(request, decode, prefill, ticket)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            ticket.prompt_off()
            await chunks.aclose()

    async def prefill_then_decode(
        self,
        request: GenerationRequest,
        decode: WorkerInfo,
        prefill: WorkerInfo,
        ticket: RequestTicket,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Reserve on the decode worker, prefill on `prefill`, stream from the decode worker."""
        metadata = self._call_metadata()
        started = time.monotonic()
        decode_call = self._generate(decode, request, compute_prompt=False, metadata=metadata)
        decode_next: asyncio.Future[decode_pb2.GenerateResponse | None] | None = None
        try:
            with self._tracer.start_as_current_span("reserve") as span:
                destination = await reservation(decode_call, decode, self._stall_timeout_s)
                span.set_attribute("nori.kv.blocks", len(destination.block_ids))
                span.set_attribute("nori.kv.lease_s", destination.lease_seconds)
            self._record(
                request.request_id,
                "prefilling",
                prefill_worker=prefill.worker_id,
                decode_worker=decode.worker_id,
            )
            decode_next = asyncio.ensure_future(
                read(decode_call, decode.worker_id, self._stall_timeout_s)
            )
            response = await self._prefill(request, prefill, destination, decode_next, metadata)
            ticket.first_token(time.monotonic())
            self.disaggregation.observe_prefill_path(
                len(request.prompt_token_ids),
                time.monotonic() - started,
                response.prefill_seconds,
                response.transfer_seconds,
            )
            first = chunk_from_delta(response.first)
            yield first
            if first.finished:
                return
            message = await decode_next
            while message is not None:
                yield chunk_from_delta(message.delta)
                if message.delta.finished:
                    return
                message = await read(decode_call, decode.worker_id, self._stall_timeout_s)
            raise WorkerLostError(
                f"{decode.worker_id} ended the stream before the request finished"
            )
        finally:
            if decode_next is not None:
                decode_next.cancel()
            decode_call.cancel()

    async def _prefill(
        self,
        request: GenerationRequest,
        prefill: WorkerInfo,
        destination: KVDestination,
        decode_next: asyncio.Future[decode_pb2.GenerateResponse | None],
        metadata: tuple[tuple[str, str], ...],
    ) -> prefill_pb2.PrefillResponse:
        """Token one from the prefill worker, while the decode stream may end first (an expired
        lease: its error is raised) or already carry token two."""
        stub = prefill_pb2_grpc.PrefillServiceStub(self._pool.channel(prefill.grpc_address))
        call = stub.Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=params_to_proto(request.params),
                destination=destination,
                priority=request.priority,
            ),
            metadata=metadata,
        )
        answer: asyncio.Future[prefill_pb2.PrefillResponse] = asyncio.ensure_future(
            rpc(call, prefill.worker_id)
        )
        try:
            either: set[asyncio.Future[Any]] = {answer, decode_next}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if decode_next.done() and not answer.done():
                decode_next.result()  # raises the decode side's error (an expired lease)
                # Decoding began without token one: bound the wait for a prefill worker that
                # hung right after sending.
                await asyncio.wait({answer}, timeout=destination.lease_seconds)
                if not answer.done():
                    raise UpstreamTimeoutError(
                        f"{prefill.worker_id} sent the KV blocks but did not answer within "
                        f"{destination.lease_seconds:g} s (hung or dead)"
                    )
            try:
                return await answer
            except (InvalidRequestError, WorkerFullError):
                raise  # nothing failed on the worker
            except BackendError as error:
                unreachable = isinstance(error, WorkerUnreachableError | WorkerLostError)  # gone
                raise PrefillFailedError(str(error), prefill.worker_id, unreachable) from None
        finally:
            answer.cancel()
            call.cancel()  # a no-op once answered

    async def _pick_prefill(
        self, request: GenerationRequest, span: trace.Span
    ) -> tuple[WorkerInfo | None, int]:
        """The prefill worker that would finish this prompt first (cached prefix, queue) and
        its cached prompt tokens; (None, 0) when none is available."""
        candidates = self._pool.available("prefill")
        block_size = self._pool.block_size
        if not candidates or block_size is None:
            return None, 0
        hashes = prompt_block_hashes(request.prompt_token_ids, block_size)
        try:
            cached = await self._directory.longest_prefixes(
                hashes, [w.worker_id for w in candidates]
            )
        except Exception as error:
            self._lookup_failures.failed(error)
            cached = {}
        cached_tokens = {worker_id: n * block_size for worker_id, n in cached.items()}
        ledger, num_tokens = self._ledger, len(request.prompt_token_ids)
        counts = (ledger.in_flight, ledger.pending_prompt_tokens)
        chosen = pick_prefill(
            candidates, *counts, cached_tokens, num_tokens, ledger.turn("prefill")
        )
        assert chosen is not None
        span.set_attribute("nori.prefill.worker", chosen.worker_id)
        span.set_attribute("nori.prefix_hit_blocks", cached.get(chosen.worker_id, 0))
        return chosen, cached_tokens.get(chosen.worker_id, 0)

    def _generate(
        self,
        worker: WorkerInfo,
        request: GenerationRequest,
        compute_prompt: bool,
        metadata: tuple[tuple[str, str], ...],
        resumed: Resumed | None = None,
    ) -> grpc.aio.UnaryStreamCall:
        stub = decode_pb2_grpc.DecodeServiceStub(self._pool.channel(worker.grpc_address))
        return stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=params_to_proto(request.params),
                compute_prompt=compute_prompt,
                resumed_output_token_ids=resumed.token_ids if resumed is not None else (),
                resumed_text_chars=resumed.num_chars if resumed is not None else 0,
                priority=request.priority,
                coalesce_ms=request.coalesce_ms,
                stream_interval=request.stream_interval,
            ),
            metadata=metadata,
        )

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """A worker call's metadata: the cluster's token and the current trace context."""
        return (*self._rpc_metadata, *grpc_metadata())

    def _record(self, request_id: str, state: str, **fields: str) -> None:
        if self._states is not None:
            self._states.record(request_id, state, **fields)


# ---------------------------------------------------------------------- gRPC calls


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
    except (WorkerFullError, WorkerUnreachableError, WorkerLostError) as error:
        raise took_nothing(error) from None
    if message is None or not message.HasField("reservation"):
        raise BackendError(f"{decode.worker_id} did not answer with a reservation")
    destination = KVDestination()
    destination.CopyFrom(message.reservation)
    # The prefill worker renews the lease here while it holds the prompt.
    destination.grpc_address = decode.grpc_address
    return destination


def took_nothing(error: BackendError) -> BackendError:
    """A DecodeFullError (another decode worker may serve it) if the decode worker took nothing
    of the request (full, unreachable, or the call dropped from its gRPC backlog), else `error`."""
    if isinstance(error, WorkerLostError) and not error.cancelled_by_server:
        return error
    return DecodeFullError(str(error), error.retry_after_s or 1.0)
