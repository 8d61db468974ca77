"""Mixture-of-experts models are exact to the token in the engine: Mixtral, Qwen2-MoE (shared
expert, a dense layer, no top-k renormalisation) and Qwen3-MoE, in float32, against transformers'
greedy output and per-step logits; batched, with chunked prefill, and with preemption.

The checkpoints are transformers' own (`tests/engine/moe_checkpoints.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nori.engine.llm import LLM
from nori.sampling.params import SamplingParams
from tests.engine.moe_checkpoints import MOE_ARCHITECTURES, VOCAB_SIZE, write_moe_checkpoint
from tests.engine.reference import HFGreedy, hf_greedy
from tests.engine.test_fidelity import NEW_TOKENS, assert_matches, make_prompts

GREEDY_FEW = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[HFGreedy]]:
    folder = write_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = make_prompts(VOCAB_SIZE, seed=0)
    return folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS)


def test_moe_routing_differs_between_tokens(
    moe_checkpoint: tuple[Path, list[list[int]], list[HFGreedy]],
) -> None:
    """The checkpoints route decisively and spread tokens over experts (else the fidelity
    tests below could pass with a broken router or a broken dispatch)."""
    folder, prompts, _ = moe_checkpoint
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=256, block_size=8)
    llm.generate(prompts[:4], GREEDY_FEW)
    routing = llm.engine.expert_routing_counts()
    assert routing is not None
    for _, counts in routing.layers:
        assert sum(count > 0 for count in counts) >= 6, counts


def test_moe_batched_greedy_and_chunked_prefill_match_transformers(
    moe_checkpoint: tuple[Path, list[list[int]], list[HFGreedy]],
) -> None:
    folder, prompts, expected = moe_checkpoint
    llm = LLM(
        str(folder),
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=4,
    )
    _, trace = assert_matches(llm, prompts, expected)
    assert trace.num_chunked_steps > 0


def test_moe_preemption_matches_transformers(
    moe_checkpoint: tuple[Path, list[list[int]], list[HFGreedy]],
) -> None:
    folder, prompts, expected = moe_checkpoint
    llm = LLM(
        str(folder), dtype="float32", block_size=4, num_kv_blocks=40, enable_prefix_caching=False
    )
    _, trace = assert_matches(llm, prompts, expected)
    assert trace.num_preemptions > 0


def test_moe_prefix_cache_hits_match_transformers(
    moe_checkpoint: tuple[Path, list[list[int]], list[HFGreedy]],
) -> None:
    folder, prompts, expected = moe_checkpoint
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=256, block_size=8)
    assert_matches(llm, prompts, expected)
    outputs, _ = assert_matches(llm, prompts, expected)
    assert sum(output.num_cached_tokens for output in outputs) > 0
