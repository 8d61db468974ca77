"""The figures of `nori bench serve` on a hand-made trace (tests/bench/serve_trace.py), each
worked out by hand: exact counts, and floats to 1e-9."""

from __future__ import annotations

import json
import math

import pytest

from nori.bench.serve.figures import compute_metrics, output_timeline
from tests.bench.serve_trace import DURATION_S, STREAM_ERROR, TOO_LONG, TRACE


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-9, abs=1e-9)


def test_record_properties() -> None:
    r0, r1, r2, _, r4, *_ = TRACE
    assert r0.ttft == 0.5 and r0.e2el == 1.5 and r0.tpot == approx(1 / 3)
    assert r0.itls == (0.25, 0.25, 0.5)
    assert r0.decode_tok_s == approx(3.0)
    assert r1.tpot == approx(0.375)
    assert r2.tpot is None and r2.decode_tok_s is None and r2.itls == ()
    assert [r.truncated for r in TRACE] == [False, False, False, True, False, False, False]
    assert r4.ttft is None and r4.e2el is None and r4.itls == ()


def test_counts_and_throughputs() -> None:
    m = compute_metrics(TRACE, DURATION_S)
    assert (m.completed, m.failed) == (4, 3)
    assert m.completed + m.failed == len(TRACE)
    assert m.duration == DURATION_S
    assert m.total_input_tokens == 10 + 20 + 30 + 40  # failed requests' prompts not counted
    assert m.total_output_tokens == 4 + 3 + 1 + 2
    assert m.request_throughput == approx(4 / 4.0)
    assert m.output_throughput == approx(10 / 4.0)
    assert m.total_token_throughput == approx(110 / 4.0)
    assert dict(m.errors) == {TOO_LONG: 2, STREAM_ERROR: 1}
    # Bins [0,1) [1,2) [2,3) [3,4): r0 2+2, r1 2+1, r2 1, r3 1+1 (one token per chunk).
    assert output_timeline(TRACE, DURATION_S) == [2.0, 4.0, 3.0, 1.0]
    assert m.max_output_tokens_per_s == 4.0


def test_latency_distributions() -> None:
    m = compute_metrics(TRACE, DURATION_S)
    # TTFT ms: 500, 250, 1000, 500 -> sorted 250 500 500 1000.
    assert m.ttft.mean == approx(562.5)
    assert m.ttft.median == approx(500.0)
    assert m.ttft.std == approx(math.sqrt((62.5**2 + 312.5**2 + 437.5**2 + 62.5**2) / 4))
    assert dict(m.ttft.percentiles) == {90: approx(850.0), 99: approx(985.0)}
    # TPOT ms over requests with > 1 token: 1000/3, 375, 500 (r2 has one token).
    assert m.tpot.mean == approx(3625 / 9)
    assert m.tpot.median == approx(375.0)
    assert m.tpot.std == approx(math.sqrt(406250 / 81))
    assert dict(m.tpot.percentiles) == {90: approx(475.0), 99: approx(497.5)}
    # ITL ms pooled: r0 250 250 500, r1 250 500, r3 500; failed r5 has none.
    assert m.itl.mean == approx(375.0)
    assert m.itl.median == approx(375.0)
    assert m.itl.std == approx(125.0)
    assert dict(m.itl.percentiles) == {90: approx(500.0), 99: approx(500.0)}
    # E2EL ms: 1500, 1000, 1000, 1000.
    assert m.e2el.mean == approx(1125.0)
    assert m.e2el.median == approx(1000.0)
    assert m.e2el.std == approx(math.sqrt(46875.0))
    assert dict(m.e2el.percentiles) == {90: approx(1350.0), 99: approx(1485.0)}
    # Decode speeds tok/s: 3, 8/3, 2.
    assert m.median_request_decode_tok_s == approx(8 / 3)
    assert m.p10_request_decode_tok_s == approx(2.0 + 0.2 * (8 / 3 - 2.0))


def test_effective_throughput_excludes_failed_and_truncated() -> None:
    m = compute_metrics(TRACE, DURATION_S)
    assert m.num_truncated == 1
    assert m.num_within_slo == 4  # no SLO set: every successful request
    assert m.num_good_requests == 3  # r3 is truncated
    assert m.effective_throughput == approx((4 + 3 + 1) / 4.0)
    assert m.goodput == approx(3 / 4.0)
    assert m.effective_throughput <= m.output_throughput


@pytest.mark.parametrize(
    ("slo_ttft_ms", "slo_tpot_ms", "within", "good_tokens", "good"),
    [
        (600.0, None, 3, 4 + 3, 2),  # r2's TTFT is 1000 ms; r3 within but truncated
        (None, 350.0, 2, 4 + 1, 2),  # r1 375 ms and r3 500 ms miss; r2 has no TPOT
        (600.0, 350.0, 1, 4, 1),
        (1000.0, 500.0, 4, 4 + 3 + 1, 3),  # limits are inclusive
    ],
)
def test_slos_filter_effective_throughput(
    slo_ttft_ms: float | None, slo_tpot_ms: float | None, within: int, good_tokens: int, good: int
) -> None:
    m = compute_metrics(TRACE, DURATION_S, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    assert m.num_within_slo == within
    assert m.num_good_requests == good
    assert m.effective_throughput == approx(good_tokens / DURATION_S)
    assert m.goodput == approx(good / DURATION_S)


def test_json_names_follow_vllm() -> None:
    data = compute_metrics(TRACE, DURATION_S).as_dict()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in data
    assert data["median_tpot_ms"] == approx(375.0)
    assert data["p99_itl_ms"] == approx(500.0)
    for key in (
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "median_request_decode_tok_s",
        "p10_request_decode_tok_s",
        "effective_throughput",
        "goodput",
        "num_truncated",
        "num_within_slo",
    ):
        assert key in data
    assert data["errors"] == {TOO_LONG: 2, STREAM_ERROR: 1}
    json.dumps(data, allow_nan=False)


def test_only_failures_give_no_statistics_rather_than_zeros() -> None:
    m = compute_metrics([r for r in TRACE if not r.success], DURATION_S)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 3, 0)
    assert m.ttft.mean is None and m.itl.median is None and m.tpot.percentiles == ()
    assert m.median_request_decode_tok_s is None
    data = m.as_dict()
    assert data["p99_ttft_ms"] is None and data["effective_throughput"] == 0.0
    json.dumps(data, allow_nan=False)


def test_duration_must_be_positive() -> None:
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(TRACE, 0.0)
