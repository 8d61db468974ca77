"""PrefillService: compute a prompt, ship its KV blocks to the decode worker, return token one.

Each call copies its request's blocks out, frees them at once and sends the copy. Until then
`LeaseKeeper` renews the decode worker's lease on the prompt's reserved blocks: one `RenewLeases`
per decode worker, on arrival and every third of the shortest lease held. If the process stops
or its engine wedges, renewals stop and the decode worker frees the blocks one lease later."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc

from nori.engine.engine import LLMEngine
from nori.engine.request import KVExport, KVToRemote
from nori.prefill.export_arena import ExportArena, ExportCopy
from nori.rpc.channels import ChannelCache
from nori.transfer.base import KVSender, TransferError, TransferRejected
from nori.transfer.handoff import TransferHeader
from nori.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from nori.v1.handoff_pb2 import KVDestination
from nori.worker.engine_core import EngineCore
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry
from nori.worker.servicer_base import (
    EngineServicer,
    OutputStreams,
    call_engine,
    delta_from_output,
    source_buffers,
)

logger = logging.getLogger(__name__)


def export_and_release(engine: LLMEngine, request_id: str) -> KVExport:
    """A prefilled request's state and a copy of its blocks, which are then freed (an engine
    operation: it goes to an engine process by name)."""
    export = engine.export_request(request_id)
    engine.finish_kv_transfer(request_id)
    return export


RenewCall = Callable[[str, list[tuple[str, bool]], float], Awaitable[list[str]]]

RENEWALS_PER_LEASE = 3
MIN_PERIOD_S = 0.05
# A decode worker unused this long loses its channel (a later renewal opens a new one).
CHANNEL_IDLE_S = 300.0


class DecodeRenewals:
    """`DecodeService.RenewLeases` calls, over one channel per decode worker used lately."""

    def __init__(self, worker_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """`metadata`: the cluster's token (`ClusterAuth.rpc_metadata()`)."""
        self._worker_id = worker_id
        self._metadata = metadata
        self._channels = ChannelCache()
        self._last_used: dict[str, float] = {}

    async def renew(
        self, address: str, renewals: list[tuple[str, bool]], timeout_s: float
    ) -> list[str]:
        """Renews the leases; returns the request ids the decode worker does not know."""
        now = time.monotonic()
        for idle, used in list(self._last_used.items()):
            if now - used > CHANNEL_IDLE_S:
                del self._last_used[idle]
                await self._channels.close(idle)
        self._last_used[address] = now
        stub = decode_pb2_grpc.DecodeServiceStub(self._channels.get(address))
        request = decode_pb2.RenewLeasesRequest(
            prefill_worker_id=self._worker_id,
            renewals=[
                decode_pb2.LeaseRenewal(request_id=request_id, started=started)
                for request_id, started in renewals
            ],
        )
        response: decode_pb2.RenewLeasesResponse = await stub.RenewLeases(
            request, timeout=timeout_s, metadata=self._metadata
        )
        return list(response.unknown_request_ids)

    async def close(self) -> None:
        await self._channels.close_all()
        self._last_used.clear()


@dataclass
class _Held:
    address: str
    lease_s: float
    started: bool = False


class LeaseKeeper:
    def __init__(self, renew: RenewCall, engine_responsive: Callable[[], bool]) -> None:
        self._renew = renew
        self._engine_responsive = engine_responsive
        self._held: dict[str, _Held] = {}
        self._wake = asyncio.Event()
        self._engine_was_responsive = True

    def hold(self, request_id: str, address: str, lease_s: float) -> None:
        if not address or lease_s <= 0:
            return  # a gateway that sends no renewal address: the lease simply runs
        self._held[request_id] = _Held(address, lease_s)
        self._wake.set()

    def started(self, request_ids: Iterable[str]) -> None:
        """The engine has begun computing these prompts (they left the queue)."""
        for request_id in request_ids:
            held = self._held.get(request_id)
            if held is not None:
                held.started = True

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def period_s(self) -> float:
        if not self._held:
            return 1.0
        shortest = min(held.lease_s for held in self._held.values())
        return max(MIN_PERIOD_S, shortest / RENEWALS_PER_LEASE)

    async def renew_once(self) -> None:
        responsive = self._engine_responsive()
        if responsive != self._engine_was_responsive:
            self._engine_was_responsive = responsive
            if not responsive:
                logger.error(
                    "the engine thread is dead or stalled: no longer renewing the decode leases "
                    "of %d request(s); their decode workers will free the blocks",
                    len(self._held),
                )
        if not responsive:
            return
        batches: dict[str, list[tuple[str, bool]]] = {}
        for request_id, held in self._held.items():
            batches.setdefault(held.address, []).append((request_id, held.started))
        timeout_s = self.period_s()
        await asyncio.gather(
            *(self._renew_batch(address, batch, timeout_s) for address, batch in batches.items())
        )

    async def _renew_batch(
        self, address: str, batch: list[tuple[str, bool]], timeout_s: float
    ) -> None:
        try:
            unknown = await self._renew(address, batch, timeout_s)
        except Exception as error:
            logger.warning("could not renew %d lease(s) on %s: %s", len(batch), address, error)
            return
        for request_id in unknown:
            self._held.pop(request_id, None)

    async def run(self) -> None:
        """Renews every held lease each period, and at once when a prompt arrives (its lease
        began before it arrived; prompts arriving together share a round), until cancelled."""
        while True:
            if not self._held:
                await self._wake.wait()
            self._wake.clear()
            await self.renew_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.period_s())


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
            # It may have run in a single step, never seen running.
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
        arena release and checksum; read off the event loop (tensor parallel: heads gathered)."""
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
                # A receiver may read the arena's copy until the transfer ends, client gone or not.
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
