"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nori.sampling.logprobs import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Everything generated so far (the whole output, not a delta).
    token_ids: list[int]
    text: str
    # What this step added, for streaming.
    new_token_ids: list[int]
    new_text: str
    finished: bool
    # "stop", "length" or "abort" once finished, else None.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if one did.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # A prefill-only request whose K/V now waits for export.
    prefilled: bool = False

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output for two consecutive steps of the same request: `later`, whose cumulative
        fields already cover both, with both steps' deltas. Streams send outputs that are ready
        together as one message instead of one per token."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge outputs of {self.request_id} and {later.request_id}")
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
        )
