"""The gateway process: the OpenAI-compatible app over the cluster backend, served by uvicorn."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import get_args

import uvicorn

from nori.batch.jobs import BatchJobs
from nori.batch.store import BatchStatus, BatchStore
from nori.gateway.app import HEALTH_PATH, METRICS_PATH, create_app
from nori.gateway.batch_api import FILES_PATH, batch_routes, batch_status_counts
from nori.gateway.cluster import ClusterBackend, ClusterOptions
from nori.gateway.middleware import Drain, instrument
from nori.models.config import ModelConfig
from nori.models.demo import resolve_model
from nori.sampling.chat_template import load_chat_template
from nori.sampling.tokenizer import Tokenizer
from nori.settings import (
    DEFAULT_DISAGGREGATION,
    DEFAULT_MAX_LOCAL_COMPUTE_S,
    DisaggregationMode,
    RoleSettings,
)
from nori.state.connection import connect
from nori.state.keys import Keys
from nori.telemetry.tracing import Tracing
from nori.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayOptions(RoleSettings):
    model: str
    served_model_name: str
    # Another model's tokenizer and chat template (the workers' must match); None: the model's.
    tokenizer: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    max_model_len: int | None = None
    # None: the block size the workers state in the registry.
    block_size: int | None = None
    max_in_flight: int = 4096
    # This and the cluster's settings below: see ClusterOptions.
    max_queued_prompt_tokens: int = 8192
    stream_interval: int = 1
    disaggregation: DisaggregationMode = DEFAULT_DISAGGREGATION
    max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S
    chat_template: str | None = None
    access_log: bool = True
    # Else the OTEL_EXPORTER_OTLP_* variables; none: tracing off.
    otlp_traces_endpoint: str | None = None
    max_request_body_mib: float = 32.0
    migration_limit: int = 3
    stream_stall_timeout_s: float = 300.0
    group_wait_s: float = 600.0
    max_decode_share: float = 0.5
    max_n: int = 64
    max_request_members: int = 4096
    # The Bearer key the /v1 API requires (else NORI_API_KEY); none: open.
    api_key: str | None = None
    # Where OpenAI's Files and Batch API keeps its files and batches; None: off.
    batch_dir: str | None = None
    max_batch_file_mib: float = 200.0
    # SIGTERM: requests in flight get this long to finish (nori.gateway.drain).
    drain_timeout_s: float = 60.0


def worker_metrics_text(stats: list[common_pb2.WorkerStats]) -> str:
    """Per-worker figures in the Prometheus text format, one sample per worker."""
    gauges = {
        "nori_worker_running_requests": ("gauge", "num_running"),
        "nori_worker_waiting_requests": ("gauge", "num_waiting"),
        "nori_worker_free_kv_blocks": ("gauge", "num_free_blocks"),
        "nori_worker_total_kv_blocks": ("gauge", "num_total_blocks"),
        "nori_worker_kv_bytes_sent_total": ("counter", "kv_bytes_sent"),
        "nori_worker_kv_bytes_received_total": ("counter", "kv_bytes_received"),
        "nori_worker_kv_transfers_total": ("counter", "num_transfers"),
        "nori_worker_requests_total": ("counter", "num_requests"),
        "nori_worker_prompt_tokens_computed_total": ("counter", "num_prompt_tokens_computed"),
        # Zero without speculative decoding.
        "nori_worker_spec_decode_num_drafts_total": ("counter", "spec_decode_num_drafts"),
        "nori_worker_spec_decode_num_draft_tokens_total": (
            "counter",
            "spec_decode_num_draft_tokens",
        ),
        "nori_worker_spec_decode_num_accepted_tokens_total": (
            "counter",
            "spec_decode_num_accepted_tokens",
        ),
    }
    lines = []
    for name, (kind, field) in gauges.items():
        lines.append(f"# TYPE {name} {kind}")
        for worker in stats:
            labels = f'worker_id="{worker.worker_id}",role="{worker.role}"'
            lines.append(f"{name}{{{labels}}} {getattr(worker, field)}")
    return "\n".join(lines) + "\n"


def refused_worker_entries_text(counts: dict[str, int]) -> str:
    """The refused worker registry entries by reason, in the Prometheus text format."""
    name = "nori_gateway_refused_worker_entries_total"
    lines = [
        f"# HELP {name} Worker registry entries refused by their signature check, by reason.",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{reason="{reason}"}} {count}' for reason, count in sorted(counts.items())]
    return "\n".join(lines) + "\n"


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining for at most `timeout_s` on its first SIGTERM or SIGINT."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
            return
        self._drain.draining = True
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info(
            "draining: %d request(s) in flight, new ones get 503 (at most %.0f s)",
            self._drain.in_flight,
            self._timeout_s,
        )
        if await self._drain.wait_idle(self._timeout_s):
            logger.info("drained: no request in flight")
        else:
            logger.warning(
                "drain timed out after %.0f s with %d request(s) in flight",
                self._timeout_s,
                self._drain.in_flight,
            )
        self.should_exit = True


def gateway_tokenizer(model_dir: Path, chat_template: str | None) -> Tokenizer:
    """The model's tokenizer, with --chat-template (a file or a template) in place of its own."""
    tokenizer = Tokenizer.from_dir(model_dir)
    if chat_template is None:
        return tokenizer
    return dataclasses.replace(tokenizer, chat_template=load_chat_template(chat_template))


async def serve_gateway(options: GatewayOptions) -> None:
    model_dir = resolve_model(options.model)
    tokenizer_dir = model_dir if options.tokenizer is None else resolve_model(options.tokenizer)
    tokenizer = gateway_tokenizer(tokenizer_dir, options.chat_template)
    model_config = ModelConfig.from_dir(model_dir)
    max_model_len = options.max_model_len or model_config.max_position_embeddings
    tracing = Tracing.for_role("gateway", options.otlp_traces_endpoint)
    backend = ClusterBackend(
        ClusterOptions(
            redis_url=options.redis_url,
            namespace=options.namespace,
            block_size=options.block_size,
            max_in_flight=options.max_in_flight,
            max_queued_prompt_tokens=options.max_queued_prompt_tokens,
            disaggregation=options.disaggregation,
            max_local_compute_s=options.max_local_compute_s,
            migration_limit=options.migration_limit,
            stream_stall_timeout_s=options.stream_stall_timeout_s,
            group_wait_s=options.group_wait_s,
            max_decode_share=options.max_decode_share,
            max_n=options.max_n,
            max_request_members=options.max_request_members,
            cluster_secret=options.cluster_secret,
        ),
        tracing.tracer,
    )
    await backend.start()

    async def extra_metrics() -> str:
        ledger = backend.ledger
        admission = (
            "# TYPE nori_gateway_queued_prompt_tokens gauge\n"
            f"nori_gateway_queued_prompt_tokens {ledger.queued_tokens}\n"
            "# TYPE nori_gateway_decode_shares_held gauge\n"
            f"nori_gateway_decode_shares_held {ledger.num_held}\n"
            "# TYPE nori_gateway_decode_shares_waiting gauge\n"
            f"nori_gateway_decode_shares_waiting {ledger.num_waiting}\n"
            "# TYPE nori_gateway_decode_pool_calls gauge\n"
            f"nori_gateway_decode_pool_calls {ledger.capacity.calls if ledger.capacity else 0}\n"
        )
        refused = refused_worker_entries_text(backend.pool.refused_entries)
        batches = ""
        if batch_store is not None:
            by_status = await asyncio.to_thread(batch_status_counts, batch_store)
            batches = "# TYPE nori_gateway_batches gauge\n" + "".join(
                f'nori_gateway_batches{{status="{status}"}} {by_status.get(status, 0)}\n'
                for status in get_args(BatchStatus)
            )
        return (
            admission
            + refused
            + batches
            + backend.disaggregation.metrics_text()
            + worker_metrics_text(await backend.pool.stats(metadata=backend.rpc_metadata))
        )

    batch_store = BatchStore(Path(options.batch_dir)) if options.batch_dir else None
    batch_redis = connect(options.redis_url) if batch_store is not None else None
    routers = []
    if batch_store is not None and batch_redis is not None:
        jobs = BatchJobs(batch_redis, Keys(options.namespace))
        routers.append(batch_routes(batch_store, jobs))

    drain = Drain()
    app = create_app(
        backend,
        tokenizer,
        options.served_model_name,
        max_model_len,
        vocab_size=model_config.vocab_size,
        extra_metrics=extra_metrics,
        max_request_body_bytes=int(options.max_request_body_mib * 1024 * 1024),
        api_keys=[options.api_key] if options.api_key else [],
        routers=routers,
        path_body_limits={FILES_PATH: int(options.max_batch_file_mib * 1024 * 1024)},
        stream_interval=options.stream_interval,
        drain=drain,
    )
    instrument(app, tracing, untraced_paths=(HEALTH_PATH, METRICS_PATH))
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        # An access line per request, as vLLM's server logs (--no-access-log turns it off).
        log_level="info" if options.access_log else "warning",
        access_log=options.access_log,
        # After the drain (DrainingServer) nothing is left for uvicorn's own wait.
        timeout_graceful_shutdown=5,
    )
    logger.info(
        "gateway serving %r on http://%s:%d", options.served_model_name, options.host, options.port
    )
    try:
        await DrainingServer(config, drain, options.drain_timeout_s).serve()
    finally:
        if batch_redis is not None:
            await batch_redis.aclose()
        tracing.shutdown()
