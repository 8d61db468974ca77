"""The TTFT breakdown of bench/trace_phases.py on hand-made spans (pure logic)."""

from __future__ import annotations

from typing import Any

import pytest

from nori.bench.trace_phases import summarize

MS = 1_000_000


def _span(
    trace: str, service: str, name: str, start_ms: int, end_ms: int, **attributes: Any
) -> dict[str, Any]:
    return {
        "service": service,
        "name": name,
        "trace": trace,
        "start_ns": start_ms * MS,
        "end_ns": end_ms * MS,
        "attributes": attributes,
    }


def _interactive(trace: str, t0: int, queue_ms: int) -> list[dict[str, Any]]:
    return [
        _span(trace, "nori-gateway", "POST /v1/completions", t0, t0 + 900),
        _span(trace, "nori-gateway", "route", t0 + 10, t0 + 11),
        _span(trace, "nori-gateway", "reserve", t0 + 11, t0 + 31),
        _span(trace, "nori-prefill", "prefill", t0 + 35, t0 + 300),
        _span(trace, "nori-prefill", "queue", t0 + 35, t0 + 35 + queue_ms),
        _span(
            trace,
            "nori-prefill",
            "compute",
            t0 + 35 + queue_ms,
            t0 + 135 + queue_ms,
            **{"nori.prompt_tokens": 64},
        ),
        _span(trace, "nori-prefill", "kv_send", t0 + 140 + queue_ms, t0 + 150 + queue_ms),
    ]


def test_requests_are_split_by_whether_a_batch_line_was_in_flight() -> None:
    spans = [
        *_interactive("a", 0, queue_ms=5),
        # A batch line's trace (its own completions span too) from 2 s to 5 s.
        _span("line", "nori-batch", "batch line", 2000, 5000),
        _span("line", "nori-gateway", "POST /v1/completions", 2001, 4999),
        *_interactive("b", 3000, queue_ms=400),
        *_interactive("c", 6000, queue_ms=7),
    ]
    summary = summarize(spans)
    assert summary["alone"]["requests"] == 2
    assert summary["beside batch"]["requests"] == 1
    beside = summary["beside batch"]
    assert beside["prefill_queue"]["p50"] == pytest.approx(0.4)
    assert beside["admit"]["p50"] == pytest.approx(0.010)
    assert beside["reserve"]["p50"] == pytest.approx(0.020)
    assert beside["to_prefill"]["p50"] == pytest.approx(0.004)
    assert beside["prefill_compute"]["p50"] == pytest.approx(0.1)
    assert summary["alone"]["prefill_queue"]["max"] == pytest.approx(0.007)


def test_a_trace_missing_its_prefill_spans_is_left_out() -> None:
    spans = [s for s in _interactive("a", 0, queue_ms=5) if s["name"] != "compute"]
    assert summarize(spans)["alone"]["requests"] == 0
