"""A chat template from the server (--chat-template) or from the request (`chat_template`), for
models without one, as vLLM takes them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nori.gateway.app import create_app
from nori.gateway.server import gateway_tokenizer
from nori.sampling.chat_template import ChatTemplateError, load_chat_template
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import MAX_MODEL_LEN, MODEL, assert_error, client
from tests.gateway.helpers import FakeBackend

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def test_a_template_is_read_from_a_file_or_taken_as_given(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_the_servers_template_replaces_the_models(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    tokenizer = gateway_tokenizer(tiny_checkpoint, str(path))
    assert tokenizer.chat_template == TEMPLATE
    rendered = tokenizer.apply_chat_template(MESSAGES)
    assert rendered == "<user>Tell me a story\n<assistant>"
    assert gateway_tokenizer(tiny_checkpoint, None).chat_template != TEMPLATE


@pytest.mark.asyncio
async def test_a_requests_template_serves_a_model_without_one(tokenizer: Tokenizer) -> None:
    plain = dataclasses.replace(tokenizer, chat_template=None)
    backend = FakeBackend()
    app = create_app(backend, plain, MODEL, MAX_MODEL_LEN)
    expected = plain.encode("<user>Tell me a story\n<assistant>", add_special_tokens=False)
    async with client(app) as http:
        without = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert_error(without, 400, "no chat template", "--chat-template")
        body = {"messages": MESSAGES, "chat_template": TEMPLATE}
        answered = await http.post("/v1/chat/completions", json=body)
        assert answered.status_code == 200, answered.text
        tokenized = (await http.post("/tokenize", json=body)).json()
    assert backend.requests[0].prompt_token_ids == expected
    assert tokenized["tokens"] == expected
