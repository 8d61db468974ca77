"""The C++ CPU kernels over an 8-bit KV cache (int8 / fp8 codes, float16 scales) against the
PyTorch references in kv_quant.py and decode_attention_reference.py."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import dense_attention, dense_context, random_paged_context

from nori.kernels import paged_decode_attention_cpu, paged_decode_attention_reference
from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.kv_quant import (
    dequantize_kv_reference,
    quantize_kv_reference,
    store_quantized_kv_cache_cpu,
    store_quantized_kv_cache_reference,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or cpu_kernels() is None,
    reason="the C++ CPU kernels run on CPU tensors and need a C++ compiler",
)

SCALE = 0.37
CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]
# float32 vs float32 over the same codes and scales, summed in a different order.
ATOL = 1e-5
RTOL = 1e-5


def _query(batch: int, num_heads: int, head_dim: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_heads, head_dim, generator=generator)


def _quantized_context(
    lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k codes, v codes, k_scale, v_scale, block_tables, seq_lens) over shuffled blocks.

    Rows get magnitudes spread over two orders, so that a kernel ignoring (or swapping) the
    scales gives a visibly different result.
    """
    ctx = random_paged_context(lengths, num_kv_heads, head_dim, block_size)
    generator = torch.Generator().manual_seed(11)
    quantized = []
    for cache in (ctx.k_cache, ctx.v_cache):
        magnitude = torch.exp(2 * torch.rand(cache.shape[:3], generator=generator) - 1)
        quantized.append(quantize_kv_reference(cache * magnitude[..., None], dtype))
    (k_codes, k_scale), (v_codes, v_scale) = quantized
    return k_codes, v_codes, k_scale, v_scale, ctx.block_tables, ctx.seq_lens


@pytest.mark.parametrize("dtype", CODE_DTYPES)
# MHA, and GQA with 2 and 4 query heads per kv head.
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 4), (8, 2)])
# 32 and 64 take the compiled-in head sizes; 40 the generic loop.
@pytest.mark.parametrize("head_dim", [32, 40, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    lengths = [1, block_size - 1, block_size, 3 * block_size + 5, 200]
    k, v, ks, vs, tables, lens = _quantized_context(
        lengths, num_kv_heads, head_dim, block_size, dtype
    )
    query = _query(len(lengths), num_heads, head_dim)
    args = (query, k, v, tables, lens, SCALE)
    expected = paged_decode_attention_reference(*args, k_scale=ks, v_scale=vs)
    out = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    # The scales matter: reading the codes without them is far off.
    unscaled = paged_decode_attention_reference(query, k.float(), v.float(), tables, lens, SCALE)
    assert not torch.allclose(out, unscaled, atol=1e-2)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_decode_matches_dense_attention_over_dequantized_rows(dtype: torch.dtype) -> None:
    """Independent of the reference: float64 attention over code * scale, token by token."""
    lengths = [7, 33, 64]
    k, v, ks, vs, tables, lens = _quantized_context(lengths, 2, 32, 8, dtype)
    query = _query(len(lengths), 4, 32)
    out = paged_decode_attention_cpu(query, k, v, tables, lens, SCALE, k_scale=ks, v_scale=vs)
    keys_all, values_all = dequantize_kv_reference(k, ks), dequantize_kv_reference(v, vs)
    for b, length in enumerate(lengths):
        keys = dense_context(keys_all, tables[b], length)
        values = dense_context(values_all, tables[b], length)
        expected = dense_attention(query[b : b + 1], keys, values, [length - 1], SCALE)
        torch.testing.assert_close(out[b : b + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
# 1 and 3 rows are cut by kv head across threads; 40 (>= 4 * threads) by sequence.
@pytest.mark.parametrize("batch", [1, 3, 40])
def test_decode_at_any_batch_and_thread_count(dtype: torch.dtype, batch: int, threads: int) -> None:
    lengths = [(i * 37) % 61 + 1 for i in range(batch)]
    k, v, ks, vs, tables, lens = _quantized_context(lengths, 4, 64, 16, dtype)
    query = _query(batch, 8, 64)
    args = (query, k, v, tables, lens, SCALE)
    expected = paged_decode_attention_reference(*args, k_scale=ks, v_scale=vs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_decode_bfloat16_query(dtype: torch.dtype) -> None:
    lengths = [5, 40, 17]
    k, v, ks, vs, tables, lens = _quantized_context(lengths, 2, 64, 16, dtype)
    query = _query(len(lengths), 8, 64).to(torch.bfloat16)
    args = (query, k, v, tables, lens, SCALE)
    out = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.bfloat16
    expected = paged_decode_attention_reference(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)


def test_decode_rejects_bad_scales() -> None:
    lengths = [5, 9]
    k, v, ks, vs, tables, lens = _quantized_context(lengths, 2, 32, 4, torch.float8_e4m3fn)
    query = _query(2, 4, 32)
    args = (query, k, v, tables, lens, SCALE)
    with pytest.raises(RuntimeError, match="int8 or float8_e4m3fn cache"):
        paged_decode_attention_cpu(query, k.float(), v.float(), tables, lens, SCALE, ks, vs)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        paged_decode_attention_cpu(*args)
    with pytest.raises(RuntimeError, match="given together"):
        paged_decode_attention_cpu(*args, k_scale=ks)
    with pytest.raises(RuntimeError, match="float16"):
        paged_decode_attention_cpu(*args, k_scale=ks.float(), v_scale=vs.float())
    with pytest.raises(RuntimeError, match=r"\[num_blocks, block_size, Hkv\]"):
        paged_decode_attention_cpu(*args, k_scale=ks[:-1], v_scale=vs[:-1])
    with pytest.raises(RuntimeError, match="contiguous"):
        paged_decode_attention_cpu(
            *args, k_scale=ks.transpose(0, 1).contiguous().transpose(0, 1), v_scale=vs
        )


def _assert_store_matches(
    caches: list[torch.Tensor], scales: list[torch.Tensor], dtype: torch.dtype
) -> None:
    """caches/scales: [kernel K, kernel V, reference K, reference V]."""
    for i in range(2):
        mine, theirs = caches[i], caches[i + 2]
        assert torch.equal(scales[i], scales[i + 2]), "scales must be bit-equal"
        # Within one quantization step of the reference: -ffast-math may round a quotient
        # the other way.
        scale = scales[i].float()[..., None]
        if dtype == torch.int8:
            atol, rtol = scale * 1.0001, 0.0
        else:
            atol, rtol = scale * 2.0**-9, 2.0**-3
        difference = (mine.float() - theirs.float()).abs() * scale
        assert bool((difference <= atol + rtol * theirs.float().abs() * scale).all())
        same = (mine.view(torch.uint8) == theirs.view(torch.uint8)).float().mean().item()
        assert same > 0.99, f"only {same:.4f} of the codes match the reference"


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_store_matches_reference(dtype: torch.dtype, input_dtype: torch.dtype) -> None:
    num_blocks, block_size, kv_heads, head_dim, tokens = 12, 16, 2, 64, 100
    generator = torch.Generator().manual_seed(5)
    # key and value as the qkv projection leaves them: views with a token stride of 3 rows.
    qkv = torch.randn(tokens, 3, kv_heads, head_dim, generator=generator)
    qkv *= torch.exp(4 * torch.rand(tokens, 3, kv_heads, 1, generator=generator) - 2)
    qkv[0, 1, 0] = 0  # a zero row: scale 1
    qkv[1, 1, 1] *= 1e-12  # too small for a float16 scale: scale 1 as well
    qkv[2, 2, 0] *= 1e9  # past the largest float16 scale: clamped to 65504
    qkv = qkv.to(input_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[3] = -1
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)
    ]
    # Garbage in the slot that -1 must leave alone, the same for both.
    scales = [torch.full((num_blocks, block_size, kv_heads), 7.0, dtype=torch.float16)] * 4
    scales = [s.clone() for s in scales]
    store_quantized_kv_cache_cpu(key, value, *caches[:2], *scales[:2], slots)
    store_quantized_kv_cache_reference(key, value, *caches[2:], *scales[2:], slots)
    _assert_store_matches(caches, scales, dtype)
    flat_k_scale = scales[0].view(-1, kv_heads)
    assert flat_k_scale[slots[0], 0] == 1 and flat_k_scale[slots[1], 1] == 1
    assert scales[1].view(-1, kv_heads)[slots[2], 0] == 65504
    assert (scales[0] == 7).sum() == (num_blocks * block_size - tokens + 1) * kv_heads


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_store_then_decode_round_trip(dtype: torch.dtype) -> None:
    """Stored by the kernel, read by the kernel: close to attention over the float rows."""
    num_kv_heads, head_dim, block_size, length = 2, 64, 16, 48
    ctx = random_paged_context([length], num_kv_heads, head_dim, block_size)
    shape = ctx.k_cache.shape
    k = torch.zeros(shape, dtype=dtype)
    v = torch.zeros(shape, dtype=dtype)
    ks = torch.zeros(shape[:3], dtype=torch.float16)
    vs = torch.zeros(shape[:3], dtype=torch.float16)
    table = ctx.block_tables[0].long()
    positions = torch.arange(length)
    slots = table[positions // block_size] * block_size + positions % block_size
    flat_k = ctx.k_cache.view(-1, num_kv_heads, head_dim)[slots]
    flat_v = ctx.v_cache.view(-1, num_kv_heads, head_dim)[slots]
    store_quantized_kv_cache_cpu(flat_k, flat_v, k, v, ks, vs, slots)
    query = _query(1, 4, head_dim)
    args = (query, k, v, ctx.block_tables, ctx.seq_lens, SCALE)
    out = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs)
    exact = paged_decode_attention_reference(
        query, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, SCALE
    )
    torch.testing.assert_close(out, exact, atol=5e-2 if dtype == torch.int8 else 2e-1, rtol=0)


def test_store_rejects_bad_arguments() -> None:
    kv_heads, head_dim = 2, 8
    key = torch.randn(3, kv_heads, head_dim)
    slots = torch.tensor([0, 5, -1])
    k = torch.zeros(2, 4, kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    ks = torch.zeros(2, 4, kv_heads, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="int8 or float8_e4m3fn"):
        store_quantized_kv_cache_cpu(key, key, k.float(), k.float(), ks, ks.clone(), slots)
    with pytest.raises(RuntimeError, match="float16"):
        store_quantized_kv_cache_cpu(key, key, k, k.clone(), ks.float(), ks.float(), slots)
    with pytest.raises(RuntimeError, match=r"\[num_blocks, block_size, Hkv\]"):
        store_quantized_kv_cache_cpu(key, key, k, k.clone(), ks[:1], ks[:1].clone(), slots)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        store_quantized_kv_cache_cpu(key.half(), key.half(), k, k.clone(), ks, ks.clone(), slots)
    with pytest.raises(RuntimeError, match="outside the cache"):
        store_quantized_kv_cache_cpu(key, key, k, k.clone(), ks, ks.clone(), slots.fill_(8))


def test_decode_reads_every_fp8_code() -> None:
    """Every finite float8_e4m3fn value, subnormals included, read back exactly: one token per
    code, each the only one a query head attends to."""
    codes = torch.arange(256, dtype=torch.int32)
    finite = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7f and 0xff are NaN
    count = finite.numel()
    head_dim = 8
    # One block per code: V's first element holds the code, the rest 0; K is the same for all.
    v = torch.zeros(count, 1, 1, head_dim, dtype=torch.uint8)
    v[:, 0, 0, 0] = finite
    v = v.view(torch.float8_e4m3fn)
    k = torch.zeros_like(v)
    ones = torch.ones(count, 1, 1, dtype=torch.float16)
    tables = torch.arange(count, dtype=torch.int32)[:, None]
    lens = torch.ones(count, dtype=torch.int32)
    query = torch.zeros(count, 1, head_dim)
    out = paged_decode_attention_cpu(query, k, v, tables, lens, SCALE, k_scale=ones, v_scale=ones)
    expected = finite.view(torch.float8_e4m3fn).float()
    assert torch.equal(out[:, 0, 0], expected)
