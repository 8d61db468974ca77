"""Large and oversized input: refused early and clearly, tokenized without holding the loop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from nori.gateway.middleware import (
    MIN_PROMPT_BODY_BYTES,
    PROMPT_BODY_BYTES_PER_TOKEN,
    prompt_body_limit,
)
from nori.sampling.tokenizer import LONG_TEXT_CHARS, Tokenizer
from tests.gateway.app_helpers import MAX_MODEL_LEN, assert_error, client, make_app, post
from tests.gateway.helpers import FakeBackend


@pytest.mark.asyncio
async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    prompt = "Once upon a time there was a cat. " * 25_000  # 850 kB: under the body bound
    for path, body in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
        ("/tokenize", {"prompt": prompt}),
    ):
        error = assert_error(
            await post(make_app(tokenizer, backend), path, body),
            400,
            f"maximum context length is {MAX_MODEL_LEN} tokens",
            "at least",
        )
        assert error["param"] in ("prompt", "messages")
    assert backend.requests == []


@pytest.mark.asyncio
async def test_prompt_endpoints_take_bodies_only_as_large_as_the_context_needs(
    tokenizer: Tokenizer,
) -> None:
    """10 MB of text or 10 M token ids: refused from the body's size (the context of 64 tokens
    needs far less than the 1 MiB floor), before anything parses it; other paths keep the
    server's bound."""
    backend = FakeBackend()
    app = make_app(tokenizer, backend)
    text = "Once upon a time there was a cat. " * 300_000  # 10 MB
    ids = json.dumps({"prompt": [1] * 10_000_000, "max_tokens": 4}).encode()
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 4}),
        ("/v1/completions", ids),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
        ("/detokenize", {"tokens": [1] * 10_000_000}),
    ):
        assert_error(await post(app, path, body), 413, f"{path}'s limit of {MIN_PROMPT_BODY_BYTES}")
    assert backend.requests == []
    assert prompt_body_limit(1 << 17, 32 << 20) == PROMPT_BODY_BYTES_PER_TOKEN << 17
    assert prompt_body_limit(1 << 20, 32 << 20) == 32 << 20  # never over the server's bound


@pytest.mark.asyncio
async def test_a_long_prompt_that_could_fit_is_tokenized_and_checked_exactly(
    tokenizer: Tokenizer,
) -> None:
    # Long in characters, but not surely too long: tokenized, then refused by its real count.
    prompt = "a" * (MAX_MODEL_LEN * 2)
    error = assert_error(
        await post(make_app(tokenizer), "/v1/completions", {"prompt": prompt}), 400
    )
    assert "tokens (" not in error["message"]  # not the estimate
    assert f"the prompt has {len(tokenizer.encode(prompt))} tokens" in error["message"]


def test_long_texts_tokenize_to_the_same_ids(tokenizer: Tokenizer) -> None:
    text = "Once upon a time, héllo wörld! " * (LONG_TEXT_CHARS // 10)
    assert len(text) > LONG_TEXT_CHARS
    assert tokenizer.encode(text) == list(tokenizer.backend.encode(text).ids)
    assert tokenizer.encode(text, add_special_tokens=False) == list(
        tokenizer.backend.encode(text, add_special_tokens=False).ids
    )


@pytest.mark.asyncio
async def test_bodies_over_the_limit_are_413_whether_sized_or_chunked(
    tokenizer: Tokenizer,
) -> None:
    app = make_app(tokenizer, max_request_body_bytes=1000)
    big = json.dumps({"prompt": "x" * 2000}).encode()
    error = assert_error(await post(app, "/v1/completions", big), 413, "limit of 1000 bytes")
    assert error["type"] == "invalid_request_error"

    async def chunks(body: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(body), 300):
            yield body[start : start + 300]

    async with client(app) as http:
        headers = {"content-type": "application/json"}
        refused = await http.post("/v1/completions", content=chunks(big), headers=headers)
        assert_error(refused, 413, "limit of 1000 bytes")
        small = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        answered = await http.post("/v1/completions", content=chunks(small), headers=headers)
        assert answered.status_code == 200, answered.text
