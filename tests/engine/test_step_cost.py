"""StepCostModel: the prompt chunk beside decodes follows the measured cost of a step."""

from __future__ import annotations

import pytest

from nori.engine.step_cost import StepCostModel

FIXED, PER_ROW, PER_TOKEN = 0.005, 0.0005, 0.0003


def step_time(rows: int, tokens: int) -> float:
    return FIXED + PER_ROW * rows + PER_TOKEN * tokens


def test_default_until_steps_of_both_kinds_are_timed() -> None:
    model = StepCostModel()
    assert model.prompt_budget(8, 1.0, 16, 2048, 256) == 256
    model.observe(num_decodes=8, num_prompt_tokens=0, seconds=0.010)
    assert model.costs() is None
    assert model.prompt_budget(8, 1.0, 16, 2048, 256) == 256
    model.observe(num_decodes=0, num_prompt_tokens=0, seconds=1.0)  # an empty step: ignored
    assert model.costs() is None


def test_the_three_costs_are_recovered_from_mixed_steps() -> None:
    model = StepCostModel()
    for rows, tokens in [(1, 0), (0, 512), (4, 64), (8, 0), (16, 32), (12, 200), (2, 100)]:
        model.observe(rows, tokens, step_time(rows, tokens))
    costs = model.costs()
    assert costs is not None
    assert costs == pytest.approx((FIXED, PER_ROW, PER_TOKEN), rel=1e-4)
    # A 16-row decode step costs 13 ms = 43 prompt tokens; ratio 2 allows 86.
    assert model.decode_step_s(16) == pytest.approx(0.013, rel=1e-4)
    assert model.prompt_budget(16, 1.0, 16, 2048, 256) == 43
    assert model.prompt_budget(16, 2.0, 16, 2048, 256) == 86
    assert model.prompt_budget(1, 1.0, 16, 2048, 256) == 18


def test_the_budget_grows_with_the_batch_while_every_step_carries_prompt_tokens() -> None:
    """The stall this model exists to avoid: after one decode-only step of 1 row, prompts queue
    and every step carries a small chunk; the decode part must still follow the batch."""
    model = StepCostModel()
    model.observe(0, 512, step_time(0, 512))
    model.observe(1, 0, step_time(1, 0))
    budgets = []
    for rows in range(1, 17):
        budget = model.prompt_budget(rows, 1.0, 16, 2048, 256)
        budgets.append(budget)
        model.observe(rows, budget, step_time(rows, budget))
    assert budgets[0] == 18  # 5.5 ms / 0.3 ms
    assert budgets[-1] == 43  # 13 ms / 0.3 ms, not frozen at the 1-row figure
    assert budgets == sorted(budgets)


def test_estimates_follow_a_change_in_cost() -> None:
    model = StepCostModel(forgetting=0.9)
    shapes = [(1, 0), (0, 512), (4, 64), (8, 0), (16, 32)]
    for rows, tokens in shapes:
        model.observe(rows, tokens, step_time(rows, tokens))
    for _ in range(40):  # the machine got 3x slower at prompt tokens
        for rows, tokens in shapes:
            model.observe(rows, tokens, FIXED + PER_ROW * rows + 3 * PER_TOKEN * tokens)
    costs = model.costs()
    assert costs is not None and costs[2] == pytest.approx(3 * PER_TOKEN, rel=1e-3)


def test_the_budget_stays_within_bounds() -> None:
    dear = StepCostModel()
    dear.observe(1, 0, 0.010)
    dear.observe(0, 100, 1.0)  # 10 ms per token
    assert dear.prompt_budget(1, 1.0, 16, 2048, 256) == 16  # 1 token, raised to the floor
    cheap = StepCostModel()
    cheap.observe(1, 0, 0.010)
    cheap.observe(0, 10_000, 0.011)
    assert cheap.prompt_budget(1, 1.0, 16, 2048, 256) == 2048  # capped at the ceiling


def test_the_published_fit_answers_from_steps_of_one_kind() -> None:
    # A prefill worker: prompt steps only. Its fit recovers 2 ms + 0.1 ms a token, with no
    # decode-row cost (None, not 0: never measured).
    model = StepCostModel()
    for tokens in (16, 64, 128, 512, 33):
        model.observe(0, tokens, 0.002 + 1e-4 * tokens)
    fit = model.fit()
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.002, rel=1e-3)
    assert fit.per_token_s == pytest.approx(1e-4, rel=1e-3)
    assert fit.per_row_s is None
    assert model.costs() is None  # the prompt budget still waits for both kinds
    # A disaggregated decode worker: decode steps only.
    model = StepCostModel()
    for rows in (1, 4, 8, 16, 3):
        model.observe(rows, 0, 0.005 + 5e-4 * rows)
    fit = model.fit()
    assert fit is not None
    assert (fit.fixed_s, fit.per_row_s) == (pytest.approx(0.005), pytest.approx(5e-4))
    assert fit.per_token_s is None
    assert StepCostModel().fit() is None


def test_adds_to_says_when_a_kind_has_become_known() -> None:
    model = StepCostModel()
    assert not model.adds_to(None)
    for _ in range(3):
        model.observe(0, 64, 0.01)
    assert model.adds_to(None)
    fit = model.fit()
    assert fit is not None and fit.per_token_s is None
    assert not model.adds_to(fit)
    model.observe(0, 32, 0.005)
    assert model.adds_to(fit)
    assert not model.adds_to(model.fit())


def test_a_fit_that_finds_no_positive_cost_states_the_cost_through_the_origin() -> None:
    # A slow first step and prompts of noisy times: the least-squares slope comes out negative.
    model = StepCostModel()
    for tokens, seconds in ((3, 0.080), (40, 0.010), (9, 0.012), (70, 0.011), (20, 0.012)):
        model.observe(0, tokens, seconds)
    fit = model.fit()
    assert fit is not None and fit.per_token_s is not None
    # Σ t x / Σ x² over the steps (the weights of the forgetting factor included).
    weights = [0.99**k for k in range(4, -1, -1)]
    steps = ((3, 0.080), (40, 0.010), (9, 0.012), (70, 0.011), (20, 0.012))
    moment = sum(w * x * t for w, (x, t) in zip(weights, steps, strict=True))
    gram = sum(w * x * x for w, (x, _) in zip(weights, steps, strict=True))
    assert fit.per_token_s == pytest.approx(moment / gram)
