"""Whole runs against the fake server (a local socket): concurrency, duration, warm-ups, the mixed
dataset's two clocks, failures kept, and the JSON, table and plot of the result."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

from nori.bench.serve.plot import RunCurves, plot_runs
from nori.bench.serve.report import format_report
from nori.bench.serve.runner import main_clock, run_benchmark
from nori.bench.serve.settings import ServeBenchSettings
from nori.sampling.tokenizer import Tokenizer
from tests.bench.fake_server import FakeOpenAI

BASE = ServeBenchSettings(
    base_url="http://fake",
    num_prompts=8,
    random_input_len=12,
    random_output_len=4,
    prompt_format="token-ids",
)


async def test_max_concurrency_bounds_requests_in_flight(tokenizer: Tokenizer) -> None:
    fake = FakeOpenAI(token_delay_s=0.005)
    settings = replace(BASE, max_concurrency=2, num_warmups=3)
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    assert fake.max_in_flight == 2
    assert len(fake.bodies) == 3 + 8  # the warm-ups were sent, but are not in the result
    assert result.num_sent == 8 and result.metrics.completed == 8
    assert result.model == "fake-model"  # from GET /v1/models
    assert [r.index for r in result.records] == list(range(8))
    for record in result.records:
        assert record.usage_from_server and record.output_tokens == record.max_tokens == 4
        assert record.prompt_tokens == 12
    assert {b["model"] for b in fake.bodies} == {"fake-model"}


async def test_duration_sends_until_the_deadline_then_drains(tokenizer: Tokenizer) -> None:
    fake = FakeOpenAI(token_delay_s=0.01)
    settings = replace(BASE, num_prompts=3, request_rate=60.0, duration_s=0.4, seed=2)
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    due = sum(1 for _ in itertools.takewhile(lambda t: t < 0.4, main_clock(settings)))
    sent = result.num_sent
    # All that were due before the deadline (fewer only if this machine lagged behind), the 3
    # prompts cycled; none after it.
    assert due // 2 <= sent <= due and due > 10
    assert len(fake.bodies) == sent
    assert result.metrics.completed == sent and result.metrics.duration >= 0.4
    prompts = [tuple(b["prompt"]) for b in fake.bodies]
    assert len(set(prompts)) == 3


async def test_refused_requests_are_counted_as_failed(tokenizer: Tokenizer) -> None:
    # Prompts of 4..20 tokens plus 1..7 output tokens; the server holds 16 in all.
    fake = FakeOpenAI(max_model_len=16)
    settings = replace(BASE, num_prompts=30, random_range_ratio=0.6)
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    metrics = result.metrics
    refused = sum(len(b["prompt"]) + b["max_tokens"] > 16 for b in fake.bodies)
    assert 0 < refused < 30
    assert metrics.failed == refused and metrics.completed == 30 - refused
    assert dict(metrics.errors) == {"HTTP 400: too long for this model": refused}
    failures = [r for r in result.records if not r.success]
    assert all(r.error == "HTTP 400: too long for this model" for r in failures)
    assert metrics.effective_throughput <= metrics.output_throughput


async def test_mixed_sends_long_requests_on_their_own_clock(tokenizer: Tokenizer) -> None:
    fake = FakeOpenAI(token_delay_s=0.005)
    settings = replace(
        BASE,
        dataset="mixed",
        num_prompts=10,
        request_rate=25.0,
        long_input_len=1000,
        long_output_len=3,
        long_request_rate=10.0,
    )
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    classes = [r.request_class for r in result.records]
    assert classes.count("short") == 10
    assert classes.count("long") >= 1
    assert set(result.class_metrics) == {"short", "long"}
    long_metrics = result.class_metrics["long"]
    assert long_metrics.completed == classes.count("long")
    assert long_metrics.total_input_tokens == 1000 * classes.count("long")
    assert result.class_metrics["short"].completed == 10
    assert result.metrics.completed == len(classes)
    first_long = min(r.send_time for r in result.records if r.request_class == "long")
    assert first_long < 0.25  # the long clock starts with the run
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["short"]["completed"] == 10
    assert "median_itl_ms" in data["long"]


async def test_result_json_table_and_plot(tokenizer: Tokenizer, tmp_path: Path) -> None:
    fake = FakeOpenAI(max_model_len=14)
    settings = replace(BASE, num_prompts=6, random_range_ratio=0.5, slo_ttft_ms=1000.0)
    async with fake.serving() as url:
        result = await run_benchmark(replace(settings, base_url=url), tokenizer=tokenizer)
    data = json.loads(json.dumps(result.to_dict(detailed=True), allow_nan=False))
    assert data["request_rate"] == "inf"
    assert data["num_sent"] == 6 == data["completed"] + data["failed"]
    assert data["model"] == "fake-model" and data["dataset"] == "random"
    assert data["slo_ttft_ms"] == 1000.0 and data["base_url"] == url
    assert len(data["requests"]) == 6
    table = format_report(result)
    for line in (
        "Serving Benchmark Result",
        "Failed requests:",
        "Truncated requests:",
        "Effective throughput (tok/s):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
    ):
        assert line in table
    if result.metrics.failed:
        assert "too long for this model" in table
    curves = RunCurves.from_result(result)
    assert len(curves.ttfts_ms) == result.metrics.completed
    path = plot_runs({"one": result, "same again": result}, tmp_path / "plots" / "run.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
