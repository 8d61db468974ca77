"""Hostile input at the app: every field refused with a 400 naming it (not a 500 from a later
step: the proto conversion, the sampler, the template), with the in-process app over a fake
backend. The same inputs against a real gateway process, timed and with its memory watched:
tests/cluster/test_hostile_requests.py."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import pytest

from nori.gateway.prompts import MAX_REQUEST_TEMPLATE_CHARS
from nori.gateway.protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import assert_error, client, make_app, post
from tests.gateway.helpers import FakeBackend

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# Integer fields checked in code rather than by their schema: token ids, against the vocabulary.
TOKEN_ID_FIELDS = {"prompt", "stop_token_ids", "tokens"}
# Python's int64 seed (torch takes it), the one integer wider than a proto int32.
INT64_FIELDS = {"seed"}

TEMPLATES = {
    "nested loops": "{% for i in range(1500) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "division by zero": "{{ 1/0 }}",
    "a huge range": "{% for i in range(1000000) %}{% endfor %}",
    "a syntax error": "{% if %}",
    "an undefined call": "{{ nothing.here() }}",
    "raise_exception": "{{ raise_exception('no system role, please') }}",
}


def _integer_fields(schema: dict[str, Any], defs: dict[str, Any], path: str = "") -> Any:
    """Every integer in a JSON schema, with its path and bounds."""
    if "$ref" in schema:
        yield from _integer_fields(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, path)
        return
    if schema.get("type") == "integer":
        yield path, schema.get("minimum"), schema.get("maximum")
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key, ()):
            yield from _integer_fields(option, defs, path)
    if "items" in schema:
        yield from _integer_fields(schema["items"], defs, path)
    for name, field in schema.get("properties", {}).items():
        yield from _integer_fields(field, defs, f"{path}.{name}" if path else name)


@pytest.mark.parametrize(
    "model", [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
)
def test_every_integer_field_is_bounded_by_its_wire_type(model: Any) -> None:
    schema = model.model_json_schema()
    for path, low, high in _integer_fields(schema, schema.get("$defs", {})):
        if path.split(".")[0] in TOKEN_ID_FIELDS:
            continue
        wire_max = 2**63 - 1 if path in INT64_FIELDS else INT32_MAX
        assert low is not None and high is not None, f"{model.__name__}.{path} is unbounded"
        assert -wire_max - 1 <= low and high <= wire_max, (path, low, high)


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [2**31, 10**30, -(2**31) - 1])
@pytest.mark.parametrize(
    ("path", "field"),
    [
        (COMPLETIONS, "top_k"),
        (COMPLETIONS, "max_tokens"),
        (COMPLETIONS, "min_tokens"),
        (COMPLETIONS, "logprobs"),
        (COMPLETIONS, "n"),
        (COMPLETIONS, "best_of"),
        (COMPLETIONS, "stop_token_ids"),
        (COMPLETIONS, "prompt"),
        (CHAT, "top_k"),
        (CHAT, "max_completion_tokens"),
        (CHAT, "top_logprobs"),
        (CHAT, "seed"),
    ],
)
async def test_integers_out_of_their_wire_range_are_400(
    tokenizer: Tokenizer, path: str, field: str, value: int
) -> None:
    backend = FakeBackend()
    body: dict[str, Any] = {"prompt": "hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    if field == "seed":
        value = value * 2**33  # past int64
    body[field] = [value] if field in TOKEN_ID_FIELDS else value
    error = assert_error(await post(make_app(tokenizer, backend), path, body), 400)
    assert error["param"] == field, error
    assert backend.requests == []


@pytest.mark.asyncio
@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "1e999"])
@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
     "repetition_penalty"],
)  # fmt: skip
async def test_non_finite_numbers_are_400(tokenizer: Tokenizer, field: str, number: str) -> None:
    backend = FakeBackend()
    raw = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {number}}}'.encode()
    error = assert_error(await post(make_app(tokenizer, backend), COMPLETIONS, raw), 400)
    assert error["param"] == field, error
    raw = f'{{"prompt": "hi", "logit_bias": {{"5": {number}}}}}'.encode()
    assert_error(await post(make_app(tokenizer, backend), COMPLETIONS, raw), 400)
    assert backend.requests == []


@pytest.mark.asyncio
@pytest.mark.parametrize("penalty", [1e-300, 0.0, -1.0, 1e300])
async def test_a_repetition_penalty_that_breaks_sampling_is_400(
    tokenizer: Tokenizer, penalty: float
) -> None:
    body = {"prompt": "hi", "repetition_penalty": penalty}
    error = assert_error(await post(make_app(tokenizer), COMPLETIONS, body), 400, "[0.01, 100]")
    assert error["param"] == "repetition_penalty"


@pytest.mark.asyncio
async def test_tool_calling_is_refused_by_name_and_no_tool_choice_is_served(
    tokenizer: Tokenizer,
) -> None:
    app = make_app(tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra, param in (
        ({"tools": tools}, "tools"),
        ({"tools": tools, "tool_choice": "auto"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ):
        body = {"messages": MESSAGES, "max_tokens": 2, **extra}
        error = assert_error(await post(app, CHAT, body), 400, "tool")
        assert error["param"] == param
    for choice in ("none", "auto"):
        body = {"messages": MESSAGES, "max_tokens": 2, "tool_choice": choice}
        response = await post(app, CHAT, body)
        assert response.status_code == 200, response.text


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(TEMPLATES))
async def test_a_failing_or_overlong_template_is_400_with_its_message(
    tokenizer: Tokenizer, name: str
) -> None:
    backend = FakeBackend()
    app = make_app(tokenizer, backend)
    template = TEMPLATES[name]
    for path in (CHAT, "/tokenize"):
        started = time.monotonic()
        body = {"messages": MESSAGES, "chat_template": template}
        fragment = "no system role" if name == "raise_exception" else "chat template"
        error = assert_error(await post(app, path, body), 400, fragment)
        assert time.monotonic() - started < 1.0
        assert error["param"] == "chat_template"
    assert backend.requests == []


@pytest.mark.asyncio
async def test_a_request_template_longer_than_the_limit_is_400_before_compiling(
    tokenizer: Tokenizer,
) -> None:
    """Compiling takes time in proportion to the text, before any step is counted."""
    app = make_app(tokenizer)
    for path in (CHAT, "/tokenize"):
        long_template = "{{ a ~ a }}" * (MAX_REQUEST_TEMPLATE_CHARS // 11 + 1)
        started = time.monotonic()
        body = {"messages": MESSAGES, "chat_template": long_template}
        error = assert_error(
            await post(app, path, body), 400, f"limit of {MAX_REQUEST_TEMPLATE_CHARS}"
        )
        assert error["param"] == "chat_template"
        assert time.monotonic() - started < 0.5
    head = "{{ messages[0].content }}{#"
    fits = head + " " * (MAX_REQUEST_TEMPLATE_CHARS - len(head) - 2) + "#}"
    assert len(fits) == MAX_REQUEST_TEMPLATE_CHARS
    response = await post(app, "/tokenize", {"messages": MESSAGES, "chat_template": fits})
    assert response.status_code == 200, response.text


@pytest.mark.asyncio
async def test_a_template_renders_off_the_event_loop(tokenizer: Tokenizer) -> None:
    """While a template spends its time budget, /health still answers at once."""
    # 2**40 macro calls: stopped by the render's time limit (0.5 s), not its step budget.
    busy = "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    app = make_app(tokenizer)
    # The apps of the tests before this one are garbage: collected now, not by a pause of a
    # few hundred ms in the middle of the measurement.
    gc.collect()
    async with client(app) as http:
        render = asyncio.ensure_future(
            http.post(CHAT, json={"messages": MESSAGES, "chat_template": busy})
        )
        await asyncio.sleep(0.05)
        slowest = 0.0
        while not render.done():
            started = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.01)
        assert_error(await render, 400, "chat template took more than")
    assert slowest < 0.1, slowest


@pytest.mark.asyncio
async def test_a_huge_token_id_prompt_is_refused_quickly(tokenizer: Tokenizer) -> None:
    body = json.dumps({"prompt": list(range(10_000_000)), "max_tokens": 2}).encode()
    started = time.monotonic()
    assert_error(await post(make_app(tokenizer), COMPLETIONS, body), 413, "limit of")
    assert time.monotonic() - started < 1.0
