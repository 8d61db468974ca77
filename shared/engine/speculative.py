"""Speculative decoding's engine side: who drafts, how many tokens, what verifications yielded.

Each step `plan` (before scheduling) says how many drafts each decoding request would verify
(`Scheduler.schedule(spec_lengths)` grants what fits); `propose` fills `Request.spec_token_ids`
for the granted ones; the model scores the last token and the drafts in one multi-query decode
(`verify_drafts` keeps the longest accepted prefix and one more token); `accept` and `record`
keep the books around `Scheduler.update`.

Proposers: "ngram", vLLM's prompt lookup (`ngram_drafts`, no second model), and "draft_model",
a smaller model with the same tokenizer (`DraftModel`, owned by the model runner)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nori.engine.config import SpeculativeConfig
from nori.engine.model_runner import ModelRunner
from nori.engine.outputs import SpecDecodeCounts
from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import SchedulerOutput
from nori.engine.step_sampling import SampledTokens


def ngram_drafts(token_ids: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Prompt lookup: for n from `max_n` down to `min_n`, the last n tokens are searched for
    earlier in `token_ids`; at the first n with a match, up to `num_tokens` tokens that followed
    its latest earlier occurrence. [] when no suffix recurs."""
    length = len(token_ids)
    if length < 2 or num_tokens < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start before the suffix does (an occurrence overlapping it counts).
        windows = sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, max_model_len: int) -> None:
        self.config = config
        self._runner = runner
        self._max_model_len = max_model_len
        self.counts = SpecDecodeCounts()

    def plan(self, running: Sequence[Request]) -> dict[str, int]:
        """Draft tokens each decoding request would verify in the next step (n-gram: found
        now, and kept in `spec_token_ids` until `propose`)."""
        config = self.config
        if (
            config.disable_by_batch_size is not None
            and len(running) >= config.disable_by_batch_size
        ):
            return {}
        lengths: dict[str, int] = {}
        for request in running:
            wanted = self._room(request)
            if wanted <= 0:
                continue
            if config.method == "ngram":
                low, high = config.lookup_range
                request.spec_token_ids = ngram_drafts(request.token_ids, low, high, wanted)
                wanted = len(request.spec_token_ids)
            if wanted:
                lengths[request.request_id] = wanted
        return lengths

    def _room(self, request: Request) -> int:
        """How many drafts are worth verifying: none for a request not decoding, and never past
        its last token (a verification yields up to drafts + 1 tokens)."""
        if (
            request.status is not RequestStatus.RUNNING
            or request.prefill_only
            or request.num_uncomputed_tokens != 1
        ):
            return 0
        left = min(
            request.max_new_tokens - request.num_output_tokens,
            self._max_model_len - request.num_tokens,
        )
        return min(self.config.num_speculative_tokens, left - 1)

    def propose(self, output: SchedulerOutput, running: Sequence[Request]) -> None:
        """Fills `spec_token_ids` of each request granted drafts (and clears the others')."""
        granted = {id(item.request): item.num_spec_tokens for item in output.scheduled}
        drafting = []
        for request in running:
            count = granted.get(id(request), 0)
            if count == 0:
                request.spec_token_ids = []
            elif self.config.method == "ngram":
                request.spec_token_ids = request.spec_token_ids[:count]
            else:
                drafting.append((request, count))
        if drafting:
            draft = self._runner.draft
            assert draft is not None, "a draft_model speculator without a draft model"
            draft.propose(drafting, self._runner.generator)

    @staticmethod
    def accept(sampled: Sequence[SampledTokens]) -> dict[str, int]:
        """Puts each verification's accepted drafts in its request (they are computed tokens,
        which `Scheduler.update` counts and the prefix cache hashes) and returns the rejected
        drafts by request id, for `Scheduler.update`. `record` takes them out again."""
        num_rejected = {}
        for result in sampled:
            if result.num_drafts:
                result.request.token_ids.extend(result.token_ids[:-1])
                num_rejected[result.request.request_id] = result.num_rejected
        return num_rejected

    def record(self, sampled: Sequence[SampledTokens]) -> None:
        """Counts the step's verifications, clears their drafts and takes the accepted ones out
        of the requests again (the engine appends each sampled token, checking for a stop)."""
        drafts = tokens = accepted = 0
        for result in sampled:
            if result.num_drafts:
                drafts += 1
                tokens += result.num_drafts
                num_accepted = len(result.token_ids) - 1
                accepted += num_accepted
                if num_accepted:
                    del result.request.token_ids[-num_accepted:]
                result.request.spec_token_ids = []
                result.request.spec_draft_probs = None
        if drafts:
            counts = self.counts
            self.counts = replace(
                counts,
                num_drafts=counts.num_drafts + drafts,
                num_draft_tokens=counts.num_draft_tokens + tokens,
                num_accepted_tokens=counts.num_accepted_tokens + accepted,
            )
