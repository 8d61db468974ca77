from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nori.kernels.rotary import rotary_reference
from nori.models.config import ModelConfig, RopeScaling
from nori.models.presets import PRESETS
from nori.models.rope import RotaryEmbedding, inverse_frequencies


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


def _hf_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Hugging Face's formula, spelled out: x * cos + rotate_half(x) * sin."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_rotation_follows_each_tokens_own_position() -> None:
    config: ModelConfig = PRESETS["tiny"]
    rotary = RotaryEmbedding(config)
    x = torch.randn(5, 2, config.head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 0, 1])  # two sequences flattened
    rotated = rotary(positions, torch.float32).apply(x.clone())
    assert torch.equal(rotated[0], x[0]) and torch.equal(rotated[3], x[3])  # position 0: identity
    assert not torch.allclose(rotated[1], x[1])
    torch.testing.assert_close(
        rotated[4:5], rotary(torch.tensor([1]), torch.float32).apply(x[4:5].clone())
    )
    # A rotation preserves each pair's norm.
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_rotation_is_the_hugging_face_formula() -> None:
    """Bit for bit on the PyTorch path; to float32 rounding on the CPU kernel (rotary_cpu.cpp),
    which rotates in place."""
    config: ModelConfig = PRESETS["demo"]
    rotary = RotaryEmbedding(config)
    x = torch.randn(7, 12, config.head_dim, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 5, 17, 300, 1023, 2047, 4000])
    expected = _hf_rotate(x, positions, rotary.inv_freq)
    tables = rotary(positions, torch.float32)
    assert torch.equal(rotary_reference(x, tables.cos, tables.sin), expected)
    torch.testing.assert_close(tables.apply(x.clone()), expected, atol=1e-6, rtol=1e-6)
