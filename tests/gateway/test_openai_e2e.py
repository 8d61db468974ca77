"""End to end: the official openai client against uvicorn + LocalEngineBackend on a tiny model.

The offline engine (`LLM.generate` on the same checkpoint) is the reference: what the server
returns must be token-identical to it for the same prompt ids and parameters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nori.engine.completion_outputs import CompletionOutput
from nori.engine.llm import LLM
from nori.gateway.app import create_app
from nori.sampling.params import SamplingParams
from tests.gateway.helpers import parse_sse, serve, sse_json
from tests.gateway.local_backend import LocalEngineBackend

MODEL = "nori-tiny"
ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 8,
    "num_kv_blocks": 256,
    "max_model_len": 256,
}
PROMPT = "once upon a time there was"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the cat."},
]
IDS_EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@dataclass
class Served:
    url: str
    client: openai.OpenAI
    backend: LocalEngineBackend


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path) -> Iterator[Served]:
    backend = LocalEngineBackend.from_model(str(tiny_checkpoint), **ENGINE_OPTIONS)
    app = create_app(
        backend, backend.tokenizer, MODEL, backend.max_model_len, vocab_size=backend.vocab_size
    )
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield Served(url, client, backend)
        client.close()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)


def offline(reference: LLM, prompt_ids: list[int], **params: Any) -> CompletionOutput:
    (output,) = reference.generate([prompt_ids], SamplingParams(**params))
    assert output.prompt_token_ids == prompt_ids
    return output.outputs[0]


def chat_prompt_ids(reference: LLM, messages: list[Any]) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(reference.tokenizer.encode(text, add_special_tokens=False))


def token_names(ids: list[int]) -> list[str]:
    return [f"token_id:{t}" for t in ids]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_matches_offline(served: Served, reference: LLM, stream: bool) -> None:
    expected = offline(
        reference,
        reference.tokenizer.encode(PROMPT),
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        logprobs=0,
    )
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 0,
        "extra_body": IDS_EXTRA,
    }
    text, finish = "", None
    tokens: list[str] = []
    logprobs: list[float] = []
    if stream:
        for event in served.client.completions.create(stream=True, **request):
            (choice,) = event.choices
            text += choice.text
            assert choice.logprobs is not None
            tokens += choice.logprobs.tokens or []
            logprobs += choice.logprobs.token_logprobs or []
            finish = choice.finish_reason or finish
    else:
        response = served.client.completions.create(**request)
        (choice,) = response.choices
        assert choice.logprobs is not None
        text, finish = choice.text, choice.finish_reason
        tokens, logprobs = choice.logprobs.tokens or [], choice.logprobs.token_logprobs or []
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
        assert response.usage.completion_tokens == 12
    assert tokens == token_names(expected.token_ids)
    assert text == expected.text
    assert finish == "length"
    assert expected.logprobs is not None
    sampled = [
        step[t].logprob for t, step in zip(expected.token_ids, expected.logprobs, strict=True)
    ]
    assert logprobs == pytest.approx(sampled, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_matches_offline(served: Served, reference: LLM, stream: bool) -> None:
    expected = offline(
        reference, chat_prompt_ids(reference, MESSAGES), max_tokens=10, temperature=0.0, logprobs=0
    )
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_completion_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "extra_body": {"return_tokens_as_token_ids": True},
    }
    text, tokens, finish, role = "", [], None, None
    if stream:
        events = list(
            served.client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **request
            )
        )
        for event in events[:-1]:
            (choice,) = event.choices
            role = role or choice.delta.role
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += [entry.token for entry in choice.logprobs.content]
            finish = choice.finish_reason or finish
        usage = events[-1].usage
        assert events[-1].choices == []
    else:
        response = served.client.chat.completions.create(**request)
        (choice,) = response.choices
        role, text, finish = choice.message.role, choice.message.content, choice.finish_reason
        assert choice.logprobs is not None and choice.logprobs.content is not None
        tokens = [entry.token for entry in choice.logprobs.content]
        usage = response.usage
    assert role == "assistant"
    assert tokens == token_names(expected.token_ids)
    assert text == expected.text
    assert finish == expected.finish_reason
    assert usage is not None
    assert usage.prompt_tokens == len(chat_prompt_ids(reference, MESSAGES))
    assert usage.completion_tokens == len(expected.token_ids)


def test_batched_prompts_match_offline_one_by_one(served: Served, reference: LLM) -> None:
    prompts = [PROMPT, "the cat sat on the mat", "a b c"]
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    expected = [offline(reference, reference.tokenizer.encode(p), **params) for p in prompts]
    response = served.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert response.usage is not None and response.usage.completion_tokens == 24

    streamed = ["", "", ""]
    for event in served.client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for choice in event.choices:
            streamed[choice.index] += choice.text
    assert streamed == [e.text for e in expected]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(served: Served, reference: LLM, stream: bool) -> None:
    reference_text = offline(
        reference,
        reference.tokenizer.encode(PROMPT),
        max_tokens=16,
        temperature=0.0,
        ignore_eos=True,
    ).text
    middle = len(reference_text) // 2
    stop = reference_text[middle : middle + 2]
    assert stop.strip() and "\ufffd" not in stop, reference_text
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "stop": [stop],
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        text, finish, stop_reason = "", None, None
        for event in served.client.completions.create(stream=True, **request):
            (choice,) = event.choices
            text += choice.text
            if choice.finish_reason is not None:
                finish, stop_reason = (
                    choice.finish_reason,
                    (choice.model_extra or {})["stop_reason"],
                )
    else:
        (choice,) = served.client.completions.create(**request).choices
        text, finish = choice.text, choice.finish_reason
        stop_reason = (choice.model_extra or {})["stop_reason"]
    assert text == reference_text[: reference_text.index(stop)]
    assert finish == "stop" and stop_reason == stop


def test_seeded_sampling_is_reproducible(served: Served, reference: LLM) -> None:
    def sample(seed: int) -> str:
        response = served.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    expected = offline(
        reference,
        reference.tokenizer.encode(PROMPT),
        max_tokens=16,
        temperature=1.0,
        seed=1234,
        ignore_eos=True,
    )
    assert first == expected.text
    assert sample(1235) != first


def test_logprob_shapes(served: Served) -> None:
    response = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 6
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # The top 3, plus the sampled token when it is not among them.
        assert 1 <= len(top) <= 4 and top[token] == logprob and logprob <= 0

    chat = served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    assert len(content.content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content.content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.top_logprobs[0].logprob >= entry.logprob


def test_sse_framing(served: Served) -> None:
    def raw(path: str, body: dict[str, Any]) -> str:
        with httpx.stream("POST", served.url + path, json=body, timeout=30) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            return "".join(response.iter_text())

    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    text = raw("/v1/completions", completion)
    assert text.endswith("data: [DONE]\n\n")
    chunks = sse_json(text)
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    completion["stream_options"] = {"include_usage": True}
    chunks = sse_json(raw("/v1/completions", completion))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all(c["usage"] is None for c in chunks[:-1])

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    chunks = sse_json(raw("/v1/chat/completions", chat))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert parse_sse(raw("/v1/chat/completions", chat))[-1] == "[DONE]"


def test_prefix_cache_hits_are_reported(served: Served) -> None:
    prompt = "the cat sat on the mat and the dog sat on the log " * 3
    usages = [
        served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage
        for _ in range(2)
    ]
    assert usages[1] is not None and usages[1].prompt_tokens_details is not None
    assert (usages[1].prompt_tokens_details.cached_tokens or 0) >= 8


def test_models_and_errors_through_the_client(served: Served) -> None:
    (card,) = served.client.models.list().data
    assert card.id == MODEL and (card.model_extra or {})["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        served.client.completions.create(model=MODEL, prompt=[1, 100000])


def test_disconnect_aborts_the_engine_request(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = served.backend.engine
    aborted: list[str] = []
    abort = engine.abort_request

    def recording_abort(request_id: str) -> None:
        aborted.append(request_id)
        abort(request_id)

    monkeypatch.setattr(engine, "abort_request", recording_abort)
    # A request that finishes normally is never aborted.
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    time.sleep(0.1)
    assert aborted == []

    total_blocks = engine.load().num_total_blocks
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(lines)
    request_id = json.loads(first.removeprefix("data: "))["id"] + "-0"
    # The engine thread drops the request and frees its blocks soon after the socket closes.
    deadline = time.monotonic() + 5
    while aborted != [request_id] or engine.load().num_free_blocks != total_blocks:
        assert time.monotonic() < deadline, f"aborted {aborted}"
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()


def test_health_and_metrics(served: Served) -> None:
    health = httpx.get(served.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    text = httpx.get(served.url + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['nori_gateway_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert samples["nori_gateway_generation_tokens_total"] >= 3
    assert samples["nori_gateway_prompt_tokens_total"] >= 1
    assert samples["nori_gateway_time_to_first_token_seconds_count"] >= 1
