"""Speculative decoding in the engine: greedy output is token-exact against transformers with
either proposer, and everything a request reports (text, stop reasons, logprobs, penalties,
streamed deltas) is that of a run without speculation; rejected drafts leak no block.

Tiny random Llama, Qwen2 and Qwen3 checkpoints and the trained stories260K, float32 on CPU. The
draft model is the first half of the target's layers (`truncate_layers`): it shares the tokenizer and
agrees with the target often, but not always, so verifications both accept and reject.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nori.engine.config import SpeculativeConfig
from nori.engine.engine import LLMEngine
from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.models.truncate import truncate_layers
from nori.sampling.params import SamplingParams
from tests.engine.reference import hf_greedy

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)


def draft_config(target: Path, tmp: Path) -> SpeculativeConfig:
    """A draft of the target's first half of its layers."""
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    draft = truncate_layers(target, tmp / "draft", max(layers // 2, 1))
    return SpeculativeConfig("draft_model", 3, model=str(draft))


def repetitive_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts with recurring phrases, so that n-gram lookups find drafts from the start."""
    rng = random.Random(seed)
    prompts = []
    for length in (2, 7, 16, 17, 40, 64):
        phrase = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 6))]
        noise = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompts.append((phrase + noise[: length // 3]) * 3 + phrase[:1])
    return prompts


def assert_spec_ran(engine: LLMEngine, rejections: bool = False) -> None:
    """Drafts were verified and some accepted (and, with `rejections`, some rejected): else the
    test would prove nothing about speculation."""
    counts = engine.load().spec_decode
    assert counts.num_accepted_tokens > 0, counts
    if rejections:
        assert counts.num_accepted_tokens < counts.num_draft_tokens, counts


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("tiny", "ngram"),
        ("tiny-qwen2", "ngram"),
        ("tiny-qwen3", "ngram"),
        ("tiny", "draft"),
        ("tiny-qwen3", "draft"),
    ],
)
def test_greedy_matches_transformers(arch: str, method: str, tmp_path: Path) -> None:
    """With chunked prefill (a 32-token step budget), the prefix cache, and a pool small
    enough to preempt: the same tokens as transformers' greedy search."""
    target = init_checkpoint(tmp_path / arch, arch, seed=1)
    spec = NGRAM if method == "ngram" else draft_config(target, tmp_path)
    llm = LLM(
        str(target),
        dtype="float32",
        speculative_config=spec,
        max_num_batched_tokens=32,
        num_kv_blocks=12,
        block_size=16,
    )
    prompts = repetitive_prompts(llm.engine.model.config.vocab_size, seed=3)
    prompts += [prompts[4][:33], prompts[4][:48]]  # prefix-cache hits on the longer prompt
    expected = hf_greedy(target, prompts, NEW_TOKENS)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == reference.tokens, f"prompt {index} diverged"
    assert_spec_ran(llm.engine, rejections=(arch, method) == ("tiny", "draft"))
    assert llm.engine.load().num_preemptions > 0, "the pool was meant to preempt"
    llm.engine.kv_cache.check_invariants()
    load = llm.engine.load()
    assert load.num_free_blocks == load.num_total_blocks


@pytest.fixture(scope="module")
def stories() -> Path:
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES}")
    return STORIES


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stories_greedy_matches_transformers(stories: Path, method: str, tmp_path: Path) -> None:
    spec = NGRAM if method == "ngram" else draft_config(stories, tmp_path)
    llm = LLM(str(stories), dtype="float32", speculative_config=spec, num_kv_blocks=256)
    texts = ["Once upon a time", "The little dog saw the cat. The little dog", "Lily wanted to"]
    prompts = [llm.tokenizer.encode(text) for text in texts]
    expected = hf_greedy(stories, prompts, 48)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for output, reference in zip(outputs, expected, strict=True):
        assert output.outputs[0].token_ids == reference.tokens
    assert_spec_ran(llm.engine)


def run_streams(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Each request's finished output and the concatenation of its streamed deltas."""
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(index), prompt, p)
    streamed: dict[str, list] = {str(i): [[], ""] for i in range(len(prompts))}
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed[output.request_id][0].extend(output.new_token_ids)
            streamed[output.request_id][1] += output.new_text
            if output.finished:
                final[output.request_id] = output
    return {key: (final[key], tuple(streamed[key][0]), streamed[key][1]) for key in final}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_requests_see_what_a_plain_run_sees(stories: Path, method: str, tmp_path: Path) -> None:
    """Stop strings and tokens, max_tokens, penalties, min_tokens, logprobs and the streamed
    deltas: identical with and without speculation."""
    spec = NGRAM if method == "ngram" else draft_config(stories, tmp_path)
    prompts = [
        "The little dog saw the cat. The little dog saw the",
        "Once upon a time, there was a girl. Once upon a time",
        "Lily wanted to play. Lily wanted to",
        "One day, a big bird flew. One day, a big",
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, stop=[" ball", "ran"]),
        SamplingParams(max_tokens=7, temperature=0.0, logprobs=3),
        SamplingParams(
            max_tokens=30,
            temperature=0.0,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            min_tokens=20,
            logprobs=0,
        ),
        SamplingParams(
            max_tokens=30, temperature=0.0, stop_token_ids=[13], include_stop_str_in_output=True
        ),
    ]
    plain = run_streams(LLMEngine_for(stories, None), prompts, params)
    engine = LLMEngine_for(stories, spec)
    speculative = run_streams(engine, prompts, params)
    assert_spec_ran(engine, rejections=True)
    for key, (expected, expected_tokens, expected_text) in plain.items():
        output, tokens, text = speculative[key]
        assert output.token_ids == expected.token_ids, f"request {key}"
        assert (output.text, output.finish_reason, output.stop_reason) == (
            expected.text,
            expected.finish_reason,
            expected.stop_reason,
        )
        assert (tokens, text) == (expected_tokens, expected_text)
        if expected.logprobs is not None:
            assert output.logprobs is not None
            assert len(output.logprobs) == len(expected.logprobs)
            for ours, theirs in zip(output.logprobs, expected.logprobs, strict=True):
                assert ours.token_id == theirs.token_id and ours.rank == theirs.rank
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
                assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def LLMEngine_for(model: Path, spec: SpeculativeConfig | None) -> LLMEngine:
    from nori.engine.config import EngineConfig

    return LLMEngine(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=128, speculative_config=spec)
    )


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_aborts_and_rejections_leak_no_block(stories: Path, method: str, tmp_path: Path) -> None:
    """Mixed speculative (greedy, sampled) and plain (a penalty-free batch past the drafts'
    reach) requests, some aborted mid-stream: every block is back at the end, the draft's
    cache tensors included (they share the one block table)."""
    spec = NGRAM if method == "ngram" else draft_config(stories, tmp_path)
    engine = LLMEngine_for(stories, spec)
    start = engine.load().num_free_blocks
    text = "The little dog saw the cat. The little dog saw the cat. The"
    for index in range(12):
        params = SamplingParams(
            max_tokens=10 + 7 * index,
            temperature=0.0 if index % 2 else 0.9,
            seed=index,
            ignore_eos=True,
        )
        engine.add_request(str(index), text, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 4:
            for victim in ("1", "4", "9"):
                engine.abort_request(victim)
        engine.kv_cache.check_invariants()
    counts = engine.load().spec_decode
    assert counts.num_drafts > 0 and counts.num_accepted_tokens < counts.num_draft_tokens
    assert engine.load().num_free_blocks == start


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_requests_are_reproducible(stories: Path, method: str, tmp_path: Path) -> None:
    spec = NGRAM if method == "ngram" else draft_config(stories, tmp_path)
    prompt = "The little dog saw the cat. The little dog saw the cat. The"
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    runs = []
    for batch_mates in (0, 3):
        engine = LLMEngine_for(stories, spec)
        for index in range(batch_mates):
            engine.add_request(
                f"mate{index}", prompt, SamplingParams(max_tokens=40, temperature=1.0)
            )
        engine.add_request("seeded", prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        runs.append(outputs["seeded"].token_ids)
        assert_spec_ran(engine)
    assert runs[0] == runs[1]
