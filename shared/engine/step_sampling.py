"""A step's logits into tokens: plain rows (`nori.sampling.Sampler`, or one argmax when every
row is plain greedy), speculative verifications (`verify_drafts`), and prompt logprobs.

The logits' rows are the sampling items' in the scheduler's order: one per plain request, 1 +
drafts per verification. Seeded requests draw from their own generators, others from `generator`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nori.engine.request import Request
from nori.engine.scheduler import ScheduledRequest
from nori.kernels.argmax import argmax_rows
from nori.sampling.batch import RowState, SamplingBatch
from nori.sampling.logprob_math import compute_logprobs
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.sampler import Sampler
from nori.sampling.speculative import DraftProposal, verify_drafts

# Prompt-logprob rows go through the LM head this many at a time: a long prompt's [rows, vocab]
# logits would otherwise take as much memory as the KV of thousands of tokens.
PROMPT_LOGPROB_ROWS = 512


@dataclass(frozen=True)
class PromptLogprobRows:
    """Consecutive rows of the flat token axis whose logits score a request's next prompt tokens
    (the row of token i scores token i + 1), for SamplingParams.prompt_logprobs."""

    request: Request
    first_row: int
    # The prompt tokens they score, in order; one per row.
    target_token_ids: list[int]


def rows_to_score(
    request: Request, start: int, end: int, first_row: int
) -> PromptLogprobRows | None:
    """The rows of tokens [start, end) that score prompt tokens still without a logprob: token i
    scores token i + 1, the prompt is tokens [0, P), and the first `done` already have theirs (a
    recompute after a preemption adds nothing twice)."""
    assert request.prompt_logprobs is not None
    done = len(request.prompt_logprobs)
    low = max(start, done - 1)
    high = min(end, len(request.prompt_token_ids) - 1)
    if low >= high:
        return None
    return PromptLogprobRows(
        request, first_row + low - start, request.token_ids[low + 1 : high + 1]
    )


class SampledTokens(NamedTuple):
    """What a step sampled for one request: one token, or for a verification (speculative
    decoding) its accepted drafts and then one token from the model."""

    request: Request
    token_ids: list[int]
    # One per token, or None when the request asked for no logprobs.
    logprobs: list[TokenLogprobs] | None
    # Draft tokens verified in the step (0: a plain decode or prompt).
    num_drafts: int = 0

    @property
    def num_rejected(self) -> int:
        return self.num_drafts - (len(self.token_ids) - 1)


class SampledStep:
    """A step's sampled tokens in the order of its sampling items. Plain rows leave their ids on
    the device (`tokens`, one per request; a later step may read them there) while a copy to the
    host runs; `resolve` waits for it once. A step with verifications is resolved when made."""

    def __init__(
        self,
        requests: list[Request],
        tokens: torch.Tensor | None,
        logprobs: list[TokenLogprobs | None] | None = None,
        resolved: list[SampledTokens] | None = None,
    ) -> None:
        self.requests, self.tokens, self._logprobs = requests, tokens, logprobs
        self._resolved = resolved
        # A non-blocking copy to the host (pinned), done when the event is.
        self._host = None if tokens is None else tokens.to("cpu", non_blocking=True)
        self._ready = torch.cuda.Event() if tokens is not None and tokens.is_cuda else None
        if self._ready is not None:
            self._ready.record()

    def resolve(self) -> list[SampledTokens]:
        if self._resolved is None:
            assert self._host is not None
            if self._ready is not None:
                self._ready.synchronize()
            token_ids: list[int] = self._host.tolist()
            logprobs = self._logprobs or [None] * len(token_ids)
            self._resolved = [
                SampledTokens(request, [token_id], None if entry is None else [entry])
                for request, token_id, entry in zip(self.requests, token_ids, logprobs, strict=True)
            ]
        return self._resolved


class StepSampler:
    def __init__(
        self, device: torch.device, eos_token_ids: frozenset[int], generator: torch.Generator
    ) -> None:
        """`eos_token_ids` are masked until a request reaches min_tokens; `generator` draws for
        unseeded requests (plain sampling and speculative verification)."""
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.sampler = Sampler(generator)

    def prompt_logprob_chunks(self, rows: list[PromptLogprobRows]) -> list[torch.Tensor]:
        """The hidden rows scoring prompt tokens, PROMPT_LOGPROB_ROWS at a time."""
        indices = [r.first_row + k for r in rows for k in range(len(r.target_token_ids))]
        return [
            torch.tensor(indices[low : low + PROMPT_LOGPROB_ROWS], device=self.device)
            for low in range(0, len(indices), PROMPT_LOGPROB_ROWS)
        ]

    def prompt_logprobs(
        self, chunk_logits: list[torch.Tensor], rows: list[PromptLogprobRows]
    ) -> list[tuple[Request, list[TokenLogprobs]]]:
        """log_softmax of the raw logits at each scored prompt position (as vLLM reports prompt
        logprobs), with the requested number of most likely alternatives; `chunk_logits` are
        the logits of `prompt_logprob_chunks(rows)`."""
        if not rows:
            return []
        targets = [token for r in rows for token in r.target_token_ids]
        counts = [r.request.sampling_params.prompt_logprobs for r in rows]
        requested = tuple(
            count for r, count in zip(rows, counts, strict=True) for _ in r.target_token_ids
        )
        max_top = max(count or 0 for count in counts)
        entries: list[TokenLogprobs | None] = []
        for chunk, logits in enumerate(chunk_logits):
            low, high = chunk * PROMPT_LOGPROB_ROWS, (chunk + 1) * PROMPT_LOGPROB_ROWS
            token_ids = torch.tensor(targets[low:high], device=self.device)
            entries.extend(compute_logprobs(logits, token_ids, requested[low:high], max_top))
        result = []
        offset = 0
        for r in rows:
            count = len(r.target_token_ids)
            scored = [entry for entry in entries[offset : offset + count] if entry is not None]
            result.append((r.request, scored))
            offset += count
        return result

    def sample(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> SampledStep:
        """One token per plain request; a verification's kept tokens (`verify_drafts`). The rows
        of `logits` are the items' in order: one each, 1 + drafts for a verification."""
        if all(item.num_spec_tokens == 0 for item in items):
            return self._sample_rows([item.request for item in items], logits, generators)
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for item in items:
            count = 1 + item.num_spec_tokens
            (spec_rows if item.num_spec_tokens else plain_rows).extend(range(row, row + count))
            row += count
        index = {id(item.request): i for i, item in enumerate(items)}
        results: list[SampledTokens | None] = [None] * len(items)
        plain = [item.request for item in items if not item.num_spec_tokens]
        if plain:
            rows_tensor = torch.tensor(plain_rows, device=logits.device)
            for result in self._sample_rows(plain, logits[rows_tensor], generators).resolve():
                results[index[id(result.request)]] = result
        verified = [item for item in items if item.num_spec_tokens]
        rows_tensor = torch.tensor(spec_rows, device=logits.device)
        for result in self._verify(verified, logits[rows_tensor], generators):
            results[index[id(result.request)]] = result
        kept = [result for result in results if result is not None]
        assert len(kept) == len(items)
        return SampledStep([result.request for result in kept], None, resolved=kept)

    def _sample_rows(
        self,
        requests: list[Request],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> SampledStep:
        if all(
            r.sampling_params.is_plain_greedy
            and r.num_output_tokens >= r.sampling_params.min_tokens
            for r in requests
        ):
            # The common benchmark and evaluation case: one argmax, no per-row tensors.
            return SampledStep(requests, argmax_rows(logits))
        rows = [
            RowState(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=generators.get(r.request_id),
            )
            for r in requests
        ]
        batch = SamplingBatch.build(rows, self.device, self.eos_token_ids)
        result = self.sampler(logits, batch)
        return SampledStep(requests, result.token_tensor, result.logprobs)

    def _verify(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        generators: Mapping[str, torch.Generator],
    ) -> list[SampledTokens]:
        """Speculative verification: row i of a request scores the token after its draft i - 1
        (row 0: after its last token), sampled as a plain run would at that position (penalties
        and min_tokens see the drafts before it as output)."""
        rows: list[RowState] = []
        proposals: list[DraftProposal] = []
        for item in items:
            r = item.request
            drafts = list(r.spec_token_ids)
            output = r.output_token_ids
            rows.extend(
                RowState(
                    params=r.sampling_params,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=output + drafts[:i],
                    generator=generators.get(r.request_id),
                )
                for i in range(len(drafts) + 1)
            )
            proposals.append(DraftProposal(drafts, r.spec_draft_probs))
        batch = SamplingBatch.build(rows, self.device, self.eos_token_ids)
        kept = verify_drafts(logits, batch, proposals, self.generator)
        logprobs: list[TokenLogprobs | None] = []
        if batch.max_logprobs >= 0:
            # The log-probs of each kept token at its own row (row j holds token j's).
            first_rows = itertools.accumulate((len(p.token_ids) + 1 for p in proposals), initial=0)
            kept_rows = [
                first + j
                for first, tokens in zip(first_rows, kept, strict=False)
                for j in range(len(tokens))
            ]
            requested = tuple(batch.logprobs[row] for row in kept_rows)
            logprobs = compute_logprobs(
                logits[torch.tensor(kept_rows, device=logits.device)],
                torch.tensor([t for tokens in kept for t in tokens], device=logits.device),
                requested,
                batch.max_logprobs,
            )
        results = []
        offset = 0
        for item, tokens in zip(items, kept, strict=True):
            entries = None
            if item.request.sampling_params.logprobs is not None:
                entries = [e for e in logprobs[offset : offset + len(tokens)] if e is not None]
            offset += len(tokens)
            results.append(SampledTokens(item.request, tokens, entries, item.num_spec_tokens))
        return results
