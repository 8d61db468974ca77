"""The prompt of a request as token ids: completions prompts, chat messages through the template,
and the model name; bad input is a 400 (404 for an unknown model). Also `/tokenize` and
`/detokenize`, as vLLM serves them: what a prompt (or a chat) is as token ids, and what token
ids read as; nothing reaches a worker."""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Protocol

from nori.gateway.context import ServingContext
from nori.gateway.errors import APIError, bad_request
from nori.gateway.protocol import (
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    TextContentPart,
    TokenizeRequest,
    TokenizeResponse,
)

# The longest chat template a request may bring. Real ones are a few kB (Llama 3.1's about 5,
# the largest tool-calling ones under 16); compiling costs time in proportion to the text
# (about a second for 32 KiB of dense tags on a loaded CPU), before any step limit applies.
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
    """Refuses a text that cannot fit the context, before tokenizing it (a 10 MB prompt would
    take the tokenizer seconds): no token covers more than `ctx.max_token_bytes` bytes, so the
    text has at least bytes / max_token_bytes tokens; halved, against normalizers that shorten
    text."""
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
    """The text `echo` returns for each prompt of the batch (a checked `prompt`): a string as
    sent, token ids decoded."""
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


class ChatInput(Protocol):
    """What a chat completion and a /tokenize body share for the template."""

    @property
    def messages(self) -> Sequence[ChatMessage] | None: ...
    @property
    def add_generation_prompt(self) -> bool: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...


def chat_prompt(ctx: ServingContext, request: ChatInput) -> list[int]:
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
        # ChatTemplateError (no template, raise_exception, any failure of the template's code,
        # a limit passed) is a ValueError; a TypeError comes from a chat_template_kwargs key
        # the renderer takes itself.
        param = "chat_template" if request.chat_template is not None else "messages"
        raise bad_request(str(error), param) from error
    refuse_hopeless_text(ctx, text, "messages")
    # The template writes BOS itself; adding special tokens again would double it.
    return check_token_ids(ctx, ctx.tokenizer.encode(text, add_special_tokens=False), "messages")


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either `prompt` or `messages`", "prompt")
    if body.messages is not None:
        tokens = chat_prompt(ctx, body)
    else:
        assert body.prompt is not None
        # Text that cannot fit the context is not tokenized: its count would only say so.
        refuse_hopeless_text(ctx, body.prompt, "prompt")
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = [ctx.tokenizer.id_to_token(token) or "" for token in tokens]
    return TokenizeResponse(
        count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens, token_strs=token_strs
    )


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(ctx, body.model)
    tokens = check_token_ids(ctx, body.tokens, "tokens") if body.tokens else []
    # Special tokens stay, as in vLLM: the text is what the ids are, not what a reply shows.
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(tokens, skip_special_tokens=False))
