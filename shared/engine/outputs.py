"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nori.sampling.logprobs import TokenLogprobs


@dataclass(frozen=True)
class StepOutput:
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
    # SamplingParams.prompt_logprobs: entry i for prompt token i, the first None (as vLLM's);
    # complete from the first output on, on the engine that computed the prompt.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # A prefill-only request whose K/V now waits for export.
    prefilled: bool = False
    # time.time() when it left the engine's queue (its first step): the queue wait's end.
    scheduled_at: float | None = None

    def followed_by(self, later: StepOutput) -> StepOutput:
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


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is: taken after every step, read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_held: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Blocks whose content is in the prefix cache (held by requests or evictable).
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    # time.monotonic() when it was taken (by the engine thread): its last sign of life.
    taken_at: float = 0.0

    @property
    def busy(self) -> bool:
        return self.num_running + self.num_waiting > 0

    @property
    def num_requests_holding_blocks(self) -> int:
        return self.num_running + self.num_held

    def registry_fields(self) -> dict[str, int]:
        """The load figures a worker publishes in the registry for routing."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_free_blocks": self.num_free_blocks,
            "num_total_blocks": self.num_total_blocks,
        }
