"""The Triton kernels of each layer's elementwise chain (RMSNorm with the residual add, rotary
on q and k, SiLU·mul) against their PyTorch references, under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import DEVICE

import nori.kernels.rms_norm as rms_norm_module
import nori.kernels.rotary as rotary_module
import nori.kernels.silu_and_mul as silu_and_mul_module
from nori.engine.llm import LLM
from nori.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from nori.kernels.rotary import rotary_reference, rotary_triton
from nori.kernels.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One unit in the last place of the output dtype (the reduction's order may differ); two for
# bfloat16 on CPU, where the interpreter truncates float32 -> bfloat16 casts (numpy has no
# bfloat16) instead of rounding to nearest as the GPU does.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-10}
# Bit for bit where the casts round as PyTorch's do.
EXACT = {torch.float32, torch.float16} | ({torch.bfloat16} if DEVICE.type == "cuda" else set())


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [8, 64, 100])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, size: int) -> None:
    x = _randn(5, size, dtype=dtype)
    weight = _randn(size, dtype=dtype, seed=1)
    normed, same = rms_norm_triton(x.clone(), weight, 1e-5)
    _assert_close(normed, rms_norm_reference(x, weight, 1e-5))
    assert torch.equal(same, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_residual_add_updates_both_in_place(dtype: torch.dtype) -> None:
    x, residual = _randn(6, 48, dtype=dtype), _randn(6, 48, dtype=dtype, seed=2)
    weight = _randn(48, dtype=dtype, seed=1)
    hidden = x + residual
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = rms_norm_triton(x_in, weight, 1e-6, residual_in)
    assert normed is x_in and new_residual is residual_in
    if dtype in EXACT:
        assert torch.equal(new_residual, hidden)  # the add, rounded as the reference rounds it
    _assert_close(new_residual, hidden)
    _assert_close(normed, rms_norm_reference(hidden, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(dtype: torch.dtype) -> None:
    """q_norm's input: heads sliced out of a fused projection, rows not contiguous."""
    fused = _randn(4, 3, 2, 16, dtype=dtype)
    heads = fused[:, 0]  # [4, 2, 16], row stride 96
    weight = _randn(16, dtype=dtype, seed=1)
    normed, _ = rms_norm_triton(heads, weight, 1e-5)
    _assert_close(normed, rms_norm_reference(heads, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [16, 1000, 1500])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, size: int) -> None:
    x = _randn(3, 2 * size, dtype=dtype)
    _assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 96])
def test_rotary_matches_the_reference_bit_for_bit(dtype: torch.dtype, head_dim: int) -> None:
    """q and k heads rotated in one launch, in place, inside a wider fused projection."""
    tokens, heads = 7, 5
    qkv = _randn(tokens, heads + 2, head_dim, dtype=dtype)
    x = qkv[:, :heads]
    angles = _randn(tokens, head_dim // 2, dtype=torch.float32, seed=3) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = rotary_reference(x, cos, sin)
    untouched = qkv[:, heads:].clone()
    result = rotary_triton(x, cos, sin)
    assert result.data_ptr() == x.data_ptr()
    if dtype in EXACT:
        assert torch.equal(result, expected)
    else:
        _assert_close(result, expected)
    assert torch.equal(qkv[:, heads:], untouched)


def test_the_model_gives_the_same_tokens_through_the_triton_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoder's wiring of the three kernels (in place where they are), float32 greedy."""
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 33, 2, 17]}, {"prompt_token_ids": [40, 41, 42]}]

    def generate() -> list[list[int]]:
        llm = LLM(str(model), num_kv_blocks=64, dtype="float32")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    expected = generate()
    for module in (rms_norm_module, rotary_module, silu_and_mul_module):
        monkeypatch.setattr(module, "should_use_triton", lambda *_: True)
    assert generate() == expected
