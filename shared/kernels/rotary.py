"""Rotary position embedding of q/k heads: C++ on CPU and Triton on GPU, both in place.

The reference is Hugging Face's formula, x * cos + rotate_half(x) * sin, written with roll(x) =
cat(x2, x1) and the minus folded into sin's first half; it and both kernels match HF bit for bit."""

from __future__ import annotations

import contextlib

import torch

from nori.kernels._common import jit, next_power_of_2, should_use_triton
from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels

with contextlib.suppress(ImportError):
    import triton.language as tl


def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_t,
    stride_x_h,
    stride_angles,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK)
    mask = dims < HALF
    base = x_ptr + token * stride_x_t + head * stride_x_h
    x1 = tl.load(base + dims, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + dims, mask=mask, other=0.0)
    dtype = x1.dtype
    cos = tl.load(cos_ptr + token * stride_angles + dims, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_angles + dims, mask=mask, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    first = (a1 * cos).to(dtype).to(tl.float32) + (a2 * -sin).to(dtype).to(tl.float32)
    second = (a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)
    tl.store(base + dims, first.to(dtype), mask=mask)
    tl.store(base + HALF + dims, second.to(dtype), mask=mask)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D] (last dim contiguous) in place; cos/sin [T, D / 2] of x's dtype."""
    half = x.shape[-1] // 2
    jit(_rotary_kernel)[(x.shape[0], x.shape[1])](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=half,
        BLOCK=next_power_of_2(half),
    )
    return x


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D / 2] (each token's angles) -> x rotated (a new tensor)."""
    full_cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
    return x * full_cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D]; on CPU (float32, bfloat16) and GPU in place (x is returned), else
    into a new tensor. Callers pass a tensor they own and use the result."""
    if (
        should_use_triton(None, [x])
        and x.dim() == 3
        and x.stride(-1) == 1
        and cos.dtype == sin.dtype == x.dtype
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
    ):
        return rotary_triton(x, cos, sin)
    if (
        x.device.type == "cpu"
        and x.dtype in CPU_KERNEL_DTYPES
        and cos.dtype == sin.dtype == x.dtype
        and x.dim() == 3
        and x.stride(-1) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            kernels.rotary_inplace(x, cos, sin)
            return x
    return rotary_reference(x, cos, sin)
