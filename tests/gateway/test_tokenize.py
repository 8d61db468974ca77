"""/tokenize and /detokenize, in-process against a fake backend, as vLLM clients call them."""

from __future__ import annotations

import pytest

from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import MAX_MODEL_LEN, MODEL, assert_error, client, make_app
from tests.gateway.helpers import FakeBackend

pytestmark = pytest.mark.asyncio


async def test_tokenize_a_prompt_and_back(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    text = "Once upon a time, a cat"
    async with client(make_app(tokenizer, backend)) as http:
        body = (await http.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
        expected = tokenizer.encode(text)
        assert body == {
            "count": len(expected),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": expected,
            "token_strs": None,
        }
        plain = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert plain.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        with_strs = await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        strs = with_strs.json()["token_strs"]
        assert strs == [tokenizer.id_to_token(token) for token in expected]
        back = await http.post("/detokenize", json={"model": MODEL, "tokens": expected})
        assert back.json() == {"prompt": tokenizer.decode(expected, skip_special_tokens=False)}
        assert text in back.json()["prompt"]
    assert backend.requests == []  # nothing reached a worker


async def test_tokenize_chat_messages_through_the_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    async with client(make_app(tokenizer)) as http:
        body = (await http.post("/tokenize", json={"messages": messages})).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"])


async def test_tokenize_and_detokenize_refuse_bad_input(tokenizer: Tokenizer) -> None:
    async with client(make_app(tokenizer)) as http:
        assert_error(await http.post("/tokenize", json={}), 400, "prompt", "messages")
        both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
        assert_error(await http.post("/tokenize", json=both), 400)
        assert_error(await http.post("/tokenize", json={"model": "other", "prompt": "a"}), 404)
        assert_error(await http.post("/tokenize", json={"prompt": 3}), 400)
        vocab = tokenizer.vocab_size
        out_of_range = {"tokens": [1, vocab + 5]}
        assert_error(await http.post("/detokenize", json=out_of_range), 400, "vocabulary")
        assert_error(await http.post("/detokenize", json={"tokens": "abc"}), 400)
        empty = await http.post("/detokenize", json={"tokens": []})
        assert empty.status_code == 200 and empty.json() == {"prompt": ""}


async def test_a_client_request_id_names_the_response_and_comes_back(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    headers = {"x-request-id": "eval-item-17"}
    async with client(make_app(tokenizer, backend)) as http:
        done = await http.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        chatted = await http.post("/v1/chat/completions", json=chat, headers=headers)
        failed = await http.post("/v1/completions", json={"prompt": 5}, headers=headers)
        anonymous = await http.post("/v1/completions", json={"prompt": "hi"})
    assert done.headers["x-request-id"] == "eval-item-17"
    assert done.json()["id"] == "cmpl-eval-item-17"
    assert chatted.json()["id"] == "chatcmpl-eval-item-17"
    assert failed.status_code == 400 and failed.headers["x-request-id"] == "eval-item-17"
    assert "x-request-id" not in anonymous.headers
    # The workers' ids start with the client's and stay unique when a client repeats one.
    worker_ids = [request.request_id for request in backend.requests[:2]]
    assert worker_ids[0].startswith("cmpl-eval-item-17-")
    assert worker_ids[1].startswith("chatcmpl-eval-item-17-")
    assert len(set(worker_ids)) == 2
