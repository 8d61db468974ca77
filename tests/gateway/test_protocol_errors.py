"""The HTTP layer's errors against a fake backend, in-process: OpenAI-style JSON, right codes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nori.gateway.app import create_app
from nori.gateway.backend import GenerationChunk, GenerationRequest
from nori.gateway.errors import BackendError, InvalidRequestError, QueueFullError, SaturatedError
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import MAX_MODEL_LEN, MODEL, assert_error, client, make_app, post
from tests.gateway.helpers import FakeBackend, chunk, sse_json

pytestmark = pytest.mark.asyncio


def _escaped(body: dict[str, Any]) -> bytes:
    """JSON with \\u escapes: how a client sends a lone surrogate (it has no UTF-8 form)."""
    return json.dumps(body, ensure_ascii=True).encode()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (b"[1, 2]", "JSON object", None),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature", "temperature"),
        ({"prompt": "hi", "stream": "yes"}, "stream", "stream"),
        ({"prompt": 5}, "prompt: expected one of", "prompt"),
        ({"prompt": ["a", 1]}, "prompt", "prompt"),
        ({}, "prompt: Field required", "prompt"),
        ({"prompt": "hi", "temperature": -1}, "temperature must be", "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p must be", "top_p"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs"),
        ({"prompt": "hi", "stop": [""]}, "stop must contain", "stop"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be", "max_tokens"),
        ({"prompt": "hi", "n": 65}, "n must be between 1 and 64", "n"),
        ({"prompt": "hi", "max_tokens": 0}, "0 only with echo", "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens must be", "max_tokens"),
        ({"prompt": "hi", "best_of": 3}, "best_of", "best_of"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream", None),
        ({"prompt": ""}, "empty", "prompt"),
        ({"prompt": []}, "empty", "prompt"),
        ({"prompt": [[]]}, "empty", "prompt"),
        ({"prompt": [1, 512]}, "out of the vocabulary range [0, 512): [512]", "prompt"),
        ({"prompt": [1, -3]}, "[-3]", "prompt"),
        # Valid JSON, not valid text: a lone surrogate cannot be encoded for the tokenizer.
        (_escaped({"prompt": "hi \ud800"}), "prompt holds a lone UTF-16 surrogate", None),
        (_escaped({"prompt": ["ok", "\udfff"]}), "prompt.1 holds a lone UTF-16 surrogate", None),
        (_escaped({"prompt": "hi", "stop": ["\ud800"]}), "stop.0 holds a lone", None),
        ({"prompt": "hi", "stop_token_ids": [10**12]}, "outside the vocabulary", "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "outside the vocabulary", "stop_token_ids"),
    ],
)
async def test_completion_input_errors_are_400(
    tokenizer: Tokenizer, body: Any, fragment: str, param: str | None
) -> None:
    backend = FakeBackend()
    error = assert_error(
        await post(make_app(tokenizer, backend), "/v1/completions", body), 400, fragment
    )
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert backend.requests == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": []}, "at least one message"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            _escaped({"messages": [{"role": "user", "content": "\ud800"}]}),
            "messages.0.content holds",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "Unknown role: wizard"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "'image_url' is not supported",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "requires logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tool"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)
async def test_chat_input_errors_are_400(tokenizer: Tokenizer, body: Any, fragment: str) -> None:
    assert_error(await post(make_app(tokenizer), "/v1/chat/completions", body), 400, fragment)


async def test_too_long_requests_name_the_numbers(tokenizer: Tokenizer) -> None:
    app = make_app(tokenizer)
    error = assert_error(
        await post(app, "/v1/completions", {"prompt": [5] * 60, "max_tokens": 10}),
        400,
        f"maximum context length is {MAX_MODEL_LEN}",
        "70 tokens (60 in the prompt, 10 in the completion)",
    )
    assert error["param"] == "max_tokens"
    assert_error(
        await post(app, "/v1/completions", {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}),
        400,
        f"the prompt has {MAX_MODEL_LEN} tokens",
    )
    long_chat = {"messages": [{"role": "user", "content": "word " * 200}]}
    assert_error(await post(app, "/v1/chat/completions", long_chat), 400, "maximum context length")
    # Exactly at the limit is fine.
    response = await post(app, "/v1/completions", {"prompt": [5] * 60, "max_tokens": 4})
    assert response.status_code == 200


async def test_unknown_model_is_404(tokenizer: Tokenizer) -> None:
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
        ),
    ]:
        error = assert_error(await post(make_app(tokenizer), path, body), 404, "gpt-4")
        assert error["code"] == "model_not_found" and error["param"] == "model"


async def test_tokenizer_without_chat_template_is_400(tokenizer: Tokenizer) -> None:
    plain = dataclasses.replace(tokenizer, chat_template=None)
    app = create_app(FakeBackend(), plain, MODEL, MAX_MODEL_LEN)
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert_error(await post(app, "/v1/chat/completions", body), 400, "no chat template")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("call_time", [False, True])
@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (SaturatedError("no decode capacity", retry_after_s=2.5), 503, "3"),
        (QueueFullError("too many requests", retry_after_s=0.1), 429, "1"),
        (InvalidRequestError("the worker says no"), 400, None),
        (BackendError("worker exploded"), 500, None),
    ],
)
async def test_backend_errors_map_to_status(
    tokenizer: Tokenizer,
    error: BackendError,
    status: int,
    retry_after: str | None,
    stream: bool,
    call_time: bool,
) -> None:
    backend = FakeBackend(call_error=error) if call_time else FakeBackend(error=error)
    response = await post(
        make_app(tokenizer, backend), "/v1/completions", {"prompt": "hi", "stream": stream}
    )
    body = assert_error(response, status, str(error))
    assert body["type"] == error.error_type
    assert response.headers.get("retry-after") == retry_after


async def test_unexpected_backend_exception_is_500_without_details(tokenizer: Tokenizer) -> None:
    backend = FakeBackend(error=RuntimeError("secret internal state"))
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        response = await post(make_app(tokenizer, backend), path, body)
        assert_error(response, 500, "internal server error")
        assert "secret" not in response.text


async def test_abort_is_an_error(tokenizer: Tokenizer) -> None:
    def script(request: GenerationRequest) -> list[GenerationChunk]:
        return [chunk([7], "Hel"), chunk([], "", finished=True, finish_reason="abort")]

    app = make_app(tokenizer, FakeBackend(script))
    assert_error(await post(app, "/v1/completions", {"prompt": "hi"}), 500, "aborted")
    response = await post(app, "/v1/completions", {"prompt": "hi", "stream": True})
    assert response.status_code == 200
    chunks = sse_json(response.text)
    assert chunks[0]["choices"][0]["text"] == "Hel"
    assert "aborted" in chunks[-1]["error"]["message"]


async def test_error_mid_stream_is_an_error_event(tokenizer: Tokenizer) -> None:
    class Backend(FakeBackend):
        async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
            yield chunk([7], "Hel")
            raise SaturatedError("decode worker lost")

    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    response = await post(make_app(tokenizer, Backend()), "/v1/chat/completions", body)
    chunks = sse_json(response.text)
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert chunks[-1] == {
        "error": {
            "message": "decode worker lost",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
    }


async def test_unknown_route_is_openai_style_404(tokenizer: Tokenizer) -> None:
    async with client(make_app(tokenizer)) as http:
        assert_error(await http.get("/v1/nothing"), 404)
        assert_error(await http.get("/v1/completions"), 405)
