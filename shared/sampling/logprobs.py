"""Log-probabilities reported to the user: vLLM's default `logprobs_mode="raw_logprobs"`, the
log_softmax of the model's logits before penalties, temperature and truncation (they describe the
model, not the sampling settings: a token masked by top-k still gets its true log-prob)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float
    rank: int  # 1 = the model's most likely token (vLLM's rank)
    top: tuple[tuple[int, float], ...]  # the requested number of most likely (token, logprob)
