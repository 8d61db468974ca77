"""What the engine reports: per-request StepOutput, EngineLoad, and the ServedModel.

A request's text side works on its own fields (`Request.detokenizer`, `text`, `num_emitted_*`):
the sampled token through the incremental detokenizer, the stop checks, and the output that
reports what is new.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nori.engine.request import Request, RequestStatus
from nori.engine.step_cost import StepCostFit
from nori.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from nori.models.config import ModelConfig
    from nori.sampling.tokenizer import Tokenizer


@dataclass(slots=True)
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
    """The busiest expert's tokens over the mean per expert; None when no token was routed."""
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


def check_stop(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> RequestStatus | None:
    """Feeds the sampled token (already appended to the request) to the detokenizer; the finish
    status when it ends the request, else None."""
    detokenizer = request.detokenizer
    assert detokenizer is not None
    params = request.sampling_params
    new_text, stop_string = detokenizer.add_token(token_id)
    if new_text:
        request.text += new_text
    num_tokens = len(request.token_ids)
    num_output = num_tokens - len(request.prompt_token_ids)
    if num_output >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return _flush(request, RequestStatus.FINISHED_STOPPED)
        if token_id in eos_token_ids and not params.ignore_eos:
            return _flush(request, RequestStatus.FINISHED_STOPPED)
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return _flush(request, RequestStatus.FINISHED_LENGTH)
    return None


def add_known_tokens(request: Request, token_ids: list[int]) -> None:
    """Tokens sampled elsewhere (the prefill side of a hand-off): into the text, no stop checks."""
    assert request.detokenizer is not None
    for token_id in token_ids:
        request.text += request.detokenizer.add_token(token_id).new_text


def resume_text(request: Request, token_ids: list[int], num_emitted_chars: int) -> None:
    """A resumed request's known output (migration): through the detokenizer, so later text
    continues it; the tokens and `num_emitted_chars` of their text count as already streamed
    (text held back there, a possible stop string, is still to come)."""
    add_known_tokens(request, token_ids)
    request.num_emitted_tokens = len(request.output_token_ids)
    request.num_emitted_chars = min(num_emitted_chars, len(request.text))


def _flush(request: Request, status: RequestStatus) -> RequestStatus:
    assert request.detokenizer is not None
    request.text += request.detokenizer.flush().new_text
    return status


def make_output(request: Request) -> StepOutput:
    """What is new since the last output (the whole text so far, too); marks it reported."""
    status = request.status
    token_ids = request.token_ids
    num_prompt = len(request.prompt_token_ids)
    text = request.text
    finished = status.is_finished
    result = StepOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=token_ids[num_prompt:],
        text=text,
        new_token_ids=token_ids[num_prompt + request.num_emitted_tokens :],
        new_text=text[request.num_emitted_chars :],
        finished=finished,
        finish_reason=status.value if finished else None,
        stop_reason=request.stop_reason,
        logprobs=None if request.logprobs is None else list(request.logprobs),
        prompt_logprobs=request.prompt_logprobs,
        num_cached_tokens=request.num_cached_tokens,
        prefilled=status is RequestStatus.PREFILLED,
        scheduled_at=request.first_scheduled_at,
    )
    request.num_emitted_tokens = len(token_ids) - num_prompt
    request.num_emitted_chars = len(text)
    return result


def aborted_output(request: Request) -> StepOutput:
    """The last output of a request ended by `abort_all`: its tokens, no text."""
    return StepOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=request.output_token_ids,
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=RequestStatus.FINISHED_ABORTED.value,
    )
