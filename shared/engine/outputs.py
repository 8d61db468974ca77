"""What the engine reports: per-request StepOutput, EngineLoad, and the ServedModel."""

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
    token_ids: list[int]  # the whole output so far, not a delta
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Entry i for prompt token i, the first None; complete from the first output on.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # A KVToRemote request whose K/V now waits to be sent (PREFILLED).
    prefilled: bool = False
    # time.time() when it left the engine's queue (its first step).
    scheduled_at: float | None = None

    def followed_by(self, later: StepOutput) -> StepOutput:
        """One output for two consecutive steps of the same request: `later`'s cumulative fields
        with both steps' deltas."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge outputs of {self.request_id} and {later.request_id}")
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
        )


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding since the engine started (cumulative, as vLLM's spec_decode metrics).
    A verification keeps its accepted drafts plus one bonus token from the model."""

    num_drafts: int = 0  # verifications: requests x steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_bonus_tokens(self) -> int:
        return self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification yields on average: 1 + accepted drafts per verification."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass(frozen=True)
class ExpertRoutingCounts:
    """Tokens routed to each expert of each routed layer since the model loaded: every forwarded
    position counts once in each of its top-k experts (not prefix-cache hits or received K/V)."""

    top_k: int
    # (decoder layer index, tokens per expert), the routed layers in order.
    layers: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def total(self) -> int:
        """Token slots routed over every expert and routed layer."""
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
    """The busiest expert's tokens over the mean per expert (1.0: even; E: all on one); None when
    no token was routed."""
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
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    running_request_ids: frozenset[str] = frozenset()
    # Prompt positions this engine computed (not prefix-cache hits or received with K/V).
    num_prompt_tokens_computed: int = 0
    spec_decode: SpecDecodeCounts = SpecDecodeCounts()
    step_cost_fit: StepCostFit | None = None  # None before any step
    # time.monotonic() when taken by the engine thread: its last sign of life.
    taken_at: float = 0.0

    @property
    def busy(self) -> bool:
        return self.num_running + self.num_waiting > 0

    @property
    def num_requests_holding_blocks(self) -> int:
        return self.num_running + self.num_held

    def registry_fields(self) -> dict[str, int | float]:
        """The load figures a worker publishes in the registry (an unfitted step cost is 0.0)."""
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
    """The model's config, its tokenizer, and the longest prompt + output it takes."""

    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
