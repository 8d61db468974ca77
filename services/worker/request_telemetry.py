"""One call's record on a worker: its metrics as it goes, and its spans when it ends.

The servicer marks a call's moments and how it ended; this file turns them into Prometheus
figures and one server span with a child per phase, written after the fact with real times."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from nori.engine.outputs import StepOutput
from nori.telemetry.propagation import context_from_metadata, current_carrier
from nori.telemetry.tracing import Tracing
from nori.transfer.handoff import KVBulk, brief_address
from nori.worker.worker_metrics import WorkerMetrics


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def wall_time(monotonic: float) -> float:
    """A time.monotonic() reading as time.time(), for spans stamped after the fact."""
    return time.time() - (time.monotonic() - monotonic)


@dataclass(frozen=True)
class WorkerTelemetry:
    metrics: WorkerMetrics
    tracing: Tracing
    worker_id: str


class CallRecord:
    def __init__(
        self,
        telemetry: WorkerTelemetry,
        name: str,
        request_id: str,
        num_prompt_tokens: int,
        metadata: Iterable[tuple[str, str | bytes]] | None,
    ) -> None:
        """A call's record from its arrival; `metadata`: the gRPC call's, with its trace context."""
        self._metrics = telemetry.metrics
        self._tracer = telemetry.tracing.tracer
        self._worker_id = telemetry.worker_id
        self.arrived = time.time()
        # The engine's queue starts at arrival (colocated) or once the KV is in (`kv_received`).
        self._queued_at = self.arrived
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._scheduled_at: float | None = None
        self._num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self._ended = False
        self.span = self._tracer.start_span(
            name,
            context=context_from_metadata(metadata),
            kind=SpanKind.SERVER,
            start_time=_ns(self.arrived),
            attributes={
                "nori.request_id": request_id,
                "nori.worker_id": telemetry.worker_id,
                "gen_ai.usage.input_tokens": num_prompt_tokens,
            },
        )
        self._metrics.prompt_tokens.inc(num_prompt_tokens)

    def output(self, output: StepOutput, computed_prompt: bool) -> None:
        """An engine output for this call; `computed_prompt`: this worker computed the prompt."""
        now = time.time()
        num_new = len(output.new_token_ids)
        if self._scheduled_at is None and output.scheduled_at is not None:
            self._first_output(output, now, computed_prompt)
        elif num_new and self._last_token_at is not None:
            gap = (now - self._last_token_at) / num_new
            for _ in range(num_new):
                self._metrics.inter_token_latency.observe(gap)
        if num_new:
            self._metrics.generation_tokens.inc(num_new)
            self.num_output_tokens += num_new
            self._last_token_at = now

    def _first_output(self, output: StepOutput, now: float, computed_prompt: bool) -> None:
        assert output.scheduled_at is not None
        scheduled = max(output.scheduled_at, self._queued_at)
        self._scheduled_at = scheduled
        self._first_token_at = now
        self._metrics.queue_time.observe(scheduled - self._queued_at)
        self._metrics.time_to_first_token.observe(now - self.arrived)
        self._phase("queue", self._queued_at, scheduled, {})
        if computed_prompt:
            cached = output.num_cached_tokens
            self._metrics.prefix_cache_queries.inc(self._num_prompt_tokens)
            self._metrics.prefix_cache_hits.inc(cached)
            self.span.set_attribute("nori.cached_tokens", cached)
            self._phase(
                "compute",
                scheduled,
                now,
                {"nori.prompt_tokens": self._num_prompt_tokens, "nori.cached_tokens": cached},
            )

    def start_kv_send(self, destination: str, num_blocks: int) -> tuple[trace.Span, dict[str, str]]:
        """The send's span, and its context for the hand-off header (the receiver's parent)."""
        span = self._tracer.start_span(
            "kv_send",
            context=trace.set_span_in_context(self.span),
            attributes={
                "nori.kv.destination": brief_address(destination),
                "nori.kv.blocks": num_blocks,
            },
        )
        return span, current_carrier(span)

    def end_kv_send(
        self, span: trace.Span, nbytes: int, seconds: float, draft_nbytes: int = 0
    ) -> None:
        self._observe_transfer(nbytes, seconds, draft_nbytes)
        span.set_attribute("nori.kv.bytes", nbytes)
        span.set_attribute("nori.kv.draft_bytes", draft_nbytes)
        span.set_attribute("nori.kv.gbps", nbytes / seconds / 1e9 if seconds > 0 else 0.0)
        span.end()

    def kv_received(
        self,
        carrier: Mapping[str, str],
        reserved_at: float,
        receiving_since: float,
        arrived_at: float,
        nbytes: int,
        num_blocks: int,
        lease_s: float,
        draft_nbytes: int = 0,
        bulk: KVBulk = "messages",
        transport: str = "",
        sender: str = "",
    ) -> None:
        """The transfer as this decode worker saw it (monotonic times), as a child span of the
        sender's. `bulk`: how the bytes came; `transport`: ucx or tcp; `sender`: HandOff.sender."""
        start, end = wall_time(receiving_since), wall_time(arrived_at)
        self._observe_transfer(nbytes, end - start, draft_nbytes, bulk)
        parent = (
            propagate.extract(dict(carrier)) if carrier else trace.set_span_in_context(self.span)
        )
        span = self._tracer.start_span(
            "kv_receive",
            context=parent,
            start_time=_ns(start),
            attributes={
                "nori.worker_id": self._worker_id,
                "nori.kv.bytes": nbytes,
                "nori.kv.draft_bytes": draft_nbytes,
                "nori.kv.blocks": num_blocks,
                "nori.kv.lease_s": lease_s,
                "nori.kv.bulk": bulk,
                "nori.kv.transport": transport,
                "nori.kv.sender": sender,
                "nori.kv.wait_s": receiving_since - reserved_at,
                "nori.kv.gbps": nbytes / (end - start) / 1e9 if end > start else 0.0,
            },
        )
        span.end(end_time=_ns(end))
        self._queued_at = end

    def _observe_transfer(
        self, nbytes: int, seconds: float, draft_nbytes: int, bulk: KVBulk | None = None
    ) -> None:
        """A hand-off's bytes (`draft_nbytes` of them a draft model's) and time; `bulk`: how
        they came (receiving side)."""
        metrics = self._metrics
        metrics.kv_transfer_bytes.inc(nbytes)
        if bulk is not None:
            metrics.kv_received_bytes.labels(bulk=bulk).inc(nbytes)
        metrics.kv_transfer_draft_bytes.inc(draft_nbytes)
        metrics.kv_transfer_seconds.observe(seconds)
        if seconds > 0:
            metrics.kv_transfer_gbps.observe(nbytes / seconds / 1e9)

    def lease_expired(self) -> None:
        self._metrics.lease_expiries.inc()

    def finish(self, outcome: str, finish_reason: str | None = None, error: str = "") -> None:
        """Counts the call by `outcome` (see metrics.OUTCOMES) and ends its spans; once."""
        if self._ended:
            return
        self._ended = True
        now = time.time()
        self._metrics.requests.labels(outcome).inc()
        self._metrics.e2e_latency.observe(now - self.arrived)
        if self._scheduled_at is not None and self.num_output_tokens and outcome != "transferred":
            assert self._first_token_at is not None
            self._phase(
                "generation",
                self._scheduled_at,
                now,
                {
                    "gen_ai.usage.output_tokens": self.num_output_tokens,
                    "nori.time_to_first_token_s": self._first_token_at - self.arrived,
                },
            )
        span = self.span
        span.set_attribute("nori.outcome", outcome)
        span.set_attribute("gen_ai.usage.output_tokens", self.num_output_tokens)
        if finish_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if outcome == "error":
            span.set_status(Status(StatusCode.ERROR, error or None))
        span.end(end_time=_ns(now))

    def _phase(
        self, name: str, start: float, end: float, attributes: Mapping[str, str | int | float]
    ) -> None:
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(self.span),
            start_time=_ns(start),
            attributes=dict(attributes),
        )
        span.end(end_time=_ns(end))
