"""The path of one admitted request through the workers, retries and migration included.

`RequestFlow.run` is the whole of it, top to bottom:

1. **route**: pick a decode worker (fewest in flight, most free blocks: `worker_pool.Router`),
   and on a disaggregated one, where the prompt is computed (`--disaggregation`: always on a
   prefill worker, never, or auto: by what each path costs now, `disaggregation.choose_path`;
   the choice and its reason go on the request's span);
2. prompt on a prefill worker, `prefill_then_decode`:
   - **reserve**: open the decode worker's Generate stream; its first message is a reservation
     (block ids under a lease, and the address to send their KV to);
   - **prefill**: call the prefill worker (the one with the longest cached prefix and the least
     queued) with that destination and where to renew the lease while it holds the prompt; it
     sends the KV blocks straight to the decode worker and answers with token one. Meanwhile
     the decode stream is watched: it ends early when the lease runs out (the prefill worker
     hung or died, or the prompt never left its queue);
   - **stream**: token one, then the rest from the decode stream;
3. on a colocated worker, a prompt the decode worker computes itself, or to continue a request
   whose decode worker died (**migrate**), `compute_and_decode`: the worker computes the prompt
   (and what was already streamed) itself and its stream carries every later token;
4. on a failure, `worker_calls.RetryPolicy.after` decides, in one place, whether and how to try
   again.

Where the request is, is its `RequestTicket`'s to count (`prompt_on`, `decoding_on`, and off
again per attempt; its `close()` in `ClusterBackend.generate` releases what an attempt left).
Closing the iterator cancels the calls, and cancelling a call frees the request's blocks on that
worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

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
)
from nori.gateway.ticket import RequestTicket
from nori.gateway.worker_calls import (
    GroupWait,
    RetryLimits,
    RetryPolicy,
    await_call,
    chunk_from_delta,
    messages,
    read,
    reservation,
)
from nori.gateway.worker_pool import Router, WorkerPool
from nori.repeated_log import RepeatedFailureLog
from nori.rpc.convert import params_to_proto
from nori.state.block_directory import BlockDirectory, prompt_block_hashes
from nori.state.registry import WorkerInfo
from nori.state.state_recorder import StateRecorder
from nori.telemetry.propagation import grpc_metadata
from nori.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a request had streamed to the client: where a migrated request picks up."""

    token_ids: list[int]
    num_chars: int = 0

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.new_token_ids)
        self.num_chars += len(chunk.new_text)


class RequestFlow:
    """One admitted request on the workers: `run`, and the two ways a worker serves it."""

    def __init__(
        self,
        pool: WorkerPool,
        router: Router,
        directory: BlockDirectory,
        states: StateRecorder | None,
        tracer: trace.Tracer | None = None,
        stall_timeout_s: float = 300.0,
        rpc_metadata: tuple[tuple[str, str], ...] = (),
        limits: RetryLimits | None = None,
        policy: DisaggregationPolicy | None = None,
    ) -> None:
        self._tracer = tracer or trace.NoOpTracer()
        self.disaggregation = policy or DisaggregationPolicy("always")
        # Every worker call carries it (the cluster's token, if any) and its trace context.
        self._rpc_metadata = rpc_metadata
        # The longest wait for a worker stream's next message (see worker_calls.read).
        self._stall_timeout_s = stall_timeout_s
        self._lookup_failures = RepeatedFailureLog(
            logger, "the block directory lookup (routing by load meanwhile)"
        )
        self._pool = pool
        self._router = router
        self._directory = directory
        self._states = states
        self._limits = limits or RetryLimits()

    async def run(
        self, request: GenerationRequest, ticket: RequestTicket
    ) -> AsyncIterator[GenerationChunk]:
        """The request on a decode worker; elsewhere when that one is full, when its prompt's
        prefill worker fails before token one, or (migration) when the decode worker dies."""
        waits = request.admission_group is not None or request.priority > 0
        policy = RetryPolicy(
            self._limits,
            GroupWait(self._limits.group_wait_s if waits else 0.0),
            self._pool.mark_failed,
        )
        streamed = Resumed([])
        renamed = 0
        while True:
            decode = self._router.pick_decode(self._pool.routable(), exclude=policy.tried)
            if decode is None:
                await policy.no_decode_worker(request.request_id, bool(streamed.token_ids))
                continue
            ticket.decoding_on(decode.worker_id)
            try:
                if streamed.token_ids:
                    chunks = self.compute_and_decode(request, decode, ticket, resumed=streamed)
                elif decode.role == "colocated":
                    chunks = self.compute_and_decode(request, decode, ticket)
                else:
                    chunks = self.serve_disaggregated(request, decode, ticket)
                async for chunk in chunks:
                    streamed.add(chunk)
                    yield chunk
                return
            except BackendError as error:
                fresh_id = await policy.after(
                    error, request.request_id, decode.worker_id, len(streamed.token_ids)
                )
                if fresh_id:
                    # Each new attempt of a request refused or failed before its first token
                    # gets a fresh id for the workers ("~1", "~2", ...): the earlier attempt may
                    # still be open on a worker a moment longer (a decode reservation being
                    # released, an engine process applying the abort), which would refuse the
                    # same id as in use.
                    renamed += 1
                    base_id = request.request_id.rsplit("~", 1)[0]
                    request = dataclasses.replace(request, request_id=f"{base_id}~{renamed}")
            finally:
                ticket.decoding_off()

    async def compute_and_decode(
        self,
        request: GenerationRequest,
        worker: WorkerInfo,
        ticket: RequestTicket,
        resumed: Resumed | None = None,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """One worker computes the prompt and decodes: a colocated worker, a decode worker the
        prompt was routed to (conditional disaggregation), or (migration) the decode worker
        that continues a request whose worker died, from `resumed` (what that one had
        streamed), which it computes with the prompt before it goes on."""
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
        except WorkerFullError as error:
            # Refused at the call's start (its queue is full): nothing ran, another may take it.
            raise DecodeFullError(str(error), error.retry_after_s) from None
        except WorkerLostError as error:
            if answered or not error.cancelled_by_server:
                raise
            # Dropped from its gRPC backlog before it was served: nothing ran there.
            raise DecodeFullError(str(error), retry_after_s=1.0) from None
        finally:
            call.cancel()

    async def serve_disaggregated(
        self, request: GenerationRequest, decode: WorkerInfo, ticket: RequestTicket
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The request on a disaggregated decode worker, its prompt computed where the policy
        chooses: the choice is made before the reservation is taken (the lease starts with the
        reservation, so nothing slow, a Redis lookup, sits between it and the Prefill call)."""
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
                    decode, prefill, self._router.in_flight, self._router.pending_prompt_tokens
                ),
            )
            attributes = choice.span_attributes()
            span.set_attributes(attributes)
            # On the request's own span too: what a trace search filters by.
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
            ticket.prompt_off()  # counted from the pick: this attempt leaves it on no path
            await chunks.aclose()

    async def prefill_then_decode(
        self,
        request: GenerationRequest,
        decode: WorkerInfo,
        prefill: WorkerInfo,
        ticket: RequestTicket,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Reserve on the decode worker, prefill on `prefill`, stream from the decode worker.
        Both workers' spans are children of the request's (the current) span."""
        metadata = self._call_metadata()
        started = time.monotonic()
        decode_call = self._generate(decode, request, compute_prompt=False, metadata=metadata)
        decode_next: asyncio.Future[decode_pb2.GenerateResponse | None] | None = None
        try:
            # 1. reserve
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
            # 2. prefill, watching the decode stream
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
            # 3. stream
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
        """Token one from the prefill worker. Either side may speak first: the decode stream may
        end (an expired lease: its error is raised), or already carry token two before the
        prefill answer with token one reaches us."""
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
        answer = asyncio.ensure_future(await_call(call, prefill.worker_id))
        try:
            either: set[asyncio.Future[Any]] = {answer, decode_next}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if decode_next.done() and not answer.done():
                decode_next.result()  # raises the decode side's error (an expired lease)
                # The KV arrived and decoding began, but token one has not: a prefill worker
                # that hangs right after sending would otherwise hold this request until its
                # channel closes.
                await asyncio.wait({answer}, timeout=destination.lease_seconds)
                if not answer.done():
                    raise UpstreamTimeoutError(
                        f"{prefill.worker_id} sent the KV blocks but did not answer within "
                        f"{destination.lease_seconds:g} s (hung or dead)"
                    )
            try:
                return await answer
            except (InvalidRequestError, WorkerFullError):
                raise  # a bad request, or a full queue: nothing failed on the worker
            except BackendError as error:
                unreachable = isinstance(error, WorkerUnreachableError | WorkerLostError)  # gone
                raise PrefillFailedError(str(error), prefill.worker_id, unreachable) from None
        finally:
            answer.cancel()
            call.cancel()  # a no-op once answered

    async def _pick_prefill(
        self, request: GenerationRequest, span: trace.Span
    ) -> tuple[WorkerInfo | None, int]:
        """The prefill worker that would finish this prompt first (its cached prefix there,
        from the block directory, and what is queued on it), and the prompt tokens it has
        cached; (None, 0) when none is available."""
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
        num_tokens = len(request.prompt_token_ids)
        chosen = self._router.pick_prefill(candidates, cached_tokens, num_tokens)
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
