"""A paged KV cache in 8 bits: int8 or fp8 (e4m3) codes, one float16 scale per (slot, kv head).

k_cache [num_blocks, block_size, Hkv, D] goes with k_scale [num_blocks, block_size, Hkv] float16
(the same for V); a row is code.float() * scale.float(), scale = amax(|row|) / limit in float16."""

from __future__ import annotations

import contextlib

import torch

from nori.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    device_function,
    jit,
    next_power_of_2,
    should_use_triton,
)
from nori.kernels.cpu_build import required_cpu_kernels

with contextlib.suppress(ImportError):
    import triton.language as tl

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANTIZED_KV_DTYPES: tuple[torch.dtype, ...] = tuple(KV_CACHE_DTYPES.values())
KV_SCALE_DTYPE = torch.float16

# int8 is kept symmetric (-128 unused); 448 is the largest finite float8_e4m3fn.
_CODE_LIMIT: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# The largest finite float16: a larger scale would round to inf.
_MAX_SCALE = 65504.0


def code_limit(dtype: torch.dtype) -> float:
    if dtype not in _CODE_LIMIT:
        raise ValueError(f"the KV cache dtype must be one of {QUANTIZED_KV_DTYPES}, got {dtype}")
    return _CODE_LIMIT[dtype]


def quantize_kv_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., H, D] float -> (codes [.., H, D] in `dtype`, scale [.., H] float16).

    scale = float16(amax(|x[.., h, :]|) / limit), 1 where that is 0; codes = x / scale, rounded
    to nearest (ties to even) and clamped to the format's range."""
    limit = code_limit(dtype)
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    scale = (amax / limit).clamp(max=_MAX_SCALE).to(KV_SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Clamping guards the row maximum against a float16 scale rounded below amax / limit.
    scaled = (x32 / scale.float()[..., None]).clamp(-limit, limit)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scale


def dequantize_kv_reference(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes [.., H, D], scale [.., H] -> codes * scale in `dtype`, computed in float32."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


def store_quantized_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantizes key/value [T, Hkv, D] and writes codes and scales at slot_mapping; -1 skips."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for rows, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, row_scales = quantize_kv_reference(rows[valid], cache.dtype)
        # Raw bytes: index_copy_ has no float8 implementation on CPU.
        cache_bytes = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        cache_bytes.index_copy_(0, slots, codes.view(torch.uint8))
        scales.view(-1, num_kv_heads).index_copy_(0, slots, row_scales)


def store_quantized_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The C++ CPU kernel (store_kv_quant_cpu.cpp): `store_quantized_kv_cache_reference`'s
    contract for float32/bfloat16 key/value; RuntimeError where the kernel is not built."""
    kernels = required_cpu_kernels()
    kernels.store_kv_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


@device_function
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, so the
    cast has nothing to round (Triton's interpreter drops the carry across a power of two)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # e4m3 keeps 3 mantissa bits; below its smallest normal (2**-6) the step stays 2**-9.
    step = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2**23 steps rounds to a multiple of the step (ties to even); subtracting is exact.
    magic = step * 12582912.0
    rounded = (tl.abs(x) + magic) - magic
    # The sign is copied back so negatives rounding to zero give -0 (compiled `-x` is 0 - x).
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@device_function
def round_to_integer(x):
    """x (float32, |x| < 2**22) rounded to the nearest integer, ties to even, as torch.round."""
    return (x + 12582912.0) - 12582912.0


@device_function
def quantize_rows(x, LIMIT: tl.constexpr, IS_INT8: tl.constexpr):
    """x [rows, BLOCK_D] float32 (zeros past the head dim) -> (codes in float32, scale fp16)."""
    amax = tl.max(tl.abs(x), axis=1)
    # div_rn: compiled Triton's `/` is approximate and would drift from the reference.
    scale = tl.minimum(tl.math.div_rn(amax, LIMIT), 65504.0).to(tl.float16)
    scale = tl.where(scale > 0, scale, 1.0).to(tl.float16)
    scaled = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -LIMIT), LIMIT)
    scaled = round_to_integer(scaled) if IS_INT8 else round_to_e4m3(scaled)
    return scaled, scale


def _store_quantized_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LIMIT: tl.constexpr,
    IS_INT8: tl.constexpr,
) -> None:
    """One program per token: every kv head's row quantized, codes and scales stored."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # Slot -1 is masked, not returned from (see store_kv.py); broadcast for the interpreter.
    head_mask = (heads < NUM_KV_HEADS) & ((heads * 0 + slot) >= 0)
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(
        key_ptr + token64 * stride_key_t + heads[:, None] * stride_key_h + dims[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    v = tl.load(
        value_ptr + token64 * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    k_codes, k_scale = quantize_rows(k, LIMIT, IS_INT8)
    v_codes, v_scale = quantize_rows(v, LIMIT, IS_INT8)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, k_codes.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v_codes.to(v_cache_ptr.dtype.element_ty), mask=mask)
    scale_offsets = slot * NUM_KV_HEADS + heads
    tl.store(k_scale_ptr + scale_offsets, k_scale, mask=head_mask)
    tl.store(v_scale_ptr + scale_offsets, v_scale, mask=head_mask)


def check_quantized_kv_caches(
    k_cache: object, v_cache: object, k_scale: object, v_scale: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches [num_blocks, block_size, Hkv, D] int8/fp8 and scales [num_blocks, block_size,
    Hkv] float16, all contiguous; raises ValueError naming the argument."""
    k = check_tensor("k_cache", k_cache, 4, QUANTIZED_KV_DTYPES)
    v = check_tensor("v_cache", v_cache, 4, QUANTIZED_KV_DTYPES)
    ks = check_tensor("k_scale", k_scale, 3, (KV_SCALE_DTYPE,))
    vs = check_tensor("v_scale", v_scale, 3, (KV_SCALE_DTYPE,))
    if k.shape != v.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k.dtype} and {v.dtype}")
    for name, scale in (("k_scale", ks), ("v_scale", vs)):
        if scale.shape != k.shape[:3]:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads] = {tuple(k.shape[:3])}, "
                f"got {tuple(scale.shape)}"
            )
    for name, tensor in (("k_cache", k), ("v_cache", v), ("k_scale", ks), ("v_scale", vs)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    return k, v, ks, vs


def _check_store_args(
    key: object,
    value: object,
    k_cache: object,
    v_cache: object,
    k_scale: object,
    v_scale: object,
    slot_mapping: object,
) -> None:
    keys = check_tensor("key", key, 3, FLOAT_DTYPES)
    values = check_tensor("value", value, 3, FLOAT_DTYPES)
    k, v, ks, vs = check_quantized_kv_caches(k_cache, v_cache, k_scale, v_scale)
    slots = check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if keys.shape != values.shape:
        raise ValueError(
            f"key and value must have the same shape, got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    if keys.shape[1:] != k.shape[2:]:
        raise ValueError(
            f"key is [T, {keys.shape[1]}, {keys.shape[2]}] but the cache holds "
            f"[.., .., {k.shape[2]}, {k.shape[3]}] (num_kv_heads, head_dim)"
        )
    if slots.shape[0] != keys.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {keys.shape[0]} tokens")
    check_same_device(
        {
            "key": keys,
            "value": values,
            "k_cache": k,
            "v_cache": v,
            "k_scale": ks,
            "v_scale": vs,
            "slots": slots,
        }
    )
    check_last_dim_contiguous("key", keys)
    check_last_dim_contiguous("value", values)
    if not slots.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")


def store_quantized_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Quantizes key/value [T, Hkv, D] (any float dtype) into the 8-bit caches at slot_mapping
    [T], each token-head's float16 scale beside it; slot -1 is skipped. Slots must be distinct
    (apart from -1) and in range; unchecked (it would need a sync)."""
    _check_store_args(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    if not should_use_triton(use_triton, [key]):
        store_quantized_kv_cache_reference(
            key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping
        )
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    jit(_store_quantized_kv_kernel)[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        LIMIT=code_limit(k_cache.dtype),
        IS_INT8=k_cache.dtype == torch.int8,
    )
