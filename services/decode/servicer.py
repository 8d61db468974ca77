"""DecodeService: reserve blocks under a lease, take the KV in, stream tokens out.

A Generate call's prompt K/V is either sent by a prefill worker (`_reserve_for_remote_kv`, the
reservation being the call's first message, then `_finish_remote_kv`) or computed here
(`_compute_prompt_here`). One call is one request's whole life here: cancelling it frees the
request's blocks. RenewLeases keeps a reservation alive (`lease.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from nori.decode.kv_sink import DecodeKVSink
from nori.decode.lease import LeaseExpired
from nori.engine.engine import LLMEngine
from nori.engine.request import KVFromRemote, NoFreeBlocks
from nori.sampling.params import SamplingParams
from nori.state.state_recorder import StateRecorder
from nori.transfer.address import parse_address
from nori.transfer.base import TransferRejected
from nori.transfer.handoff import HandOff
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination
from nori.worker.engine_core import EngineCore
from nori.worker.grpc_calls import call_engine
from nori.worker.output_streams import (
    OutputStreams,
    delta_from_output,
    next_output,
    next_output_coalesced,
    next_output_of,
)
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry
from nori.worker.servicer_base import EngineServicer

logger = logging.getLogger(__name__)


class DecodeServicer(EngineServicer, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        worker_id: str,
        engine: EngineCore,
        streams: OutputStreams,
        sink: DecodeKVSink | None,
        states: StateRecorder | None,
        transfer_address: str,
        lease_s: float,
        is_draining: Callable[[], bool],
        telemetry: WorkerTelemetry,
        max_open_calls: int,
    ) -> None:
        super().__init__(worker_id, engine, streams, is_draining, telemetry, max_open_calls)
        self._sink = sink
        self._states = states
        self._transfer_address = transfer_address
        self._lease_s = lease_s

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        request_id = request.request_id
        if self._is_draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        if not request.compute_prompt and self._sink is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker takes no KV transfers"
            )
        role = "generate" if request.compute_prompt or self._sink is None else "decode"
        params, prompt, queue, record = await self._open(request, context, role)
        finished = False
        outcome, finish_reason, error = "error", None, ""
        try:
            if request.compute_prompt:
                await self._compute_prompt_here(request, prompt, params, context)
            else:
                yield await self._reserve_for_remote_kv(request, prompt, params, context)
                await self._finish_remote_kv(request_id, context, record)
            coalesce_s = request.coalesce_ms / 1000
            first = True
            while not finished:
                # The first output at once (it ends the gateway's admission wait); the rest
                # merged as the caller asked.
                if coalesce_s > 0 and not first:
                    output = await next_output_coalesced(queue, coalesce_s)
                elif request.stream_interval > 1 and not first:
                    output = await next_output_of(queue, request.stream_interval)
                else:
                    output = await next_output(queue)
                first = False
                record.output(output, computed_prompt=request.compute_prompt)
                finished = output.finished
                if finished:
                    # Set before the last yield: the caller may close the stream right after it.
                    outcome = finish_reason = output.finish_reason or "stop"
                delta: common_pb2.TokenDelta = delta_from_output(output)
                yield decode_pb2.GenerateResponse(delta=delta)
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                outcome = "abort"  # the gateway cancelled the call (its client left)
            raise
        except Exception as exception:
            error = str(exception) or type(exception).__name__
            raise
        finally:
            record.finish(outcome, finish_reason, error)
            self._close(request_id)
            if self._sink is not None:
                self._sink.forget(request_id)
            if not finished:
                self._engine.submit(LLMEngine.abort_request, request_id)

    async def _compute_prompt_here(
        self,
        request: decode_pb2.GenerateRequest,
        prompt: list[int],
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The prompt is computed here (colocated, or a migrated request with its tokens)."""
        await call_engine(
            self._engine,
            context,
            LLMEngine.add_request,
            request.request_id,
            prompt,
            params,
            priority=request.priority,
            output_token_ids=list(request.resumed_output_token_ids),
            num_emitted_chars=request.resumed_text_chars,
        )

    async def _reserve_for_remote_kv(
        self,
        request: decode_pb2.GenerateRequest,
        prompt: list[int],
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.GenerateResponse:
        """Reserves blocks for the prompt's K/V (RESOURCE_EXHAUSTED when the pool has no room)."""
        request_id = request.request_id
        try:
            block_ids = await call_engine(
                self._engine,
                context,
                LLMEngine.add_request,
                request_id,
                prompt,
                params,
                priority=request.priority,
                remote_kv=KVFromRemote(),
            )
        except NoFreeBlocks:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this worker"
            )
        assert self._sink is not None
        lease = self._sink.expect(request_id, block_ids, self._lease_s)
        return decode_pb2.GenerateResponse(
            reservation=KVDestination(
                worker_id=self._worker_id,
                transfer_address=self._transfer_address,
                block_ids=block_ids,
                lease_seconds=self._lease_s,
                lease_epoch=lease.epoch,
                transfer_token=lease.transfer_token,
            )
        )

    async def _finish_remote_kv(
        self, request_id: str, context: grpc.aio.ServicerContext, record: CallRecord
    ) -> None:
        assert self._sink is not None
        hand_off = await self._receive(request_id, context, record)
        # A tensor-parallel engine takes the blocks from a staging copy (each rank its heads).
        staged = self._sink.staged_blocks(request_id)
        self._record(request_id, "decoding")
        generator_state = hand_off.generator_state if hand_off.HasField("generator_state") else None
        await call_engine(
            self._engine,
            context,
            LLMEngine.finish_kv_transfer,
            request_id,
            list(hand_off.output_token_ids),
            generator_state,
            staged,
        )

    async def _receive(
        self, request_id: str, context: grpc.aio.ServicerContext, record: CallRecord
    ) -> HandOff:
        sink = self._sink
        assert sink is not None
        try:
            hand_off = await sink.wait(request_id)
        except (LeaseExpired, TimeoutError) as error:
            record.lease_expired()
            message = str(error) or "the KV transfer timed out"
            self._record(request_id, "failed", error=message)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
        except TransferRejected as error:
            self._record(request_id, "failed", error=str(error))
            await context.abort(grpc.StatusCode.ABORTED, str(error))
        lease = sink.lease(request_id)
        if lease is not None:
            record.kv_received(
                hand_off.trace_context,
                reserved_at=lease.reserved_at,
                receiving_since=lease.receiving_since,
                arrived_at=lease.arrived_at,
                nbytes=lease.nbytes,
                num_blocks=len(lease.block_ids),
                lease_s=lease.policy.lease_s,
                draft_nbytes=len(lease.block_ids) * self._engine.facts.draft_kv_bytes_per_block,
                bulk=lease.bulk,
                transport=parse_address(self._transfer_address).scheme,
                sender=hand_off.sender,
            )
        return hand_off

    def _record(self, request_id: str, state: str, **fields: str) -> None:
        if self._states is not None:
            self._states.record(request_id, state, decode_worker=self._worker_id, **fields)

    async def RenewLeases(
        self, request: decode_pb2.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.RenewLeasesResponse:
        sink = self._sink
        unknown = [
            renewal.request_id
            for renewal in request.renewals
            if sink is None or not sink.renew(renewal.request_id, renewal.started)
        ]
        return decode_pb2.RenewLeasesResponse(unknown_request_ids=unknown)

    async def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        sink = self._sink
        if sink is None:
            return self.stats("colocated")
        return self.stats(
            "decode", kv_bytes_received=sink.bytes_received, num_transfers=sink.transfers_completed
        )
