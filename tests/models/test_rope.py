from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nori.models.config import ModelConfig, RopeScaling
from nori.models.presets import PRESETS
from nori.models.rope import RotaryEmbedding, apply_rotary, inverse_frequencies


def test_llama3_frequencies_match_transformers() -> None:
    config = PRESETS["llama3-8b"]
    hf_config = LlamaConfig(**config.to_dict())
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    actual = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, "cpu")
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_scaling_keeps_high_frequencies_and_divides_low_ones() -> None:
    scaling = RopeScaling(8.0, 1.0, 4.0, 8192)
    plain = inverse_frequencies(128, 5e5, None, "cpu")
    scaled = inverse_frequencies(128, 5e5, scaling, "cpu")
    assert torch.equal(scaled[:4], plain[:4])
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)


def test_rotation_follows_each_tokens_own_position() -> None:
    config: ModelConfig = PRESETS["tiny"]
    rotary = RotaryEmbedding(config)
    x = torch.randn(5, 2, config.head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 0, 1])  # two sequences flattened
    cos, sin = rotary(positions, torch.float32)
    rotated = apply_rotary(x, cos, sin)
    assert torch.equal(rotated[0], x[0]) and torch.equal(rotated[3], x[3])  # position 0: identity
    cos1, sin1 = rotary(torch.tensor([1]), torch.float32)
    torch.testing.assert_close(rotated[4:5], apply_rotary(x[4:5], cos1, sin1))
    # A rotation preserves each pair's norm.
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
