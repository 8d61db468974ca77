"""`echo` on /v1/completions, as vLLM answers it: the prompt before the completion, its tokens'
logprobs before the generated ones (the first prompt token's null), and `max_tokens: 0` for the
prompt alone. This is how evaluation harnesses (lm-eval's `local-completions`) score a text.

The server runs the in-process engine; the offline engine on the same checkpoint is the reference
(its prompt logprobs are checked against transformers in tests/engine/test_prompt_logprobs.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nori.engine.llm import LLM
from nori.gateway.app import create_app
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.helpers import serve, sse_json
from tests.gateway.local_backend import LocalEngineBackend

ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 8,
    "num_kv_blocks": 256,
    "max_model_len": 256,
}
PROMPT = "once upon a time there was a cat"


@pytest.fixture(scope="module")
def url(tiny_checkpoint: Path) -> Iterator[str]:
    backend = LocalEngineBackend.from_model(str(tiny_checkpoint), **ENGINE_OPTIONS)
    app = create_app(
        backend, backend.tokenizer, "tiny", backend.max_model_len, vocab_size=backend.vocab_size
    )
    with serve(app) as base:
        yield base


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)


def complete(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def prompt_logprobs(reference: LLM, prompt: list[int], top: int) -> list[Any]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top)
    (output,) = reference.generate([prompt], params, use_tqdm=False)
    assert output.prompt_logprobs is not None
    return output.prompt_logprobs


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(
    url: str, reference: LLM, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    body = complete(url, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, temperature=0)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    names = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs["tokens"] == names
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [sum(len(name) for name in names[:i]) for i in range(len(ids))]
    assert logprobs["text_offset"] == offsets
    expected = prompt_logprobs(reference, ids, top=2)
    for i in range(1, len(ids)):
        entry = expected[i]
        assert logprobs["token_logprobs"][i] == pytest.approx(entry[ids[i]].logprob, abs=1e-6)
        top = logprobs["top_logprobs"][i]
        # The prompt token and the two most likely ones (vLLM's `logprobs + 1` at most).
        assert names[i] in top and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(
            max(lp.logprob for lp in entry.values()), abs=1e-6
        )
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_puts_the_prompt_before_the_completion(url: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    greedy = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    plain = complete(url, prompt=PROMPT, logprobs=1, **greedy)["choices"][0]
    echoed = complete(url, prompt=PROMPT, logprobs=1, echo=True, **greedy)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    tokens = echoed["logprobs"]["tokens"]
    assert len(tokens) == len(ids) + 5
    assert tokens[len(ids) :] == plain["logprobs"]["tokens"]
    # The echoed request computes its prompt's logits too (prompt logprobs), so its rows go
    # through GEMMs of other shapes: float32 rounding apart (5e-7 seen on an Intel AMX host).
    assert echoed["logprobs"]["token_logprobs"][len(ids) :] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert echoed["logprobs"]["text_offset"][0] == 0
    # Without logprobs, echo is text only.
    bare = complete(url, prompt=PROMPT, echo=True, **greedy)["choices"][0]
    assert bare["text"] == echoed["text"] and bare["logprobs"] is None


def test_a_tokenized_batch_scores_as_lm_eval_asks(url: str, tokenizer: Tokenizer) -> None:
    """lm-eval's loglikelihood request: token ids, echo, one token, logprobs 1, temperature 0."""
    prompts = [tokenizer.encode("the dog ran"), tokenizer.encode(PROMPT)]
    body = complete(url, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices, strict=True):
        assert choice["text"].startswith(tokenizer.decode(prompt))
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None
        assert all(isinstance(value, float) for value in logprobs["token_logprobs"][1:])
        # lm-eval's greedy check compares each token's logprob with the largest in its top.
        scored = zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True)
        assert all(value <= max(top.values()) for value, top in scored)
    assert body["usage"]["completion_tokens"] == 2


def test_streamed_echo_sends_the_prompt_first(url: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    request = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 0, "stream": True}
    for max_tokens in (0, 4):
        request["max_tokens"] = max_tokens
        response = httpx.post(f"{url}/v1/completions", json=request, timeout=60)
        events = [event["choices"][0] for event in sse_json(response.text)]
        assert events[0]["text"].startswith(PROMPT)
        tokens = [token for event in events for token in event["logprobs"]["tokens"]]
        assert len(tokens) == len(ids) + max_tokens
        assert events[0]["logprobs"]["token_logprobs"][0] is None
        assert events[-1]["finish_reason"] == "length"
        if max_tokens == 0:
            assert "".join(event["text"] for event in events) == PROMPT


def test_max_tokens_0_needs_echo(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60
    )
    assert response.status_code == 400
    assert "0 only with echo" in response.json()["error"]["message"]
