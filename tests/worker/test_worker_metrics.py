"""A worker's /metrics: the engine-state gauges and counters read at scrape time (speculative
decoding's among them), and the per-call record."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nori.engine.outputs import EngineLoad, SpecDecodeCounts, StepOutput
from nori.telemetry.tracing import Tracing
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry
from nori.worker.worker_metrics import WorkerMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _output(new: list[int], scheduled_at: float | None, finished: bool = False) -> StepOutput:
    return StepOutput(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        token_ids=new,
        text="",
        new_token_ids=new,
        new_text="",
        finished=finished,
        num_cached_tokens=2,
        scheduled_at=scheduled_at,
    )


def test_the_state_gauges_follow_the_engine_and_the_record_counts_a_call() -> None:
    metrics = WorkerMetrics()
    load = EngineLoad(
        num_running=3,
        num_waiting=2,
        num_free_blocks=90,
        num_total_blocks=100,
        num_cached_blocks=7,
        num_preemptions=4,
    )
    metrics.watch_engine(lambda: load, lambda: 1)
    server, port = metrics.serve("127.0.0.1", 0)
    try:
        telemetry = WorkerTelemetry(metrics, Tracing.off(), "w")
        record = CallRecord(telemetry, "generate", "r", 3, metadata=None)
        record.output(_output([5], scheduled_at=record.arrived), computed_prompt=True)
        record.output(_output([6, 7], scheduled_at=record.arrived), computed_prompt=True)
        record.finish("length", "length")
        record.finish("error")  # a second finish is ignored
        samples = _samples(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    finally:
        server.shutdown()
    assert samples[("nori_num_requests_running", ())] == 3
    assert samples[("nori_num_requests_waiting", ())] == 2
    assert samples[("nori_kv_blocks_free", ())] == 90
    assert samples[("nori_kv_blocks_used", ())] == 10
    assert samples[("nori_kv_blocks_cached", ())] == 7
    assert samples[("nori_num_preemptions_total", ())] == 4
    assert samples[("nori_kv_transfers_in_flight", ())] == 1
    assert samples[("nori_requests_total", (("outcome", "length"),))] == 1
    assert samples[("nori_requests_total", (("outcome", "error"),))] == 0
    assert samples[("nori_prompt_tokens_total", ())] == 3
    assert samples[("nori_prefix_cache_queries_total", ())] == 3
    assert samples[("nori_prefix_cache_hits_total", ())] == 2
    assert samples[("nori_generation_tokens_total", ())] == 3
    assert samples[("nori_time_to_first_token_seconds_count", ())] == 1
    # Two tokens after the first: two inter-token gaps.
    assert samples[("nori_inter_token_latency_seconds_count", ())] == 2
    assert samples[("nori_e2e_request_latency_seconds_count", ())] == 1


def test_token_totals_feed_the_load_line() -> None:
    metrics = WorkerMetrics()
    assert metrics.token_totals() == (0.0, 0.0)
    metrics.prompt_tokens.inc(30)
    metrics.generation_tokens.inc(7)
    assert metrics.token_totals() == (30.0, 7.0)


def test_the_engine_counters_follow_its_load_and_the_ratios_wait_for_a_draft() -> None:
    metrics = WorkerMetrics()
    load = EngineLoad(num_prompt_tokens_computed=1234)
    metrics.watch_engine(lambda: load, lambda: 0)
    samples = _samples(generate_latest(metrics.registry).decode())
    assert samples[("nori_prompt_tokens_computed_total", ())] == 1234
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_bonus_tokens"):
        assert samples[(f"nori_spec_decode_{name}_total", ())] == 0
    # No draft yet: no ratio rather than a NaN or a 0 that would read as a measurement.
    assert ("nori_spec_decode_acceptance_rate", ()) not in samples
    assert ("nori_spec_decode_mean_accepted_length", ()) not in samples

    # 10 verifications of 3 drafts each, 18 of the 30 accepted: each verification yields its
    # accepted drafts plus one bonus token, 28 tokens in all.
    spec = SpecDecodeCounts(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=18)
    load = EngineLoad(num_prompt_tokens_computed=2000, spec_decode=spec)
    samples = _samples(generate_latest(metrics.registry).decode())
    assert samples[("nori_prompt_tokens_computed_total", ())] == 2000
    assert samples[("nori_spec_decode_num_drafts_total", ())] == 10
    assert samples[("nori_spec_decode_num_draft_tokens_total", ())] == 30
    assert samples[("nori_spec_decode_num_accepted_tokens_total", ())] == 18
    assert samples[("nori_spec_decode_num_bonus_tokens_total", ())] == 10
    assert samples[("nori_spec_decode_acceptance_rate", ())] == pytest.approx(0.6)
    assert samples[("nori_spec_decode_mean_accepted_length", ())] == pytest.approx(28 / 10)
