"""API keys at the gateway: Bearer tokens as the openai client sends them, 401 otherwise,
/health and /metrics open."""

from __future__ import annotations

import openai
import pytest

from nori.gateway.middleware import ApiKeyMiddleware
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import MODEL, assert_error, client, make_app

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.asyncio
async def test_the_api_wants_the_key_and_health_and_metrics_do_not(tokenizer: Tokenizer) -> None:
    app = make_app(tokenizer, api_keys=["sk-right", "sk-other"])
    async with client(app) as http:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
            refused = await http.post("/v1/completions", json=BODY, headers=headers)
            error = assert_error(refused, 401, "API key")
            assert error["code"] == "invalid_api_key"
            assert refused.headers["www-authenticate"] == "Bearer"
        for key in ("sk-right", "sk-other"):
            answered = await http.post(
                "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
            )
            assert answered.status_code == 200, answered.text
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


@pytest.mark.asyncio
async def test_the_openai_client_sends_its_key(tokenizer: Tokenizer) -> None:
    app = make_app(tokenizer, api_keys=["sk-right"])
    async with client(app) as http:
        right = openai.AsyncOpenAI(
            base_url="http://gateway/v1", api_key="sk-right", http_client=http
        )
        completion = await right.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert completion.choices[0].text
        wrong = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="sk-no", http_client=http)
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_an_empty_key_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        ApiKeyMiddleware(lambda *_: None, keys=[""], open_paths=())  # type: ignore[arg-type]
