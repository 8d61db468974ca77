"""PrefillService: compute a prompt, ship its KV blocks to the decode worker, return token one.

The engine batches prefills from many calls; each call then copies its request's blocks out,
frees them at once, and sends the copy. While a call holds its prompt, the `LeaseKeeper` renews
the decode worker's reservation for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from nori.engine.engine import LLMEngine
from nori.engine.request import KVExport, KVToRemote
from nori.prefill.export_arena import ExportArena, ExportCopy
from nori.prefill.lease_keeper import LeaseKeeper
from nori.transfer.base import KVSender, TransferError, TransferRejected
from nori.transfer.handoff import TransferHeader
from nori.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination
from nori.worker.engine_core import EngineCore
from nori.worker.grpc_calls import call_engine
from nori.worker.kv_layout import source_buffers
from nori.worker.output_streams import OutputStreams, delta_from_output
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry
from nori.worker.servicer_base import EngineServicer

logger = logging.getLogger(__name__)


def export_and_release(engine: LLMEngine, request_id: str) -> KVExport:
    """A prefilled request's state and a copy of its blocks, which are then freed (an engine
    operation: it goes to an engine process by name)."""
    export = engine.export_request(request_id)
    engine.finish_kv_transfer(request_id)
    return export


class PrefillServicer(EngineServicer, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        worker_id: str,
        engine: EngineCore,
        streams: OutputStreams,
        sender: KVSender,
        is_draining: Callable[[], bool],
        leases: LeaseKeeper,
        telemetry: WorkerTelemetry,
        max_open_calls: int,
        max_background_calls: int | None = None,
        export_arena: ExportArena | None = None,
        host: str = "",
    ) -> None:
        super().__init__(
            worker_id, engine, streams, is_draining, telemetry, max_open_calls, max_background_calls
        )
        self._sender = sender
        self._sender_name = f"{worker_id}@{host}" if host else worker_id
        # Where each request's KV copy waits for its transfer (shared memory).
        self._arena = export_arena if export_arena is not None else ExportArena()
        self._leases = leases
        self.kv_bytes_sent = 0
        self.num_transfers = 0
        self.transfers_in_flight = 0

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        request_id = request.request_id
        if self._is_draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        destination = request.destination
        params, prompt, queue, record = await self._open(request, context, "prefill")
        done = False
        outcome, finish_reason, error = "error", None, ""
        # Before the prompt is queued: its wait in our queue must not use up the decode lease.
        self._leases.hold(request_id, destination.grpc_address, destination.lease_seconds)
        try:
            started = time.perf_counter()
            await call_engine(
                self._engine,
                context,
                LLMEngine.add_request,
                request_id,
                prompt,
                params,
                priority=request.priority,
                remote_kv=KVToRemote(),
            )
            output = await queue.get()
            record.output(output, computed_prompt=True)
            # It may have run in a single step, unseen by the StartWatch.
            self._leases.started([request_id])
            first = delta_from_output(output)
            prefill_seconds = time.perf_counter() - started
            if output.finished:
                done = True  # the first token ended it: nothing to send
                outcome = finish_reason = output.finish_reason or "stop"
                return prefill_pb2.PrefillResponse(first=first, prefill_seconds=prefill_seconds)
            export, copy = await self._export(request_id)
            done = True  # the blocks are free; what remains is sending the copy
            sent = await self._send(export, copy, destination, context, record)
            outcome = "transferred"
            return prefill_pb2.PrefillResponse(
                first=first,
                kv_bytes_sent=sent,
                prefill_seconds=prefill_seconds,
                transfer_seconds=time.perf_counter() - started - prefill_seconds,
            )
        except asyncio.CancelledError:
            outcome = "abort"  # the gateway gave up on it (its client left)
            raise
        except Exception as exception:
            error = str(exception) or type(exception).__name__
            raise
        finally:
            record.finish(outcome, finish_reason, error)
            self._leases.release(request_id)
            self._close(request_id)
            if not done:
                self._engine.submit(LLMEngine.abort_request, request_id)

    async def _export(self, request_id: str) -> tuple[KVExport, ExportCopy]:
        """A copy of the prefilled request's state and blocks, which are then freed, with its
        arena release and checksum. The cache is read here, off the event loop (an engine
        process's is shared memory); under tensor parallelism the engine gathers the heads."""
        facts = self._engine.facts
        if facts.tensor_parallel_size > 1:
            export = await self._engine.call(export_and_release, request_id)
            return export, ExportCopy(export.blocks)
        state, block_ids = await self._engine.call(LLMEngine.prefilled_kv, request_id)
        copying = asyncio.ensure_future(
            asyncio.to_thread(self._arena.read_blocks, facts.kv_cache_tensors, block_ids)
        )
        try:
            copy = await asyncio.shield(copying)
        except asyncio.CancelledError:
            copying.add_done_callback(_release_copy)
            raise
        self._engine.submit(LLMEngine.finish_kv_transfer, request_id)
        return KVExport(state=state, blocks=copy.blocks), copy

    async def _send(
        self,
        export: KVExport,
        copy: ExportCopy,
        destination: KVDestination,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
    ) -> int:
        block_ids = list(destination.block_ids)
        release = copy.release
        try:
            try:
                buffers = source_buffers(export.blocks, block_ids)
            except ValueError as error:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"bad KV destination: {error}"
                )
            state = export.state
            span, trace_context = record.start_kv_send(destination.transfer_address, len(block_ids))
            header = TransferHeader.of(
                request_id=state.request_id,
                block_ids=block_ids,
                buffer_nbytes=[buffer.nbytes for buffer in buffers],
                output_token_ids=state.output_token_ids,
                generator_state=state.generator_state,
                destination=destination,
                trace_context=trace_context,
                # Checksums follow the data, unless the export copy took one as it copied.
                checksums_follow=True,
                sender=self._sender_name,
            )
            header = dataclasses.replace(header, sender_checksum=copy.checksum)
        except BaseException:
            if release is not None:
                release()  # no transfer will read the copy
            raise
        nbytes = sum(header.buffer_nbytes)
        started = time.perf_counter()
        self.transfers_in_flight += 1
        try:
            transfer = asyncio.ensure_future(
                self._sender.send(destination.transfer_address, header, buffers)
            )
            if release is None:
                await transfer
            else:
                # A receiver may read the arena's copy until the transfer ends, even after this
                # call's client left.
                transfer.add_done_callback(_release_after(release))
                await asyncio.shield(transfer)
        except TransferRejected as error:
            span.end()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV refused: {error}")
        except TransferError as error:
            span.end()
            # ABORTED, not UNAVAILABLE: the path failed, not this worker; the gateway starts over.
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {error}")
        except BaseException:
            span.end()
            raise
        finally:
            self.transfers_in_flight -= 1
        draft_nbytes = len(block_ids) * self._engine.facts.draft_kv_bytes_per_block
        record.end_kv_send(span, nbytes, time.perf_counter() - started, draft_nbytes)
        self.kv_bytes_sent += nbytes
        self.num_transfers += 1
        return nbytes

    async def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return self.stats(
            "prefill", kv_bytes_sent=self.kv_bytes_sent, num_transfers=self.num_transfers
        )


def _release_copy(copying: asyncio.Future[ExportCopy]) -> None:
    """Gives back the arena range of a copy whose caller left before it was made."""
    if not copying.cancelled() and copying.exception() is None:
        release = copying.result().release
        if release is not None:
            release()


def _release_after(release: Callable[[], None]) -> Callable[[asyncio.Future[None]], None]:

    def done(transfer: asyncio.Future[None]) -> None:
        release()
        if not transfer.cancelled():
            transfer.exception()  # seen here too: its caller may have left

    return done
