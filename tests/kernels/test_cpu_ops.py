"""The C++ CPU kernels of the per-layer ops against their PyTorch references."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import xxhash

from nori.kernels._common import unpack_weight_panels
from nori.kernels.argmax import argmax_rows
from nori.kernels.bf16_gemv import (
    bf16_gemv,
    bf16_gemv_reference,
    pack_bf16_gemv_weight,
)
from nori.kernels.copy_pieces import (
    copy_and_hash_pieces,
    copy_and_hash_pieces_reference,
    copy_pieces,
    copy_pieces_reference,
    copy_share_of_chunks,
)
from nori.kernels.cpu_build import cpu_kernels
from nori.kernels.int8_gemv import (
    int8_gemv_reference,
    pack_int8_gemv_weight,
    weight_row_sums,
)
from nori.kernels.quantized_linear import quantize_weight
from nori.kernels.rms_norm import rms_norm, rms_norm_reference
from nori.kernels.rotary import rotary, rotary_reference
from nori.kernels.row_scale import (
    SMALLEST_ROW_MAX,
    rows_to_unit_reference,
    scale_rows_back_reference,
)
from nori.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from nori.kernels.store_kv import store_kv_cache_cpu, store_kv_cache_reference

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or cpu_kernels() is None,
    reason="the C++ CPU kernels run on CPU tensors and need a C++ compiler",
)

# float32 results of the same arithmetic summed or fused in another order.
ATOL = RTOL = 1e-5
# bfloat16: the kernels round once (float32 inside), the references after each op: a couple of
# units in the last of bfloat16's 8 bits apart.
TOLERANCE = {
    torch.float32: {"atol": ATOL, "rtol": RTOL},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 64, 4096])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x, weight = _randn(rows, hidden).to(dtype), _randn(hidden, seed=1).to(dtype)
    out, residual = rms_norm(x, weight, 1e-5)
    assert residual is x and out.dtype is dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **TOLERANCE[dtype])


def test_fused_add_rms_norm_updates_both_in_place() -> None:
    x, residual, weight = _randn(9, 256), _randn(9, 256, seed=1), _randn(256, seed=2)
    expected_residual = x + residual
    expected = rms_norm_reference(expected_residual, weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = rms_norm(x_in, weight, 1e-6, residual_in)
    assert out is x_in and new_residual is residual_in
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_rms_norm_falls_back_off_the_fast_path() -> None:
    """Non-contiguous rows take the reference (and give the same answer)."""
    x, weight = _randn(8, 64)[:, ::2], _randn(32, seed=1)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5)[0], rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 37, 1376])
def test_silu_and_mul(width: int, dtype: torch.dtype) -> None:
    x = (_randn(11, 2 * width) * 4).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 32, 128])
def test_rotary_in_place_inside_a_fused_projection(head_dim: int, dtype: torch.dtype) -> None:
    """q and k heads sit inside a wider qkv row: the kernel rotates them and nothing else."""
    tokens, heads, extra = 6, 5, 3
    qkv = _randn(tokens, (heads + extra) * head_dim).to(dtype)
    view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = _randn(tokens, head_dim // 2, seed=1) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = rotary_reference(view, cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    result = rotary(view, cos, sin)
    assert result.data_ptr() == view.data_ptr()
    torch.testing.assert_close(result, expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_store_kv_matches_reference_and_skips_minus_one() -> None:
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 7
    qkv = _randn(tokens, 3 * kv_heads * head_dim)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 0, -1, 23, 9, 10, 17])
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(4)]
    store_kv_cache_cpu(key, value, caches[0], caches[1], slots)
    store_kv_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        store_kv_cache_cpu(key, value, caches[0], caches[1], slots.clone().fill_(24))


def test_argmax_matches_torch_including_ties_infinities_and_nan() -> None:
    logits = _randn(6, 1000)
    logits[1, 10] = logits[1, 500] = 100.0  # a tie: the first index wins
    logits[2] = float("-inf")
    logits[2, 999] = 0.0
    logits[3, 7] = float("inf")
    logits[4, 321] = float("nan")
    logits[5] = float("-inf")  # all equal: index 0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("width", [1, 37, 2752])
@pytest.mark.parametrize("rows", [2, 9, 300])
def test_rows_to_unit(rows: int, width: int) -> None:
    """Rows of very different magnitudes, and an all-zero row, against the reference."""
    x = _randn(rows, width) * torch.logspace(-3, 3, rows)[:, None]
    x[rows // 2] = 0
    scaled, row_max = cpu_kernels().rows_to_unit(x, SMALLEST_ROW_MAX)
    expected_scaled, expected_max = rows_to_unit_reference(x)
    torch.testing.assert_close(row_max, expected_max, atol=0, rtol=0)
    torch.testing.assert_close(scaled, expected_scaled, atol=ATOL, rtol=RTOL)
    assert row_max[rows // 2].item() == pytest.approx(SMALLEST_ROW_MAX)
    # Every non-zero row's largest magnitude is 1 (times the inverse: within a rounding).
    torch.testing.assert_close(scaled.abs().amax(-1)[: rows // 2], torch.ones(rows // 2))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 300])
def test_scale_rows_back_in_place(rows: int, bias: bool) -> None:
    out, row_max = _randn(rows, 1376), _randn(rows, 1, seed=1).abs() + 0.1
    bias_values = _randn(1376, seed=2) if bias else None
    expected = scale_rows_back_reference(out.clone(), row_max, bias_values)
    cpu_kernels().scale_rows_back(out, row_max, bias_values)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [5, 37, 512, 1376])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 21])
def test_int8_gemv(rows: int, width: int, bias: bool) -> None:
    """Widths off the 4-byte group (padded codes), 67 outputs (a part panel), row counts below,
    at and past one 16-row block, one all-zero row, against the reference (exact int64 sums):
    only float32 rounding of the scaling separates them."""
    weight = _randn(67, width) * 0.05
    qweight, scale = quantize_weight(weight, "int8")
    x = _randn(rows, width, seed=1) * torch.logspace(-2, 2, rows)[:, None]
    if rows > 1:
        x[-1] = 0
    bias_values = _randn(67, seed=2) if bias else None
    expected = int8_gemv_reference(x, qweight, scale, bias_values)
    packed = pack_int8_gemv_weight(qweight)
    assert packed.shape == (5, (width + 3) // 4, 16, 4)
    assert torch.equal(unpack_weight_panels(packed, 67, width), qweight)
    result = cpu_kernels().int8_gemv(
        x, packed, 67, scale.float(), weight_row_sums(qweight), bias_values
    )
    torch.testing.assert_close(result, expected)
    # The reference is the dequantized weight times per-row 8-bit activations.
    exact = torch.nn.functional.linear(x, weight, bias_values)
    assert ((expected - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [5, 37, 512, 1376])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21])
def test_bf16_gemv(rows: int, width: int, bias: bool) -> None:
    """Odd widths (a half pair), 67 outputs (a part panel), row counts below, at and past one
    16-row block, against float32 products of the same bf16 values: they differ by the order of
    the float32 sums and one bf16 rounding."""
    weight = _randn(67, width).bfloat16()
    x = _randn(rows, width, seed=1).bfloat16()
    bias_values = _randn(67, seed=2).bfloat16() if bias else None
    packed = pack_bf16_gemv_weight(weight)
    assert packed.shape == (5, (width + 1) // 2, 16, 2)
    assert torch.equal(unpack_weight_panels(packed, 67, width), weight)
    result = bf16_gemv(x, packed, 67, bias_values)
    assert result.dtype is torch.bfloat16 and result.shape == (rows, 67)
    torch.testing.assert_close(
        result, bf16_gemv_reference(x, weight, bias_values), **TOLERANCE[torch.bfloat16]
    )


@pytest.mark.parametrize("seed", range(3))
def test_copy_pieces_matches_its_reference_and_plain_slices(seed: int) -> None:
    """Pieces of every size (empty ones, and ones past the 64 KiB hash step) from one buffer
    into scattered, unaligned places of another: the kernels, their memmove references and
    torch slicing land the same bytes and nothing else, and the hashing ones return xxh3-64 of
    the pieces' bytes in order (the Python package's, which senders use)."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator)
    sizes = [
        0,
        1,
        65536,
        65537,
        200_000,
        *torch.randint(0, 40_000, (19,), generator=generator).tolist(),
    ]
    starts = torch.randint(0, source.numel() - 200_000, (24,), generator=generator).tolist()
    expected = torch.zeros(24 * 200_000, dtype=torch.uint8)
    rows = []
    for index, (start, nbytes) in enumerate(zip(starts, sizes, strict=True)):
        at = index * 200_000 + 7
        expected[at : at + nbytes] = source[start : start + nbytes]
        rows.append((at, start, nbytes))
    digest = xxhash.xxh3_64_intdigest(
        b"".join(source[start : start + nbytes].numpy().tobytes() for _, start, nbytes in rows)
    )
    for copy in (
        copy_pieces,
        copy_pieces_reference,
        copy_and_hash_pieces,
        copy_and_hash_pieces_reference,
    ):
        landed = torch.zeros_like(expected)
        pieces = np.array(
            [(landed.data_ptr() + at, source.data_ptr() + start, n) for at, start, n in rows],
            dtype=np.int64,
        )
        result = copy(pieces)
        assert torch.equal(landed, expected), copy.__name__
        if "hash" in copy.__name__:
            assert result == digest, copy.__name__


def test_copy_threads_shares_cover_every_chunk_once() -> None:
    """Three threads' shares of seven chunks copy each chunk (hashed where digests are asked
    for, each digest at its chunk's index), and a share stops at its next chunk once told to."""
    source = torch.arange(7 * 64, dtype=torch.int64).to(torch.uint8)
    for with_digests in (False, True):
        landed = torch.zeros_like(source)
        chunks = [
            np.array([(landed.data_ptr() + at, source.data_ptr() + at, 64)], dtype=np.int64)
            for at in range(0, source.numel(), 64)
        ]
        digests = [0] * len(chunks) if with_digests else None
        for first in range(3):
            copy_share_of_chunks(chunks, first, 3, digests)
        assert torch.equal(landed, source)
        if digests is not None:
            assert digests == [
                xxhash.xxh3_64_intdigest(source[at : at + 64].numpy().tobytes())
                for at in range(0, source.numel(), 64)
            ]
    stop = threading.Event()
    stop.set()
    landed.zero_()
    copy_share_of_chunks(chunks, 0, 1, None, stop)
    assert not landed.any()


def test_copy_pieces_refuses_a_malformed_table() -> None:
    with pytest.raises(RuntimeError, match=r"int64 \[n, 3\]"):
        cpu_kernels().copy_pieces(torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="negative"):
        cpu_kernels().copy_pieces(torch.tensor([[0, 0, -1]], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="negative"):
        cpu_kernels().copy_and_hash_pieces(torch.tensor([[0, 0, -1]], dtype=torch.int64))
