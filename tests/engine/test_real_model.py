"""A real trained model: greedy output of stories260K matches transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from nori.engine.llm import LLM
from nori.sampling.params import SamplingParams
from tests.engine.reference import hf_greedy

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES}; the real-model check needs it")
    return STORIES


def test_stories260k_greedy_matches_transformers(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, block_size=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=48)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for output, prompt_ids, reference in zip(outputs, prompts, expected, strict=True):
        assert output.prompt_token_ids == prompt_ids
        (completion,) = output.outputs
        assert completion.token_ids == reference.tokens
        # Streamed text keeps the leading space a standalone decode would strip (as vLLM does).
        full = llm.tokenizer.decode(prompt_ids + reference.tokens)
        assert llm.tokenizer.decode(prompt_ids) + completion.text == full
    # A trained model writes words, not noise: a sanity check that the weights really loaded.
    texts = [o.outputs[0].text for o in outputs]
    assert any(" the " in text or " was " in text for text in texts)
