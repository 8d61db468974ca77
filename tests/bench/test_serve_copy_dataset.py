"""The copy dataset: documents (ShareGPT answers) under instructions to summarise, quote or
rewrite them; deterministic by seed, within the length options, in every prompt format."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nori.bench.serve.copy_dataset import (
    MIN_DOCUMENT_CHARS,
    TEMPLATES,
    copy_requests,
    question_for,
)
from nori.bench.serve.datasets import build_workload
from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.settings import ServeBenchSettings
from nori.bench.serve.sharegpt import read_exchanges
from nori.sampling.tokenizer import Tokenizer

SHAREGPT_FILE = Path("/work/shared/data/sharegpt/ShareGPT_V3_sample2000.json")
needs_sample = pytest.mark.skipif(
    not SHAREGPT_FILE.is_file(), reason="the ShareGPT sample is not on this machine"
)
_INSTRUCTIONS = {template.name: template.text.split("\n")[0] for template in TEMPLATES}


def _settings(**overrides: object) -> ServeBenchSettings:
    base = ServeBenchSettings(
        dataset="copy",
        dataset_path=str(SHAREGPT_FILE),
        num_prompts=16,
        copy_input_len=600,
        copy_output_len=64,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def _template_of(prompt: str) -> str:
    (name,) = [name for name, first in _INSTRUCTIONS.items() if prompt.startswith(first)]
    return name


@needs_sample
def test_prompts_quote_a_whole_document_and_mix_the_instructions(tokenizer: Tokenizer) -> None:
    workload = build_workload(_settings(num_warmups=4), tokenizer)
    answers = {answer.strip() for _, answer in read_exchanges(SHAREGPT_FILE)}
    assert len(workload.requests) == 16 and len(workload.warmups) == 4
    for spec in workload.requests:
        assert isinstance(spec.prompt, str)
        documents = [a for a in answers if len(a) >= MIN_DOCUMENT_CHARS and a in spec.prompt]
        assert documents, spec.prompt[:200]
        assert spec.prompt_len == len(tokenizer.encode(spec.prompt)) <= 600
        assert spec.max_tokens == 64 and spec.request_class == "copy"
    names = [_template_of(str(spec.prompt)) for spec in workload.requests]
    assert sorted(set(names)) == sorted(_INSTRUCTIONS)
    assert len(set(workload.requests)) == 16
    assert not set(workload.warmups) & set(workload.requests)


@needs_sample
def test_the_seed_decides_and_the_length_options_hold(tokenizer: Tokenizer) -> None:
    first = build_workload(_settings(), tokenizer)
    assert build_workload(_settings(), tokenizer) == first
    assert build_workload(_settings(seed=1), tokenizer).requests != first.requests
    capped = build_workload(_settings(copy_input_len=2000, max_model_len=400), tokenizer)
    assert all(s.prompt_len + s.max_tokens <= 400 for s in capped.requests)
    as_ids = build_workload(_settings(prompt_format="token-ids", num_prompts=4), tokenizer)
    for spec, text in zip(as_ids.requests, first.requests[:4], strict=True):
        # The same documents, sent as the token ids the text encodes to.
        assert spec.prompt == tuple(tokenizer.encode(str(text.prompt)))


def test_documents_questions_and_filters(tokenizer: Tokenizer, tmp_path: Path) -> None:
    document = "Paris is the capital of France. It lies on the Seine. " * 5
    long_question = "Tell me everything about it. " * 20
    data = [
        {"conversations": [{"from": "human", "value": "Where is Paris?"},
                           {"from": "gpt", "value": f"  {document}\n"}]},
        {"conversations": [{"from": "human", "value": long_question},
                           {"from": "gpt", "value": document.upper()}]},
        {"conversations": [{"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello! How can I help?"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    maker = PromptMaker.create(tokenizer, "text")
    specs = copy_requests(path, maker, np.random.default_rng(0), 8, 10_000, 32)
    prompts = {str(s.prompt) for s in specs}
    # The short answer is no document; the two others, under the instructions in turn.
    assert len(specs) == 8 and len(prompts) == 2
    assert all(document.strip() in p or document.upper().strip() in p for p in prompts)
    assert "Hello!" not in "".join(prompts)
    assert question_for("  Where is\nParis? ") == "Where is Paris?"
    assert question_for(long_question) == "What is the main point of the document?"
    quote = TEMPLATES[2].prompt(document, question_for("Where is Paris?"))
    assert "Question: Where is Paris?" in quote and document in quote
    with pytest.raises(ValueError, match="makes a prompt of at most 20 tokens"):
        copy_requests(path, maker, np.random.default_rng(0), 1, 20, 32)


def test_the_copy_dataset_needs_a_file() -> None:
    with pytest.raises(ValueError, match="--dataset copy needs --dataset-path"):
        ServeBenchSettings(dataset="copy")
    with pytest.raises(ValueError, match="--copy-output-len"):
        _settings(copy_output_len=0)
