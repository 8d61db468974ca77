"""What `LLM.generate` and `LLM.chat` return, in vLLM's shapes: one `RequestOutput` per prompt,
whose `outputs` hold its `n` completions, so vLLM offline code runs unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nori.engine import outputs as engine
from nori.sampling.logprobs import TokenLogprobs


@dataclass
class Logprob:
    """vLLM's `Logprob`: log-probability, rank (1 = most likely) and the token decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the sampled token's entry first, then the requested top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token; the first has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # The sum of the sampled tokens' log-probabilities; None unless logprobs were asked for.
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (None for EOS).
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    # The prompt's text; None for a prompt given as token ids.
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (its first completion's).
    num_cached_tokens: int | None = None


def completion_output(
    index: int, output: engine.StepOutput, token_text: Callable[[int], str]
) -> CompletionOutput:
    logprobs = (
        None
        if output.logprobs is None
        else [sample_logprobs(entry, token_text) for entry in output.logprobs]
    )
    return CompletionOutput(
        index=index,
        text=output.text,
        token_ids=list(output.token_ids),
        cumulative_logprob=(
            None if output.logprobs is None else sum(e.logprob for e in output.logprobs)
        ),
        logprobs=logprobs,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def request_output(
    request_id: str,
    prompt: str | None,
    choices: Sequence[engine.StepOutput],
    token_text: Callable[[int], str],
) -> RequestOutput:
    """A prompt's result from its choices' final outputs, in order."""
    first = choices[0]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=list(first.prompt_token_ids),
        prompt_logprobs=(
            None
            if first.prompt_logprobs is None
            else [
                None if entry is None else sample_logprobs(entry, token_text)
                for entry in first.prompt_logprobs
            ]
        ),
        outputs=[completion_output(i, c, token_text) for i, c in enumerate(choices)],
        finished=all(c.finished for c in choices),
        num_cached_tokens=first.num_cached_tokens,
    )


def sample_logprobs(entry: TokenLogprobs, token_text: Callable[[int], str]) -> dict[int, Logprob]:
    """vLLM's layout of one generated token: the sampled token (once), then the ranked top
    alternatives."""
    result = {entry.token_id: Logprob(entry.logprob, entry.rank, token_text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if token_id not in result:
            result[token_id] = Logprob(logprob, rank, token_text(token_id))
    return result
