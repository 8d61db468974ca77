"""What a step costs, learnt from the steps the engine times: `fixed + per_row * decode rows +
per_token * prompt tokens` by least squares over timed steps, older ones weighing less; no torch.

With `prefill_budget_with_decodes="auto"` a step's prompt part is kept at most `ratio` times the
decode part of the running batch. The fit is published (`StepCostFit`) for the gateway's
conditional disaggregation; a kind of step never timed gets no cost (None)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nori.engine.config import PrefillBudget
    from nori.engine.scheduler import Scheduler, SchedulerOutput

# Features of a step: 1 (the fixed part), decode rows, prompt tokens.
_NUM_FEATURES = 3
# Steps of a kind (with decode rows, with prompt tokens) before `fit()` states that kind's cost.
_MIN_STEPS_OF_A_KIND = 4
# Keeps the fit defined while a feature has not varied yet; tiny beside any real step's weight.
_RIDGE = 1e-9
# The "auto" prompt cap before any step has been timed.
AUTO_PREFILL_BUDGET_START = 256
# Seconds between solves of the published fit.
_FIT_EVERY_S = 0.25


@dataclass(frozen=True)
class StepCostFit:
    """A step's fitted costs in seconds: `fixed_s + per_row_s * decode rows + per_token_s *
    prompt tokens`; a cost is None until steps of its kind have been timed."""

    fixed_s: float
    per_row_s: float | None
    per_token_s: float | None


@dataclass
class StepCostModel:
    # Each new step multiplies the weight of the earlier ones by this (about the last
    # 1 / (1 - forgetting) steps count): batch sizes and contexts drift during a run.
    forgetting: float = 0.99
    # Σ w·x·xᵀ and Σ w·x·seconds over the timed steps, x = (1, decode rows, prompt tokens).
    _gram: list[list[float]] = field(
        default_factory=lambda: [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
    )
    _moment: list[float] = field(default_factory=lambda: [0.0] * _NUM_FEATURES)
    # Steps timed with decode rows, with prompt tokens.
    _num_decode_steps: int = 0
    _num_prompt_steps: int = 0

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One timed step: how many decode rows and prompt tokens it computed."""
        if num_decodes == 0 and num_prompt_tokens == 0:
            return
        x = (1.0, float(num_decodes), float(num_prompt_tokens))
        keep = self.forgetting
        for i in range(_NUM_FEATURES):
            self._moment[i] = keep * self._moment[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._gram[i][j] = keep * self._gram[i][j] + x[i] * x[j]
        self._num_decode_steps += num_decodes > 0
        self._num_prompt_steps += num_prompt_tokens > 0

    def costs(self) -> tuple[float, float, float] | None:
        """(fixed, per decode row, per prompt token) seconds; None until steps of both kinds
        have been timed or while the fit is degenerate."""
        if not (self._num_decode_steps and self._num_prompt_steps):
            return None
        solution = self._solve()
        if solution is None:
            return None
        fixed, per_row, per_token = solution
        if per_token <= 0.0 or fixed + per_row <= 0.0:
            return None
        return fixed, per_row, per_token

    def adds_to(self, fit: StepCostFit | None) -> bool:
        """Whether `fit()` would now state a cost that `fit` (an earlier one) lacks."""
        if fit is None:
            return bool(self._num_decode_steps or self._num_prompt_steps)
        return (fit.per_row_s is None and self._num_decode_steps >= _MIN_STEPS_OF_A_KIND) or (
            fit.per_token_s is None and self._num_prompt_steps >= _MIN_STEPS_OF_A_KIND
        )

    def fit(self) -> StepCostFit | None:
        """The fitted costs, each None until `_MIN_STEPS_OF_A_KIND` steps of its kind have been
        timed; None before any step."""
        if not (self._num_decode_steps or self._num_prompt_steps):
            return None
        solution = self._solve()
        if solution is None:
            return None
        fixed, per_row, per_token = solution
        return StepCostFit(
            fixed_s=fixed,
            per_row_s=self._stated(1, per_row, self._num_decode_steps),
            per_token_s=self._stated(2, per_token, self._num_prompt_steps),
        )

    def _solve(self) -> tuple[float, float, float] | None:
        """The weighted least-squares costs, each at least 0; None while degenerate."""
        gram = np.array(self._gram) + _RIDGE * np.eye(_NUM_FEATURES)
        try:
            solution = np.linalg.solve(gram, np.array(self._moment))
        except np.linalg.LinAlgError:
            return None
        fixed, per_row, per_token = (max(float(value), 0.0) for value in solution)
        return fixed, per_row, per_token

    def _stated(self, feature: int, fitted: float, num_steps: int) -> float | None:
        """A kind's fitted cost once enough steps of it were timed; where the fit gives it no
        positive cost, its steps' time over its units (the fixed part included), never zero."""
        if num_steps < _MIN_STEPS_OF_A_KIND:
            return None
        if fitted > 0:
            return fitted
        units = self._gram[feature][feature]
        return self._moment[feature] / units if units > 0 and self._moment[feature] > 0 else None

    def decode_step_s(self, num_decodes: int) -> float | None:
        """The fitted time of a step of `num_decodes` decode rows and no prompt."""
        costs = self.costs()
        return None if costs is None else costs[0] + costs[1] * num_decodes

    def prompt_budget(
        self, num_decodes: int, ratio: float, low: int, high: int, default: int
    ) -> int:
        """Prompt tokens whose cost is `ratio` times a step of `num_decodes` decode rows,
        within [low, high]; `default` until the fit is defined."""
        costs = self.costs()
        if costs is None:
            return max(low, min(default, high))
        fixed, per_row, per_token = costs
        tokens = int(ratio * (fixed + per_row * max(num_decodes, 1)) / per_token)
        return max(low, min(tokens, high))


class StepCosts:
    """The engine's side: `before_schedule` sets the scheduler's prompt cap (with "auto"),
    `after_execute` times the step into the model and refreshes the published `fit`."""

    def __init__(self, budget: PrefillBudget, block_size: int, max_num_batched_tokens: int) -> None:
        self.model = StepCostModel()
        self.fit: StepCostFit | None = None
        self._auto = budget == "auto"
        self._low, self._high = block_size, max_num_batched_tokens
        self._fit_at = -math.inf

    @staticmethod
    def initial_budget(budget: PrefillBudget) -> int | None:
        """The scheduler's prompt cap before the first step."""
        return AUTO_PREFILL_BUDGET_START if budget == "auto" else budget

    def before_schedule(self, scheduler: Scheduler) -> None:
        if self._auto:
            scheduler.prefill_budget_with_decodes = self.model.prompt_budget(
                # The running requests are (about) the decode rows of the coming step.
                num_decodes=len(scheduler.running),
                ratio=1.0,
                low=self._low,
                high=self._high,
                default=AUTO_PREFILL_BUDGET_START,
            )

    def after_execute(self, output: SchedulerOutput, seconds: float) -> None:
        """`seconds`: what running the model on `output` took."""
        num_decodes = sum(1 for item in output.scheduled if item.num_new_tokens == 1)
        self.model.observe(num_decodes, output.num_batched_tokens - num_decodes, seconds)
        if time.monotonic() - self._fit_at >= _FIT_EVERY_S or self.model.adds_to(self.fit):
            self.fit = self.model.fit()
            self._fit_at = time.monotonic()
