"""CausalLM logits against transformers on the same checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nori.models.config import ModelConfig, RopeScaling
from nori.models.llama import CausalLM
from nori.models.loader import load_model
from nori.models.presets import PRESETS
from tests.models.dense_attention import SingleSequenceCausalAttention
from tests.models.model_helpers import STORIES_260K, sample_ids

TOLERANCE = 1e-4

CONFIGS: dict[str, ModelConfig] = {
    "tiny": PRESETS["tiny"],
    "tiny-qwen2": PRESETS["tiny-qwen2"],
    "tiny-qwen3": PRESETS["tiny-qwen3"],
    "tiny-mixtral": PRESETS["tiny-mixtral"],
    "tiny-qwen2-moe": PRESETS["tiny-qwen2-moe"],
    "tiny-qwen3-moe": PRESETS["tiny-qwen3-moe"],
    # A dense layer between routed ones (Qwen2-MoE's `mlp_only_layers`).
    "qwen2-moe-dense-layer": replace(PRESETS["tiny-qwen2-moe"], mlp_only_layers=(0,)),
    # Short original context so positions below 64 already reach the scaled frequencies.
    "llama3-scaling-tied": replace(
        PRESETS["tiny"],
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32),
        tie_word_embeddings=True,
    ),
    "llama-untied-bias": replace(
        PRESETS["tiny"], attention_bias=True, attention_output_bias=True, mlp_bias=True
    ),
    "mistral": replace(
        PRESETS["tiny"], architecture="MistralForCausalLM", num_key_value_heads=1, head_dim=8
    ),
}


class FlattenedAttention:
    """Causal attention over several sequences flattened into one token axis."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.dense = SingleSequenceCausalAttention()

    def __call__(
        self,
        layer_index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        parts = zip(
            query.split(self.lengths),
            key.split(self.lengths),
            value.split(self.lengths),
            strict=True,
        )
        return torch.cat([self.dense(layer_index, q, k, v, scale) for q, k, v in parts])


def _our_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), SingleSequenceCausalAttention())
        return model.compute_logits(hidden)


def _reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return reference(ids[None]).logits[0].float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(
    name: str, make_checkpoint: Callable[[ModelConfig], Path]
) -> None:
    config = CONFIGS[name]
    folder = make_checkpoint(config)
    model, loaded_config = load_model(folder, torch.float32, "cpu")
    assert loaded_config == config
    ids = sample_ids(config.vocab_size, 48)
    ours = _our_logits(model, ids)
    assert ours.dtype == torch.float32 and ours.shape == (48, config.vocab_size)
    torch.testing.assert_close(ours, _reference_logits(folder, ids), rtol=0, atol=TOLERANCE)


def test_flattened_sequences_do_not_mix(make_checkpoint: Callable[[ModelConfig], Path]) -> None:
    model, config = load_model(make_checkpoint(PRESETS["tiny-qwen3"]), torch.float32, "cpu")
    sequences = [
        sample_ids(config.vocab_size, length, seed) for seed, length in enumerate((7, 3, 12))
    ]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(len(sequence)) for sequence in sequences])
    with torch.inference_mode():
        hidden = model(ids, positions, FlattenedAttention([len(s) for s in sequences]))
        batched = model.compute_logits(hidden)
    separate = torch.cat([_our_logits(model, sequence) for sequence in sequences])
    torch.testing.assert_close(batched, separate, rtol=0, atol=1e-5)


def test_stories260k_matches_transformers() -> None:
    if not (STORIES_260K / "config.json").is_file():
        pytest.skip(f"real checkpoint not found at {STORIES_260K}")
    model, config = load_model(STORIES_260K, torch.float32, "cpu")
    ids = sample_ids(config.vocab_size, 64)
    torch.testing.assert_close(
        _our_logits(model, ids), _reference_logits(STORIES_260K, ids), rtol=0, atol=TOLERANCE
    )


def test_bfloat16_stays_close_to_float32(make_checkpoint: Callable[[ModelConfig], Path]) -> None:
    folder = make_checkpoint(PRESETS["tiny"])
    ids = sample_ids(PRESETS["tiny"].vocab_size, 32)
    full = _our_logits(load_model(folder, torch.float32, "cpu")[0], ids)
    half_model, _ = load_model(folder, torch.bfloat16, "cpu")
    assert half_model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half_model.rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(_our_logits(half_model, ids), full, rtol=0, atol=0.05)
