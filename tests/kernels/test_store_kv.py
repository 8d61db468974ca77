from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from nori.kernels import store_kv_cache, store_kv_cache_reference


def _inputs(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    slot_dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    # key/value are views into a wider tensor, as when they are sliced out of a fused QKV output.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key = fused[:, num_kv_heads : 2 * num_kv_heads].to(DEVICE)
    value = fused[:, 2 * num_kv_heads :].to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::3] = -1
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    return key, value, cache.to(dtype).to(DEVICE), slots.to(slot_dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(1, 8, 1), (2, 16, 8), (3, 64, 16)]
)
def test_triton_matches_reference(
    dtype: torch.dtype, slot_dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    key, value, cache, slots = _inputs(13, num_kv_heads, head_dim, block_size, dtype, slot_dtype)
    k_triton, v_triton = cache.clone(), cache.clone()
    k_ref, v_ref = cache.clone(), cache.clone()
    store_kv_cache(key, value, k_triton, v_triton, slots, use_triton=True)
    store_kv_cache_reference(key, value, k_ref, v_ref, slots)
    # A copy must be bit-exact, and skipped slots must keep their old contents.
    assert torch.equal(k_triton, k_ref)
    assert torch.equal(v_triton, v_ref)


def test_reference_writes_each_token_to_its_slot() -> None:
    key, value, cache, slots = _inputs(11, 2, 8, 4, torch.float32, torch.int64)
    k_cache, v_cache = cache.clone(), cache.clone()
    store_kv_cache_reference(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = cache.clone(), cache.clone()
    block_size = cache.shape[1]
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, cache)


def test_empty_batch_is_a_no_op() -> None:
    key, value, cache, slots = _inputs(0, 2, 8, 4, torch.float32, torch.int64)
    k_cache = cache.clone()
    store_kv_cache(key, value, k_cache, cache.clone(), slots, use_triton=True)
    assert torch.equal(k_cache, cache)


def test_rejects_bad_arguments() -> None:
    key, value, cache, slots = _inputs(5, 2, 8, 4, torch.float32, torch.int64)
    with pytest.raises(ValueError, match="key must have 3 dimensions"):
        store_kv_cache(key[0], value, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store_kv_cache(key[:, :1], value[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping has 4 entries for 5 tokens"):
        store_kv_cache(key, value, cache, cache.clone(), slots[:4])
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        store_kv_cache(key, value, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="must match the cache dtype"):
        store_kv_cache(key.half(), value.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        store_kv_cache(key, value, cache.transpose(2, 3), cache.transpose(2, 3), slots)
    with pytest.raises(ValueError, match="unit stride"):
        store_kv_cache(
            key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, cache.clone(), slots
        )
