"""The batched sampler: logits [B, V] -> one token per row, and the per-row stages it is built of.

Stage order follows vLLM: min_tokens bans, penalties, then argmax for greedy rows; temperature,
top-k, top-p, min-p and a draw for sampled ones; unused stages are skipped, and speculative
verification uses the same stage functions. Draws use the exponential race (argmax(p_i / E_i),
E_i ~ Exp(1)); a seeded row fills its E row from its own generator, independent of its batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nori.kernels.argmax import argmax_rows
from nori.sampling.batch import SamplingBatch
from nori.sampling.logprob_math import compute_logprobs
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.penalties import apply_penalties, ban_stop_tokens
from nori.sampling.truncation import apply_min_p, apply_top_k_top_p

# Guards p / E against E == 0 (U rounds to 1), which would make a masked token's 0 / 0 a NaN.
_MIN_EXPONENTIAL = 1e-10


def penalised_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 [B, V]: min_tokens bans, then penalties. A greedy row's token is its argmax."""
    return apply_penalties(ban_stop_tokens(logits.float(), batch), batch)


def sampled_probs(penalised: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 [B, V]: what a sampled row draws from (temperature, top-k/top-p, min-p, softmax).
    Greedy rows get an unused softmax of their penalised logits."""
    logits = penalised
    if batch.temperature is not None:
        logits = logits / batch.temperature[:, None]
    logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
    logits = apply_min_p(logits, batch.min_p)
    return logits.softmax(dim=-1)


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 [B, V]: each row's processed distribution, speculative sampling's `p`: sampled
    rows' `sampled_probs`, greedy rows' one-hot argmax."""
    penalised = penalised_logits(logits, batch)
    if not batch.any_greedy:
        return sampled_probs(penalised, batch)
    one_hot = torch.zeros_like(penalised).scatter_(1, argmax_rows(penalised)[:, None], 1.0)
    if batch.all_greedy:
        return one_hot
    return torch.where(batch.greedy[:, None], one_hot, sampled_probs(penalised, batch))


def exponential_race(
    weights: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    seeded_rows: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """long [B]: one token per row, with probability weights[row] / sum(weights[row]).

    Unless every row is seeded, one uniform_ over [B, V] from `generator`; then each row in
    `seeded_rows`, in order, refills its V values from `generators[row]` alone."""
    uniform = torch.empty_like(weights, dtype=torch.float32)
    if len(seeded_rows) < weights.shape[0]:
        # One draw for the whole batch; seeded rows are overwritten below.
        uniform.uniform_(generator=generator)
    for row in seeded_rows:
        uniform[row].uniform_(generator=generators[row])
    noise = uniform.log_().neg_().clamp_min_(_MIN_EXPONENTIAL)
    return argmax_rows(weights / noise)


@dataclass(frozen=True)
class SamplerOutput:
    token_tensor: torch.Tensor  # one id per row, on the logits' device (not copied out)
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


class Sampler:
    """Stateless apart from the generator shared by unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(
                f"logits must be [batch={batch.size}, vocab], got {tuple(logits.shape)}"
            )
        penalised = penalised_logits(logits, batch)

        if batch.all_greedy:
            tokens = argmax_rows(penalised)
        else:
            probs = sampled_probs(penalised, batch)
            tokens = exponential_race(probs, batch.generators, batch.seeded_rows, self._generator)
            if batch.any_greedy:
                tokens = torch.where(batch.greedy, argmax_rows(penalised), tokens)

        logprobs = None
        if batch.max_logprobs >= 0:
            logprobs = compute_logprobs(logits, tokens, batch.logprobs, batch.max_logprobs)
        return SamplerOutput(tokens, logprobs)
