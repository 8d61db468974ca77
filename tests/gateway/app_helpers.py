"""An in-process app over a fake backend, its client, and the OpenAI error shape."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI

from nori.gateway.app import create_app
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.helpers import FakeBackend

MODEL = "tiny-test"
MAX_MODEL_LEN = 64


def make_app(tokenizer: Tokenizer, backend: Any = None, **options: Any) -> FastAPI:
    return create_app(
        backend if backend is not None else FakeBackend(),
        tokenizer,
        MODEL,
        MAX_MODEL_LEN,
        **options,
    )


def client(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert "Traceback" not in response.text
    return dict(error)


async def post(app: FastAPI, path: str, body: Any) -> httpx.Response:
    async with client(app) as http:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            return await http.post(path, content=body, headers=headers)
        return await http.post(path, json=body)
