"""What the engine reports: each request's progress after a step (StepOutput), its load
(EngineLoad), and the model it serves (ServedModel)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nori.engine.step_cost import StepCostFit
from nori.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from nori.models.config import ModelConfig
    from nori.sampling.tokenizer import Tokenizer


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
    # A KVToRemote request whose K/V now waits to be sent (PREFILLED).
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
class SpecDecodeCounts:
    """Speculative decoding since the engine started (cumulative counters, as vLLM's
    spec_decode metrics). Each verification of a request's drafts keeps its accepted drafts and
    one more token sampled from the model (the bonus token)."""

    # Verifications: requests x steps that carried drafts (each yields one bonus token).
    num_drafts: int = 0
    # Draft tokens proposed and verified.
    num_draft_tokens: int = 0
    # Of those, the ones the model accepted.
    num_accepted_tokens: int = 0

    @property
    def num_bonus_tokens(self) -> int:
        return self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification yields on average: 1 + accepted drafts per verification."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass(frozen=True)
class ExpertRoutingCounts:
    """Tokens a mixture-of-experts model routed to each expert of each routed layer, cumulative
    since the model loaded (`LLMEngine.expert_routing_counts`). Every forwarded position counts
    once in each of its top-k experts: prompt positions computed, every decode and verification
    row (a benchmark's padding rows too); not prompt positions found in the prefix cache or
    received with their K/V."""

    # Experts each token is routed to.
    top_k: int
    # (decoder layer index, tokens per expert), the routed layers in order (a dense layer,
    # Qwen2-MoE's `mlp_only_layers`, has none).
    layers: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def total(self) -> int:
        """Token slots routed over every expert and routed layer: tokens x top_k x layers."""
        return sum(sum(counts) for _, counts in self.layers)

    def since(self, earlier: ExpertRoutingCounts) -> ExpertRoutingCounts:
        """The tokens routed between `earlier` (a snapshot of the same model) and this one."""
        if [layer for layer, _ in earlier.layers] != [layer for layer, _ in self.layers]:
            raise ValueError("snapshots of different models")
        return replace(
            self,
            layers=tuple(
                (layer, tuple(now - before for now, before in zip(counts, old, strict=True)))
                for (layer, counts), (_, old) in zip(self.layers, earlier.layers, strict=True)
            ),
        )


def expert_imbalance(counts: tuple[int, ...]) -> float | None:
    """The busiest expert's tokens over the mean per expert: 1.0 is perfectly even, E (the
    number of experts) is every token on one expert; None when no token was routed. With
    expert parallelism the busiest expert's rank sets the step's pace, so max/mean is the
    slowdown over an even spread (the figure vLLM's EPLB balances)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


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
    # Requests preempted (their blocks taken back, to be recomputed) since the start.
    num_preemptions: int = 0
    # The requests in the running batch (computing their prompt or decoding).
    running_request_ids: frozenset[str] = frozenset()
    # Prompt positions this engine computed since the start (chunks, recomputes; not those
    # found in the prefix cache or received from another worker): a decode worker's own prompt
    # work, zero for requests handed to it with their K/V.
    num_prompt_tokens_computed: int = 0
    # Speculative decoding's counters (all zero without it).
    spec_decode: SpecDecodeCounts = SpecDecodeCounts()
    # What this engine's steps cost (step_cost.py), as last fitted; None before any step.
    step_cost_fit: StepCostFit | None = None
    # time.monotonic() when it was taken (by the engine thread): its last sign of life.
    taken_at: float = 0.0

    @property
    def busy(self) -> bool:
        return self.num_running + self.num_waiting > 0

    @property
    def num_requests_holding_blocks(self) -> int:
        return self.num_running + self.num_held

    def registry_fields(self) -> dict[str, int | float]:
        """The load figures a worker publishes in the registry for routing (a step cost not
        yet fitted is 0.0)."""
        fit = self.step_cost_fit
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_free_blocks": self.num_free_blocks,
            "num_total_blocks": self.num_total_blocks,
            "step_fixed_s": fit.fixed_s if fit is not None else 0.0,
            "step_per_row_s": (fit.per_row_s or 0.0) if fit is not None else 0.0,
            "step_per_token_s": (fit.per_token_s or 0.0) if fit is not None else 0.0,
        }


@dataclass(frozen=True)
class ServedModel:
    """What the engine serves: the model's config, its tokenizer, and the longest prompt +
    output it takes (the config's max_model_len, capped by the model and the KV pool)."""

    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
