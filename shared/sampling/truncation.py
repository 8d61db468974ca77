"""Top-k, top-p and min-p: masking unlikely tokens to -inf before sampling.

Order is top-k, then top-p on the renormalised top-k set, then min-p (HF's warper order, and
vLLM's before its V1 engine). min-p compares each token with the most likely one, which neither
top-k nor top-p ever removes, so it is simply the union of its own mask with theirs.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k alone: one `topk(max_top_k)` instead of sorting the whole vocabulary.

    Tokens tied with the k-th logit survive too (as in vLLM), so a row may keep more than k
    tokens only when logits are exactly equal.
    """
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
        # Same tie rule as apply_top_k: keep everything equal to the k-th logit.
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(1, (k - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    probs = ordered.softmax(dim=-1)
    # Mass strictly before each token: it survives while that is still below p, so the most
    # likely token always survives. Rows with p = 1 are left alone, since rounding in the
    # cumulative sum could otherwise reach 1 early and drop tail tokens.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    ordered = ordered.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Masks tokens with probability below min_p times the top token's probability.

    p_i < min_p * p_max is the same as logit_i - logit_max < log(min_p), which needs no
    softmax; log(0) = -inf leaves rows with min_p = 0 untouched.
    """
    if min_p is None:
        return logits
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits - top < torch.log(min_p)[:, None], NEG_INF)
