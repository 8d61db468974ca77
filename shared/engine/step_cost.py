"""What a step costs, learnt from the steps the engine times: sizes the prompt chunks that ride
along with decodes (`prefill_budget_with_decodes="auto"`).

A step's time is close to a fixed part for its decodes plus a part per prompt token. Keeping
the prompt part of a step at most `ratio` times the decode part keeps a running stream's
inter-token latency within (1 + ratio) decode steps, whatever the model and the hardware: a
token cap right for a 3.7M-parameter model on a CPU would stall a 24M one for tens of
milliseconds, and be far too small for a GPU. Pure Python; the clock is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with fewer prompt tokens than this say too little about the per-token cost (their time
# is mostly the decode part and noise).
MIN_PROMPT_TOKENS = 32


def _smoothed(previous: float | None, sample: float, weight: float) -> float:
    return sample if previous is None else previous + weight * (sample - previous)


@dataclass
class StepCostModel:
    # How fast the estimates follow change (batch sizes and contexts drift during a run).
    smoothing: float = 0.2
    # Seconds of a step that runs decodes only.
    decode_step_s: float | None = None
    # Seconds each prompt token adds to a step.
    prompt_token_s: float | None = None

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One timed step: how many decode rows and prompt tokens it computed."""
        if num_prompt_tokens == 0:
            if num_decodes > 0:
                self.decode_step_s = _smoothed(self.decode_step_s, seconds, self.smoothing)
            return
        if num_prompt_tokens < MIN_PROMPT_TOKENS:
            return
        decode_part = 0.0
        if num_decodes > 0:
            if self.decode_step_s is None:
                return  # cannot split this step's time yet
            decode_part = self.decode_step_s
        per_token = max(seconds - decode_part, 0.0) / num_prompt_tokens
        self.prompt_token_s = _smoothed(self.prompt_token_s, per_token, self.smoothing)

    def prompt_budget(self, ratio: float, low: int, high: int, default: int) -> int:
        """Prompt tokens whose cost is `ratio` decode steps, within [low, high]; `default`
        until both parts of a step have been measured."""
        if self.decode_step_s is None or not self.prompt_token_s:
            return max(low, min(default, high))
        tokens = int(ratio * self.decode_step_s / self.prompt_token_s)
        return max(low, min(tokens, high))
