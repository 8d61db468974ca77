"""The batch runner role (`nori serve batch`): runs the lines of every batch in the directory.

Runners share the work through `nori.batch.jobs`; each claims lines up to `max_in_flight`. A
result is fsync'd before it is acknowledged, so none is lost. Flow: docs/architecture.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from redis.asyncio import Redis

from nori.batch.durable_writes import AppendLog
from nori.batch.jobs import BatchJobs, Claim
from nori.batch.line_client import LineOutcome, error_record, send_line
from nori.batch.store import BatchStore, LineResult, ValidLine
from nori.batch.validate_finalize import finalize_batch, line_record_id, validate_batch
from nori.settings import RoleSettings
from nori.state.keys import Keys

logger = logging.getLogger(__name__)

# How long a cancelled or expired batch waits for every runner to stop its lines.
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class RunnerOptions(RoleSettings):
    batch_dir: str = "nori-batches"
    gateway_url: str = "http://127.0.0.1:8000"
    # Unique among a directory's runners: its result logs are named after it.
    runner_id: str = ""
    max_in_flight: int = 512
    # A held line not renewed for this long is taken over by another runner.
    lease_s: float = 10.0
    poll_s: float = 0.5
    metrics_port: int = 0  # 0: none
    metrics_host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)


def default_runner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RunnerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lines = Counter(
            "nori_batch_lines", "batch lines done, by outcome", ["outcome"], registry=self.registry
        )
        self.retries = Counter(
            "nori_batch_line_retries",
            "batch line retries (429, 503, a lost worker)",
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "nori_batch_output_tokens",
            "completion tokens of finished batch lines",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "nori_batch_lines_in_flight",
            "batch lines this runner has sent and not finished",
            registry=self.registry,
        )
        self.queued = Gauge(
            "nori_batch_lines_queued",
            "lines of active batches not done yet (all runners)",
            registry=self.registry,
        )


@dataclass
class _Batch:
    batch_id: str
    endpoint: str
    expires_at: float
    link: Link | None
    total: int = 0
    lines: list[ValidLine] = field(default_factory=list)
    log: AppendLog | None = None
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    stopping: bool = False


class BatchRunner:
    def __init__(
        self,
        options: RunnerOptions,
        redis: Redis,
        tracer: trace.Tracer | None = None,
        metrics: RunnerMetrics | None = None,
    ) -> None:
        self.options = options
        self.runner_id = options.runner_id or default_runner_id()
        self.store = BatchStore(Path(options.batch_dir))
        self.jobs = BatchJobs(redis, Keys(options.namespace), int(options.lease_s * 1000))
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or RunnerMetrics()
        self._batches: dict[str, _Batch] = {}
        self._wake = asyncio.Event()
        self._renewed_at = 0.0

    @property
    def num_in_flight(self) -> int:
        return sum(len(b.tasks) for b in self._batches.values())

    async def run(self, stop: asyncio.Event) -> None:
        headers = (
            {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}
        )
        connector = aiohttp.TCPConnector(limit=self.options.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as session:
            self._session = session
            try:
                while not stop.is_set():
                    try:
                        await self.turn()
                    except Exception as error:  # Redis away, a disk hiccup: next turn
                        logger.warning("batch runner turn failed: %s", error)
                    self._wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.options.poll_s)
            finally:
                await self._stop_all()

    async def turn(self) -> None:
        queued = 0
        active = self.store.active_batch_ids()
        for batch_id in set(self._batches) - set(active):  # finalized by another runner
            batch = self._batches.pop(batch_id)
            await self._stop_lines(batch)
            if batch.log is not None:
                batch.log.close()
        for batch_id in active:
            queued += await self._tend(batch_id)
        self.metrics.queued.set(queued)
        await self._fill()
        if time.monotonic() - self._renewed_at > self.options.lease_s / 3:
            self._renewed_at = time.monotonic()
            for batch in self._batches.values():
                await self.jobs.renew(batch.batch_id, self.runner_id, list(batch.tasks))

    async def _tend(self, batch_id: str) -> int:
        """Moves the batch along; the number of its lines not done yet."""
        store = self.store
        batch = self._batches.get(batch_id)
        if batch is None:
            request = store.batch_request(batch_id)
            if not store.is_validated(batch_id):
                await validate_batch(store, self.jobs, batch_id, request)
                return 0
            batch = self._open(batch_id, request)
        cancelling_at = store.cancelling_at(batch_id)
        expired = time.time() >= batch.expires_at
        if cancelling_at is not None or expired:
            await self._stop_lines(batch)
            since = time.time() - (cancelling_at if cancelling_at is not None else batch.expires_at)
            if since >= STOP_GRACE_S:
                await self._finalize(batch, "cancelled" if cancelling_at is not None else "expired")
            return 0
        if not await self.jobs.is_seeded(batch_id):
            await self.jobs.seed(batch_id, store)
            return len(batch.lines)
        queued = await self.jobs.num_queued(batch_id)
        if queued == 0 and not batch.tasks:
            counts = await self.jobs.counts(batch_id, batch.total)
            if counts is not None and counts.completed + counts.failed >= counts.total:
                await self._finalize(batch, "completed")
        return queued

    def _open(self, batch_id: str, request: dict[str, Any]) -> _Batch:
        link = None
        context = request.get("trace")
        if context:
            link = Link(
                SpanContext(
                    int(context["trace_id"], 16),
                    int(context["span_id"], 16),
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
            )
        validated = self.store.validated(batch_id) or {"total": 0, "lines": []}
        batch = _Batch(
            batch_id,
            request["endpoint"],
            float(request["expires_at"]),
            link,
            int(validated["total"]),
            [ValidLine(*entry) for entry in validated["lines"]],
        )
        self._batches[batch_id] = batch
        return batch

    async def _fill(self) -> None:
        room = self.options.max_in_flight - self.num_in_flight
        for batch in list(self._batches.values()):
            if room <= 0:
                return
            if batch.stopping:
                continue
            claims = await self.jobs.claim(batch.batch_id, self.runner_id, room)
            done: dict[int, LineResult] | None = None
            for claim in claims:
                line = batch.lines[claim.index]
                if claim.entry_id in batch.tasks:
                    continue
                if claim.reclaimed:
                    # Its holder may have made its result durable and died before acknowledging.
                    done = done if done is not None else self.store.read_results(batch.batch_id)
                    if line.line in done:
                        await self.jobs.done(
                            batch.batch_id, claim.entry_id, line.line, done[line.line].ok
                        )
                        continue
                room -= 1
                batch.tasks[claim.entry_id] = asyncio.create_task(self._run_line(batch, claim))
        self.metrics.in_flight.set(self.num_in_flight)

    async def _run_line(self, batch: _Batch, claim: Claim) -> None:
        line = batch.lines[claim.index]
        record_id = line_record_id(batch.batch_id, line.line)
        try:
            with self.tracer.start_as_current_span(
                "batch line",
                links=[batch.link] if batch.link else None,
                attributes={
                    "nori.batch.id": batch.batch_id,
                    "nori.batch.line": line.line,
                    "nori.batch.custom_id": line.custom_id,
                },
            ) as span:
                raw = await asyncio.to_thread(self.store.read_line, batch.batch_id, line)
                body = json.loads(raw)["body"]
                outcome = await send_line(
                    self._session,
                    self.options.gateway_url.rstrip("/") + batch.endpoint,
                    body,
                    record_id=record_id,
                    custom_id=line.custom_id,
                    request_id=f"{batch.batch_id}-{line.line}",
                    deadline=time.monotonic() + (batch.expires_at - time.time()),
                    span=span,
                )
                span.set_attribute("nori.batch.retries", outcome.retries)
                status = (outcome.record.get("response") or {}).get("status_code")
                if status is not None:
                    span.set_attribute("http.response.status_code", status)
            await self._record(batch, claim, line, outcome)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a line that cannot even be read: its own error
            logger.warning("batch %s line %d: %s", batch.batch_id, line.line, error)
            outcome = LineOutcome(
                False, error_record(record_id, line.custom_id, "internal_error", str(error))
            )
            await self._record(batch, claim, line, outcome)
        finally:
            batch.tasks.pop(claim.entry_id, None)
            self.metrics.in_flight.set(self.num_in_flight)
            self._wake.set()

    async def _record(
        self, batch: _Batch, claim: Claim, line: ValidLine, outcome: LineOutcome
    ) -> None:
        if batch.log is None:
            batch.log = AppendLog(self.store.result_log(batch.batch_id, self.runner_id))
        result = LineResult(line.line, outcome.ok, outcome.record)
        await batch.log.append(result.to_json())
        await self.jobs.done(batch.batch_id, claim.entry_id, line.line, outcome.ok)
        self.metrics.lines.labels("completed" if outcome.ok else "failed").inc()
        self.metrics.retries.inc(outcome.retries)
        self.metrics.output_tokens.inc(outcome.completion_tokens)

    async def _stop_lines(self, batch: _Batch) -> None:
        """Cancels the lines this runner holds (the gateway aborts them, freeing their blocks)."""
        batch.stopping = True
        tasks = list(batch.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_all(self) -> None:
        for batch in self._batches.values():
            await self._stop_lines(batch)
            if batch.log is not None:
                batch.log.close()

    async def _finalize(self, batch: _Batch, status: str) -> None:
        if await finalize_batch(self.store, self.jobs, batch.batch_id, batch.lines, status):
            if batch.log is not None:
                batch.log.close()
            self._batches.pop(batch.batch_id, None)


async def serve_batch(options: RunnerOptions, tracer: trace.Tracer | None = None) -> None:
    """The role's process: runs until SIGINT/SIGTERM, then stops its lines (they run again
    elsewhere once their leases run out)."""
    import signal

    from nori.state.connection import connect

    redis = connect(options.redis_url)
    metrics = RunnerMetrics()
    if options.metrics_port:
        start_http_server(options.metrics_port, options.metrics_host, registry=metrics.registry)
    runner = BatchRunner(options, redis, tracer, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    logger.info(
        "batch runner %s: %s -> %s", runner.runner_id, options.batch_dir, options.gateway_url
    )
    try:
        await runner.run(stop)
    finally:
        await redis.aclose()
