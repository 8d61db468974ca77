"""Top-k, top-p and min-p: masking unlikely tokens to -inf before sampling, in HF's warper order
(top-p on the top-k set; min-p never removes the top token, so its mask is simply unioned)."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k alone, with one `topk(max_top_k)`; tokens tied with the k-th logit survive too."""
    vocab = logits.shape[1]
    k = min(max_top_k, vocab)
    kth = logits.topk(k, dim=-1).values.gather(1, (top_k.clamp(1, k) - 1)[:, None])
    kth = kth.masked_fill((top_k <= 0)[:, None], NEG_INF)  # rows with top-k off keep everything
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int = 0
) -> torch.Tensor:
    """Masks per row: outside the k most likely tokens (k = 0 off), and outside the smallest
    most-likely set whose mass reaches p (computed on the distribution left by top-k)."""
    if top_p is None:
        return logits if top_k is None else apply_top_k(logits, top_k, max_top_k)
    vocab = logits.shape[1]
    ordered, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(1, (k - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    probs = ordered.softmax(dim=-1)
    # Mass strictly before each token: the top token always survives. p = 1 rows are left alone
    # (cumsum rounding could reach 1 early).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    ordered = ordered.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Masks tokens below min_p times the top token's probability, as logit_i - logit_max <
    log(min_p) (no softmax)."""
    if min_p is None:
        return logits
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits - top < torch.log(min_p)[:, None], NEG_INF)
