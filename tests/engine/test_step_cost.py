"""StepCostModel: the prompt chunk beside decodes follows the measured cost of a step."""

from __future__ import annotations

import pytest

from nori.engine.step_cost import MIN_PROMPT_TOKENS, StepCostModel


def test_default_until_both_parts_are_measured() -> None:
    model = StepCostModel()
    assert model.prompt_budget(1.0, 16, 2048, 256) == 256
    model.observe(num_decodes=8, num_prompt_tokens=0, seconds=0.010)
    assert model.prompt_budget(1.0, 16, 2048, 256) == 256
    # A prefill-only step measures the per-token cost on its own.
    model.observe(num_decodes=0, num_prompt_tokens=1000, seconds=0.100)
    assert model.prompt_token_s == pytest.approx(1e-4)
    # One decode step (10 ms) is worth 100 prompt tokens; ratio 2 allows 200.
    assert model.prompt_budget(1.0, 16, 2048, 256) == 100
    assert model.prompt_budget(2.0, 16, 2048, 256) == 200


def test_mixed_steps_subtract_the_decode_part() -> None:
    model = StepCostModel(smoothing=1.0)
    model.observe(num_decodes=4, num_prompt_tokens=100, seconds=0.05)
    assert model.prompt_token_s is None  # no decode estimate yet to split this step with
    model.observe(num_decodes=4, num_prompt_tokens=0, seconds=0.02)
    model.observe(num_decodes=4, num_prompt_tokens=100, seconds=0.05)
    assert model.prompt_token_s == pytest.approx(0.03 / 100)


def test_small_chunks_and_empty_steps_teach_nothing() -> None:
    model = StepCostModel()
    model.observe(num_decodes=0, num_prompt_tokens=MIN_PROMPT_TOKENS - 1, seconds=1.0)
    model.observe(num_decodes=0, num_prompt_tokens=0, seconds=1.0)
    assert model.prompt_token_s is None and model.decode_step_s is None


def test_estimates_follow_change_smoothly_and_stay_in_bounds() -> None:
    model = StepCostModel(smoothing=0.5)
    model.observe(num_decodes=1, num_prompt_tokens=0, seconds=0.010)
    model.observe(num_decodes=1, num_prompt_tokens=0, seconds=0.020)
    assert model.decode_step_s == pytest.approx(0.015)
    model.observe(num_decodes=0, num_prompt_tokens=100, seconds=1.0)  # 10 ms per token
    assert model.prompt_budget(1.0, 16, 2048, 256) == 16  # 1.5 tokens, raised to the floor
    cheap = StepCostModel(smoothing=1.0)
    cheap.observe(num_decodes=1, num_prompt_tokens=0, seconds=0.010)
    cheap.observe(num_decodes=0, num_prompt_tokens=10_000, seconds=0.001)
    assert cheap.prompt_budget(1.0, 16, 2048, 256) == 2048  # 100k tokens: capped at the ceiling
