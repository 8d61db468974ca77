"""A request resumed on another engine from the tokens it had streamed (migration): the rest of
its output is what an undisturbed run would have produced, token for token and in text."""

from __future__ import annotations

from pathlib import Path

import pytest

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import StepOutput
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

PROMPT = "once upon a time there was"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-resume")
    init_checkpoint(folder, "tiny", seed=11)
    return folder


def _engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=128)
    )


def _run(engine: LLMEngine, request_id: str) -> list[StepOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        # Penalties count the resumed tokens as output, as the first engine did.
        SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=0.8,
            presence_penalty=0.5, repetition_penalty=1.3,
        ),
    ],
    ids=["greedy", "greedy-with-penalties"],
)  # fmt: skip
def test_a_resumed_request_continues_exactly(checkpoint: Path, params: SamplingParams) -> None:
    first = _engine(checkpoint)
    first.add_request("r", PROMPT, params)
    undisturbed = _run(first, "r")
    tokens, text = undisturbed[-1].token_ids, undisturbed[-1].text
    # What the client had when the first worker died: 7 tokens and the text streamed with them.
    seen = [o for o in undisturbed if len(o.token_ids) <= 7]
    streamed_tokens = seen[-1].token_ids
    streamed_text = "".join(o.new_text for o in seen)
    assert len(streamed_tokens) == 7

    second = _engine(checkpoint)
    prompt = second.model.tokenizer.encode(PROMPT)
    second.add_request(
        "r", prompt, params, output_token_ids=streamed_tokens, num_emitted_chars=len(streamed_text)
    )
    resumed = _run(second, "r")
    assert [t for o in resumed for t in o.new_token_ids] == tokens[7:]
    assert streamed_text + "".join(o.new_text for o in resumed) == text
    assert resumed[-1].token_ids == tokens and resumed[-1].finish_reason == "length"
    second.kv_cache.check_invariants()
