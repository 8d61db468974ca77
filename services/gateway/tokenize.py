"""`/tokenize` and `/detokenize`, as vLLM serves them: what a prompt (or a chat, through the
template) is as token ids, and what token ids read as. Nothing reaches a worker."""

from __future__ import annotations

from nori.gateway.context import ServingContext
from nori.gateway.errors import bad_request
from nori.gateway.prompts import chat_prompt, check_model, check_token_ids, refuse_hopeless_text
from nori.gateway.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


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
