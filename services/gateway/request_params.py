"""From a parsed request to the engine's `SamplingParams`, and the request checks that need it.

`SamplingParams` already validates ranges with messages that name the field; a ValueError from it
becomes a 400 carrying that message. Features the protocol has but Nori does not implement are
refused here by name instead of being silently ignored, since ignoring `suffix` or `best_of`
would hand the client an answer to a different question.
"""

from __future__ import annotations

from typing import Any

from nori.gateway.errors import bad_request
from nori.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from nori.sampling.params import SamplingParams, choice_params

_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__)
# repetition_penalty divides (or multiplies) logits: 1e-300 makes them infinite and the output
# empty. vLLM takes any value > 0; this keeps to what changes sampling without breaking it.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Choices per prompt: each is a request of its own in the cluster, so bound the fan-out.
MAX_N = 64


def sample_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of a prompt's n independent choices (as `LLM.generate` samples them):
    with a seed, choice i samples with seed + i; without one, each draws its own."""
    return choice_params(params, n)


def check_common(request: SamplingFields) -> None:
    if not 1 <= request.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {request.n}", "n")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if request.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    penalty = request.repetition_penalty
    if penalty is not None and not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
        raise bad_request(
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
            f"{MAX_REPETITION_PENALTY:g}] (1 disables it), got {penalty!r}",
            "repetition_penalty",
        )


def check_token_ids(request: SamplingFields, vocab_size: int) -> None:
    """Token ids the request names must be the model's."""
    for token_id in request.stop_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )


def check_completion(request: CompletionRequest) -> None:
    check_common(request)
    if request.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if request.best_of is not None and request.best_of != 1:
        raise bad_request(f"best_of must be 1 (got {request.best_of})", "best_of")


def check_chat(request: ChatCompletionRequest) -> None:
    check_common(request)
    if not request.messages:
        raise bad_request("messages must contain at least one message", "messages")
    if request.tools:
        raise bad_request("tool calling is not supported by this server", "tools")
    if request.tool_choice not in (None, "none", "auto"):
        # "required" or a named tool asks for a tool call this server never makes; "auto"
        # without tools is no tool call, as is "none".
        raise bad_request(
            "tool calling is not supported by this server: tool_choice may only be 'none' or "
            f"'auto' (without tools), got {request.tool_choice!r}",
            "tool_choice",
        )
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise bad_request(
            "response_format other than {'type': 'text'} is not supported by this server",
            "response_format",
        )
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")


def resolve_max_tokens(
    requested: int | None, param: str, num_prompt_tokens: int, max_model_len: int
) -> int:
    """The output budget; None means whatever room the context leaves (OpenAI chat default)."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {num_prompt_tokens} tokens; it must leave room for at least one generated "
            f"token (at most {max_model_len - 1} prompt tokens). Please shorten the prompt.",
            "messages" if param == "max_completion_tokens" else "prompt",
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if requested < 1:
        raise bad_request(f"{param} must be an int >= 1, got {requested}", param)
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} in the completion). Please reduce the length of the prompt "
            f"or {param}.",
            param,
        )
    return requested


def completion_max_tokens(
    request: CompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> int:
    """The engine's output budget. An echo with max_tokens 0 (how vLLM scores a prompt) answers
    with the prompt alone: as in vLLM, the engine computes it with one token, left out of the
    response."""
    requested = request.max_tokens
    if requested == 0:
        if not request.echo:
            raise bad_request(
                "max_tokens must be an int >= 1 (0 only with echo, for the prompt alone), got 0",
                "max_tokens",
            )
        requested = 1
    return resolve_max_tokens(requested, "max_tokens", num_prompt_tokens, max_model_len)


def completion_sampling_params(request: CompletionRequest, max_tokens: int) -> SamplingParams:
    # An echo with logprobs reports the prompt's tokens too (vLLM's prompt_logprobs).
    prompt_logprobs = request.logprobs if request.echo else None
    return _build(request, max_tokens, request.logprobs, prompt_logprobs)


def chat_sampling_params(request: ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _build(request, max_tokens, logprobs)


def chat_max_tokens_field(request: ChatCompletionRequest) -> tuple[int | None, str]:
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def _build(
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    # An omitted (or null) field keeps SamplingParams' default, which is OpenAI's default.
    present = {name: value for name, value in fields.items() if value is not None}
    try:
        return SamplingParams(**present)
    except ValueError as error:
        message = str(error)
        first_word = message.split(" ", 1)[0]
        param = first_word if first_word in _PARAM_NAMES else None
        raise bad_request(message, param) from error
