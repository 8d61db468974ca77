"""The engine is exact to the token: greedy output and per-step logits match transformers.

Tiny random Llama, Qwen2 and Qwen3 checkpoints in float32 on CPU; 10 prompts of different
lengths batched together; 32 greedy tokens. Then the same with prefix-cache hits, with prompts
split by chunked prefill, and with a KV pool so small that requests are preempted.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from tests.engine.reference import HFGreedy, hf_greedy, trace_engine

NEW_TOKENS = 32
LOGITS_ATOL = 1e-4
ARCHITECTURES = ["tiny", "tiny-qwen2", "tiny-qwen3"]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 31, 40, 64, 5, 90]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(37)]
    suffixes = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 4, 11, 20, 0)]
    return [prefix + s for s in suffixes] + [prefix[:16], prefix[:17], prefix[:33]]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    init_checkpoint(folder, request.param, seed=1)
    return folder


class References:
    """transformers' greedy output per prompt set, computed once per checkpoint."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Path, str], tuple[list[list[int]], list[HFGreedy]]] = {}

    def get(
        self, checkpoint: Path, kind: str, vocab_size: int
    ) -> tuple[list[list[int]], list[HFGreedy]]:
        key = (checkpoint, kind)
        if key not in self._cache:
            maker = make_prompts if kind == "mixed" else shared_prefix_prompts
            prompts = maker(vocab_size, seed=0)
            self._cache[key] = (prompts, hf_greedy(checkpoint, prompts, NEW_TOKENS))
        return self._cache[key]


@pytest.fixture(scope="module")
def references() -> References:
    return References()


def assert_matches(llm: LLM, prompts: list[list[int]], reference: list[HFGreedy]) -> list:
    with trace_engine(llm.engine) as trace:
        outputs = llm.generate(prompts, GREEDY)
    for index, (output, expected) in enumerate(zip(outputs, reference, strict=True)):
        assert output.outputs[0].token_ids == expected.tokens, f"prompt {index} diverged"
        logits = trace.stacked(output.request_id)
        assert logits.shape == expected.logits.shape
        torch.testing.assert_close(logits, expected.logits, atol=LOGITS_ATOL, rtol=0)
    llm.engine.kv_cache.check_invariants()
    return [outputs, trace]


def test_batched_greedy_matches_transformers(checkpoint: Path, references: References) -> None:
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8)
    prompts, expected = references.get(checkpoint, "mixed", llm.engine.model.config.vocab_size)
    assert_matches(llm, prompts, expected)


def test_prefix_cache_hits_match_transformers(checkpoint: Path, references: References) -> None:
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, block_size=8)
    prompts, reference = references.get(checkpoint, "shared", llm.engine.model.config.vocab_size)
    first, _ = assert_matches(llm, prompts, reference)
    # Within the first batch, prompts admitted after the first chunk of the prefix hit it too.
    second, _ = assert_matches(llm, prompts, reference)
    assert all(o.num_cached_tokens > 0 for o in second)
    # The cache never serves a prompt's last token: a 16-token prompt hits one 8-token block.
    assert second[5].num_cached_tokens == 8
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)


def test_chunked_prefill_matches_transformers(checkpoint: Path, references: References) -> None:
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=4,
    )
    prompts, expected = references.get(checkpoint, "mixed", llm.engine.model.config.vocab_size)
    _, trace = assert_matches(llm, prompts, expected)
    assert trace.max_tokens_in_step <= 12
    assert trace.num_chunked_steps > 0


def test_preemption_matches_transformers(checkpoint: Path, references: References) -> None:
    # 40 blocks of 4 tokens: the 10 requests need ~130 blocks together, the longest 31 alone.
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        enable_prefix_caching=False,
    )
    prompts, expected = references.get(checkpoint, "mixed", llm.engine.model.config.vocab_size)
    _, trace = assert_matches(llm, prompts, expected)
    assert trace.num_preemptions > 0


def test_preemption_with_prefix_cache_matches_transformers(
    checkpoint: Path, references: References
) -> None:
    llm = LLM(
        str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=32
    )
    prompts, expected = references.get(checkpoint, "shared", llm.engine.model.config.vocab_size)
    _, trace = assert_matches(llm, prompts, expected)
    assert trace.num_preemptions > 0


def test_engine_on_triton_kernels_matches_transformers(
    checkpoint: Path, references: References
) -> None:
    """The engine with its Triton kernels (the GPU path; here in Triton's CPU interpreter)."""
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=8,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        attention_backend="triton",
    )
    prompts, expected = references.get(checkpoint, "mixed", llm.engine.model.config.vocab_size)
    # Four prompts keep the interpreter fast; chunking and mixed decode+prefill steps still occur.
    picks = [1, 3, 6, 9]
    _, trace = assert_matches(llm, [prompts[i] for i in picks], [expected[i] for i in picks])
    assert trace.num_chunked_steps > 0
