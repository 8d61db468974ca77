"""Speculative decoding's verification: which drafts a request keeps once the target scored them.

The target scores the last token plus k drafts as k + 1 rows (row i sees drafts[:i]); a request
keeps its accepted drafts and one more token. Greedy: drafts while each equals its row's argmax,
then that argmax (exactly a plain greedy run). Sampled: speculative sampling (Leviathan et al.,
Chen et al. 2023): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), else draw from
normalise(max(0, p_i - q_i)); all accepted, a bonus token from p_k. No draft probabilities
means a one-hot q; a residual with no mass falls back to p_i."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nori.kernels.argmax import argmax_rows
from nori.sampling.batch import SamplingBatch
from nori.sampling.sampler import exponential_race, penalised_logits, sampled_probs


@dataclass(frozen=True)
class DraftProposal:
    token_ids: list[int]  # k >= 1 draft tokens
    # [k, V]: the draft model's processed distribution q at each draft; None: one-hot q.
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a DraftProposal needs at least one draft token")
        if self.probs is not None and (
            self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)
        ):
            raise ValueError(
                f"probs must be [k={len(self.token_ids)}, vocab], got {tuple(self.probs.shape)}"
            )


def draw_tokens(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator | None = None,
) -> list[int]:
    """One token per row of probs [N, V] (unnormalised weights). A row with a generator draws
    from it alone; the others share one uniform_ over [N, V] from `generator`."""
    if probs.dim() != 2 or len(generators) != probs.shape[0]:
        raise ValueError(
            f"probs must be [{len(generators)} generators, vocab], got {tuple(probs.shape)}"
        )
    seeded = [row for row, g in enumerate(generators) if g is not None]
    tokens: list[int] = exponential_race(probs.float(), generators, seeded, generator).tolist()
    return tokens


def verify_drafts(
    logits: torch.Tensor,
    batch: SamplingBatch,
    proposals: Sequence[DraftProposal],
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """logits [R, V], each request's k + 1 rows consecutive in `proposals`' order; `batch` has
    one row per logits row. Returns per proposal the accepted drafts plus one more token. A
    request is greedy and seeded as its rows say (its first row's generator is used)."""
    starts = _request_starts(logits, batch, proposals)
    greedy = _greedy_requests(batch, starts, proposals)
    penalised = penalised_logits(logits, batch)
    kept: list[list[int]] = [[] for _ in proposals]

    greedy_requests = [j for j, is_greedy in enumerate(greedy) if is_greedy]
    if greedy_requests:
        targets: list[int] = argmax_rows(penalised).tolist()
        for j in greedy_requests:
            drafts = proposals[j].token_ids
            row_targets = targets[starts[j] : starts[j] + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == row_targets[accepted]:
                accepted += 1
            kept[j] = row_targets[: accepted + 1]

    sampled_requests = [j for j, is_greedy in enumerate(greedy) if not is_greedy]
    if sampled_requests:
        results = _speculative_sample(
            sampled_probs(penalised, batch),
            [starts[j] for j in sampled_requests],
            [proposals[j] for j in sampled_requests],
            [batch.generators[starts[j]] for j in sampled_requests],
            generator,
        )
        for j, tokens in zip(sampled_requests, results, strict=True):
            kept[j] = tokens
    return kept


def _request_starts(
    logits: torch.Tensor, batch: SamplingBatch, proposals: Sequence[DraftProposal]
) -> list[int]:
    starts = []
    rows = 0
    for proposal in proposals:
        starts.append(rows)
        rows += len(proposal.token_ids) + 1
    if logits.dim() != 2 or logits.shape[0] != rows or batch.size != rows:
        raise ValueError(
            f"logits and batch must have sum(k + 1) = {rows} rows, got logits "
            f"{tuple(logits.shape)} and a batch of {batch.size}"
        )
    vocab = logits.shape[1]
    for proposal in proposals:
        if not all(0 <= token < vocab for token in proposal.token_ids):
            raise ValueError(f"draft tokens {proposal.token_ids} outside the vocab of {vocab}")
        if proposal.probs is not None and proposal.probs.shape[1] != vocab:
            raise ValueError(
                f"draft probs have vocab {proposal.probs.shape[1]}, logits {logits.shape[1]}"
            )
    return starts


def _greedy_requests(
    batch: SamplingBatch, starts: list[int], proposals: Sequence[DraftProposal]
) -> list[bool]:
    if batch.all_greedy or not batch.any_greedy:
        return [batch.all_greedy] * len(starts)
    flags: list[bool] = batch.greedy.tolist()
    result = []
    for start, proposal in zip(starts, proposals, strict=True):
        rows = flags[start : start + len(proposal.token_ids) + 1]
        if len(set(rows)) != 1:
            raise ValueError(f"the rows from {start} of one request mix greedy and sampled")
        result.append(rows[0])
    return result


def _acceptance_threshold(p_drafts: torch.Tensor, q_drafts: torch.Tensor) -> torch.Tensor:
    """u < p / q accepts with probability min(1, p / q); q == 0 rejects. (A module function so
    tests can swap in wrong rules.)"""
    return torch.where(q_drafts > 0, p_drafts / q_drafts, torch.zeros_like(p_drafts))


def _residual(p_last: torch.Tensor, q_last: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised: the race normalises (q is zero after all accepted)."""
    return (p_last - q_last).clamp_min(0.0)


def _speculative_sample(
    probs: torch.Tensor,
    starts: list[int],
    proposals: list[DraftProposal],
    generators: list[torch.Generator | None],
    generator: torch.Generator | None,
) -> list[list[int]]:
    """The sampled requests' rule, batched: draft tests as a [J, max k] table, then one [J, V]
    residual-or-bonus distribution and one race. A seeded request draws k uniforms then V from
    its own generator, whatever was accepted; unseeded ones share `generator` (same, batched)."""
    device = probs.device
    lengths = [len(p.token_ids) for p in proposals]
    width = max(lengths)
    count = len(proposals)
    drafts = torch.tensor(
        [p.token_ids + [0] * (width - len(p.token_ids)) for p in proposals], device=device
    )
    rows = torch.tensor(
        [
            [start + min(i, k - 1) for i in range(width)]
            for start, k in zip(starts, lengths, strict=True)
        ],
        device=device,
    )
    k_col = torch.tensor(lengths, device=device)
    valid = torch.arange(width, device=device)[None, :] < k_col[:, None]
    p_drafts = probs[rows, drafts]  # [J, width]: p_i(d_i)

    dense = [p.probs is not None for p in proposals]
    dense_col = torch.tensor(dense, device=device)
    dense_q = None
    dense_rows = None
    q_drafts = torch.ones_like(p_drafts)
    if any(dense):
        dense_q = torch.cat(
            [
                p.probs.to(device=device, dtype=torch.float32)
                for p in proposals
                if p.probs is not None
            ]
        )
        offsets = []
        offset = 0
        for k, is_dense in zip(lengths, dense, strict=True):
            offsets.append(
                [offset + min(i, k - 1) for i in range(width)] if is_dense else [0] * width
            )
            offset += k if is_dense else 0
        dense_rows = torch.tensor(offsets, device=device)
        q_drafts = torch.where(dense_col[:, None], dense_q[dense_rows, drafts], q_drafts)

    seeded = [j for j, g in enumerate(generators) if g is not None]
    uniform = torch.zeros(count, width, device=device)
    if len(seeded) < count:
        uniform.uniform_(generator=generator)
    for j in seeded:
        uniform[j, : lengths[j]].uniform_(generator=generators[j])

    accept = valid & (uniform < _acceptance_threshold(p_drafts, q_drafts))
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts, [J]

    # The last token: from max(0, p_n - q_n) at the first rejected draft n, or from p_k.
    rejected = accepted < k_col
    at = torch.minimum(accepted, k_col - 1)[:, None]
    p_last = probs[torch.tensor(starts, device=device) + accepted]
    q_last = torch.zeros_like(p_last)
    if dense_q is not None and dense_rows is not None:
        q_last = dense_q[dense_rows.gather(1, at)[:, 0]] * dense_col[:, None]
    q_last.scatter_add_(1, drafts.gather(1, at), (~dense_col).float()[:, None])
    residual = _residual(p_last, q_last * rejected[:, None])
    weights = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_last)
    last = exponential_race(weights, generators, seeded, generator)

    accepted_list, last_list = torch.stack([accepted, last]).tolist()
    return [
        [*p.token_ids[:n], token]
        for p, n, token in zip(proposals, accepted_list, last_list, strict=True)
    ]
