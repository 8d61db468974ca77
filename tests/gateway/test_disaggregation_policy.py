"""Conditional disaggregation's choice (nori.gateway.disaggregation), on fixed figures: the costs
of both paths worked out by hand from the module's formulas, the learnt threshold, the modes,
the stall cap and what it does before anything is measured."""

from __future__ import annotations

import math

import pytest

from nori.gateway.disaggregation import (
    DisaggregationPolicy,
    PathQueues,
    PrefillPathFigures,
    PrefillPathMeter,
    choose_path,
)
from nori.state.registry import WorkerInfo

# 0.1 ms per prompt token on both sides, a 5 ms decode step (+0.5 ms per stream).
DECODE = WorkerInfo(
    "decode-0", "decode", step_fixed_s=0.005, step_per_row_s=0.0005, step_per_token_s=1e-4
)
PREFILL = WorkerInfo("prefill-0", "prefill", step_fixed_s=0.002, step_per_token_s=1e-4)
IDLE = PathQueues(decode_running=0, decode_pending_tokens=0, prefill_pending_tokens=0)


def measured(hop_s: float = 0.02) -> PrefillPathFigures:
    # The transfer: 1 µs a token, no fixed part.
    return PrefillPathFigures(hop_s=hop_s, transfer_fixed_s=0.0, transfer_s_per_token=1e-6)


def test_a_short_prompt_on_an_idle_cluster_is_computed_on_the_decode_worker() -> None:
    choice = choose_path("auto", 64, DECODE, PREFILL, 0, IDLE, measured())
    assert (choice.path, choice.reason) == ("decode", "cheaper_on_decode")
    # decode: 0 + 0.005 + 1e-4 * 64 = 0.0114; prefill: 0.02 + 0 + 0.002 + 1e-4 * 64 +
    # 1e-6 * 64 = 0.028464
    assert choice.decode_cost_s == pytest.approx(0.0114)
    assert choice.prefill_cost_s == pytest.approx(0.028464)
    # Equal at (0.022 - 0.005) / (1e-4 - 1e-4 - 1e-6): the slopes favour prefill by the
    # transfer only, so the decode worker wins at every length the compute cap allows.
    assert choice.threshold_tokens == math.inf


def test_streams_on_the_decode_worker_make_the_prefill_worker_cheaper_past_a_threshold() -> None:
    queues = PathQueues(decode_running=8, decode_pending_tokens=0, prefill_pending_tokens=0)
    # decode, in chunks beside 8 streams (c = 2): 0.005 + 0.0005 * 8 = 0.009 + 1e-4 (2 + 8) T;
    # prefill: 0.022 + 1e-4 T + 1e-6 (1 + 8) T
    threshold = (0.022 - 0.009) / (1e-3 - 1e-4 - 9e-6)
    short = choose_path("auto", 8, DECODE, PREFILL, 0, queues, measured())
    assert short.path == "decode"
    assert short.threshold_tokens == pytest.approx(threshold)
    longer = choose_path("auto", math.ceil(threshold) + 1, DECODE, PREFILL, 0, queues, measured())
    assert (longer.path, longer.reason) == ("prefill", "cheaper_on_prefill")


def test_a_busy_prefill_worker_sends_short_prompts_to_the_decode_worker() -> None:
    queues = PathQueues(decode_running=8, decode_pending_tokens=0, prefill_pending_tokens=0)
    assert choose_path("auto", 100, DECODE, PREFILL, 0, queues, measured()).path == "prefill"
    # A 2000-token prompt queued on the prefill worker: 0.2 s before this one starts there.
    busy = PathQueues(decode_running=8, decode_pending_tokens=0, prefill_pending_tokens=2000)
    assert choose_path("auto", 100, DECODE, PREFILL, 0, busy, measured()).path == "decode"


def test_the_prefill_workers_cached_prefix_counts_for_the_prefill_path() -> None:
    queues = PathQueues(decode_running=8, decode_pending_tokens=0, prefill_pending_tokens=0)
    uncached = choose_path("auto", 20, DECODE, PREFILL, 0, queues, measured())
    cached = choose_path("auto", 20, DECODE, PREFILL, 16, queues, measured())
    assert cached.uncached_tokens == 4
    assert cached.prefill_cost_s == pytest.approx(uncached.prefill_cost_s - 16 * 1e-4)


def test_the_compute_cap_keeps_long_prompts_off_the_decode_worker() -> None:
    # Idle: the decode worker is cheaper at any length, but 300 tokens would take it 30 ms.
    choice = choose_path("auto", 300, DECODE, PREFILL, 0, IDLE, measured(), 0.025)
    assert (choice.path, choice.reason) == ("prefill", "local_cap")
    assert choose_path("auto", 200, DECODE, PREFILL, 0, IDLE, measured(), 0.025).path == "decode"


def test_modes_and_what_auto_does_before_it_has_measured() -> None:
    assert choose_path("always", 8, DECODE, PREFILL, 0, IDLE, measured()).reason == "mode"
    assert choose_path("always", 8, DECODE, PREFILL, 0, IDLE, measured()).path == "prefill"
    never = choose_path("never", 5000, DECODE, PREFILL, 0, IDLE, measured())
    assert (never.path, never.reason) == ("decode", "mode")
    unmeasured = choose_path("auto", 8, DECODE, PREFILL, 0, IDLE, PrefillPathFigures())
    assert (unmeasured.path, unmeasured.reason) == ("prefill", "not_measured")
    unfitted = WorkerInfo("prefill-0", "prefill")
    assert choose_path("auto", 8, DECODE, unfitted, 0, IDLE, measured()).reason == "not_measured"
    alone = choose_path("auto", 5000, DECODE, None, 0, IDLE, PrefillPathFigures())
    assert (alone.path, alone.reason) == ("decode", "no_prefill_worker")


def test_a_decode_worker_that_computed_no_prompt_borrows_the_prefill_workers_token_cost() -> None:
    no_prompts_yet = WorkerInfo("decode-0", "decode", step_fixed_s=0.005, step_per_row_s=0.0005)
    choice = choose_path("auto", 64, no_prompts_yet, PREFILL, 0, IDLE, measured())
    assert choice.decode_cost_s == pytest.approx(0.0114)


def test_the_prefill_path_meter_fits_the_transfer_as_a_line_in_the_prompt_length() -> None:
    meter = PrefillPathMeter()
    assert not meter.figures().complete
    # 100 tokens: 30 ms to token one, of which 20 ms queue + compute and 4 ms transfer.
    meter.observe(100, 0.030, 0.020, 0.004)
    first = meter.figures()
    assert first.hop_s == pytest.approx(0.006)
    # One length so far: all of the transfer per token.
    assert (first.transfer_fixed_s, first.transfer_s_per_token) == (0.0, pytest.approx(4e-5))
    # Transfers of 1 ms + 10 µs a token, at other lengths: the line is recovered.
    meter = PrefillPathMeter()
    for tokens in (16, 500, 64, 2000, 128):
        meter.observe(tokens, 1.0, 1.0, 0.001 + 1e-5 * tokens)
    figures = meter.figures()
    assert figures.transfer_fixed_s == pytest.approx(0.001)
    assert figures.transfer_s_per_token == pytest.approx(1e-5)
    assert figures.hop_s == 0.0  # never negative
    meter.observe(64, 0.02, 0.02, 0.0)  # finished with token one: no transfer to fit
    assert meter.figures().transfer_s_per_token == pytest.approx(1e-5)


def test_the_policy_counts_each_decision_by_path_and_reason() -> None:
    policy = DisaggregationPolicy("auto")
    policy.choose(64, DECODE, PREFILL, 0, IDLE)  # nothing measured yet
    policy.observe_prefill_path(100, 0.030, 0.020, 0.004)
    policy.choose(64, DECODE, PREFILL, 0, IDLE)
    assert policy.decision_count("prefill", "not_measured") == 1
    assert policy.decision_count("decode", "cheaper_on_decode") == 1
    text = policy.metrics_text()
    assert (
        'nori_gateway_disaggregation_decisions_total{path="decode",reason="cheaper_on_decode"} 1.0'
        in text
    )
    assert "nori_gateway_prefill_hop_seconds" in text
    hop = policy.registry.get_sample_value("nori_gateway_prefill_hop_seconds")
    assert hop == pytest.approx(0.006)
    with pytest.raises(ValueError):
        DisaggregationPolicy("auto", max_local_compute_s=0)
