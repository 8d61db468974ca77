"""The batched sampler: logits [B, V] -> one token per row.

Stage order follows vLLM: min_tokens bans, repetition/frequency/presence penalties, then greedy
rows take the argmax; sampled rows get temperature, top-k, top-p, min-p and a random draw.
Stages that no row uses are skipped (see SamplingBatch), so an all-greedy batch is one argmax.

Random draws use the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with
probability p_i (E = -log U with U uniform, which is several times faster than exponential_ on
CPU and the same distribution). Each seeded row fills its E row from its own generator, so its tokens depend
only on its seed and its own logits, not on batch mates or its position in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.kernels.argmax import argmax_rows
from nori.sampling.batch import SamplingBatch
from nori.sampling.logprob_math import compute_logprobs
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.penalties import apply_penalties, ban_stop_tokens
from nori.sampling.truncation import apply_min_p, apply_top_k_top_p

# Guards p / E against E == 0 (U rounds to 1), which would turn a masked token's 0 / 0 into
# NaN, and argmax would then pick it. U == 0 gives E = inf and p / E = 0: harmless.
_MIN_EXPONENTIAL = 1e-10


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    token_tensor: torch.Tensor  # the same ids on the logits' device, to feed the next step
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
        raw = logits
        logits = logits.float()
        logits = ban_stop_tokens(logits, batch)
        logits = apply_penalties(logits, batch)

        if batch.all_greedy:
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, batch)
            if batch.any_greedy:
                tokens = torch.where(batch.greedy, argmax_rows(logits), tokens)

        logprobs = None
        if batch.max_logprobs >= 0:
            logprobs = compute_logprobs(raw, tokens, batch.logprobs, batch.max_logprobs)
        return SamplerOutput(tokens.tolist(), tokens, logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.temperature is not None:
            logits = logits / batch.temperature[:, None]
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
        logits = apply_min_p(logits, batch.min_p)
        probs = logits.softmax(dim=-1)

        uniform = torch.empty_like(probs)
        if len(batch.seeded_rows) < batch.size:
            # One draw for the whole batch; seeded rows are overwritten below. Cheaper than
            # gathering the unseeded rows when (as usual) most rows are unseeded.
            uniform.uniform_(generator=self._generator)
        for row in batch.seeded_rows:
            uniform[row].uniform_(generator=batch.generators[row])
        noise = uniform.log_().neg_().clamp_min_(_MIN_EXPONENTIAL)
        return argmax_rows(probs / noise)
