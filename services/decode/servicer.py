"""The decode worker process and its DecodeService: reserve blocks under a lease, take the KV in,
stream tokens out; `colocated` (`nori up --colocated`) computes prompts itself, no transfers.

A Generate call's prompt K/V is sent by a prefill worker (`_reserve_for_remote_kv`, then
`_finish_remote_kv`) or computed here. One call is one request's whole life here: cancelling it
frees the request's blocks. RenewLeases keeps a reservation alive (`kv_sink.py`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable

import grpc

from nori.decode.kv_sink import DecodeKVSink, LeaseExpired
from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.request import KVFromRemote, NoFreeBlocks
from nori.sampling.params import SamplingParams
from nori.settings import DEFAULT_KV_LEASE_S
from nori.state.requests import RequestStateStore, StateRecorder
from nori.transfer.base import KVReceiver, TransferRejected
from nori.transfer.factory import make_receiver
from nori.transfer.handoff import HandOff, parse_address
from nori.transfer.ucx_env import confine_ucx_to
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination
from nori.worker.engine_core import EngineCore
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry
from nori.worker.runtime import Worker, WorkerOptions
from nori.worker.servicer_base import (
    BlockLayout,
    EngineServicer,
    OutputStreams,
    call_engine,
    delta_from_output,
    next_output,
    next_output_coalesced,
    next_output_of,
)

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
            if request.compute_prompt:  # colocated, or a migrated request with its tokens
                await call_engine(
                    self._engine,
                    context,
                    LLMEngine.add_request,
                    request_id,
                    prompt,
                    params,
                    priority=request.priority,
                    output_token_ids=list(request.resumed_output_token_ids),
                    num_emitted_chars=request.resumed_text_chars,
                )
            else:
                yield await self._reserve_for_remote_kv(request, prompt, params, context)
                await self._finish_remote_kv(request_id, context, record)
            coalesce_s = request.coalesce_ms / 1000
            first = True
            while not finished:
                # The first output at once (it ends admission's wait); the rest merged as asked.
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


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def kv_listen_host(host: str, advertise_host: str) -> str:
    """Where the KV receiver listens: `--host`, or, when that is a wildcard, the advertised
    address if it is one of this machine's own (senders only come to the advertised one)."""
    if host not in WILDCARD_HOSTS:
        return host
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            advertise_host, 0, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind) as probe:
            probe.bind((address[0], 0))
    except OSError:
        return host
    return str(address[0])


class DecodeWorker(Worker):
    service_names = ("nori.v1.DecodeService",)

    def __init__(
        self,
        options: WorkerOptions,
        engine_config: EngineConfig,
        transport: str | None = None,
        transfer_port: int = 0,
        lease_s: float = DEFAULT_KV_LEASE_S,
        colocated: bool = False,
        queue_timeout_s: float = 60.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.role = "colocated" if colocated else "decode"
        super().__init__(options, engine_config)
        self.transport = transport
        self.transfer_port = transfer_port
        self.lease_s = lease_s
        self.queue_timeout_s = queue_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.colocated = colocated
        self._receiver: KVReceiver | None = None
        self._sink: DecodeKVSink | None = None
        self._servicer: DecodeServicer | None = None

    async def start_role(self) -> None:
        streams = OutputStreams()
        core = await self.start_engine(streams.dispatch)
        engine = core.facts
        assert self.redis is not None
        states = StateRecorder(RequestStateStore(self.redis, self.keys))
        if not self.colocated:
            # Under tensor parallelism the cache is split over processes: blocks arrive in a
            # staging copy, which the engine then scatters to the ranks.
            staging = (
                [BlockLayout(dtype, shape) for dtype, shape in engine.kv_block_layouts]
                if engine.tensor_parallel_size > 1
                else None
            )
            self._sink = DecodeKVSink(
                engine.kv_cache_tensors,
                staging=staging,
                on_receiving=lambda request_id: states.record(
                    request_id, "transferring", decode_worker=self.worker_id
                ),
                queue_timeout_s=self.queue_timeout_s,
                transfer_timeout_s=self.transfer_timeout_s,
            )
            # Before UCX starts: a loopback worker keeps UCX's own sockets on loopback.
            confine_ucx_to(self.options.host)
            self._receiver = make_receiver(self.transport, self._sink)
            advertise_host = self.options.resolved_advertise_host()
            self.transfer_address = await self._receiver.start(
                host=kv_listen_host(self.options.host, advertise_host),
                port=self.transfer_port,
                advertise_host=advertise_host,
            )
        self._servicer = DecodeServicer(
            worker_id=self.worker_id,
            engine=core,
            streams=streams,
            sink=self._sink,
            states=states,
            transfer_address=self.transfer_address,
            lease_s=self.lease_s,
            is_draining=lambda: self.draining,
            telemetry=self.telemetry,
            max_open_calls=self.options.max_open_calls(self.engine_config.max_num_seqs),
        )

    def add_servicers(self, server: grpc.aio.Server) -> None:
        assert self._servicer is not None
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self._servicer, server)

    def transfers_in_flight(self) -> int:
        return self._sink.num_receiving() if self._sink is not None else 0

    def transfer_counts(self) -> dict[str, int]:
        return {"kv_bytes_received": self._sink.bytes_received if self._sink is not None else 0}

    async def stop_role(self) -> None:
        if self._receiver is not None:
            await self._receiver.close()
        if self._engine is not None:
            await self._engine.stop()
