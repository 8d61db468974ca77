"""The human-readable result: vLLM's "Serving Benchmark Result" block, plus Nori's figures
(truncated requests, effective throughput, per-request decode speed, speculative decoding's
acceptance when the server speculated, errors, mixed classes)."""

from __future__ import annotations

import math

from nori.bench.serve.figures import PERCENTILES, Distribution, ServeMetrics
from nori.bench.serve.result import ServeBenchResult
from nori.bench.serve.server_metrics import SpecDecodeFigures

_WIDTH = 50
# (attribute, short name, section title), in vLLM's order.
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_report(result: ServeBenchResult) -> str:
    settings, metrics = result.settings, result.metrics
    lines = [_rule(" Serving Benchmark Result ", "=")]
    lines += [
        _line("Successful requests:", metrics.completed),
        _line("Failed requests:", metrics.failed),
        _line("Truncated requests:", metrics.num_truncated),
    ]
    if settings.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", settings.max_concurrency))
    if not math.isinf(settings.request_rate):
        lines.append(_line("Request rate configured (RPS):", settings.request_rate))
    lines += [
        _line("Benchmark duration (s):", metrics.duration),
        _line("Total input tokens:", metrics.total_input_tokens),
        _line("Total generated tokens:", metrics.total_output_tokens),
        _line("Request throughput (req/s):", metrics.request_throughput),
        _line("Output token throughput (tok/s):", metrics.output_throughput),
        _line("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        _line("Total Token throughput (tok/s):", metrics.total_token_throughput),
    ]
    lines += _goodput_lines(result)
    for name, short, title in _SECTIONS:
        lines += _distribution_lines(getattr(metrics, name), short, title)
    lines += [
        _rule("Per-request Decode Speed", "-"),
        _line("Median decode speed (tok/s):", metrics.median_request_decode_tok_s),
        _line("P10 decode speed (tok/s):", metrics.p10_request_decode_tok_s),
    ]
    if result.spec_decode is not None:
        lines += _spec_decode_lines(result.spec_decode)
    for name, class_metrics in result.class_metrics.items():
        lines += _class_lines(name, class_metrics)
    if metrics.errors:
        lines.append(_rule("Errors", "-"))
        lines += [f"{count:>6} x {message}" for message, count in metrics.errors.items()]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _goodput_lines(result: ServeBenchResult) -> list[str]:
    settings, metrics = result.settings, result.metrics
    slos = [
        f"{name} <= {value:g} ms"
        for name, value in (("TTFT", settings.slo_ttft_ms), ("TPOT", settings.slo_tpot_ms))
        if value is not None
    ]
    lines = [_rule("Effective Throughput", "-")]
    if slos:
        lines.append(_line("SLOs:", ", ".join(slos)))
        lines.append(_line("Requests within SLO:", metrics.num_within_slo))
    lines += [
        _line("Good requests:", metrics.num_good_requests),
        _line("Goodput (req/s):", metrics.goodput),
        _line("Effective throughput (tok/s):", metrics.effective_throughput),
    ]
    return lines


def _spec_decode_lines(figures: SpecDecodeFigures) -> list[str]:
    return [
        _rule("Speculative Decoding", "-"),
        _line("Acceptance rate (%):", figures.acceptance_rate * 100.0),
        _line("Mean accepted length (tok):", figures.mean_accepted_length),
        _line("Verifications (drafts):", figures.num_drafts),
        _line("Draft tokens:", figures.num_draft_tokens),
        _line("Accepted tokens:", figures.num_accepted_tokens),
    ]


def _distribution_lines(distribution: Distribution, short: str, title: str) -> list[str]:
    known = dict(distribution.percentiles)
    return [
        _rule(title, "-"),
        _line(f"Mean {short} (ms):", distribution.mean),
        _line(f"Median {short} (ms):", distribution.median),
        *(_line(f"P{p} {short} (ms):", known.get(p)) for p in PERCENTILES),
    ]


def _class_lines(name: str, metrics: ServeMetrics) -> list[str]:
    ttft, itl, tpot = dict(metrics.ttft.percentiles), dict(metrics.itl.percentiles), metrics.tpot
    return [
        _rule(f"Requests of class {name!r}", "-"),
        _line("Successful requests:", metrics.completed),
        _line("Failed requests:", metrics.failed),
        _line("Output token throughput (tok/s):", metrics.output_throughput),
        _line("Effective throughput (tok/s):", metrics.effective_throughput),
        _line("Median TTFT (ms):", metrics.ttft.median),
        _line("P99 TTFT (ms):", ttft.get(99)),
        _line("Median TPOT (ms):", tpot.median),
        _line("Median ITL (ms):", metrics.itl.median),
        _line("P99 ITL (ms):", itl.get(99)),
    ]


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _line(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text}"
