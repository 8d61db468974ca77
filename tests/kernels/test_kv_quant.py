from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from nori.kernels import (
    KV_CACHE_DTYPES,
    dequantize_kv_reference,
    quantize_kv_reference,
    store_quantized_kv_cache,
    store_quantized_kv_cache_reference,
)

CACHE_DTYPES = list(KV_CACHE_DTYPES.values())
LIMITS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class QuantizedCaches:
    """Codes and scales filled with garbage, so that untouched slots can be told apart."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 1,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        garbage = torch.randn((2, *shape), generator=generator) * 10
        self.k_cache, self.v_cache = (g.to(dtype).to(DEVICE) for g in garbage)
        scales = torch.rand((2, *shape[:3]), generator=generator) + 0.5
        self.k_scale, self.v_scale = (s.half().to(DEVICE) for s in scales)

    def clone(self) -> QuantizedCaches:
        copy = object.__new__(QuantizedCaches)
        copy.k_cache, copy.v_cache = self.k_cache.clone(), self.v_cache.clone()
        copy.k_scale, copy.v_scale = self.k_scale.clone(), self.v_scale.clone()
        return copy

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache, self.k_scale, self.v_scale


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # fp8 has no torch.equal on every build, and -0 must differ from +0: compare raw bytes.
    return tensor.view(torch.int8) if tensor.element_size() == 1 else tensor


def _assert_same_caches(actual: QuantizedCaches, expected: QuantizedCaches) -> None:
    for got, want in zip(actual.tensors(), expected.tensors(), strict=True):
        assert torch.equal(_bits(got).cpu(), _bits(want).cpu())


def _rows(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # key/value are views into a fused QKV output; each row gets its own magnitude.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator)
    fused *= torch.rand(num_tokens, 3 * num_kv_heads, 1, generator=generator) * 8
    fused = fused.to(dtype).to(DEVICE)
    return fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]


def _slots(num_tokens: int, num_slots: int, slot_dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::3] = -1
    return slots.to(slot_dtype).to(DEVICE)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(1, 8, 1), (2, 16, 8), (3, 80, 16)]
)
def test_triton_matches_reference_bit_exactly(
    cache_dtype: torch.dtype, dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    num_tokens = 13
    key, value = _rows(num_tokens, num_kv_heads, head_dim, dtype)
    # A zero row and a row mixing signs with zeros exercise the scale-1 and -0 corners.
    key[1, 0] = 0
    value[2, -1, ::2] = -0.0
    num_blocks = num_tokens // block_size + 3
    caches = QuantizedCaches(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    slots = _slots(
        num_tokens, num_blocks * block_size, torch.int64 if block_size > 1 else torch.int32
    )
    triton_caches, reference_caches = caches.clone(), caches.clone()
    store_quantized_kv_cache(key, value, *triton_caches.tensors(), slots, use_triton=True)
    store_quantized_kv_cache_reference(key, value, *reference_caches.tensors(), slots)
    _assert_same_caches(triton_caches, reference_caches)
    # Skipped slots keep their old contents; written ones changed.
    assert bool((slots < 0).any())
    flat_before = caches.k_scale.view(-1, num_kv_heads).cpu()
    flat_after = triton_caches.k_scale.view(-1, num_kv_heads).cpu()
    written = slots[slots >= 0].long().cpu()
    untouched = torch.ones(flat_before.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_after[untouched], flat_before[untouched])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_scales_are_float16_amax_over_limit(cache_dtype: torch.dtype) -> None:
    x = torch.randn(20, 3, 32, generator=torch.Generator().manual_seed(3)) * 5
    codes, scale = quantize_kv_reference(x, cache_dtype)
    assert codes.dtype == cache_dtype and codes.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == x.shape[:2]
    expected = (x.abs().amax(dim=-1) / LIMITS[cache_dtype]).half()
    assert torch.equal(scale, expected)
    # The largest code sits at (or, after the float16 rounding, next to) the limit.
    assert (codes.float().abs().amax(dim=-1) >= LIMITS[cache_dtype] * 0.99).all()


def test_int8_round_trip_is_within_half_a_step() -> None:
    x = torch.randn(50, 4, 64, generator=torch.Generator().manual_seed(4)) * 3
    codes, scale = quantize_kv_reference(x, torch.int8)
    error = (dequantize_kv_reference(codes, scale) - x).abs()
    half_step = scale.float()[..., None] / 2
    # A float32 hair above half a step: x / scale itself is rounded before torch.round.
    assert (error <= half_step * (1 + 1e-5)).all()


def test_fp8_round_trip_is_within_e4m3_precision() -> None:
    x = torch.randn(50, 4, 64, generator=torch.Generator().manual_seed(5)) * 3
    codes, scale = quantize_kv_reference(x, torch.float8_e4m3fn)
    error = (dequantize_kv_reference(codes, scale) - x).abs()
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 for normal codes, and an
    # absolute one of half the subnormal step (2**-10 of a scale) below 2**-6.
    bound = torch.maximum(x.abs() * 2**-4, scale.float()[..., None] * 2**-10)
    assert (error <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_zero_rows_get_scale_one_and_zero_codes(cache_dtype: torch.dtype) -> None:
    x = torch.zeros(2, 3, 16)
    x[1, 2] = 1.0
    codes, scale = quantize_kv_reference(x, cache_dtype)
    assert torch.equal(scale[0], torch.ones(3, dtype=torch.float16))
    assert torch.equal(scale[1, :2], torch.ones(2, dtype=torch.float16))
    assert torch.equal(dequantize_kv_reference(codes, scale)[0], torch.zeros(3, 16))


def test_dequantize_returns_the_requested_dtype() -> None:
    x = torch.randn(3, 2, 8)
    codes, scale = quantize_kv_reference(x, torch.int8)
    out = dequantize_kv_reference(codes, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_empty_batch_is_a_no_op() -> None:
    caches = QuantizedCaches(2, 4, 2, 8, torch.int8)
    before = caches.clone()
    key, value = _rows(0, 2, 8, torch.float32)
    slots = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    store_quantized_kv_cache(key, value, *caches.tensors(), slots, use_triton=True)
    _assert_same_caches(caches, before)


def test_rejects_bad_arguments() -> None:
    caches = QuantizedCaches(3, 4, 2, 8, torch.int8)
    k, v, ks, vs = caches.tensors()
    key, value = _rows(5, 2, 8, torch.float32)
    slots = _slots(5, 12, torch.int64)
    with pytest.raises(ValueError, match="k_cache must have dtype"):
        store_quantized_kv_cache(key, value, k.float(), v.float(), ks, vs, slots)
    with pytest.raises(ValueError, match="k_scale must have dtype"):
        store_quantized_kv_cache(key, value, k, v, ks.float(), vs, slots)
    with pytest.raises(ValueError, match=r"v_scale must be \[num_blocks"):
        store_quantized_kv_cache(key, value, k, v, ks, vs[:, :2], slots)
    with pytest.raises(ValueError, match="share a dtype"):
        store_quantized_kv_cache(key, value, k, v.to(torch.float8_e4m3fn), ks, vs, slots)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store_quantized_kv_cache(key[:, :1], value[:, :1], k, v, ks, vs, slots)
    with pytest.raises(ValueError, match="slot_mapping has 4 entries for 5 tokens"):
        store_quantized_kv_cache(key, value, k, v, ks, vs, slots[:4])
    with pytest.raises(ValueError, match="k_scale must be contiguous"):
        bad_scale = ks.transpose(0, 1).contiguous().transpose(0, 1)
        store_quantized_kv_cache(key, value, k, v, bad_scale, vs, slots)
    with pytest.raises(ValueError, match="the KV cache dtype must be one of"):
        quantize_kv_reference(key, torch.float16)
