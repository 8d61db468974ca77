"""The gated MLP's activation, silu(gate) * up over a fused [T, 2I] projection: C++ on CPU,
Triton on GPU, each rounding as the reference does (silu to the input dtype, then the product)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from nori.kernels._common import cdiv, jit, should_use_triton
from nori.kernels.cpu_build import CPU_KERNEL_DTYPES, cpu_kernels

with contextlib.suppress(ImportError):
    import triton.language as tl

SILU_BLOCK = 1024


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` over x [T, 2I] with a contiguous last dimension."""
    size = x.shape[1] // 2
    out = torch.empty((x.shape[0], size), dtype=x.dtype, device=x.device)
    grid = (x.shape[0], cdiv(size, SILU_BLOCK))
    jit(_silu_and_mul_kernel)[grid](x, out, x.stride(0), out.stride(0), size, BLOCK=SILU_BLOCK)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> [T, I]; C++ for contiguous f32/bf16 CPU rows, Triton on GPU."""
    if should_use_triton(None, [x]) and x.dim() == 2 and x.stride(-1) == 1:
        return silu_and_mul_triton(x)
    if (
        x.device.type == "cpu"
        and x.dtype in CPU_KERNEL_DTYPES
        and x.dim() == 2
        and x.is_contiguous()
    ):
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.silu_and_mul(x)
    return silu_and_mul_reference(x)
