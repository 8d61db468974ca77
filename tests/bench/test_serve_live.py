"""`nori bench serve` against a live cluster of real processes (Redis, gateway, one colocated
worker on a tiny random checkpoint whose context is 1024 tokens): through the Python API and as
the command a user types. Each run is a handful of short requests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from nori.bench.serve.runner import run_benchmark_sync
from nori.bench.serve.settings import ServeBenchSettings
from nori.launch.local_cluster import LocalCluster
from nori.models.init_checkpoint import init_checkpoint
from tests.cluster.conftest import start_cluster

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024  # the tiny preset's max_position_embeddings
CONTEXT_ERROR = "maximum context length is 1024 tokens"
FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "effective_throughput",
    "goodput",
    "num_truncated",
    "num_within_slo",
    "median_request_decode_tok_s",
    "p10_request_decode_tok_s",
    *(f"{s}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
    "errors",
    "request_rate",
    "max_concurrency",
    "base_url",
    "model",
)


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("bench-live")
    checkpoint = init_checkpoint(folder / "tiny", "tiny", seed=7)
    cluster = start_cluster(redis_url, checkpoint, folder / "logs", colocated=True)
    try:
        yield cluster
    finally:
        cluster.stop()


def gateway_counter(cluster: LocalCluster, sample: str) -> float:
    """One sample of the gateway's Prometheus text, e.g. 'nori_gateway_prompt_tokens_total'."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


PROMPT_TOKENS = "nori_gateway_prompt_tokens_total"
GENERATED_TOKENS = "nori_gateway_generation_tokens_total"
REFUSED = 'nori_gateway_requests_total{endpoint="/v1/completions",status="400"}'


def base_settings(cluster: LocalCluster, **overrides: object) -> ServeBenchSettings:
    settings = ServeBenchSettings(
        base_url=cluster.url,
        tokenizer=cluster.spec.model,
        num_prompts=6,
        random_input_len=32,
        random_output_len=8,
        request_rate=30.0,
        ignore_eos=True,
        request_timeout_s=120.0,
    )
    return replace(settings, **overrides)  # type: ignore[arg-type]


def test_api_counts_are_the_servers_and_latencies_are_ordered(live: LocalCluster) -> None:
    settings = base_settings(live, prompt_format="token-ids", slo_ttft_ms=60_000.0)
    before = gateway_counter(live, PROMPT_TOKENS), gateway_counter(live, GENERATED_TOKENS)
    result = run_benchmark_sync(settings)
    after = gateway_counter(live, PROMPT_TOKENS), gateway_counter(live, GENERATED_TOKENS)
    data = result.to_dict()
    for field in FIELDS:
        assert field in data, field
    metrics = result.metrics
    assert (metrics.completed, metrics.failed, result.num_sent) == (6, 0, 6)
    assert result.model == Path(live.spec.model).name  # the server's first model
    for record in result.records:
        assert record.success and record.usage_from_server
        # Token ids go as they are and ignore_eos runs to max_tokens: the server's usage
        # must report exactly what was asked.
        assert (record.prompt_tokens, record.output_tokens) == (32, 8)
        assert record.finish_reason == "length" and not record.truncated
        ttft, e2el = record.ttft, record.e2el
        assert ttft is not None and e2el is not None and 0 < ttft <= e2el
    assert metrics.total_input_tokens == 6 * 32 and metrics.total_output_tokens == 6 * 8
    # The server's own count of the same run, read from its metrics rather than the streams.
    assert (after[0] - before[0], after[1] - before[1]) == (6 * 32, 6 * 8)
    assert metrics.effective_throughput <= metrics.output_throughput
    assert metrics.num_good_requests == 6


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_text_prompts(live: LocalCluster, endpoint_type: str) -> None:
    settings = base_settings(live, endpoint_type=endpoint_type, random_input_len=40)
    result = run_benchmark_sync(settings)
    assert result.metrics.completed == 6
    for record in result.records:
        assert record.usage_from_server and record.output_tokens == 8
        if endpoint_type == "completions":
            # The local tokenizer fitted the text to 40 tokens as the server counts them.
            assert record.prompt_tokens == 40
        else:
            assert record.prompt_tokens > 40  # the chat template's tokens come on top


@pytest.mark.parametrize(
    ("input_len", "output_len"),
    [(MAX_MODEL_LEN + 76, 8), (16, MAX_MODEL_LEN)],
    ids=["prompt-too-long", "max-tokens-too-large"],
)
def test_requests_the_server_refuses_are_failures(
    live: LocalCluster, input_len: int, output_len: int
) -> None:
    settings = base_settings(
        live, num_prompts=2, random_input_len=input_len, random_output_len=output_len
    )
    refused_before = gateway_counter(live, REFUSED)
    result = run_benchmark_sync(settings)
    assert gateway_counter(live, REFUSED) - refused_before == 2
    metrics = result.metrics
    assert (metrics.completed, metrics.failed) == (0, 2)
    assert metrics.effective_throughput == 0.0 and metrics.total_output_tokens == 0
    for record in result.records:
        assert not record.success
        assert record.error is not None and record.error.startswith("HTTP 400: ")
        assert CONTEXT_ERROR in record.error
    [(message, count)] = metrics.errors.items()
    assert count == 2 and CONTEXT_ERROR in message


def test_mixed_run_keeps_refused_long_requests_as_failures(live: LocalCluster) -> None:
    settings = base_settings(
        live,
        dataset="mixed",
        num_prompts=8,
        random_input_len=24,
        long_input_len=MAX_MODEL_LEN + 1,  # refused: longer than the context
        long_request_rate=4.0,
        request_rate=8.0,
    )
    result = run_benchmark_sync(settings)
    short, long = result.class_metrics["short"], result.class_metrics["long"]
    assert (short.completed, short.failed) == (8, 0)
    assert long.completed == 0 and long.failed >= 1
    assert result.metrics.completed + result.metrics.failed == result.num_sent
    assert result.num_sent == 8 + long.failed
    [message] = long.errors
    assert CONTEXT_ERROR in message


def nori_bench_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_json_result_file_and_plot(live: LocalCluster, tmp_path: Path) -> None:
    result_file, plot_file = tmp_path / "result.json", tmp_path / "run.png"
    completed = nori_bench_serve(
        *("--base-url", live.url, "--tokenizer", live.spec.model),
        *("--dataset", "mixed", "--num-prompts", "8", "--request-rate", "10"),
        *("--random-input-len", "24", "--random-output-len", "6"),
        *("--long-input-len", "1000", "--long-output-len", "4", "--long-request-rate", "2"),
        *("--ignore-eos", "--slo-ttft-ms", "60000", "--num-warmups", "2", "--seed", "3"),
        *("--json", "--result-file", str(result_file), "--save-detailed"),
        *("--plot", str(plot_file)),
    )
    assert completed.returncode == 0, completed.stderr
    data = json.loads(completed.stdout)
    assert json.loads(result_file.read_text()) == data
    for field in FIELDS:
        assert field in data, field
    assert data["dataset"] == "mixed" and data["slo_ttft_ms"] == 60000.0
    assert data["completed"] + data["failed"] == data["num_sent"] == len(data["requests"])
    assert data["failed"] == 0 and data["short"]["completed"] == 8
    assert data["long"]["completed"] >= 1
    assert data["long"]["total_input_tokens"] == 1000 * data["long"]["completed"]
    assert data["effective_throughput"] <= data["output_throughput"]
    for record in data["requests"]:
        assert record["usage_from_server"] and record["output_tokens"] == record["max_tokens"]
        assert record["chunk_times"][0] - record["send_time"] <= (
            record["end_time"] - record["send_time"]
        )
    assert plot_file.read_bytes()[:4] == b"\x89PNG" and plot_file.stat().st_size > 10_000


def test_cli_table(live: LocalCluster) -> None:
    completed = nori_bench_serve(
        *("--base-url", live.url, "--tokenizer", live.spec.model, "--num-prompts", "3"),
        *("--random-input-len", "20", "--random-output-len", "4", "--max-concurrency", "2"),
    )
    assert completed.returncode == 0, completed.stderr
    table = completed.stdout
    assert "Serving Benchmark Result" in table
    assert "Successful requests:                     3" in table
    assert "Failed requests:                         0" in table
    assert "Truncated requests:" in table
    assert f"{'Maximum request concurrency:':<40} 2" in table


def test_cli_reports_bad_options_without_a_traceback() -> None:
    completed = nori_bench_serve("--base-url", "http://127.0.0.1:9", "--dataset", "sharegpt")
    assert completed.returncode == 2
    assert "nori: error: --dataset sharegpt needs --dataset-path FILE" in completed.stderr
