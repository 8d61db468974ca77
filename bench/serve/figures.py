"""The benchmark's figures: a pure function of the per-request records and the run's duration.

Names follow vLLM's `benchmark_serving.py` result files (`completed`, `median_tpot_ms`,
`p99_itl_ms`, ...), and so do the definitions: TTFT is first content chunk minus send, TPOT is
(E2EL - TTFT) / (output tokens - 1) over requests with more than one output token, ITL pools the
gaps between consecutive content chunks of all requests, the percentiles interpolate linearly
(numpy's default) and the standard deviation is the population one. A statistic over no values
is None rather than vLLM's 0, which would read as a measurement.

On top of vLLM's figures, `effective_throughput` counts only the output of requests that did
what was asked: no error, not truncated by the server, and within the SLOs that are set.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nori.bench.serve.records import RequestRecord

PERCENTILES = (90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Distribution:
    """One latency over the run, in milliseconds."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    percentiles: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(ms)),
            median=float(np.median(ms)),
            std=float(np.std(ms)),
            percentiles=tuple((p, float(np.percentile(ms, p))) for p in PERCENTILES),
        )

    def fields(self, name: str) -> dict[str, float | None]:
        """`mean_{name}_ms`, `median_{name}_ms`, `std_{name}_ms`, `p90_{name}_ms`, ..."""
        result = {
            f"mean_{name}_ms": self.mean,
            f"median_{name}_ms": self.median,
            f"std_{name}_ms": self.std,
        }
        known = dict(self.percentiles)
        for p in PERCENTILES:
            result[f"p{p}_{name}_ms"] = known.get(p)
        return result


@dataclass(frozen=True)
class ServeMetrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # The busiest second's output (vLLM's max_output_tokens_per_s).
    max_output_tokens_per_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    median_request_decode_tok_s: float | None
    p10_request_decode_tok_s: float | None
    effective_throughput: float
    goodput: float
    num_truncated: int
    num_within_slo: int
    num_good_requests: int
    # Failed requests by error message (the HTTP status is part of the message).
    errors: Mapping[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        result: dict[str, object] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "effective_throughput": self.effective_throughput,
            "goodput": self.goodput,
            "num_truncated": self.num_truncated,
            "num_within_slo": self.num_within_slo,
            "num_good_requests": self.num_good_requests,
            "median_request_decode_tok_s": self.median_request_decode_tok_s,
            "p10_request_decode_tok_s": self.p10_request_decode_tok_s,
        }
        for name in LATENCIES:
            distribution: Distribution = getattr(self, name)
            result.update(distribution.fields(name))
        result["errors"] = dict(self.errors)
        return result


def within_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request that met each SLO that is set. A request with one output token has
    no TPOT and meets any TPOT SLO (as in vLLM's goodput); one with no text has no TTFT and
    meets no TTFT SLO."""
    if not record.success:
        return False
    if slo_ttft_ms is not None:
        ttft = record.ttft
        if ttft is None or ttft * 1000.0 > slo_ttft_ms:
            return False
    tpot = record.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def output_timeline(
    records: Sequence[RequestRecord], duration_s: float, bin_s: float = 1.0
) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` from the start of the run.

    A request's tokens are spread evenly over its content chunks, since a chunk may carry
    several tokens and the usage report only gives the total.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0.0] * num_bins
    for record in records:
        if not record.success or not record.chunk_times:
            continue
        per_chunk = record.output_tokens / len(record.chunk_times)
        for time in record.chunk_times:
            tokens[min(num_bins - 1, max(0, int(time // bin_s)))] += per_chunk
    return [count / bin_s for count in tokens]


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> ServeMetrics:
    """Every figure of a run (or of one class of its requests) from its records."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    good = [r for r in done if not r.truncated and within_slo(r, slo_ttft_ms, slo_tpot_ms)]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    decode_speeds = [s for r in done if (s := r.decode_tok_s) is not None]
    errors = Counter(r.error or "unknown error" for r in records if not r.success)
    return ServeMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=max(output_timeline(done, duration_s)),
        ttft=Distribution.of_seconds([t for r in done if (t := r.ttft) is not None]),
        tpot=Distribution.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itls]),
        e2el=Distribution.of_seconds([t for r in done if (t := r.e2el) is not None]),
        median_request_decode_tok_s=_percentile(decode_speeds, 50),
        p10_request_decode_tok_s=_percentile(decode_speeds, 10),
        effective_throughput=sum(r.output_tokens for r in good) / duration_s,
        goodput=len(good) / duration_s,
        num_truncated=sum(r.truncated for r in done),
        num_within_slo=sum(within_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done),
        num_good_requests=len(good),
        errors=dict(errors.most_common()),
    )


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
