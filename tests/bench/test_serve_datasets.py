"""The request specs of `nori bench serve`: lengths, prefix groups, ShareGPT, mixed, seeds."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nori.bench.serve.datasets import build_workload, sample_lengths
from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.settings import ServeBenchSettings
from nori.bench.serve.sharegpt import sharegpt_requests
from nori.sampling.tokenizer import Tokenizer

SHAREGPT_FILE = Path("/work/shared/data/sharegpt/ShareGPT_V3_sample2000.json")


def settings(**overrides: object) -> ServeBenchSettings:
    return replace(ServeBenchSettings(num_prompts=40), **overrides)  # type: ignore[arg-type]


def test_token_id_prompts_have_exact_lengths_within_the_range(tokenizer: Tokenizer) -> None:
    workload = build_workload(
        settings(
            prompt_format="token-ids",
            random_input_len=64,
            random_output_len=20,
            random_range_ratio=0.5,
            num_prompts=200,
        ),
        tokenizer,
    )
    assert len(workload.requests) == 200
    for spec in workload.requests:
        assert isinstance(spec.prompt, tuple)
        assert len(spec.prompt) == spec.prompt_len
        assert spec.prompt[0] == tokenizer.bos_token_id  # what the server would add to text
        assert not set(spec.prompt[1:]) & tokenizer.special_token_ids
        assert 32 <= spec.prompt_len <= 96
        assert 10 <= spec.max_tokens <= 30
    lengths = {spec.prompt_len for spec in workload.requests}
    assert len(lengths) > 20  # the range is used, not one length


def test_text_prompts_encode_to_the_asked_length(tokenizer: Tokenizer) -> None:
    workload = build_workload(settings(random_input_len=100, random_output_len=7), tokenizer)
    for spec in workload.requests:
        assert isinstance(spec.prompt, str)
        # Counted as the server counts a completions prompt: with its BOS.
        assert len(tokenizer.encode(spec.prompt)) == spec.prompt_len == 100
        assert spec.max_tokens == 7


def test_range_ratio_bounds_follow_vllm() -> None:
    rng = np.random.default_rng(0)
    lengths = sample_lengths(rng, 5000, 100, 0.25)
    assert min(lengths) == 75 and max(lengths) == 125  # both ends reached, never beyond
    assert sample_lengths(rng, 50, 100, 0.0) == [100] * 50
    odd = sample_lengths(rng, 5000, 7, 0.5)
    assert min(odd) == math.floor(3.5) and max(odd) == math.ceil(10.5)
    assert min(sample_lengths(rng, 1000, 2, 0.9, minimum=2)) == 2


@pytest.mark.parametrize("prompt_format", ["token-ids", "text"])
def test_prefix_groups_share_identical_prefix_tokens(
    tokenizer: Tokenizer, prompt_format: str
) -> None:
    workload = build_workload(
        settings(
            dataset="prefix",
            prompt_format=prompt_format,
            prefix_num_groups=3,
            prefix_len=50,
            suffix_len=10,
            prefix_output_len=5,
            num_prompts=30,
        ),
        tokenizer,
    )
    maker = PromptMaker.create(tokenizer, prompt_format)
    ids = [
        maker.from_text(s.prompt).ids if isinstance(s.prompt, str) else s.prompt
        for s in workload.requests
    ]
    prefixes = {tuple(i[:50]) for i in ids}
    assert len(prefixes) == 3
    groups = [sum(i[:50] == prefix for i in ids) for prefix in prefixes]
    assert sorted(groups) == [10, 10, 10]
    assert all(len(i) == 60 for i in ids)
    assert [s.prompt_len for s in workload.requests] == [60] * 30
    assert {s.max_tokens for s in workload.requests} == {5}
    assert len({tuple(i) for i in ids}) == 30  # every suffix is its own
    # Shuffled: the groups interleave rather than come in blocks.
    assert [i[:50] for i in ids[:3]] != [ids[0][:50]] * 3


def test_mixed_has_short_requests_and_long_prompts_on_demand(tokenizer: Tokenizer) -> None:
    workload = build_workload(
        settings(dataset="mixed", random_input_len=20, random_output_len=8, long_input_len=1200),
        tokenizer,
    )
    assert {s.request_class for s in workload.requests} == {"short"}
    assert all(s.prompt_len == 20 for s in workload.requests)
    assert workload.background is not None
    longs = [workload.background(i) for i in range(3)]
    assert {s.request_class for s in longs} == {"long"}
    for spec in longs:
        assert isinstance(spec.prompt, str)
        assert spec.prompt_len == 1200 >= 1000
        assert len(tokenizer.encode(spec.prompt)) == 1200
        assert spec.max_tokens == 16
    assert len({s.prompt for s in longs}) == 3  # each one new: no prefix-cache hits
    assert workload.background(1) == longs[1]  # the same for the same seed and index


def test_long_prompts_must_be_long() -> None:
    with pytest.raises(ValueError, match="--long-input-len must be >= 1000"):
        settings(dataset="mixed", long_input_len=999)
    with pytest.raises(ValueError, match="the shortest long prompt"):
        settings(dataset="mixed", long_input_len=1400, long_range_ratio=0.3)
    with pytest.raises(ValueError, match="--long-fraction must be in"):
        settings(dataset="mixed", long_fraction=1.0)
    with pytest.raises(ValueError, match="--long-range-ratio must be in"):
        settings(dataset="mixed", long_range_ratio=-0.1)


def fraction_settings(**overrides: object) -> ServeBenchSettings:
    """The issue's conditional-disaggregation load: 80% short prompts of 32-128 tokens, 20%
    long ones of 1000-2000 tokens, on one arrival process."""
    chosen = settings(
        dataset="mixed",
        prompt_format="token-ids",
        random_input_len=80,
        random_range_ratio=0.6,
        random_output_len=32,
        long_input_len=1500,
        long_range_ratio=0.333,
        long_output_len=16,
        long_fraction=0.2,
        num_prompts=200,
        num_warmups=10,
    )
    return replace(chosen, **overrides)  # type: ignore[arg-type]


def test_long_fraction_mixes_both_classes_on_the_main_arrivals(tokenizer: Tokenizer) -> None:
    workload = build_workload(fraction_settings(), tokenizer)
    assert workload.background is None  # no clock of their own
    classes = [spec.request_class for spec in workload.requests]
    assert len(classes) == 200 and classes.count("long") == 40 and classes.count("short") == 160
    warmup_classes = [spec.request_class for spec in workload.warmups]
    assert warmup_classes.count("long") == 2 and len(warmup_classes) == 10
    # Interleaved at random places, not in one block.
    first_long = classes.index("long")
    assert classes[first_long : first_long + 40] != ["long"] * 40
    assert "long" in classes[:100] and "long" in classes[100:]
    for spec in workload.requests:
        assert isinstance(spec.prompt, tuple) and len(spec.prompt) == spec.prompt_len
        if spec.request_class == "short":
            assert 32 <= spec.prompt_len <= 128
            assert 12 <= spec.max_tokens <= 52
        else:
            assert 1000 <= spec.prompt_len <= 2000
            assert spec.max_tokens == 16
    short_lens = {s.prompt_len for s in workload.requests if s.request_class == "short"}
    long_lens = {s.prompt_len for s in workload.requests if s.request_class == "long"}
    assert len(short_lens) > 40 and len(long_lens) > 30  # the ranges are used
    assert min(long_lens) < 1300 and max(long_lens) > 1700
    # Every prompt is its own: no prefix-cache hits between them.
    assert len({spec.prompt for spec in workload.requests}) == 200


def test_long_fraction_is_reproducible_per_seed_and_rounds(tokenizer: Tokenizer) -> None:
    chosen = fraction_settings(seed=3, num_prompts=50, num_warmups=0)
    first, again = build_workload(chosen, tokenizer), build_workload(chosen, tokenizer)
    assert first.requests == again.requests
    other = build_workload(replace(chosen, seed=4), tokenizer)
    assert [s.request_class for s in other.requests] != [s.request_class for s in first.requests]
    assert [s.request_class for s in first.requests].count("long") == 10
    odd = build_workload(replace(chosen, num_prompts=7, long_fraction=0.3), tokenizer)
    assert [s.request_class for s in odd.requests].count("long") == 2  # round(2.1)


def test_long_fraction_is_in_the_echoed_settings() -> None:
    echo = fraction_settings().echo("m")
    assert echo["long_fraction"] == 0.2 and echo["long_range_ratio"] == 0.333
    assert "long_request_rate" not in echo
    clocked = settings(dataset="mixed").echo("m")
    assert clocked["long_request_rate"] == 0.5 and "long_fraction" not in clocked


def test_long_range_ratio_on_the_long_clock(tokenizer: Tokenizer) -> None:
    workload = build_workload(
        settings(
            dataset="mixed",
            prompt_format="token-ids",
            long_input_len=1500,
            long_range_ratio=0.333,
            num_prompts=2,
        ),
        tokenizer,
    )
    assert workload.background is not None
    lengths = [workload.background(index).prompt_len for index in range(30)]
    assert all(1000 <= length <= 2000 for length in lengths) and len(set(lengths)) > 20


def test_seed_reproduces_the_workload_and_warmups_are_distinct(tokenizer: Tokenizer) -> None:
    chosen = settings(random_input_len=30, random_range_ratio=0.3, num_warmups=3, seed=5)
    first, again = build_workload(chosen, tokenizer), build_workload(chosen, tokenizer)
    assert first.requests == again.requests and first.warmups == again.warmups
    assert len(first.requests) == 40 and len(first.warmups) == 3
    assert not set(first.warmups) & set(first.requests)
    other = build_workload(replace(chosen, seed=6), tokenizer)
    assert other.requests != first.requests


def _write_sharegpt(path: Path, tokenizer: Tokenizer) -> None:
    word = "hello there "
    long_text = word * 300  # well over 1024 tokens
    data = [
        {"id": "ok", "conversations": [
            {"from": "human", "value": "What is the capital of France today?"},
            {"from": "gpt", "value": "The capital of France is Paris, a large city."},
            {"from": "human", "value": "not used"},
        ]},
        {"id": "gpt-first", "conversations": [
            {"from": "gpt", "value": "Hello, how can I help?"},
            {"from": "human", "value": "Tell me a short story about a fox."},
            {"from": "gpt", "value": "A fox ran through the forest at night."},
        ]},
        {"id": "no-answer", "conversations": [{"from": "human", "value": "Anyone here at all?"}]},
        {"id": "human-twice", "conversations": [
            {"from": "human", "value": "First question here please?"},
            {"from": "human", "value": "Second question here please?"},
        ]},
        {"id": "short-answer", "conversations": [
            {"from": "human", "value": "Please say yes or no now."},
            {"from": "gpt", "value": "Yes"},
        ]},
        {"id": "short-prompt", "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello, how are you doing today?"},
        ]},
        {"id": "long-prompt", "conversations": [
            {"from": "human", "value": long_text},
            {"from": "gpt", "value": "That was a lot of greetings."},
        ]},
        {"id": "long-pair", "conversations": [
            {"from": "human", "value": word * 150},
            {"from": "gpt", "value": word * 300},
        ]},
        {"id": "not-a-conversation"},
    ]  # fmt: skip
    path.write_text(json.dumps(data), encoding="utf-8")
    # The fixture is only meaningful if its lengths are what the comments above say.
    assert len(tokenizer.encode(long_text)) > 1024
    pair = len(tokenizer.encode(word * 150)) + len(tokenizer.encode(word * 300, False))
    assert len(tokenizer.encode(word * 150)) <= 1024 < 2048 < pair


def test_sharegpt_parsing_and_filters(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path, tokenizer)
    maker = PromptMaker.create(tokenizer, "text")
    specs = sharegpt_requests(path, maker, np.random.default_rng(0), 6)
    kept = {s.prompt for s in specs}
    assert kept == {"What is the capital of France today?", "Tell me a short story about a fox."}
    assert len(specs) == 6  # two kept, repeated in turn to reach the count
    answer = "The capital of France is Paris, a large city."
    by_prompt = {s.prompt: s for s in specs}
    first = by_prompt["What is the capital of France today?"]
    assert first.max_tokens == len(tokenizer.encode(answer, add_special_tokens=False))
    assert isinstance(first.prompt, str)
    assert first.prompt_len == len(tokenizer.encode(first.prompt))
    assert {s.request_class for s in specs} == {"sharegpt"}
    # --max-model-len drops pairs the server could not hold.
    fox = by_prompt["Tell me a short story about a fox."]
    limit = fox.prompt_len + fox.max_tokens
    assert first.prompt_len + first.max_tokens > limit
    capped = sharegpt_requests(path, maker, np.random.default_rng(0), 2, max_model_len=limit)
    assert {s.prompt for s in capped} == {fox.prompt}


def test_sharegpt_token_ids_and_unreadable_files(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path, tokenizer)
    maker = PromptMaker.create(tokenizer, "token-ids")
    for spec in sharegpt_requests(path, maker, np.random.default_rng(1), 2):
        assert isinstance(spec.prompt, tuple) and len(spec.prompt) == spec.prompt_len
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="passes the ShareGPT length filters"):
        sharegpt_requests(empty, maker, np.random.default_rng(0), 1)
    with pytest.raises(ValueError, match="cannot read"):
        sharegpt_requests(tmp_path / "missing.json", maker, np.random.default_rng(0), 1)


@pytest.mark.skipif(
    not SHAREGPT_FILE.is_file(), reason="the ShareGPT sample is not on this machine"
)
def test_real_sharegpt_sample(tokenizer: Tokenizer) -> None:
    chosen = settings(dataset="sharegpt", dataset_path=str(SHAREGPT_FILE), num_prompts=100)
    workload = build_workload(chosen, tokenizer)
    assert len(workload.requests) == 100
    assert len({s.prompt for s in workload.requests}) == 100
    for spec in workload.requests:
        assert 4 <= spec.prompt_len <= 1024 and spec.max_tokens >= 4
        assert spec.prompt_len + spec.max_tokens <= 2048
    capped = build_workload(replace(chosen, max_model_len=512), tokenizer)
    assert all(s.prompt_len + s.max_tokens <= 512 for s in capped.requests)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt_format": "token-ids", "endpoint_type": "chat"}, "token-ids needs"),
        ({"dataset": "sharegpt"}, "--dataset-path"),
        ({"duration_s": 5.0}, "--duration needs"),
        ({"random_range_ratio": 1.0}, "range-ratio"),
        ({"request_rate": 0.0}, "--request-rate"),
        ({"num_prompts": 0}, "--num-prompts"),
    ],
)
def test_settings_refuse_what_cannot_run(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(**overrides)
