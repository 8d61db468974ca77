"""`n > 1`: independent choices per prompt, in OpenAI's order, each as the engine samples it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from nori.engine.llm import LLM
from nori.gateway.app import create_app
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer
from tests.gateway.app_helpers import assert_error, client, make_app
from tests.gateway.helpers import FakeBackend, serve, sse_json
from tests.gateway.local_backend import LocalEngineBackend

ENGINE_OPTIONS = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 256, "max_model_len": 256}


@pytest.mark.asyncio
async def test_a_batch_times_n_is_one_request_per_choice(tokenizer: Tokenizer) -> None:
    backend = FakeBackend()
    body = {"prompt": ["a cat", "the dog ran"], "n": 3, "seed": 7, "max_tokens": 4}
    async with client(make_app(tokenizer, backend)) as http:
        response = (await http.post("/v1/completions", json=body)).json()
    assert [choice["index"] for choice in response["choices"]] == list(range(6))
    prompts = [tokenizer.encode("a cat"), tokenizer.encode("the dog ran")]
    sent = backend.requests
    assert [r.prompt_token_ids for r in sent] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert [r.params.seed for r in sent] == [7, 8, 9, 7, 8, 9]
    assert len({r.request_id for r in sent}) == 6
    # The prompts count once each, as in OpenAI's and vLLM's usage.
    assert response["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])


@pytest.mark.asyncio
async def test_streamed_chat_choices_each_open_and_finish(tokenizer: Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    async with client(make_app(tokenizer)) as http:
        events = sse_json((await http.post("/v1/chat/completions", json=body)).text)
    choices = [event["choices"][0] for event in events if event["choices"]]
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] is not None
        assert all(c["finish_reason"] is None for c in mine[:-1])


@pytest.mark.asyncio
async def test_n_out_of_range_is_refused(tokenizer: Tokenizer) -> None:
    async with client(make_app(tokenizer)) as http:
        for n in (0, 65):
            response = await http.post("/v1/completions", json={"prompt": "a", "n": n})
            assert_error(response, 400, "n must be between 1 and 64")


def test_each_choice_is_what_the_engine_samples_with_its_seed(tiny_checkpoint: Path) -> None:
    backend = LocalEngineBackend.from_model(str(tiny_checkpoint), **ENGINE_OPTIONS)
    app = create_app(backend, backend.tokenizer, "tiny", backend.max_model_len)
    reference = LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)
    prompt = reference.tokenizer.encode("once upon a time")
    with serve(app) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = api.completions.create(
            model="tiny", prompt=[prompt], n=3, seed=41, temperature=1.0, max_tokens=8,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0,
        )  # fmt: skip
        api.close()
    # The offline API samples n choices the same way: LLM.generate with n=3 gives the same three.
    offline = reference.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=41, ignore_eos=True)
    )[0]
    assert [completion.index for completion in offline.outputs] == [0, 1, 2]
    for choice in answer.choices:
        params = SamplingParams(
            temperature=1.0, max_tokens=8, seed=41 + choice.index, ignore_eos=True
        )
        expected = reference.generate([prompt], params)[0].outputs[0].token_ids
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in expected]
        assert offline.outputs[choice.index].token_ids == expected
    texts = {choice.text for choice in answer.choices}
    assert len(texts) > 1  # different seeds, different samples
