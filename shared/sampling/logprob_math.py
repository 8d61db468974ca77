"""Computes the log-probabilities reported to the user (`logprobs.py` says which), in one batch."""

from __future__ import annotations

import torch

from nori.sampling.logprobs import TokenLogprobs


def compute_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,
    requested: tuple[int | None, ...],
    max_logprobs: int,
) -> list[TokenLogprobs | None]:
    """One batched log_softmax/topk for all rows; Python work only for rows that asked."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(max_logprobs, dim=-1) if max_logprobs > 0 else None

    chosen_list = chosen[:, 0].tolist()
    rank_list = ranks.tolist()
    token_list = token_ids.tolist()
    top_values = top.values.tolist() if top is not None else None
    top_ids = top.indices.tolist() if top is not None else None

    result: list[TokenLogprobs | None] = []
    for row, count in enumerate(requested):
        if count is None:
            result.append(None)
            continue
        pairs: tuple[tuple[int, float], ...] = ()
        if count > 0 and top_ids is not None and top_values is not None:
            pairs = tuple(zip(top_ids[row][:count], top_values[row][:count], strict=True))
        result.append(TokenLogprobs(token_list[row], chosen_list[row], rank_list[row], pairs))
    return result
