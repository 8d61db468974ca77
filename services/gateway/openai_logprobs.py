"""Log-probabilities in the OpenAI layouts (completions and chat), as vLLM reports them."""

from __future__ import annotations

from collections.abc import Sequence

from nori.gateway.context import ServingContext
from nori.gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from nori.gateway.session import Choice
from nori.sampling.logprobs import TokenLogprobs

# JSON has no -inf; vLLM reports impossible tokens with this value instead.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN and -inf


class TokenNames:
    def __init__(self, ctx: ServingContext, as_token_ids: bool) -> None:
        self._text = ctx.token_text
        self._as_ids = as_token_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._text(token_id)


def prompt_entries(
    token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobs | None] | None
) -> list[TokenLogprobs | int]:
    """An echoed prompt's tokens for `completion_logprobs`: each one's logprobs, or its bare id
    where it has none (the first token)."""
    scored = prompt_logprobs or ()
    entries: list[TokenLogprobs | int] = []
    for index, token_id in enumerate(token_ids):
        entry = scored[index] if index < len(scored) else None
        entries.append(token_id if entry is None else entry)
    return entries


def completion_logprobs(
    entries: Sequence[TokenLogprobs | int], names: TokenNames, choice: Choice
) -> CompletionLogprobs:
    """vLLM's layout: the sampled token is always among top_logprobs, as vLLM reports it. A bare
    token id (an echoed prompt's first token) has null logprobs, as in vLLM."""
    result = CompletionLogprobs()
    for entry in entries:
        if isinstance(entry, int):
            token = names(entry)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(choice.text_offset)
            choice.text_offset += len(token)
            continue
        token = names(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(entry.logprob))
        top = {names(token_id): _clamp(logprob) for token_id, logprob in entry.top}
        # Distinct ids can share a string (each partial UTF-8 byte decodes to U+FFFD); the
        # sampled token's own value wins so that top_logprobs[i][tokens[i]] is always right.
        top[token] = _clamp(entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(choice.text_offset)
        choice.text_offset += len(token)
    return result


def chat_logprobs(entries: Sequence[TokenLogprobs], names: TokenNames) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = names(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            name = names(token_id)
            top.append(TopLogprob(token=name, logprob=_clamp(logprob), bytes=_utf8(name)))
        content.append(
            ChatTokenLogprob(
                token=token, logprob=_clamp(entry.logprob), bytes=_utf8(token), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
