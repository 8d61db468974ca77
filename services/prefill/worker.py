"""The prefill worker process: batched prompt computation, KV blocks out over the transport.

Its prefix cache is mirrored into the Redis block directory; after each engine step it hears
which prompts the engine has started (for their decode leases, `servicer.LeaseKeeper`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import grpc
from prometheus_client import Gauge

from nori.cluster_auth import ClusterAuth
from nori.engine.block_manager import BlockEvent
from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.prefill.export_arena import ExportArena
from nori.prefill.servicer import DecodeRenewals, LeaseKeeper, PrefillServicer
from nori.state.block_directory import BlockDirectory
from nori.transfer.base import KVSender
from nori.transfer.factory import make_sender
from nori.transfer.ucx_env import confine_ucx_to
from nori.v1 import prefill_pb2_grpc
from nori.worker.engine_core import responsive
from nori.worker.runtime import Worker, WorkerOptions
from nori.worker.servicer_base import OutputStreams

logger = logging.getLogger(__name__)

# Block events waiting for Redis; beyond this the oldest are dropped (the directory is a hint).
MAX_PENDING_BLOCK_EVENTS = 65536
# A step this long is a wedged engine: the worker stops renewing decode leases.
ENGINE_STALL_S = 120.0


@dataclass(frozen=True)
class StepProbed:
    running_request_ids: frozenset[str]
    block_events: tuple[BlockEvent, ...]


def probe_step(engine: LLMEngine) -> StepProbed:
    """After each engine step, where the engine lives (module-level: it goes to an engine process
    by name): the prompts being computed and the prefix cache's new block events."""
    running = engine.load().running_request_ids
    return StepProbed(running, tuple(engine.kv_cache.drain_block_events()))


def record_block_events(engine: LLMEngine) -> None:
    engine.kv_cache.record_block_events()


def cached_block_hashes(engine: LLMEngine) -> list[bytes]:
    return engine.kv_cache.cached_block_hashes()


class PrefillWorker(Worker):
    role = "prefill"
    service_names = ("nori.v1.PrefillService",)

    def __init__(
        self, options: WorkerOptions, engine_config: EngineConfig, transport: str | None = None
    ) -> None:
        super().__init__(options, engine_config)
        self.transport = transport
        self._sender: KVSender | None = None
        self._servicer: PrefillServicer | None = None
        self._events: collections.deque[BlockEvent] = collections.deque(
            maxlen=MAX_PENDING_BLOCK_EVENTS
        )
        self._publisher: asyncio.Task[None] | None = None
        self._renewals = DecodeRenewals(
            self.worker_id, ClusterAuth.from_text(options.cluster_secret).rpc_metadata()
        )
        self._leases = LeaseKeeper(self._renewals.renew, self._engine_responsive)
        self._lease_renewer: asyncio.Task[None] | None = None

    async def start_role(self) -> None:
        streams = OutputStreams()
        engine = await self.start_engine(
            streams.dispatch,
            setup=record_block_events,
            probe=probe_step,
            on_probe=self._on_probe,
        )
        confine_ucx_to(self.options.host)
        self._sender = make_sender(self.transport)
        arena = ExportArena()
        Gauge(
            "nori_kv_export_arena_bytes_in_use",
            "Bytes of the export arena (shared memory) that KV copies waiting for, or in, their "
            "transfer hold.",
            registry=self.metrics.registry,
        ).set_function(lambda: arena.capacity - arena.free_bytes)
        self._servicer = PrefillServicer(
            worker_id=self.worker_id,
            host=self.options.resolved_advertise_host(),
            engine=engine,
            streams=streams,
            sender=self._sender,
            is_draining=lambda: self.draining,
            leases=self._leases,
            telemetry=self.telemetry,
            max_open_calls=self.options.max_open_calls(self.engine_config.max_num_seqs),
            # A batch may fill the running batch; the queue beyond it stays for interactive work.
            max_background_calls=self.engine_config.max_num_seqs,
            export_arena=arena,
        )
        self._lease_renewer = asyncio.create_task(self._leases.run())
        assert self.redis is not None
        self._publisher = asyncio.create_task(
            self._publish_blocks(BlockDirectory(self.redis, self.keys))
        )

    def _engine_responsive(self) -> bool:
        return self._engine is not None and responsive(self._engine, ENGINE_STALL_S)

    def _on_probe(self, probed: StepProbed) -> None:
        self._events.extend(probed.block_events)
        self._leases.started(probed.running_request_ids)

    async def _publish_blocks(self, directory: BlockDirectory) -> None:
        refresh_every = directory.ttl_s / 3
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            if time.monotonic() - last_refresh > refresh_every:
                # Re-announce what is still cached so long-lived prefixes stay in the directory.
                last_refresh = time.monotonic()
                assert self._engine is not None
                held = await self._engine.call(cached_block_hashes)
                try:
                    await directory.touch(self.worker_id, held)
                except Exception:
                    logger.warning("could not refresh the block directory", exc_info=True)
            events = list(self._events)
            self._events.clear()
            if not events:
                continue
            try:
                await directory.publish(self.worker_id, events)
            except Exception:
                logger.warning("could not publish %d block events", len(events), exc_info=True)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        assert self._servicer is not None
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self._servicer, server)

    def transfers_in_flight(self) -> int:
        return self._servicer.transfers_in_flight if self._servicer is not None else 0

    def transfer_counts(self) -> dict[str, int]:
        return {"kv_bytes_sent": self._servicer.kv_bytes_sent if self._servicer is not None else 0}

    async def stop_role(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        if self._lease_renewer is not None:
            self._lease_renewer.cancel()
        await self._renewals.close()
        if self._sender is not None:
            await self._sender.close()
        if self._engine is not None:
            await self._engine.stop()
