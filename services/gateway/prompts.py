"""From an OpenAI body to what the backend takes: the prompt as token ids and the engine's
`SamplingParams`, with every check that needs them; bad input is a 400 (404 for an unknown model).

Chat messages go through the template (the request's, else the model's). A `SamplingParams`
ValueError is a 400 with its message; `suffix`, `best_of` and tools are refused by name."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from starlette.types import Scope

from nori.gateway.backend import Backend, GenerationRequest
from nori.gateway.errors import APIError, bad_request
from nori.gateway.middleware import GatewayMetrics
from nori.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TextContentPart,
    TokenizeRequest,
)
from nori.sampling.chat_template import TemplateLimits
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingContext:
    """What the OpenAI endpoints share for the server's lifetime."""

    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: GatewayMetrics
    # The per-prompt producer tasks, referenced until they end.
    tasks: set[asyncio.Task[None]]
    token_text: Callable[[int], str]
    # The most UTF-8 bytes one token's text has (see refuse_hopeless_text).
    max_token_bytes: int = 64
    stream_interval: int = 1
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)


# ---------------------------------------------------------------------- prompts

# The longest chat template a request may bring (real ones are a few kB): compiling costs time
# in proportion to the text, before any step limit applies.
MAX_REQUEST_TEMPLATE_CHARS = 32 * 1024


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            HTTPStatus.NOT_FOUND,
            f"The model `{model}` does not exist. This server serves `{ctx.model_name}`.",
            param="model",
            code="model_not_found",
        )


def check_token_ids(ctx: ServingContext, ids: Sequence[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(
            f"{param} has token ids out of the vocabulary range [0, {ctx.vocab_size}): {bad[:5]}",
            param,
        )
    return list(ids)


def refuse_hopeless_text(ctx: ServingContext, text: str, param: str) -> None:
    """Refuses, before tokenizing it, a text that cannot fit the context: it has at least
    bytes / max_token_bytes tokens (halved, against normalizers that shorten text)."""
    if len(text) < ctx.max_model_len:
        return  # under the bound whatever its bytes (at most 4 a character)
    at_least = len(text.encode("utf-8")) // (2 * ctx.max_token_bytes)
    if at_least >= ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens, and the prompt "
            f"has at least {at_least} tokens ({len(text)} characters). Please shorten the prompt.",
            param,
        )


def _prompt_items(prompt: object) -> list[Any]:
    """The completions `prompt` field as the list of its prompts (strings or token id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]  # a single tokenized prompt
    if isinstance(prompt, list):
        return prompt
    raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")


def completion_prompts(ctx: ServingContext, prompt: object) -> list[list[int]]:
    """The completions `prompt` field as token ids, one list per prompt of the batch."""
    items = _prompt_items(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    result = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            refuse_hopeless_text(ctx, item, "prompt")
            # Completions prompts get the tokenizer's special tokens (BOS), as in vLLM.
            result.append(check_token_ids(ctx, ctx.tokenizer.encode(item), "prompt"))
        else:
            result.append(check_token_ids(ctx, item, "prompt"))
    return result


def echoed_prompts(ctx: ServingContext, prompt: object) -> list[str]:
    """The text `echo` returns for each prompt of a checked `prompt`: as sent, or decoded."""
    return [
        item if isinstance(item, str) else ctx.tokenizer.decode(item)
        for item in _prompt_items(prompt)
    ]


def _message_for_template(message: ChatMessage) -> dict[str, Any]:
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if content is None:
        # Templates concatenate content as a string; an assistant turn may have none.
        rendered["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, TextContentPart):
                kind = part.get("type", "unknown")
                if kind == "text":
                    raise bad_request("a text content part needs a string `text`", "messages")
                raise bad_request(
                    f"message content of type {kind!r} is not supported; only text parts are",
                    "messages",
                )
            texts.append(part.text)
        # vLLM joins text parts with newlines.
        rendered["content"] = "\n".join(texts)
    return rendered


def chat_prompt(ctx: ServingContext, request: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """Chat messages through the template (the request's, else the model's), as token ids."""
    messages = request.messages or ()
    if (
        request.chat_template is not None
        and len(request.chat_template) > MAX_REQUEST_TEMPLATE_CHARS
    ):
        raise bad_request(
            f"chat_template is {len(request.chat_template)} characters, more than this server's "
            f"limit of {MAX_REQUEST_TEMPLATE_CHARS}",
            "chat_template",
        )
    rendered = [_message_for_template(m) for m in messages]
    extra = {
        key: value
        for key, value in (request.chat_template_kwargs or {}).items()
        if key not in ("messages", "add_generation_prompt", "chat_template", "template_limits")
    }
    try:
        text = ctx.tokenizer.apply_chat_template(
            rendered,
            add_generation_prompt=request.add_generation_prompt,
            chat_template=request.chat_template,
            template_limits=ctx.template_limits,
            **extra,
        )
    except (ValueError, TypeError) as error:
        # ChatTemplateError is a ValueError; a TypeError: a chat_template_kwargs key it takes.
        param = "chat_template" if request.chat_template is not None else "messages"
        raise bad_request(str(error), param) from error
    refuse_hopeless_text(ctx, text, "messages")
    # The template writes BOS itself; adding special tokens again would double it.
    return check_token_ids(ctx, ctx.tokenizer.encode(text, add_special_tokens=False), "messages")


# ---------------------------------------------------------------------- sampling parameters

_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__)
# repetition_penalty divides or multiplies logits: a tiny one makes them infinite.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Choices per prompt: each is a request of its own in the cluster, so bound the fan-out.
MAX_N = 64


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


def check_stop_token_ids(request: SamplingFields, vocab_size: int) -> None:
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
    """The engine's output budget. An echo with max_tokens 0 (how vLLM scores a prompt) is
    computed with one token, left out of the response, as in vLLM."""
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


# ---------------------------------------------------------------------- backend requests

# A non-streamed request's outputs come from the decode worker at most this often.
COALESCE_MS = 1000


def generation_requests(
    ctx: ServingContext,
    scope: Scope,
    body: SamplingFields,
    request_ids: Sequence[str],
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
) -> list[GenerationRequest]:
    """One backend request per choice (`prompts[i]`: choice i's; each prompt stands n times in a
    row), one admission group per HTTP request; not streamed, outputs come merged."""
    group = request_ids[0] if len(prompts) > 1 else None
    client, streamed = client_identity(scope), bool(body.stream)
    return [
        GenerationRequest(
            request_id,
            prompt,
            p,
            admission_group=group,
            client=client,
            group_size=len(prompts),
            num_choices=body.n,
            priority=body.priority,
            coalesce_ms=0 if streamed else COALESCE_MS,
            stream_interval=ctx.stream_interval if streamed else 1,
        )
        for request_id, prompt, p in zip(request_ids, prompts, params, strict=True)
    ]


def client_identity(scope: Scope) -> str:
    """Who sent a request, for fair shares: a digest of its API key (never the key), else its
    address (behind a proxy, one owner for every keyless client)."""
    header = dict(scope.get("headers", [])).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip()).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"
