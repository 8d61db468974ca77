"""The engine's expert routing counts (`LLMEngine.expert_routing_counts`) are the routing
transformers itself makes: per routed layer and expert, exactly, on the tokens the engine
forwarded; and their sum is forwarded tokens x top_k x routed layers (Qwen2-MoE's dense layer
counts nothing). A dense model has none.

The checkpoints are transformers' own (`tests/engine/moe_checkpoints.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nori.engine.llm import LLM
from nori.engine.outputs import ExpertRoutingCounts, expert_imbalance
from nori.sampling.params import SamplingParams
from tests.engine.moe_checkpoints import MOE_ARCHITECTURES, VOCAB_SIZE, write_moe_checkpoint
from tests.engine.test_fidelity import make_prompts

# The decoder layers with a router, from the checkpoints' configs (Qwen2-MoE: layer 1 dense).
ROUTED_LAYERS = {"mixtral": (0, 1), "qwen2_moe": (0, 2), "qwen3_moe": (0, 1)}
TOP_K = 2
NUM_EXPERTS = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def transformers_routing(folder: Path, sequences: list[list[int]]) -> list[list[int]]:
    """Per routed layer, the tokens per expert of transformers' own router over `sequences`
    (each run alone, from its first position): top-k of each layer's router logits, counted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    totals: list[torch.Tensor] | None = None
    with torch.no_grad():
        for tokens in sequences:
            router_logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
            counts = [
                torch.bincount(logits.topk(TOP_K, dim=-1).indices.flatten(), minlength=NUM_EXPERTS)
                for logits in router_logits
            ]
            totals = (
                counts if totals is None else [a + b for a, b in zip(totals, counts, strict=True)]
            )
    assert totals is not None
    return [layer.tolist() for layer in totals]


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_expert_counts_are_transformers_routing(architecture: str, tmp_path: Path) -> None:
    folder = write_moe_checkpoint(tmp_path / architecture, architecture)
    prompts = make_prompts(VOCAB_SIZE, seed=0)[:5]
    # Chunked prompts batched with decodes; no prefix cache, a pool with room for all.
    llm = LLM(
        str(folder),
        dtype="float32",
        num_kv_blocks=128,
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    before = engine.expert_routing_counts()
    assert before is not None
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    counts = engine.expert_routing_counts()
    assert counts is not None
    run = counts.since(before)
    load = engine.load()
    assert load.num_preemptions == 0

    # Forwarded: every prompt position, then each sampled token but the last (never fed back).
    forwarded = [
        prompt + output.outputs[0].token_ids[:-1]
        for prompt, output in zip(prompts, outputs, strict=True)
    ]
    num_forwarded = sum(len(tokens) for tokens in forwarded)
    assert load.num_prompt_tokens_computed == sum(len(prompt) for prompt in prompts)
    assert [layer for layer, _ in run.layers] == list(ROUTED_LAYERS[architecture])
    assert run.top_k == TOP_K
    assert run.total == num_forwarded * TOP_K * len(ROUTED_LAYERS[architecture])
    for _, layer_counts in run.layers:
        assert len(layer_counts) == NUM_EXPERTS
        assert sum(layer_counts) == num_forwarded * TOP_K

    expected = transformers_routing(folder, forwarded)
    assert [list(layer_counts) for _, layer_counts in run.layers] == expected
    # Routing is decisive in these checkpoints but not even: the imbalance is measurable.
    for layer_counts in expected:
        imbalance = expert_imbalance(tuple(layer_counts))
        assert imbalance is not None and 1.0 < imbalance < NUM_EXPERTS


def test_counts_are_cumulative_and_windows_subtract(tmp_path: Path) -> None:
    folder = write_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=8)
    engine = llm.engine
    prompts = make_prompts(VOCAB_SIZE, seed=1)[:3]
    first_prompts, second_prompts = prompts[:2], prompts[2:]
    start = engine.expert_routing_counts()
    llm.generate(first_prompts, GREEDY, use_tqdm=False)
    middle = engine.expert_routing_counts()
    llm.generate(second_prompts, GREEDY, use_tqdm=False)
    end = engine.expert_routing_counts()
    assert start is not None and middle is not None and end is not None

    def forwarded(batch: list[list[int]]) -> int:
        return sum(len(prompt) + GREEDY.max_tokens - 1 for prompt in batch)

    layers = len(ROUTED_LAYERS["qwen3_moe"])
    assert middle.since(start).total == forwarded(first_prompts) * TOP_K * layers
    assert end.since(middle).total == forwarded(second_prompts) * TOP_K * layers
    assert end.since(start).total == middle.since(start).total + end.since(middle).total
    # A snapshot is a copy: later steps leave it as it was.
    assert middle.total < end.total


def test_imbalance_is_max_over_mean() -> None:
    assert expert_imbalance((5, 5, 5, 5)) == 1.0
    assert expert_imbalance((8, 0, 0, 0)) == 4.0
    assert expert_imbalance((3, 1, 0, 0)) == 3.0
    assert expert_imbalance((0, 0)) is None
    counts = ExpertRoutingCounts(top_k=1, layers=((0, (1, 2)),))
    with pytest.raises(ValueError, match="different models"):
        counts.since(ExpertRoutingCounts(top_k=1, layers=((1, (0, 0)),)))


def test_dense_model_has_no_expert_counts() -> None:
    llm = LLM("demo", num_kv_blocks=16, block_size=8)
    assert llm.engine.expert_routing_counts() is None
