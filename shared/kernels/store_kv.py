"""Writes the new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

import contextlib

import torch

from nori.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kv_caches,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    jit,
    next_power_of_2,
    should_use_triton,
)
from nori.kernels.cpu_build import required_cpu_kernels

with contextlib.suppress(ImportError):
    import triton.language as tl


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # Slot -1 is masked, not returned from (older Triton forbids it); the slot test is broadcast
    # first, as the interpreter's tensor-and-scalar `&` gives int32, rejected as a mask.
    in_bounds = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    mask = in_bounds & ((heads[:, None] * 0 + slot) >= 0)
    token64 = token.to(tl.int64)
    k = tl.load(
        key_ptr + token64 * stride_key_t + heads[:, None] * stride_key_h + dims[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr + token64 * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
        mask=mask,
    )
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def store_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[valid])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[valid])


def store_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The C++ CPU kernel (store_kv_cpu.cpp): `store_kv_cache_reference`'s contract (int64
    slots); RuntimeError where it is not built."""
    required_cpu_kernels().store_kv(key, value, k_cache, v_cache, slot_mapping)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Writes key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 is skipped.
    Slots (block_id * block_size + offset) must be distinct (bar -1) and in range, unchecked."""
    key = check_tensor("key", key, 3, FLOAT_DTYPES)
    value = check_tensor("value", value, 3, FLOAT_DTYPES)
    k_cache, v_cache = check_kv_caches(k_cache, v_cache)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key is [T, {key.shape[1]}, {key.shape[2]}] but the cache holds "
            f"[.., .., {k_cache.shape[2]}, {k_cache.shape[3]}] (num_kv_heads, head_dim)"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(
            f"key/value dtypes ({key.dtype}, {value.dtype}) must match the cache dtype {k_cache.dtype}"
        )
    check_same_device(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slots": slot_mapping}
    )
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")

    if not should_use_triton(use_triton, [key]):
        store_kv_cache_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    jit(_store_kv_kernel)[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )
