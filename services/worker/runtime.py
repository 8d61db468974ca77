"""The life of a worker process: serve gRPC, stay registered in Redis, drain on SIGTERM.

Roles supply servicers and load figures; this file owns the grpc.aio server and health service,
the heartbeat, and the shutdown order: announce draining, finish requests, deregister, stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from nori.cluster_auth import ClusterAuth
from nori.rpc.auth import server_interceptors
from nori.rpc.options import GRPC_OPTIONS
from nori.settings import RoleSettings, WorkerRole
from nori.state.connection import connect, wait_for_redis
from nori.state.keys import Keys
from nori.state.registry import Heartbeat, WorkerInfo, WorkerRegistry
from nori.telemetry.tracing import Tracing
from nori.transfer.handoff import brief_address
from nori.worker.request_telemetry import WorkerTelemetry
from nori.worker.worker_metrics import EngineExpertCounts, WorkerMetrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from nori.engine.config import EngineConfig
    from nori.engine.outputs import EngineLoad, StepOutput
    from nori.worker.engine_core import EngineCore, EngineCoreMode
    from nori.worker.servicer_base import EngineServicer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions(RoleSettings):
    host: str = "0.0.0.0"
    port: int = 0
    advertise_host: str = "127.0.0.1"
    worker_id: str = ""
    served_model_name: str = ""
    heartbeat_ttl_s: float = 3.0
    drain_timeout_s: float = 120.0
    # Prometheus /metrics port (0: a free one, stated in the registry; -1: none).
    metrics_port: int = 0
    otlp_traces_endpoint: str | None = None
    # Requests held beyond the running batch; past it a call gets RESOURCE_EXHAUSTED, so the
    # queue stays bounded. None: a quarter of max_num_seqs (at least 8).
    max_queued_requests: int | None = None
    # "auto": a process on CPU with one rank, else a thread (engine_core.resolve_engine_core).
    engine_core: EngineCoreMode = "auto"

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")

    def max_open_calls(self, max_num_seqs: int) -> int:
        """Calls a worker serves at once: its running batch and its bounded queue."""
        queued = self.max_queued_requests
        return max_num_seqs + (max(8, max_num_seqs // 4) if queued is None else queued)

    def resolved_worker_id(self, role: str) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"

    def resolved_advertise_host(self) -> str:
        """ "auto": this host's own address, so each replica of a scaled role is reachable."""
        if self.advertise_host != "auto":
            return self.advertise_host
        return socket.gethostbyname(socket.gethostname())


# gRPC core silently cancels calls beyond its default pending limit, before any handler runs;
# allow far more, so every call gets the worker's own answer (RESOURCE_EXHAUSTED past its queue).
SERVER_BACKLOG_OPTIONS = [
    ("grpc.server.max_pending_requests", 16_384),
    ("grpc.server.max_pending_requests_hard_limit", 16_384),
]
# How long a starting worker waits for Redis' first answer before loading its engine anyway.
REDIS_CHECK_S = 0.5
LOAD_LOG_INTERVAL_S = 10.0


def load_line(
    load: EngineLoad,
    new_requests: int,
    interval_s: float,
    prompt_tokens: float = 0.0,
    generated_tokens: float = 0.0,
) -> str:
    """One worker's load in a line, as vLLM's stats line: interval throughput, queue and KV use."""
    used = load.num_total_blocks - load.num_free_blocks
    share = used / load.num_total_blocks if load.num_total_blocks else 0.0
    return (
        f"prompt {prompt_tokens / interval_s:.1f} tokens/s, generation "
        f"{generated_tokens / interval_s:.1f} tokens/s; "
        f"{load.num_running} running, {load.num_waiting} waiting, {load.num_held} held; "
        f"KV blocks {used}/{load.num_total_blocks} used ({share:.1%}); "
        f"{new_requests} new requests in {interval_s:.0f} s"
    )


class Worker(ABC):
    role: WorkerRole
    service_names: tuple[str, ...]

    def __init__(self, options: WorkerOptions, engine_config: EngineConfig) -> None:
        self.options = options
        self.engine_config = engine_config
        self.worker_id = options.resolved_worker_id(self.role)
        self.draining = False
        self.grpc_address = ""
        self.transfer_address = ""
        self.metrics_address = ""
        self.metrics = WorkerMetrics()
        self.tracing = Tracing.for_role(self.role, options.otlp_traces_endpoint)
        self.telemetry = WorkerTelemetry(self.metrics, self.tracing, self.worker_id)
        self._started_at = time.time()
        self._stop = asyncio.Event()
        self.redis: Redis | None = None
        self.keys = Keys(options.namespace)
        self._engine: EngineCore | None = None
        self._servicer: EngineServicer | None = None

    @abstractmethod
    async def start_role(self) -> None:
        """Loads the engine, starts transports; called before the gRPC server opens."""

    @abstractmethod
    def add_servicers(self, server: grpc.aio.Server) -> None: ...

    async def start_engine(
        self, on_outputs: Callable[[list[StepOutput]], None], **hooks: Any
    ) -> EngineCore:
        """The role's engine core (`--engine-core`); `hooks` are start_engine_core's."""
        from nori.worker.engine_core import start_engine_core

        self._engine = await start_engine_core(
            self.options.engine_core,
            self.engine_config,
            on_outputs,
            on_death=self._engine_died,
            **hooks,
        )
        return self._engine

    def _engine_died(self, reason: str) -> None:
        """The engine process is gone: the worker exits at once (code 1). Its streams break as a
        killed worker's do, so the gateway migrates them; `nori up` restarts it."""
        logger.critical("%s; %s worker %s exits", reason, self.role, self.worker_id)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    @abstractmethod
    def transfer_counts(self) -> dict[str, int]:
        """The role's KV transfer figures for its WorkerInfo (bytes sent or received)."""

    def transfers_in_flight(self) -> int:
        return 0

    def num_active_requests(self) -> int:
        """Requests this worker still owes an answer (what draining waits for)."""
        return self._servicer.num_active_requests if self._servicer is not None else 0

    def load_info(self) -> dict[str, Any]:
        if self._engine is None or self._servicer is None:
            return {}
        return {**self._engine.load.registry_fields(), **self.transfer_counts()}

    @abstractmethod
    async def stop_role(self) -> None: ...

    def info(self) -> WorkerInfo:
        speculative = self.engine_config.speculative_config  # the gateway pairs workers by it
        dtype = self._engine.facts.kv_cache_tensors[0].dtype if self._engine is not None else ""
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            grpc_address=self.grpc_address,
            transfer_address=self.transfer_address,
            metrics_address=self.metrics_address,
            model=self.options.served_model_name,
            draining=self.draining,
            started_at=self._started_at,
            block_size=self.engine_config.block_size,
            kv_cache_dtype=str(dtype).removeprefix("torch."),
            speculative_config=speculative.as_json() if speculative is not None else "",
            max_num_seqs=self.engine_config.max_num_seqs,
            max_open_calls=self.options.max_open_calls(self.engine_config.max_num_seqs),
            **self.load_info(),
        )

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)

        redis = self.redis = connect(self.options.redis_url)
        # Redis away: keep trying while the engine loads, registering when it answers; refused
        # credentials fail at once (within REDIS_CHECK_S), before any engine is loaded.
        redis_ready = asyncio.create_task(wait_for_redis(redis, self.options.redis_url))
        await asyncio.wait([redis_ready], timeout=REDIS_CHECK_S)
        if redis_ready.done() and redis_ready.exception() is not None:
            await redis.aclose()
            redis_ready.result()
        auth = ClusterAuth.from_text(self.options.cluster_secret)
        registry = WorkerRegistry(redis, self.keys, self.options.heartbeat_ttl_s, auth=auth)
        await self.start_role()
        metrics_server = self._serve_metrics()

        # Calls without the cluster's token are refused (nori.rpc.auth).
        server = grpc.aio.server(
            options=[*GRPC_OPTIONS, *SERVER_BACKLOG_OPTIONS], interceptors=server_interceptors(auth)
        )
        self.add_servicers(server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port(f"{self.options.host}:{self.options.port}")
        if port == 0:
            raise ValueError(f"cannot listen on {self.options.host}:{self.options.port}")
        self.grpc_address = f"{self.options.resolved_advertise_host()}:{port}"
        await server.start()
        for name in ("", *self.service_names):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)

        if not redis_ready.done():
            logger.warning(
                "%s worker %s ready; waiting for Redis to register", self.role, self.worker_id
            )
        await redis_ready
        heartbeat = Heartbeat(registry, self.info)
        try:
            await registry.register(self.info())
        except (RedisError, OSError) as error:
            # Redis went away while the engine loaded: the heartbeat registers when it returns.
            logger.warning("registering in Redis failed (%s); the heartbeat retries", error)
        heartbeat.start()
        load_logger = asyncio.create_task(self._log_load_forever())
        logger.info(
            "%s worker %s serving gRPC on %s (KV transfers: %s, metrics: %s)",
            self.role,
            self.worker_id,
            self.grpc_address,
            brief_address(self.transfer_address) if self.transfer_address else "none",
            f"http://{self.metrics_address}/metrics" if self.metrics_address else "none",
        )
        try:
            await self._stop.wait()
            await self._drain(registry, health)
        finally:
            load_logger.cancel()
            await heartbeat.stop(deregister=True)
            await server.stop(grace=0.5)
            await self.stop_role()
            await redis.aclose()
            if metrics_server is not None:
                metrics_server.shutdown()
            self.tracing.shutdown()
            logger.info("%s worker %s stopped", self.role, self.worker_id)

    def _serve_metrics(self) -> WSGIServer | None:
        engine = self._engine
        assert engine is not None
        self.metrics.watch_engine(lambda: engine.load, self.transfers_in_flight)
        self.metrics.watch_experts(EngineExpertCounts(engine, asyncio.get_running_loop()))
        if self.options.metrics_port < 0:
            return None
        server, port = self.metrics.serve(self.options.host, self.options.metrics_port)
        self.metrics_address = f"{self.options.resolved_advertise_host()}:{port}"
        return server

    async def _log_load_forever(self) -> None:
        served, tokens = 0, self.metrics.token_totals()
        while True:
            await asyncio.sleep(LOAD_LOG_INTERVAL_S)
            if self._engine is None or self._servicer is None:
                continue
            load, total = self._engine.load, self._servicer.num_requests
            now = self.metrics.token_totals()
            if load.busy or total != served:
                line = load_line(
                    load,
                    total - served,
                    LOAD_LOG_INTERVAL_S,
                    prompt_tokens=now[0] - tokens[0],
                    generated_tokens=now[1] - tokens[1],
                )
                logger.info("%s", line)
            served, tokens = total, now

    async def _drain(self, registry: WorkerRegistry, health: health_aio.HealthServicer) -> None:
        """Stops taking new requests (the gateway sees `draining`) and lets running ones finish."""
        self.draining = True
        for name in ("", *self.service_names):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            await registry.heartbeat(self.info())
        except Exception:
            logger.warning("could not announce draining in Redis", exc_info=True)
        deadline = time.monotonic() + self.options.drain_timeout_s
        logger.info(
            "%s worker %s draining %d request(s)",
            self.role,
            self.worker_id,
            self.num_active_requests(),
        )
        while self.num_active_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_active_requests():
            logger.warning("drain timed out with %d request(s) left", self.num_active_requests())


def run_worker(worker: Worker) -> None:
    asyncio.run(worker.serve())
