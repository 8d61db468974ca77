"""Logit penalties: min_tokens bans, repetition, frequency and presence (vLLM semantics)."""

from __future__ import annotations

import torch

from nori.sampling.batch import PAD_TOKEN, SamplingBatch


def _scatter_columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Padding goes to a spare last column, sliced off afterwards, so no per-row lengths are needed.
    return ids.masked_fill(ids == PAD_TOKEN, vocab_size)


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] padded token ids -> [B, V] float occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, _scatter_columns(ids, vocab_size), ones)
    return counts[:, :vocab_size]


def token_presence(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] padded token ids -> [B, V] bool: token occurs in the row."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    seen.scatter_(1, _scatter_columns(ids, vocab_size), True)
    return seen[:, :vocab_size]


def ban_stop_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Rows below min_tokens cannot pick EOS or their stop_token_ids (vLLM's MinTokens)."""
    if batch.banned_rows is None or batch.banned_tokens is None:
        return logits
    in_vocab = batch.banned_tokens < logits.shape[1]  # ids past the vocabulary cannot be sampled
    logits = logits.clone()
    logits[batch.banned_rows[in_vocab], batch.banned_tokens[in_vocab]] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM: divide positive logits,
    multiply negative ones), then frequency and presence penalties over output tokens only."""
    vocab = logits.shape[1]
    counts = None
    if batch.output_ids is not None:
        counts = token_counts(batch.output_ids, vocab)
    if batch.repetition_penalty is not None and batch.prompt_ids is not None:
        seen = token_presence(batch.prompt_ids, vocab)
        if counts is not None:
            seen |= counts > 0
        penalty = torch.where(seen, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if (
        counts is not None
        and batch.frequency_penalty is not None
        and batch.presence_penalty is not None
    ):
        logits = (
            logits
            - batch.frequency_penalty[:, None] * counts
            - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
        )
    return logits
