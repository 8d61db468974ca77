"""Packing per-request sampling state into tensors, once per step, for the batched sampler.

Every optional stage gets `None` when no row in the batch uses it, so the sampler skips whole
stages (sorting the vocabulary, building count tensors) rather than running them as no-ops."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from nori.sampling.params import SamplingParams

PAD_TOKEN = -1  # padding in the ragged token-id tensors; the sampler maps it to a spare column


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator for a seeded request; it must live on the logits' device."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class RowState:
    """One request's view for a decode step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # set for seeded requests (see make_generator)


def _padded(rows: Iterable[Sequence[int]], device: torch.device) -> torch.Tensor:
    lists = [list(ids) for ids in rows]
    width = max((len(ids) for ids in lists), default=0)
    data = [ids + [PAD_TOKEN] * (width - len(ids)) for ids in lists]
    return torch.tensor(data, dtype=torch.long, device=device).reshape(len(lists), width)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors of shape [B] (or [B, L] for token ids)."""

    size: int
    # Greedy rows carry temperature 1 so the shared division stays finite; their token comes
    # from the argmax of the penalised logits instead.
    temperature: torch.Tensor | None  # None when every sampled row has temperature 1
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # long [B], 0 = off
    max_top_k: int  # largest enabled top_k (0 when none), sizes the topk call
    top_p: torch.Tensor | None  # float [B], 1 = off
    min_p: torch.Tensor | None  # float [B], 0 = off
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    prompt_ids: torch.Tensor | None  # long [B, Lp], PAD_TOKEN padded; only for repetition
    output_ids: torch.Tensor | None  # long [B, Lo]; only when a penalty needs it
    banned_rows: torch.Tensor | None  # (row, token) pairs masked to -inf for min_tokens
    banned_tokens: torch.Tensor | None
    generators: tuple[torch.Generator | None, ...]
    seeded_rows: tuple[int, ...]
    logprobs: tuple[int | None, ...]
    max_logprobs: int  # -1 when no row asked for logprobs

    @classmethod
    def build(
        cls,
        rows: Sequence[RowState],
        device: torch.device | str,
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingBatch:
        """Packs `rows`; `eos_token_ids` are masked (with each row's stop_token_ids) until the
        row has `min_tokens` outputs, unless the row sets `ignore_eos` (then EOS is no stop)."""
        dev = torch.device(device)
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]

        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = [
            p.top_k if p.top_k > 0 and not g else 0 for p, g in zip(params, greedy, strict=True)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        any_rep = any(r != 1.0 for r in rep)
        any_count = any(f != 0.0 for f in freq) or any(x != 0.0 for x in pres)

        eos = tuple(eos_token_ids)
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for index, (row, p) in enumerate(zip(rows, params, strict=True)):
            if len(row.output_token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos)
                ban_rows.extend([index] * len(stops))
                ban_tokens.extend(sorted(stops))

        seeded = tuple(
            i
            for i, (row, g) in enumerate(zip(rows, greedy, strict=True))
            if row.generator is not None and not g
        )
        logprobs = tuple(p.logprobs for p in params)
        requested = [n for n in logprobs if n is not None]

        return cls(
            size=len(rows),
            temperature=_column(temps, dev) if any(t != 1.0 for t in temps) else None,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            top_k=(torch.tensor(top_k, dtype=torch.long, device=dev) if any(top_k) else None),
            max_top_k=max(top_k, default=0),
            top_p=_column(top_p, dev) if any(p < 1.0 for p in top_p) else None,
            min_p=_column(min_p, dev) if any(p > 0.0 for p in min_p) else None,
            repetition_penalty=_column(rep, dev) if any_rep else None,
            frequency_penalty=_column(freq, dev) if any_count else None,
            presence_penalty=_column(pres, dev) if any_count else None,
            prompt_ids=_padded((r.prompt_token_ids for r in rows), dev) if any_rep else None,
            output_ids=(
                _padded((r.output_token_ids for r in rows), dev) if any_rep or any_count else None
            ),
            banned_rows=torch.tensor(ban_rows, dtype=torch.long, device=dev) if ban_rows else None,
            banned_tokens=(
                torch.tensor(ban_tokens, dtype=torch.long, device=dev) if ban_rows else None
            ),
            generators=tuple(row.generator for row in rows),
            seeded_rows=seeded,
            logprobs=logprobs,
            max_logprobs=max(requested) if requested else -1,
        )
