from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from nori.kernels import (
    QUANT_METHODS,
    dequantize_weight,
    quantize_weight,
    weight_only_linear,
    weight_only_linear_reference,
)

# Triton vs reference, per activation dtype. Both accumulate in float32 (products of the
# stored weights and the activations are exact there), so float32 differs only by summation
# order; half-precision outputs may also round to the neighbouring value.
TRITON_TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2},
}
# (tokens, in_features, out_features): none a multiple of the tile sizes but 64; 70 tokens
# take the prefill tiles (two row tiles), and 300 input features several K steps.
SHAPES = [(1, 40, 24), (5, 64, 100), (33, 40, 100), (70, 300, 24)]
# The largest fp8 e4m3 value, and the smallest normal one.
FP8_MAX = 448.0
FP8_MIN_NORMAL = 2.0**-6


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes, so that a shared scale would fail the per-channel checks.
    row_scale = torch.logspace(-2, 1, out_features)[:, None]
    return torch.randn(out_features, in_features, generator=generator) * row_scale


def _activations(
    num_tokens: int, in_features: int, dtype: torch.dtype, seed: int = 1
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # A view into a wider tensor (row stride > in_features), as when sliced from a fused output.
    wide = torch.randn(num_tokens, in_features + 8, generator=generator).to(dtype)
    return wide[:, 3 : 3 + in_features].to(DEVICE)


def _bias(out_features: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, generator=generator).to(dtype).to(DEVICE)


def _quantized(
    out_features: int, in_features: int, method: str
) -> tuple[torch.Tensor, torch.Tensor]:
    qweight, scale = quantize_weight(_weight(out_features, in_features), method)
    return qweight.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("method", QUANT_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("num_tokens", "in_features", "out_features"), SHAPES)
def test_triton_matches_reference(
    method: str,
    dtype: torch.dtype,
    with_bias: bool,
    num_tokens: int,
    in_features: int,
    out_features: int,
) -> None:
    qweight, scale = _quantized(out_features, in_features, method)
    x = _activations(num_tokens, in_features, dtype)
    bias = _bias(out_features, dtype) if with_bias else None
    actual = weight_only_linear(x, qweight, scale, bias, use_triton=True)
    expected = weight_only_linear_reference(x, qweight, scale, bias)
    assert actual.shape == (num_tokens, out_features)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TRITON_TOLERANCE[dtype])


@pytest.mark.parametrize("method", QUANT_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64_linear(method: str, dtype: torch.dtype) -> None:
    qweight, scale = _quantized(100, 40, method)
    x = _activations(7, 40, dtype)
    bias = _bias(100, torch.float32)
    expected = torch.nn.functional.linear(
        x.double(), dequantize_weight(qweight, scale, torch.float64), bias.double()
    )
    actual = weight_only_linear_reference(x, qweight, scale, bias)
    assert actual.dtype == dtype
    # float32 keeps about 7 digits over a 40-term sum; bfloat16 output keeps 3.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)


def test_dispatch_picks_the_reference_off_gpu() -> None:
    qweight, scale = quantize_weight(_weight(24, 40), "int8")
    x = _activations(3, 40, torch.float32).cpu()
    # On CPU tensors use_triton=None must give exactly the reference.
    assert torch.equal(
        weight_only_linear(x, qweight, scale), weight_only_linear_reference(x, qweight, scale)
    )


def test_empty_batch() -> None:
    qweight, scale = _quantized(24, 40, "int8")
    x = _activations(0, 40, torch.float32)
    out = weight_only_linear(x, qweight, scale, use_triton=True)
    assert out.shape == (0, 24)


def test_int8_round_trip_is_within_half_a_step() -> None:
    weight = _weight(24, 40)
    qweight, scale = quantize_weight(weight, "int8")
    assert qweight.dtype == torch.int8
    assert scale.dtype == torch.float32
    assert qweight.shape == weight.shape
    assert scale.shape == (24,)
    error = (weight.double() - dequantize_weight(qweight, scale, torch.float64)).abs()
    # Half a step, plus float32's error in w / scale (|w / scale| <= 127).
    step = scale.double()[:, None]
    assert bool((error <= step / 2 + 1e-5 * step).all())


def test_int8_values_stay_symmetric() -> None:
    weight = _weight(24, 40)
    # The most negative element of every row is its largest magnitude: it must map to -127.
    weight[:, 0] = -weight.abs().amax(dim=1) * 1.5
    qweight, _ = quantize_weight(weight, "int8")
    assert int(qweight.min()) == -127
    assert int(qweight.max()) <= 127
    assert bool((qweight[:, 0] == -127).all())


@pytest.mark.parametrize(("method", "limit"), [("int8", 127.0), ("fp8", FP8_MAX)])
def test_scales_are_per_output_channel(method: str, limit: float) -> None:
    weight = _weight(24, 40)
    qweight, scale = quantize_weight(weight, method)
    amax = weight.abs().amax(dim=1)
    torch.testing.assert_close(scale, amax / limit)
    # Each row's largest magnitude maps to the format's largest value.
    assert torch.equal(qweight.float().abs().amax(dim=1), torch.full((24,), limit))


def test_fp8_round_trip_is_within_half_an_ulp() -> None:
    weight = _weight(24, 40)
    # Elements this far below their row's maximum fall into e4m3's subnormal range.
    weight[:, 1] *= 1e-5
    qweight, scale = quantize_weight(weight, "fp8")
    assert qweight.dtype == torch.float8_e4m3fn
    error = (weight.double() - dequantize_weight(qweight, scale, torch.float64)).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value for normal values, and
    # 2**-10 of the scale (half of the subnormal spacing 2**-9) below the normal range.
    step = scale.double()[:, None]
    bound = torch.maximum(weight.double().abs() * 2.0**-4, step * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-5)).all())
    assert bool((weight.abs() < FP8_MIN_NORMAL * scale[:, None]).any()), "no subnormals tested"


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_zero_row_gets_unit_scale(method: str) -> None:
    weight = _weight(4, 16)
    weight[2] = 0.0
    qweight, scale = quantize_weight(weight, method)
    assert float(scale[2]) == 1.0
    assert bool((qweight[2].float() == 0).all())
    assert bool(torch.isfinite(dequantize_weight(qweight, scale)).all())


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_quantizes_in_float32_whatever_the_input_dtype(method: str) -> None:
    weight = _weight(8, 16).bfloat16()
    from_bfloat16 = quantize_weight(weight, method)
    from_float32 = quantize_weight(weight.float(), method)
    assert torch.equal(from_bfloat16[0].float(), from_float32[0].float())
    assert torch.equal(from_bfloat16[1], from_float32[1])


def test_quantize_rejects_bad_arguments() -> None:
    weight = _weight(4, 16)
    with pytest.raises(ValueError, match="unknown quantization method 'int4'"):
        quantize_weight(weight, "int4")
    with pytest.raises(ValueError, match=r"2-D \[out, in\] tensor, got \(16,\)"):
        quantize_weight(weight[0], "int8")
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(weight[None], "fp8")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_weight(weight.to(torch.int32), "int8")
    weight[1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_weight(weight, "int8")


def test_linear_rejects_bad_arguments() -> None:
    qweight, scale = _quantized(24, 40, "int8")
    x = _activations(5, 40, torch.float32)
    bias = _bias(24, torch.float32)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        weight_only_linear(x[0], qweight, scale)
    with pytest.raises(ValueError, match="x must have dtype"):
        weight_only_linear(x.to(torch.int32), qweight, scale)
    with pytest.raises(ValueError, match=r"x has 39 input features but qweight is \[out, in\]"):
        weight_only_linear(x[:, :39], qweight, scale)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        weight_only_linear(x, qweight.float(), scale)
    with pytest.raises(ValueError, match="scale must have dtype"):
        weight_only_linear(x, qweight, scale.half())
    with pytest.raises(ValueError, match="scale must have one entry per output row"):
        weight_only_linear(x, qweight, scale[:23])
    with pytest.raises(ValueError, match="bias must have 24 entries"):
        weight_only_linear(x, qweight, scale, bias[:20])
    with pytest.raises(ValueError, match="bias must have 1 dimensions"):
        weight_only_linear(x, qweight, scale, bias[None])
    with pytest.raises(ValueError, match="qweight must have a unit stride"):
        weight_only_linear(x, qweight.t().contiguous().t(), scale)
